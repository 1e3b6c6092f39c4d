// Grace Adam ordered on a CUDA stream: the handler returns at once and the
// step runs on the process's host threads when the stream reaches it, as a
// host function (cuLaunchHostFunc). The optimizer state must be in host
// memory (pinned_host operands): a state buffer in device memory is
// refused. Any other operand or result that XLA placed in device memory
// (gradients, parameters, scalars, new weights) is staged: copied to or
// from pinned buffers of the launch's own on the same stream, around the
// step. The CUDA driver is looked up at run time, so this library needs no
// CUDA to build or load.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_STREAM_LAUNCH_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_STREAM_LAUNCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/launch.h"

namespace jax_superoffload {

// The CUDA driver entry points the launch uses (CUresult is an int, 0 for
// success; streams and device pointers are passed as the driver declares
// them).
struct CudaDriver {
  // cuLaunchHostFunc(stream, fn, data).
  int (*launch_host_func)(void* stream, void (*fn)(void*), void* data);
  // cuPointerGetAttribute(data, attribute, pointer).
  int (*pointer_get_attribute)(void* data, int attribute, uint64_t pointer);
  // cuMemcpyDtoHAsync_v2(host, device, bytes, stream).
  int (*copy_to_host)(void* host, uint64_t device, size_t bytes, void* stream);
  // cuMemcpyHtoDAsync_v2(device, host, bytes, stream).
  int (*copy_to_device)(uint64_t device, const void* host, size_t bytes,
                        void* stream);
  // cuMemHostAlloc(&pointer, bytes, flags).
  int (*host_alloc)(void** pointer, size_t bytes, unsigned flags);
  // cuGetErrorString(error, &text); may be null.
  int (*get_error_string)(int error, const char** text);
};

// libcuda's entry points, or null (with the reason in `why`) where the
// driver cannot be loaded. Looked up once.
const CudaDriver* SystemCudaDriver(std::string* why);

// CU_POINTER_ATTRIBUTE_MEMORY_TYPE and CU_MEMORYTYPE_DEVICE (cuda.h).
inline constexpr int kPointerMemoryType = 2;
inline constexpr unsigned kMemoryTypeDevice = 2;

class OnStream final : public Launch {
 public:
  OnStream(const CudaDriver* driver, void* stream)
      : driver_(driver), stream_(stream) {}
  ffi::Error Place(std::vector<Touched>& touched) override;
  ffi::Error Run(Work work) override;

 private:
  struct Copy {
    void* host;
    uint64_t device;
    size_t bytes;
  };
  const CudaDriver* driver_;
  void* stream_;
  bool placed_ = false;
  std::vector<Copy> in_;   // Device to staging, before the step.
  std::vector<Copy> out_;  // Staging to device, after it.
};

// A bucket handler's body `Body(Launch&, operands...)` as the handler of
// one platform: on XLA:CPU's pool (also the CUDA plugin's host compute), or
// ordered on a CUDA stream.
template <auto Body>
constexpr auto kOnCpu = [](ffi::ThreadPool pool, auto... operands) {
  RunNow launch(&pool);
  return Body(launch, operands...);
};

template <auto Body>
constexpr auto kOnStream = [](void* stream, auto... operands) {
  OnStream launch(SystemCudaDriver(nullptr), stream);
  return Body(launch, operands...);
};

// Defines the handler symbols `Cpu` (XLA:CPU, and the CUDA plugin's host
// compute) and `Stream` (ordered on a CUDA stream) of the bucket handler
// body `Body`, bound as BucketBinding<..., kSumsq, flags...> says.
#define JSO_DEFINE_BUCKET_HANDLERS(Cpu, Stream, Body, ...)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      Cpu, ::jax_superoffload::kOnCpu<Body>,                                \
      (::jax_superoffload::BucketBinding<::xla::ffi::ThreadPool,            \
                                         __VA_ARGS__>()));                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      Stream, ::jax_superoffload::kOnStream<Body>,                          \
      (::jax_superoffload::BucketBinding<::xla::ffi::PlatformStream<void*>, \
                                         __VA_ARGS__>()))

// A step that ran from a stream cannot fail its call, which has returned:
// its error is printed, kept, and returned by the next stream launch in the
// process (which then clears it). Returns and clears it.
ffi::Error TakeDeferredError();

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_STREAM_LAUNCH_H_
