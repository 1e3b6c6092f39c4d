// aarch64 SVE path (Grace: Neoverse V2), vector-length agnostic: a predicate
// covers the tail, so there is no scalar remainder. Built with +sve.

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/adam_kernel_isa.h"
#include "xla_ffi/lowp_moments_impl.h"

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
JSO_INLINE void SveStoreLowp(svbool_t pg, void* out, int64_t i, svfloat32_t x) {
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

// One vector at i, its active lanes `pg`: load, step, store. Returns g * g.
template <ElementType kGrad, ElementType kLowp, bool kNesterov, bool kDecay,
          bool kGuard>
JSO_INLINE svfloat32_t SveElements(const AdamConstants& k, const AdamBuffers& b,
                                   svbool_t pg, int64_t i) {
  if (StartsLine(i, static_cast<int64_t>(svcntw()))) {
    PrefetchInputs<kGrad>(b, i);
  }
  svfloat32_t master = svld1_f32(pg, b.master_in + i);
  svfloat32_t mu = svld1_f32(pg, b.mu_in + i);
  svfloat32_t nu = svld1_f32(pg, b.nu_in + i);
  const svfloat32_t grad = SveLoadGrad<kGrad>(pg, b.grad, i);
  const svfloat32_t g_squared =
      AdamMath<SveOps, kNesterov, kDecay, kGuard>(k, grad, master, mu, nu);
  svst1_f32(pg, b.master_out + i, master);
  svst1_f32(pg, b.mu_out + i, mu);
  svst1_f32(pg, b.nu_out + i, nu);
  SveStoreLowp<kLowp>(pg, b.lowp_out, i, master);
  return g_squared;
}

// As AdamLoop (adam_kernel_impl.h), with the tail in the last, partial
// vector. With kSumSquares, each lane adds up to kSumSquaresPerLane squares
// of its active elements in fp32, then goes into a double: the even lanes
// into one vector of doubles, the odd lanes into another, which are stored
// and added in lane order at the end.
template <ElementType kGrad, ElementType kLowp, bool kNesterov, bool kDecay,
          bool kGuard, bool kSumSquares>
struct SveLoop {
  static double Run(const AdamConstants& constants, const AdamBuffers& buffers,
                    int64_t begin, int64_t end) {
    // Local copies, as in AdamLoop.
    const AdamConstants k = constants;
    const AdamBuffers b = buffers;
    const int64_t lanes = static_cast<int64_t>(svcntw());
    if constexpr (!kSumSquares) {
      for (int64_t i = begin; i < end; i += lanes) {
        SveElements<kGrad, kLowp, kNesterov, kDecay, kGuard>(
            k, b, svwhilelt_b32(i, end), i);
      }
      return 0.0;
    } else {
      const svbool_t all64 = svptrue_b64();
      svfloat64_t even = svdup_n_f64(0.0), odd = svdup_n_f64(0.0);
      for (int64_t i = begin; i < end;) {
        const int64_t stop = SumSquaresBlockEnd(i, end, lanes);
        svfloat32_t sum = svdup_n_f32(0.0f);
        for (; i < stop; i += lanes) {
          const svbool_t pg = svwhilelt_b32(i, stop);
          // Merging add: lanes past the end keep their sum.
          sum =
              svadd_f32_m(pg, sum,
                          SveElements<kGrad, kLowp, kNesterov, kDecay, kGuard>(
                              k, b, pg, i));
        }
        // svcvt_f64_f32 widens the even-numbered fp32 lanes; shifting each
        // 64-bit container right by 32 brings the odd ones there.
        even = svadd_f64_x(all64, even, svcvt_f64_f32_x(all64, sum));
        const svfloat32_t odd_moved = svreinterpret_f32_u64(
            svlsr_n_u64_x(all64, svreinterpret_u64_f32(sum), 32));
        odd = svadd_f64_x(all64, odd, svcvt_f64_f32_x(all64, odd_moved));
      }
      double even_lanes[32], odd_lanes[32];  // Vectors hold up to 2048 bits.
      svst1_f64(all64, even_lanes, even);
      svst1_f64(all64, odd_lanes, odd);
      double total = 0.0;
      for (int64_t lane = 0; lane < lanes / 2; ++lane) {
        total += even_lanes[lane];
        total += odd_lanes[lane];
      }
      return total;
    }
  }
};

}  // namespace
}  // namespace jax_superoffload

namespace jax_superoffload::internal {

bool SveCompiled() { return true; }

double AdamStepRangeSve(const AdamConstants& k, const AdamBuffers& b,
                        int64_t begin, int64_t end, bool sum_squares) {
  return DispatchAdam<SveLoop>(k, b, begin, end, sum_squares);
}

void RooflineRangeSve(const AdamBuffers& b, int64_t begin, int64_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  for (int64_t i = begin; i < end; i += svcntw()) {
    const svbool_t pg = svwhilelt_b32(i, end);
    if (StartsLine(i, static_cast<int64_t>(svcntw()))) {
      PrefetchInputs<ElementType::kF32>(b, i);
    }
    const svfloat32_t master = svld1_f32(pg, b.master_in + i);
    const svfloat32_t mu = svld1_f32(pg, b.mu_in + i);
    const svfloat32_t nu = svld1_f32(pg, b.nu_in + i);
    svst1_f32(pg, b.master_out + i,
              svadd_f32_x(pg, master, svld1_f32(pg, grad + i)));
    svst1_f32(pg, b.mu_out + i, nu);
    svst1_f32(pg, b.nu_out + i, mu);
  }
}

void ReseedBf16RangeSve(float* master, const uint16_t* params, float tolerance,
                        int64_t begin, int64_t end) {
  ReseedBf16Loop(master, params, tolerance, begin, end);
}

}  // namespace jax_superoffload::internal
#else
JSO_DEFINE_MISSING_ISA(Sve)
#endif

// Low-precision moments run the scalar path on SVE machines (lowp_moments.h).
JSO_DEFINE_MISSING_LOWP_ISA(Sve)
