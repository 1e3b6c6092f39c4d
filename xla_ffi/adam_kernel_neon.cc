// aarch64 Advanced SIMD (NEON) path (4 lanes); part of every aarch64 CPU.

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/adam_kernel_isa.h"
#include "xla_ffi/lowp_moments_impl.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

namespace jax_superoffload {
namespace {

struct NeonOps {
  using V = float32x4_t;
  static constexpr int64_t kLanes = 4;
  static JSO_INLINE V Set(float x) { return vdupq_n_f32(x); }
  static JSO_INLINE V Add(V a, V b) { return vaddq_f32(a, b); }
  static JSO_INLINE V Sub(V a, V b) { return vsubq_f32(a, b); }
  static JSO_INLINE V Mul(V a, V b) { return vmulq_f32(a, b); }
  static JSO_INLINE V Div(V a, V b) { return vdivq_f32(a, b); }
  static JSO_INLINE V Sqrt(V a) { return vsqrtq_f32(a); }
  static JSO_INLINE V SelectFinite(V g, V a, V b) {
    return vbslq_f32(vceqq_f32(vsubq_f32(g, g), vdupq_n_f32(0.0f)), a, b);
  }
  static JSO_INLINE V Load(const float* p) { return vld1q_f32(p); }
  static JSO_INLINE void Store(float* p, V x) { vst1q_f32(p, x); }
  // No streaming store for single vectors: plain ones (same values).
  static JSO_INLINE void StoreStream(float* p, V x) { vst1q_f32(p, x); }
  static JSO_INLINE void Fence() {}
  static JSO_INLINE V LoadBf16(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static JSO_INLINE V LoadF16(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static JSO_INLINE void StoreBf16(uint16_t* p, V x) {
    const uint32x4_t bits = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t rounded =
        vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7fff), lsb));
    const uint32x4_t quiet_nan = vorrq_u32(bits, vdupq_n_u32(0x00400000));
    const uint32x4_t is_nan = vmvnq_u32(vceqq_f32(x, x));
    vst1_u16(p, vshrn_n_u32(vbslq_u32(is_nan, quiet_nan, rounded), 16));
  }
  static JSO_INLINE void StoreF16(uint16_t* p, V x) {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
};

}  // namespace
}  // namespace jax_superoffload

JSO_DEFINE_FIXED_WIDTH_ISA(Neon, NeonOps)
JSO_DEFINE_LOWP_ISA(Neon, NeonOps)
#else
JSO_DEFINE_MISSING_ISA(Neon)
JSO_DEFINE_MISSING_LOWP_ISA(Neon)
#endif
