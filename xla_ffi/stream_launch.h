// Grace Adam started from a CUDA stream without holding it (the start/join
// design). A bucket call on XLA's compute stream ("start")
// returns at once, having enqueued, on a side stream of the library's own
// (one per CUDA context) that waits for the compute stream's work so far:
// copies of the bucket's device operands into pinned staging, and a host
// function that only hands the launch to a worker thread. The compute
// stream waits for those copies (so that XLA may reuse what they read),
// unless the call holds its inputs (BucketAttrs::hold_inputs: XLA keeps
// them alive until the join), and then it does not wait at all. The
// worker (our thread, which may call CUDA) runs the step on host memory
// and, only if it succeeded, enqueues the copies of its results back to
// the device, then records the launch's "done" event in every case: a
// bucket's new weights, written over its gradients' buffers
// (BucketAttrs::weights_over_grads), reach the device while the compute
// stream goes on with the backward pass. One "join" call per step waits
// for every launch of its stream, makes the compute stream wait for their
// done events (the first point where the GPU waits) and returns the first
// failed launch's error. A failed launch keeps its
// stream failed: later launches on it run no step and write nothing back
// until a join has reported the error. A step's on-demand inputs (a
// re-seeding step's parameters) are not copied at the start: the worker
// copies them, on the context's fetch stream, only if the step asks when
// it runs (Workers::Fetch: the device-side test said they changed); the
// join keeps them alive until then.
//
// Optimizer state must be in host memory (pinned_host operands); state in
// device memory is staged like the other device operands where it is small
// (0-d and the like), refused otherwise. Staging is pinned and portable,
// allocated in the stream's context, two slots per context (double
// buffered: launch k uses slot k % 2, and waits for the slot's previous
// launch), grown only when a bucket needs more than any before it, and
// freed when the launches' owner is destroyed (at exit for the process's).
// The CUDA driver is looked up at run time, so this library needs no CUDA
// to build or load.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_STREAM_LAUNCH_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_STREAM_LAUNCH_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/launch.h"

namespace jax_superoffload {

// The CUDA driver entry points the launches use (CUresult is an int, 0 for
// success; handles and device pointers are passed as the driver declares
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
  // cuMemcpyDtoDAsync_v2(destination, source, bytes, stream).
  int (*copy_device_to_device)(uint64_t destination, uint64_t source,
                               size_t bytes, void* stream);
  // cuMemHostAlloc(&pointer, bytes, flags).
  int (*host_alloc)(void** pointer, size_t bytes, unsigned flags);
  // cuMemFreeHost(pointer).
  int (*host_free)(void* pointer);
  // cuStreamGetCtx(stream, &context).
  int (*stream_get_ctx)(void* stream, void** context);
  // cuCtxPushCurrent_v2(context).
  int (*ctx_push_current)(void* context);
  // cuCtxPopCurrent_v2(&context).
  int (*ctx_pop_current)(void** context);
  // cuStreamIsCapturing(stream, &status).
  int (*stream_is_capturing)(void* stream, int* status);
  // cuStreamCreate(&stream, flags).
  int (*stream_create)(void** stream, unsigned flags);
  // cuStreamDestroy_v2(stream).
  int (*stream_destroy)(void* stream);
  // cuStreamSynchronize(stream).
  int (*stream_synchronize)(void* stream);
  // cuEventCreate(&event, flags).
  int (*event_create)(void** event, unsigned flags);
  // cuEventDestroy_v2(event).
  int (*event_destroy)(void* event);
  // cuEventRecord(event, stream).
  int (*event_record)(void* event, void* stream);
  // cuStreamWaitEvent(stream, event, flags).
  int (*stream_wait_event)(void* stream, void* event, unsigned flags);
  // cuGetErrorString(error, &text); may be null.
  int (*get_error_string)(int error, const char** text);
};

// libcuda's entry points, or null (with the reason in `why`) where the
// driver cannot be loaded. Looked up once.
const CudaDriver* SystemCudaDriver(std::string* why);

// cuda.h's values the launches use.
inline constexpr int kPointerMemoryType = 2;        // CU_POINTER_ATTRIBUTE_...
inline constexpr unsigned kMemoryTypeDevice = 2;    // CU_MEMORYTYPE_DEVICE
inline constexpr int kErrorInvalidValue = 1;        // CUDA_ERROR_INVALID_VALUE
inline constexpr unsigned kHostAllocPortable = 1;   // CU_MEMHOSTALLOC_PORTABLE
inline constexpr unsigned kStreamNonBlocking = 1;   // CU_STREAM_NON_BLOCKING
inline constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING
inline constexpr int kCaptureStatusNone = 0;  // CU_STREAM_CAPTURE_STATUS_NONE

// State in device memory up to this size (a 0-d count, a scalar leaf's
// moments) is staged like any device operand; larger state is refused.
inline constexpr int64_t kMaxStagedStateBytes = 4096;

namespace stream_internal {
struct Context;
struct Pending;
}  // namespace stream_internal

// The launches of one process (or one test): per CUDA context, its side
// stream, worker thread, staging slots and the launches not yet joined.
class StreamLaunches {
 public:
  explicit StreamLaunches(const CudaDriver* driver);
  // Waits (bounded) for the launches still in flight, stops the workers
  // and frees the staging, events and side streams.
  ~StreamLaunches();
  StreamLaunches(const StreamLaunches&) = delete;
  StreamLaunches& operator=(const StreamLaunches&) = delete;

