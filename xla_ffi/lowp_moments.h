// Grace Adam with low-precision moments: bf16, or 8-bit blockwise.
//
// The fp32 master stays fp32; mu and nu are stored in fewer bytes, which is
// what a memory-bound step is paid by:
//
//   moments                 bytes moved per step   host state per param
//   fp32 (adam_kernel.h)    28                     12 (master, mu, nu)
//   mu bf16, nu fp32        24                     10
//   bf16                    20                      8
//   8-bit blockwise         ~18 (16 + scales)      ~6 (codes + scales)
//
// One step per element, as adam_kernel.h's formula, in fp32: the old
// moments are decoded (exactly, for bf16; code times scale, one rounding,
// for 8-bit), the new ones computed and used for the update unrounded (as
// optax does with `mu_dtype`), then stored rounded: bf16 to nearest even;
// 8-bit per block of kQuantBlock elements, as moment_codec.h describes.
// Every instruction set gives the same bits.
//
// Pure C++17, like adam_kernel.h.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_LOWP_MOMENTS_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_LOWP_MOMENTS_H_

#include <cstdint>

#include "xla_ffi/adam_kernel.h"

namespace jax_superoffload {

// How a moment is stored.
enum class MomentFormat : int {
  kF32 = 0,
  kBF16 = 1,  // uint16 bits of bf16.
  kQ8 = 2,    // One byte per element and one fp32 scale per block.
};

const char* MomentFormatName(MomentFormat format);

// Elements per 8-bit block. Blocks start at element 0 of a buffer.
inline constexpr int64_t kQuantBlock = 256;

// The buffers of one step with low-precision moments. `*_in` and `*_out`
// may alias (in place) but must not partially overlap. Scales (kQ8 only)
// hold one fp32 per block, ceil(size / kQuantBlock) of them.
struct LowpMomentBuffers {
  int64_t size = 0;
  const float* master_in = nullptr;
  float* master_out = nullptr;
  const void* grad = nullptr;
  ElementType grad_type = ElementType::kF32;
  MomentFormat mu_format = MomentFormat::kBF16;
  MomentFormat nu_format = MomentFormat::kF32;
  const void* mu_in = nullptr;
  void* mu_out = nullptr;
  const float* mu_scale_in = nullptr;
  float* mu_scale_out = nullptr;
  const void* nu_in = nullptr;
  void* nu_out = nullptr;
  const float* nu_scale_in = nullptr;
  float* nu_scale_out = nullptr;
  void* lowp_out = nullptr;  // Copy of the new master, as in AdamBuffers.
  ElementType lowp_type = ElementType::kNone;
  Prefetch prefetch = kDefaultPrefetch;  // As in AdamBuffers.
};

// The pairs of formats supported: (kBF16, kF32) (optax's mu_dtype=bf16),
// (kBF16, kBF16) and (kQ8, kQ8).
bool LowpFormatsSupported(MomentFormat mu, MomentFormat nu);

// Returns an error message for invalid buffers, nullptr if valid.
const char* ValidateLowpMomentBuffers(const LowpMomentBuffers& buffers);

// Updates elements [begin, end) with instruction set `isa` (SVE runs the
// scalar path) and returns the sum of the squared scaled gradients, as
// AdamStepSumSquaresRange does (0 unless `sum_squares`). `begin` must be a
// multiple of kQuantBlock (for kQ8; any element otherwise).
double LowpAdamStepRange(const AdamConstants& constants,
                         const LowpMomentBuffers& buffers, int64_t begin,
                         int64_t end, Isa isa, bool sum_squares);

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_LOWP_MOMENTS_H_
