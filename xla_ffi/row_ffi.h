// One row of stacked (scanned) layers' fp32 Adam state stepped in place:
// the host step a scanned layer's backward starts inside the loop (issue
// 37 point 1). Each leaf's master, mu and nu hold L rows of n elements
// (f32[L, ...], pinned host memory on a GPU, never copied); a call steps
// elements [row * n, (row + 1) * n) of each with the row's gradient, with
// exactly the math of a Segments bucket of that row (StepSegmentPiece).
// The row is an operand (the loop's counter, a device scalar on a GPU) and
// is read when the step runs, like the scalars.
//
// fp32 weights only, for this first cut: no low-precision weight copies
// (the new weights are the master's row) and no sum of squares. Its
// handler symbols are declared with the others, in adam_ffi.h.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_ROW_FFI_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_ROW_FFI_H_

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/launch.h"

namespace jax_superoffload {

// A row step's decoded operands. Each leaf's buffers are its row 0 (b.size
// = n, master_in == master_out and so on, each of `rows` * n elements);
// `row` (s32[1]) is read by the work.
struct RowStep {
  ScalarSet set;
  const int32_t* row = nullptr;
  int64_t rows = 0;
  std::vector<SegmentLeaf> leaves;
};

// Places `step`'s buffers through `launch` and runs (or enqueues) the
// step of its row; a row outside [0, rows) is the work's error, and then
// nothing is written.
ffi::Error StartRowStep(Launch& launch, RowStep step, const BucketAttrs& attrs);

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ROW_FFI_H_
