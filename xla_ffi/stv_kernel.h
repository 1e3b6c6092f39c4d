// Speculation-then-validation over double-buffered Adam state.
//
// Each state array of a bucket (master, mu, nu) holds two rows end to end:
// row `from` is the current state, row 1 - from the spare. The speculative
// step reads row `from` and writes row 1 - from, so the current state is
// still there, bit for bit, when validation speaks:
//
// - accepted: row 1 - from becomes the current state (nothing to do);
// - clipped: the step is taken again from row `from` with the clipped
//   gradient scale, over row 1 - from (exact: no algebraic undo);
// - dropped (non-finite gradients): row `from` stays the current state.
//
// A step reads 16 B per parameter and writes 12, as an in-place step does;
// the speculative step also writes the gradient it read, as fp32 (4 B), so
// the redo can read it after the caller's gradient buffers are gone. The
// spare row is not in cache when the speculative step writes it, so it is
// written with streaming stores where it can (AdamBuffers::stream_state):
// a plain store would first read each line, 12 B/param more. So is the kept
// gradient when it shares the spare row's alignment (as when row 0 is the
// spare, or the length is a multiple of 16); otherwise it is copied with
// plain stores right after each block is stepped (4 B/param more).
//
// Pure C++17, like adam_kernel.h, so it can be tested against float64 alone.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_STV_KERNEL_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_STV_KERNEL_H_

#include <cstdint>

#include "xla_ffi/adam_kernel.h"

namespace jax_superoffload {

// One segment (a leaf, or a whole bucket) of a double-buffered bucket.
struct PairBuffers {
  int64_t size = 0;         // Elements of this segment.
  int64_t row_stride = 0;   // Elements from row 0 to row 1 of the state.
  float* master = nullptr;  // Row 0 of the segment; row 1 is + row_stride.
  float* mu = nullptr;
  float* nu = nullptr;
  const void* grad = nullptr;  // The gradient, as the caller stores it.
  ElementType grad_type = ElementType::kF32;
  float* kept_grad = nullptr;  // Receives the gradient as fp32; may be null.
  void* lowp_out = nullptr;    // Copy of the new weights, as in AdamBuffers.
  ElementType lowp_type = ElementType::kNone;
  Prefetch prefetch = kDefaultPrefetch;  // As in AdamBuffers.
};

// The AdamBuffers of a step that reads row `from` and writes row 1 - from,
// with `grad` (and its type) as the gradient.
AdamBuffers RowStep(const PairBuffers& pair, int from, const void* grad,
                    ElementType grad_type);

// The speculative step over [begin, end) of the segment: reads row `from`
// and the gradient, writes row 1 - from, the weights copy and (when
// `kept_grad` is set) the gradient as fp32. Returns the sum of the squared
// scaled gradients. Its order of additions is fixed by the instruction set,
// the range and where the written row reaches a 64-byte boundary: the two
// rows of a segment whose length is not a multiple of 16 reach it at
// different elements, so the same gradients can give sums an ulp apart
// with row 0 and with row 1 current (and a clip scale an ulp apart).
double SpeculativeStepRange(const AdamConstants& constants,
                            const PairBuffers& pair, int from, int64_t begin,
                            int64_t end, Isa isa);

// The redo of a clipped step over [begin, end): the step again from the
// untouched row `from`, reading the kept fp32 gradient, with `constants`
// (the speculative ones with the clipped grad_scale and keep_nonfinite
// off), over row 1 - from and the weights copy.
void RedoStepRange(const AdamConstants& constants, const PairBuffers& pair,
                   int from, int64_t begin, int64_t end, Isa isa);

// Elements per sub-range of SpeculativeStepRange when it does not stream
// the kept gradient: the gradient is copied to `kept_grad` right after the
// step has read it, while it is still in cache.
inline constexpr int64_t kKeepGradBlock = 1 << 14;

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_STV_KERNEL_H_
