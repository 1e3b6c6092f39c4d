// Storage codes of low-precision Adam moments (see lowp_moments.h).
//
// bf16: round to nearest even (float_convert.h).
//
// 8-bit blockwise: a block of kQuantBlock moments is stored as one fp32
// scale, the largest magnitude in the block, and one byte per moment: the
// moment times the scale's fp32 reciprocal (so |y| <= 1 up to rounding; a
// multiply, not a division per element), rounded to the nearest value of
// a small floating-point format, ties to the even code (an fp8-like
// exponent-aware code map: relative precision 2^-4 over many octaves below
// the block's largest value):
//
//   mu (signed):  bit 7 the sign, bits 0-6 an E4M3 magnitude with bias 15:
//                 code c >= 8 is 2^((c >> 3) - 15) * (1 + (c & 7) / 8),
//                 c < 8 is c * 2^-17; 1.0 is code 120.
//   nu (>= 0):    an E5M3 magnitude with bias 31: c >= 8 is
//                 2^((c >> 3) - 31) * (1 + (c & 7) / 8), c < 8 is c * 2^-33;
//                 1.0 is code 248.
//
// Decoding a code is exact; the moment is the decoded value times the scale
// (one fp32 rounding). A block holding a NaN or an infinity is stored with
// that non-finite scale and codes 0, so it decodes to NaN throughout, and a
// block of zeros as scale 0 and codes 0.
//
// Only integer and correctly rounded IEEE operations, so every instruction
// set (and the compiler's vectorisation of these loops) gives the same bits.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_MOMENT_CODEC_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_MOMENT_CODEC_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// The 16-lane helpers below return 64-byte vectors from inline functions;
// GCC warns that units without AVX-512 pass them differently, which no
// caller outside the unit ever sees.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include "xla_ffi/float_convert.h"

namespace jax_superoffload {
// Internal linkage, as in float_convert.h.
namespace {

// Magnitude y in [0, 1] (NaN gives 0) to the code of a format with 3
// mantissa bits and exponent bias kBias, rounded to nearest, ties to even.
// Branch-free, so that the compiler vectorises the loops that call it.
template <uint32_t kBias>
inline uint32_t EncodeMagnitude(float y) {
  const uint32_t bits = FloatBits(y);
  // Subnormal codes are multiples of 2^(-2 - kBias): adding 2^(21 - kBias),
  // whose ulp that is, rounds y to one with the FPU's nearest-even.
  const float magic = BitsToFloat((127u + 21u - kBias) << 23);
  const uint32_t subnormal = FloatBits(y + magic) - FloatBits(magic);
  // Normal codes: the exponent rebiased, the mantissa rounded to 3 bits.
  const uint32_t rebiased = bits - ((127u - kBias) << 23);
  const uint32_t normal = (rebiased + 0x7ffffu + ((rebiased >> 20) & 1u)) >> 20;
  const uint32_t code = bits < ((128u - kBias) << 23) ? subnormal : normal;
  return y >= 0.0f ? code : 0u;  // NaN: 0.
}

template <uint32_t kBias>
inline float DecodeMagnitude(uint32_t code) {
  const float subnormal = static_cast<float>(static_cast<int32_t>(code)) *
                          BitsToFloat((125u - kBias) << 23);
  const uint32_t normal =
      (((code >> 3) + 127u - kBias) << 23) | ((code & 7u) << 20);
  // Selected by a mask, not a branch or `?:` on floats, which GCC does
  // not vectorise here.
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(code < 8);
  return BitsToFloat((FloatBits(subnormal) & is_subnormal) |
                     (normal & ~is_subnormal));
}

inline constexpr uint32_t kMuBias = 15;
inline constexpr uint32_t kNuBias = 31;

// The code in the low 8 bits of a uint32 (the width the encoding loops
// vectorise at).
inline uint32_t EncodeMu(float y) {
  // A NaN's sign is the hardware's choice (x86's default NaN is negative,
  // Arm's positive): NaN encodes as code 0 on every instruction set.
  const uint32_t sign = y == y ? FloatBits(y) >> 31 : 0u;
  const float magnitude = BitsToFloat(FloatBits(y) & 0x7fffffffu);
  return (sign << 7) | EncodeMagnitude<kMuBias>(magnitude);
}

inline float DecodeMu(uint8_t code) {
  const float magnitude = DecodeMagnitude<kMuBias>(code & 0x7fu);
  const uint32_t sign = static_cast<uint32_t>(code >> 7) << 31;
  return BitsToFloat(FloatBits(magnitude) | sign);
}

inline uint32_t EncodeNu(float y) { return EncodeMagnitude<kNuBias>(y); }

inline float DecodeNu(uint8_t code) { return DecodeMagnitude<kNuBias>(code); }

// The same codes 16 at a time, in GCC/Clang generic vectors (lowered to
// whatever the unit's target has: one AVX-512 register, two AVX2 ones, four
// NEON ones, or scalar code). The same integer and IEEE operations as the
// functions above, lane by lane, so they give the same bits; GCC does not
// vectorise those functions' byte loops at full width by itself.
#define JSO_CODEC_INLINE __attribute__((always_inline)) inline

typedef uint8_t Codes16 __attribute__((vector_size(16)));
typedef uint32_t Bits16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));
typedef float Floats16 __attribute__((vector_size(64)));

