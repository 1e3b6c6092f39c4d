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

class RunNow final : public Launch {
 public:
  explicit RunNow(ffi::ThreadPool* pool) : pool_(pool) {}
  ffi::Error Place(std::vector<Touched>&) override {
    return ffi::Error::Success();
  }
  ffi::Error Run(Work work) override { return work(Workers{pool_}); }

 private:
  ffi::ThreadPool* pool_;
};

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_
