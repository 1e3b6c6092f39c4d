// How a handler's work runs once its operands are decoded and checked: at
// once on XLA:CPU's pool (RunNow), or later, in order on a GPU stream
// (stream_launch.h). The handlers read every scalar operand inside the work,
// never while decoding: on a stream those operands are written by copies
// that have not run yet when the handler is called.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_

#include <functional>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_support.h"

namespace jax_superoffload {

// A step's work on decoded buffers. Its captures must own what they hold:
// it may run after the handler has returned.
using Work = std::function<ffi::Error(Workers)>;

class Launch {
 public:
  virtual ~Launch() = default;
  // Runs `work` or enqueues it. `touched`: every buffer the work reads or
  // writes, which a launch may check is where the CPU can reach it.
  virtual ffi::Error Run(Work work,
                         const std::vector<const void*>& touched) = 0;
};

class RunNow final : public Launch {
 public:
  explicit RunNow(ffi::ThreadPool* pool) : pool_(pool) {}
  ffi::Error Run(Work work, const std::vector<const void*>&) override {
    return work(Workers{pool_});
  }

 private:
  ffi::ThreadPool* pool_;
};

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_LAUNCH_H_
