// aarch64 SVE path (Grace: Neoverse V2), vector-length agnostic: a predicate
// covers the tail, so there is no scalar remainder. Built with +sve.

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/adam_kernel_isa.h"

#if defined(__ARM_FEATURE_SVE)
#include <arm_sve.h>

namespace jax_superoffload {
namespace {

// Arithmetic runs on all lanes: inactive lanes hold zeros from the
// predicated loads and are never stored.
struct SveOps {
  using V = svfloat32_t;
  static JSO_INLINE svbool_t All() { return svptrue_b32(); }
  static JSO_INLINE V Set(float x) { return svdup_n_f32(x); }
  static JSO_INLINE V Add(V a, V b) { return svadd_f32_x(All(), a, b); }
  static JSO_INLINE V Sub(V a, V b) { return svsub_f32_x(All(), a, b); }
  static JSO_INLINE V Mul(V a, V b) { return svmul_f32_x(All(), a, b); }
  static JSO_INLINE V Div(V a, V b) { return svdiv_f32_x(All(), a, b); }
  static JSO_INLINE V Sqrt(V a) { return svsqrt_f32_x(All(), a); }
  static JSO_INLINE V SelectFinite(V g, V a, V b) {
    return svsel_f32(svcmpeq_n_f32(All(), svsub_f32_x(All(), g, g), 0.0f), a,
                     b);
  }
};

template <ElementType kGrad>
JSO_INLINE svfloat32_t SveLoadGrad(svbool_t pg, const void* grad, int64_t i) {
  if constexpr (kGrad == ElementType::kF32) {
    return svld1_f32(pg, static_cast<const float*>(grad) + i);
  } else {
    // Each 16-bit value lands, zero-extended, in the low half of a lane.
    const svuint32_t h =
        svld1uh_u32(pg, static_cast<const uint16_t*>(grad) + i);
    if constexpr (kGrad == ElementType::kBF16) {
      return svreinterpret_f32_u32(svlsl_n_u32_x(pg, h, 16));
    } else {
      return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
    }
  }
}

template <ElementType kLowp>
JSO_INLINE void SveStoreLowp(svbool_t pg, void* out, int64_t i,
                             svfloat32_t x) {
  uint16_t* dst = static_cast<uint16_t*>(out) + i;  // Unused for kF32.
  if constexpr (kLowp == ElementType::kF32) {
    svst1_f32(pg, static_cast<float*>(out) + i, x);
  } else if constexpr (kLowp == ElementType::kBF16) {
    const svuint32_t bits = svreinterpret_u32_f32(x);
    const svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, bits, 16), 1);
    const svuint32_t rounded =
        svadd_u32_x(pg, bits, svadd_n_u32_x(pg, lsb, 0x7fff));
    const svuint32_t quiet_nan = svorr_n_u32_x(pg, bits, 0x00400000);
    const svbool_t is_nan = svcmpuo_f32(pg, x, x);
    const svuint32_t chosen = svsel_u32(is_nan, quiet_nan, rounded);
    svst1h_u32(pg, dst, svlsr_n_u32_x(pg, chosen, 16));
  } else if constexpr (kLowp == ElementType::kF16) {
    svst1h_u32(pg, dst, svreinterpret_u32_f16(svcvt_f16_f32_x(pg, x)));
  }
}

template <ElementType kGrad, ElementType kLowp, bool kNesterov, bool kDecay, bool kGuard>
struct SveLoop {
  static void Run(const AdamConstants& k, const AdamBuffers& b, int64_t begin,
                  int64_t end) {
    for (int64_t i = begin; i < end; i += svcntw()) {
      const svbool_t pg = svwhilelt_b32(i, end);
      svfloat32_t master = svld1_f32(pg, b.master_in + i);
      svfloat32_t mu = svld1_f32(pg, b.mu_in + i);
      svfloat32_t nu = svld1_f32(pg, b.nu_in + i);
      const svfloat32_t grad = SveLoadGrad<kGrad>(pg, b.grad, i);
      AdamMath<SveOps, kNesterov, kDecay, kGuard>(k, grad, master, mu, nu);
      svst1_f32(pg, b.master_out + i, master);
      svst1_f32(pg, b.mu_out + i, mu);
      svst1_f32(pg, b.nu_out + i, nu);
      SveStoreLowp<kLowp>(pg, b.lowp_out, i, master);
    }
  }
};

}  // namespace
}  // namespace jax_superoffload

namespace jax_superoffload::internal {

bool SveCompiled() { return true; }

void AdamStepRangeSve(const AdamConstants& k, const AdamBuffers& b,
                      int64_t begin, int64_t end) {
  DispatchAdam<SveLoop>(k, b, begin, end);
}

void RooflineRangeSve(const AdamBuffers& b, int64_t begin, int64_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  for (int64_t i = begin; i < end; i += svcntw()) {
    const svbool_t pg = svwhilelt_b32(i, end);
    const svfloat32_t master = svld1_f32(pg, b.master_in + i);
    const svfloat32_t mu = svld1_f32(pg, b.mu_in + i);
    const svfloat32_t nu = svld1_f32(pg, b.nu_in + i);
    svst1_f32(pg, b.master_out + i,
              svadd_f32_x(pg, master, svld1_f32(pg, grad + i)));
    svst1_f32(pg, b.mu_out + i, nu);
    svst1_f32(pg, b.nu_out + i, mu);
  }
}

}  // namespace jax_superoffload::internal
#else
JSO_DEFINE_MISSING_ISA(Sve)
#endif
