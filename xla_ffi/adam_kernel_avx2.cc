// x86-64 AVX2 path (8 lanes); needs AVX2 and F16C. Built with -mavx2 -mf16c.

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/adam_kernel_isa.h"
#include "xla_ffi/lowp_moments_impl.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

namespace jax_superoffload {
namespace {

struct Avx2Ops {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static JSO_INLINE V Set(float x) { return _mm256_set1_ps(x); }
  static JSO_INLINE V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static JSO_INLINE V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static JSO_INLINE V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static JSO_INLINE V Div(V a, V b) { return _mm256_div_ps(a, b); }
  static JSO_INLINE V Sqrt(V a) { return _mm256_sqrt_ps(a); }
  static JSO_INLINE V SelectFinite(V g, V a, V b) {
    const V finite =
        _mm256_cmp_ps(_mm256_sub_ps(g, g), _mm256_setzero_ps(), _CMP_EQ_OQ);
    return _mm256_blendv_ps(b, a, finite);
  }
  static JSO_INLINE V Load(const float* p) { return _mm256_loadu_ps(p); }
  static JSO_INLINE void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
  // p is aligned to the vector (AdamBuffers::stream_state).
  static JSO_INLINE void StoreStream(float* p, V x) { _mm256_stream_ps(p, x); }
  static JSO_INLINE void Fence() { _mm_sfence(); }
  static JSO_INLINE V LoadBf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static JSO_INLINE V LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static JSO_INLINE void StoreBf16(uint16_t* p, V x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb =
        _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(
        bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i quiet_nan =
        _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256i is_nan =
        _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i high =
        _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet_nan, is_nan), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high),
                                            _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static JSO_INLINE void StoreF16(uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

}  // namespace
}  // namespace jax_superoffload

JSO_DEFINE_FIXED_WIDTH_ISA(Avx2, Avx2Ops)
JSO_DEFINE_LOWP_ISA(Avx2, Avx2Ops)
#else
JSO_DEFINE_MISSING_ISA(Avx2)
JSO_DEFINE_MISSING_LOWP_ISA(Avx2)
#endif
