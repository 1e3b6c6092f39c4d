#include "xla_ffi/lowp_moments.h"

#include <cstdint>

#include "xla_ffi/adam_kernel_isa.h"

namespace jax_superoffload {

const char* MomentFormatName(MomentFormat format) {
  static constexpr const char* kNames[] = {"f32", "bf16", "q8"};
  return internal::EnumName(kNames, format, "?");
}

bool LowpFormatsSupported(MomentFormat mu, MomentFormat nu) {
  return (mu == MomentFormat::kBF16 &&
          (nu == MomentFormat::kF32 || nu == MomentFormat::kBF16)) ||
         (mu == MomentFormat::kQ8 && nu == MomentFormat::kQ8);
}

const char* ValidateLowpMomentBuffers(const LowpMomentBuffers& b) {
  if (b.size < 0) return "size must be non-negative";
  if (!LowpFormatsSupported(b.mu_format, b.nu_format)) {
    return "moment formats must be (bf16, f32), (bf16, bf16) or (q8, q8)";
  }
  if (b.size == 0) return nullptr;
  if (b.master_in == nullptr || b.master_out == nullptr || b.grad == nullptr ||
      b.mu_in == nullptr || b.mu_out == nullptr || b.nu_in == nullptr ||
      b.nu_out == nullptr) {
    return "master, grad, mu and nu buffers must be set";
  }
  if (b.mu_format == MomentFormat::kQ8 &&
      (b.mu_scale_in == nullptr || b.mu_scale_out == nullptr ||
       b.nu_scale_in == nullptr || b.nu_scale_out == nullptr)) {
    return "8-bit moments need their scales";
  }
  if (b.grad_type == ElementType::kNone) return "gradient type must be set";
  if (b.lowp_type != ElementType::kNone && b.lowp_out == nullptr) {
    return "lowp_out must be set when lowp_type is";
  }
  return nullptr;
}

double LowpAdamStepRange(const AdamConstants& constants,
                         const LowpMomentBuffers& buffers, int64_t begin,
                         int64_t end, Isa isa, bool sum_squares) {
  if (begin >= end) return 0.0;
  if (!IsaAvailable(isa)) isa = Isa::kScalar;
  return internal::Entries(isa).lowp_step(constants, buffers, begin, end,
                                          sum_squares);
}

}  // namespace jax_superoffload
