// x86-64 AVX-512 path (16 lanes); needs AVX512F. Built with -mavx512f.

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/adam_kernel_isa.h"
#include "xla_ffi/lowp_moments_impl.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace jax_superoffload {
namespace {

struct Avx512Ops {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static JSO_INLINE V Set(float x) { return _mm512_set1_ps(x); }
  static JSO_INLINE V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static JSO_INLINE V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static JSO_INLINE V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static JSO_INLINE V Div(V a, V b) { return _mm512_div_ps(a, b); }
  static JSO_INLINE V Sqrt(V a) { return _mm512_sqrt_ps(a); }
  static JSO_INLINE V SelectFinite(V g, V a, V b) {
    const __mmask16 finite = _mm512_cmp_ps_mask(
        _mm512_sub_ps(g, g), _mm512_setzero_ps(), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(finite, b, a);
  }
  static JSO_INLINE V Load(const float* p) { return _mm512_loadu_ps(p); }
  static JSO_INLINE void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
  // p is aligned to the vector (AdamBuffers::stream_state).
  static JSO_INLINE void StoreStream(float* p, V x) { _mm512_stream_ps(p, x); }
  static JSO_INLINE void Fence() { _mm_sfence(); }
  static JSO_INLINE V LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static JSO_INLINE V LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static JSO_INLINE void StoreBf16(uint16_t* p, V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb =
        _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(
        bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __m512i quiet_nan =
        _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i high = _mm512_srli_epi32(
        _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(high));
  }
  static JSO_INLINE void StoreF16(uint16_t* p, V x) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(p),
        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace
}  // namespace jax_superoffload

JSO_DEFINE_FIXED_WIDTH_ISA(Avx512, Avx512Ops)
JSO_DEFINE_LOWP_ISA(Avx512, Avx512Ops)
#else
JSO_DEFINE_MISSING_ISA(Avx512)
JSO_DEFINE_MISSING_LOWP_ISA(Avx512)
#endif
