// One row of stacked (scanned) layers' fp32 Adam state stepped in place:
// the host step a scanned layer's backward starts inside the loop
// (`overlap_scan`). Each leaf's master, mu and nu hold L rows of n
// elements (f32[L, ...], pinned host memory on a GPU, never copied); a
// call steps elements [row * n, (row + 1) * n) of each with the row's
// gradient, with exactly the math of a Segments bucket of that row
// (StepSegmentPiece). The row is an operand (the loop's counter, a device
// scalar on a GPU) and is read when the step runs, like the scalars.
//
// Optionally each leaf also has a stacked 16-bit weight (bf16 or f16, L
// rows of n elements, pinned host memory on a GPU): the call writes its
// row with the new master rounded to nearest even, in the same pass (the
// buckets' low-precision copy), and leaves its other rows alone. No sum
// of squares. The re-seed from the parameters, where they are
// not the weights the last step produced, is a call of its own per stack
// (AdamReseedRows), made before the loop, where the whole stacked
// parameters are alive: inside the loop a row's parameters are a temporary
// that XLA may reuse before a worker could copy them on demand. The
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
// = n, master_in == master_out and so on, each of `rows` * n elements, as
// is b.lowp_out where the leaf has stacked weights); `row` (s32[1]) is
// read by the work. `stacked_grads`: each b.grad is every row's gradient
// (row 0's pointer), of which the work reads its row: in place, or, where
// it was given a stand-in (`grads_staged`, a row of staging), fetched into
// it then (Workers::Fetch).
struct RowStep {
  ScalarSet set;
  int32_t* row = nullptr;  // With stacked_grads, a cursor (see StepRow).
  int64_t rows = 0;
  std::vector<SegmentLeaf> leaves;
  bool stacked_grads = false;
  bool grads_staged = false;
  // The new weights go over the step's row of the stacked gradients
  // (b.lowp_out is b.grad), and with a stand-in back to that row.
  bool over_grads = false;
};

// Places `step`'s buffers through `launch` and runs (or enqueues) the
// step of its row; a row outside [0, rows) is the work's error, and then
// nothing is written.
ffi::Error StartRowStep(Launch& launch, RowStep step, const BucketAttrs& attrs);

// One leaf of a re-seed (AdamReseedRows): its stacked master, re-seeded in
// place, and its stacked parameters, each `rows` rows of `size` elements,
// as row 0's pointers. `staged`: the parameters' row 0 was given a stand-in
// (a staging window that Workers::Fetch fills with each row in turn).
struct ReseedLeaf {
  float* master = nullptr;
  const void* params = nullptr;
  ElementType param_type = ElementType::kNone;
  int64_t size = 0;
  bool staged = false;
};

// A re-seed, decoded: the scalars of the row steps that follow (their
// learning rate sets the tolerance, ReseedTolerance), the s32 `unchanged`
// flag, read when the re-seed runs, the rows and the leaves.
struct StackReseed {
  ScalarSet set;
  const int32_t* unchanged = nullptr;
  int64_t rows = 0;
  std::vector<ReseedLeaf> leaves;
};

// Places `reseed`'s buffers through `launch` (the parameters' row 0 on
// demand, Touched::Role::kOnDemand: one row of staging) and runs (or
// enqueues) it: where `unchanged` is zero, each row's parameters are read
// in turn and that row of the master re-seeded as a row step with those
// parameters would have (ReseedRange); otherwise nothing is read or
// written.
ffi::Error StartReseedRows(Launch& launch, StackReseed reseed,
                           const BucketAttrs& attrs);

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ROW_FFI_H_
