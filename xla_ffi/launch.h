// How a handler's work runs once its operands are decoded and checked: at
// once on XLA:CPU's pool (RunNow), or later, in order on a GPU stream
// (stream_launch.h). The handlers read every scalar operand inside the work,
// never while decoding: on a stream those operands are written by work that
// has not run yet when the handler is called.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_support.h"

namespace jax_superoffload {

// A step's work on decoded buffers. Its captures must own what they hold:
// it may run after the handler has returned.
using Work = std::function<ffi::Error(Workers)>;

// One buffer a step reads or writes, for a launch to check or stand in for.
struct Touched {
  enum class Role {
    kState,   // Read and written in place: must be where the CPU reaches it.
    kInput,   // Read only.
    kOutput,  // Written only.
    kInOut,   // Read and written, where it is or through a stand-in.
    // Read only, and only if the step asks for it (Workers::Fetch) when it
    // runs: a stand-in is filled then, not at the start.
    kOnDemand,
    // As kOnDemand, and written: after a step that succeeded, its stand-in
    // goes back to the window the step fetched (a row of a stack).
    kOnDemandInOut,
  };
  const void* data = nullptr;
  int64_t bytes = 0;
  Role role = Role::kInput;
  // Points the step at a stand-in for `data` (a staged copy).
  std::function<void(void*)> retarget;
};

// `pointer` (any of the decoded pointer fields) as a Touched entry.
template <class T>
Touched Touch(T*& pointer, int64_t bytes, Touched::Role role) {
  return Touched{pointer, bytes, role,
                 [&pointer](void* to) { pointer = static_cast<T*>(to); }};
}

class Launch {
 public:
  virtual ~Launch() = default;
  // Checks `touched` and, where the step cannot reach a buffer where it
  // is, points the step at a stand-in (through `retarget`). Call after
  // decoding and before the work captures the pointers.
  virtual ffi::Error Place(std::vector<Touched>& touched) = 0;
  // Runs `work` or enqueues it, with the stand-ins' copies around it.
  virtual ffi::Error Run(Work work) = 0;
};

// The count and scalars of `set`, for a launch to place.
inline std::vector<Touched> TouchScalars(ScalarSet& set) {
  return {Touch(set.count, 4 * set.num_sets, Touched::Role::kInput),
          Touch(set.scalars, 4 * kNumScalarsPerSet * set.num_sets,
                Touched::Role::kInput)};
}

// Runs `work` through `launch` with the helper threads the call's
// attributes ask for.
inline ffi::Error RunWith(Launch& launch, const BucketAttrs& attrs, Work work) {
  return launch.Run(
      [threads = attrs.host_threads, work = std::move(work)](Workers workers) {
        workers.host_threads = threads;
        return work(workers);
      });
}

// Whether a re-seeding step reads its parameters: only where `unchanged`
// (an s32 flag, read when the step runs) is zero, that is where they may
// differ from the weights the last step produced (equal weights would
// re-seed nothing). Fetches them then (they are Touched::Role::kOnDemand).
inline ffi::Error ReadsParams(const int32_t* unchanged, bool reseed,
                              const Workers& workers, bool* reads) {
  *reads = reseed && *unchanged == 0;
  return *reads ? workers.Fetch() : ffi::Error::Success();
}

// `unchanged`, checked: an s32 flag, whose first element is read (a
// vmapped single-leaf call broadcasts it with the other operands).
inline ffi::Error CheckUnchanged(Flag unchanged, const int32_t** data) {
  if (unchanged.element_count() < 1) {
    return InvalidArgument("unchanged must be an s32 flag");
  }
  *data = unchanged.typed_data();
  return ffi::Error::Success();
}

class RunNow final : public Launch {
 public:
  explicit RunNow(ffi::ThreadPool* pool) : pool_(pool) {}
  ffi::Error Place(std::vector<Touched>&) override {
    return ffi::Error::Success();
  }
  ffi::Error Run(Work work) override {
    Workers workers;
    workers.xla = pool_;
    return work(workers);
  }

 private:
  ffi::ThreadPool* pool_;
};

// `binding | BindArg<T>{}` is `binding.Arg<T>()`, so that a fold can append
// a pack of operands (a Binding cannot be copied or moved from outside).
template <class T>
struct BindArg {};

template <class Binding, class T>
auto operator|(Binding&& binding, BindArg<T>) {
  return std::move(binding).template Arg<T>();
}

// The binding of a bucket handler on `Context` (XLA:CPU's ffi::ThreadPool
// or a CUDA stream's ffi::PlatformStream<void*>): the count and scalars,
// the typed operands `Flags` it takes before its leaves, the leaves'
// operands, an f32[1] sum of squares where `kSumsq`, the leaves' results,
// and BucketAttrs.
template <class Context, bool kSumsq, class... Flags>
auto BucketBinding() {
  auto args = (ffi::Ffi::Bind()
                   .Ctx<Context>()
                   .template Arg<Counts>()
                   .template Arg<Scalars>() |
               ... | BindArg<Flags>{})
                  .RemainingArgs();
  if constexpr (kSumsq) {
    return std::move(args)
        .template Ret<ffi::Buffer<ffi::F32>>()  // SumSq.
        .RemainingRets()
        .template Attrs<BucketAttrs>();
  } else {
    return std::move(args).RemainingRets().template Attrs<BucketAttrs>();
  }
}

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_