// 16 bytes widened to 32 bits each, and back. GCC lowers a generic
// conversion between byte and word vectors one lane at a time through
// general registers on x86, so the x86 units use their own instructions.
JSO_CODEC_INLINE Bits16 Widen16(const uint8_t* p) {
  Bits16 out;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&out, &w, sizeof(out));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i halves[2] = {_mm256_cvtepu8_epi32(b),
                             _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
  std::memcpy(&out, halves, sizeof(out));
#else
  Codes16 bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  out = __builtin_convertvector(bytes, Bits16);
#endif
  return out;
}

// The low byte of each lane (every lane holds a code, below 256).
JSO_CODEC_INLINE void Narrow16(const Bits16& x, uint8_t* p) {
#if defined(__AVX512F__)
  __m512i v;
  std::memcpy(&v, &x, sizeof(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
#elif defined(__AVX2__)
  __m256i halves[2];
  std::memcpy(halves, &x, sizeof(halves));
  // Packs work within 128-bit lanes: words come out as lo0-3, hi0-3,
  // lo4-7, hi4-7, which the permutation puts in order.
  const __m256i words =
      _mm256_permute4x64_epi64(_mm256_packus_epi32(halves[0], halves[1]), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi16(_mm256_castsi256_si128(words),
                                    _mm256_extracti128_si256(words, 1)));
#else
  const Codes16 bytes = __builtin_convertvector(x, Codes16);
  std::memcpy(p, &bytes, sizeof(bytes));
#endif
}

template <uint32_t kBias>
JSO_CODEC_INLINE Floats16 DecodeMagnitude16(const Bits16& code) {
  const Floats16 subnormal =
      __builtin_convertvector(reinterpret_cast<Ints16>(code), Floats16) *
      BitsToFloat((125u - kBias) << 23);
  const Bits16 normal =
      (((code >> 3) + (127u - kBias)) << 23) | ((code & 7u) << 20);
  const Bits16 is_subnormal = reinterpret_cast<Bits16>(code < 8u);
  return reinterpret_cast<Floats16>(
      (reinterpret_cast<Bits16>(subnormal) & is_subnormal) |
      (normal & ~is_subnormal));
}

// 16 codes at `code` times `scale` (DecodeMu or DecodeNu, then the scale).
template <bool kSigned>
JSO_CODEC_INLINE Floats16 Decode16(const uint8_t* code, float scale) {
  const Bits16 c = Widen16(code);
  if constexpr (kSigned) {
    const Floats16 magnitude = DecodeMagnitude16<kMuBias>(c & 0x7fu);
    return reinterpret_cast<Floats16>(reinterpret_cast<Bits16>(magnitude) |
                                      ((c >> 7) << 31)) *
           scale;
  } else {
    return DecodeMagnitude16<kNuBias>(c) * scale;
  }
}

template <uint32_t kBias>
JSO_CODEC_INLINE Bits16 EncodeMagnitude16(const Floats16& y) {
  const Bits16 bits = reinterpret_cast<Bits16>(y);
  const float magic = BitsToFloat((127u + 21u - kBias) << 23);
  const Bits16 subnormal =
      reinterpret_cast<Bits16>(y + magic) - FloatBits(magic);
  const Bits16 rebiased = bits - ((127u - kBias) << 23);
  const Bits16 normal = (rebiased + 0x7ffffu + ((rebiased >> 20) & 1u)) >> 20;
  const Bits16 is_subnormal =
      reinterpret_cast<Bits16>(bits < ((128u - kBias) << 23));
  const Bits16 code = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  return code & reinterpret_cast<Bits16>(y >= 0.0f);  // NaN: 0.
}

// EncodeMu or EncodeNu of 16 values, stored as 16 bytes at `code`.
template <bool kSigned>
JSO_CODEC_INLINE void Encode16(const Floats16& y, uint8_t* code) {
  const Bits16 bits = reinterpret_cast<Bits16>(y);
  Bits16 out;
  if constexpr (kSigned) {
    const Floats16 magnitude = reinterpret_cast<Floats16>(bits & 0x7fffffffu);
    const Bits16 not_nan = reinterpret_cast<Bits16>(y == y);
    out =
        (((bits >> 31) & not_nan) << 7) | EncodeMagnitude16<kMuBias>(magnitude);
  } else {
    out = EncodeMagnitude16<kNuBias>(y);
  }
  Narrow16(out, code);
}

}  // namespace
}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_MOMENT_CODEC_H_