  // The process's launches, on the system driver; destroyed at exit.
  static StreamLaunches& Process();

  // Waits for every launch started from `stream` so far, makes `stream`
  // wait for their results, and returns the first failed launch's error
  // (then clears it).
  ffi::Error Join(void* stream);

  // A copy to device memory, of `bytes` bytes.
  struct ToDevice {
    void* device;
    const void* source;
    size_t bytes;
  };

  // Enqueues `copies` on `stream` (in its context): the new weights of
  // joined launches, from where XLA placed the launches' results. That is
  // pinned host memory the workers wrote them to, or device memory, which
  // the workers filled from staging: XLA:GPU keeps a result that aliases
  // no operand in host memory when the call's other results alias host
  // operands (jaxlib 0.12.0.1), or in device memory (0.12.1). A copy whose
  // destination is not device memory is refused before any is enqueued.
  ffi::Error CopyToDevice(void* stream, const std::vector<ToDevice>& copies);

  const CudaDriver* driver() const { return driver_; }
  // Pinned staging allocations (cuMemHostAlloc calls) so far.
  int64_t staging_allocations() const;
  // On-demand inputs copied to staging (Workers::Fetch) so far.
  int64_t fetched_inputs() const;

 private:
  friend class OnStream;
  // The context of `stream`'s object, created (side stream, events, worker)
  // the first time; null with `error`. The context must be current.
  stream_internal::Context* ContextOf(void* context, ffi::Error* error);
  stream_internal::Context* FindContext(void* context);
  // A count of every context's, summed.
  int64_t SumOverContexts(int64_t (stream_internal::Context::*count)()) const;

  const CudaDriver* driver_;
  mutable std::mutex mutex_;
  std::map<void*, std::unique_ptr<stream_internal::Context>> contexts_;
};

// One bucket call from a CUDA stream (a start): Place stages the device
// operands through a staging slot of its own, Run enqueues the launch. A
// slot is sized to at least `reserve` bytes (the step's largest bucket), so
// that the slots are allocated once whatever order the buckets come in.
class OnStream final : public Launch {
 public:
  // `hold_inputs`: XLA keeps the device operands alive until the join (see
  // BucketAttrs::hold_inputs), so the compute stream does not wait for
  // their copies to staging.
  OnStream(StreamLaunches* launches, void* stream, size_t reserve = 0,
           bool hold_inputs = false)
      : launches_(launches),
        stream_(stream),
        reserve_(reserve),
        hold_inputs_(hold_inputs) {}
  ~OnStream() override;
  ffi::Error Place(std::vector<Touched>& touched) override;
  ffi::Error Run(Work work) override;

  struct Copy {
    void* host;
    uint64_t device;
    size_t bytes;
  };

 private:
  ffi::Error Stage(std::vector<Touched>& touched,
                   const std::vector<bool>& on_device);

  StreamLaunches* launches_;
  void* stream_;
  size_t reserve_;
  bool hold_inputs_;
  void* cuda_context_ = nullptr;
  stream_internal::Context* context_ = nullptr;
  int slot_ = -1;  // The staging slot held, until Run hands it on.
  bool placed_ = false;
  std::vector<Copy> in_;   // Device to staging, before the step.
  std::vector<Copy> out_;  // Staging to device, after a step that succeeded.
  std::vector<Copy> on_demand_;  // Device to staging, if the step asks.
  // Of those, what goes back to the window fetched, after the step.
  std::vector<Copy> on_demand_back_;
};

// A bucket handler's body `Body(Launch&, operands...)` as the handler of
// one platform: on XLA:CPU's pool (also the CUDA plugin's host compute), or
// started from a CUDA stream.
template <auto Body>
constexpr auto kOnCpu = [](ffi::ThreadPool pool, auto... operands) {
  RunNow launch(&pool);
  return Body(launch, operands...);
};

// The staging bound a bucket handler's operands carry (its BucketAttrs).
template <typename T>
size_t StagingBytesOf(const T&) {
  return 0;
}
inline size_t StagingBytesOf(const BucketAttrs& attrs) {
  return attrs.staging_bytes > 0 ? static_cast<size_t>(attrs.staging_bytes) : 0;
}

// Whether a bucket handler's operands are held until the join.
template <typename T>
bool HoldsInputs(const T&) {
  return false;
}
inline bool HoldsInputs(const BucketAttrs& attrs) { return attrs.hold_inputs; }

template <auto Body>
constexpr auto kOnStream = [](void* stream, auto... operands) {
  const size_t reserve = std::max<size_t>({0, StagingBytesOf(operands)...});
  const bool hold = (false || ... || HoldsInputs(operands));
  OnStream launch(&StreamLaunches::Process(), stream, reserve, hold);
  return Body(launch, operands...);
};

// Defines the handler symbols `Cpu` (XLA:CPU, and the CUDA plugin's host
// compute) and `Stream` (started from a CUDA stream) of the bucket handler
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

// The join's operands and results: results [0, n) alias operands [0, n);
// the operand after those (the barrier) only orders the call.
ffi::Error CheckJoin(ffi::RemainingArgs args, ffi::RemainingRets rets);

// The copies of a stream "to device" call: result i, in device memory, is
// a copy of operand i, in host memory, of its size.
ffi::Error ToDeviceCopies(ffi::RemainingArgs args, ffi::RemainingRets rets,
                          std::vector<StreamLaunches::ToDevice>* copies);

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_STREAM_LAUNCH_H_
