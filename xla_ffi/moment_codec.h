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
  const uint32_t normal =
      (rebiased + 0x7ffffu + ((rebiased >> 20) & 1u)) >> 20;
  const uint32_t code = bits < ((128u - kBias) << 23) ? subnormal : normal;
  return y >= 0.0f ? code : 0u;  // NaN: 0.
}

template <uint32_t kBias>
inline float DecodeMagnitude(uint32_t code) {
  const float subnormal = static_cast<float>(static_cast<int32_t>(code)) *
                          BitsToFloat((125u - kBias) << 23);
  const uint32_t normal = (((code >> 3) + 127u - kBias) << 23) |
                          ((code & 7u) << 20);
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
  return BitsToFloat(FloatBits(magnitude) | (static_cast<uint32_t>(code >> 7) << 31));
}

inline uint32_t EncodeNu(float y) { return EncodeMagnitude<kNuBias>(y); }

inline float DecodeNu(uint8_t code) { return DecodeMagnitude<kNuBias>(code); }

}  // namespace
}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_MOMENT_CODEC_H_
