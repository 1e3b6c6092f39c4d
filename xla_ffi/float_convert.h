// Bit-exact scalar conversions between fp32 and the 16-bit float formats.
//
// Round-to-nearest-even, as the vector units do, so that the scalar tail of a
// vectorised loop gives the same bits as its body. NaNs stay NaN (quietened).

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_FLOAT_CONVERT_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_FLOAT_CONVERT_H_

#include <cstdint>
#include <cstring>

namespace jax_superoffload {
// Internal linkage: this header is included by translation units compiled
// for different instruction sets, and a shared inline definition compiled
// with AVX-512 must never be the one the linker keeps for baseline code.
namespace {

inline uint32_t FloatBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float BitsToFloat(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline float Bf16BitsToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

inline uint16_t FloatToBf16Bits(float x) {
  const uint32_t bits = FloatBits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // Quiet NaN.
  }
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

inline float F16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {  // Inf or NaN; NaNs are quietened like F16C.
    const uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return BitsToFloat(sign | 0x7f800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {  // Zero or subnormal: mantissa * 2^-24 is exact.
    const float magnitude =
        static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsToFloat(sign | FloatBits(magnitude));
  }
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t FloatToF16Bits(float x) {
  const uint32_t bits = FloatBits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: keep the top payload bits, quieten.
    return sign | 0x7e00u | static_cast<uint16_t>((magnitude >> 13) & 0x1ffu);
  }
  // 65520 (0x477ff000) is halfway between the largest half, 65504, and 2^16;
  // ties go to even, which is the overflow to infinity.
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  if (magnitude < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 (whose ulp is 2^-24)
    // rounds the magnitude to a multiple of 2^-24 with the FPU's rounding,
    // nearest-even by default, and the low bits are then the half mantissa.
    const float rounded = BitsToFloat(magnitude) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(rounded) - 0x3f000000u);
  }
  const uint32_t odd = (magnitude >> 13) & 1u;
  const uint32_t rebiased = magnitude - (112u << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(rebiased >> 13);
}

}  // namespace
}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_FLOAT_CONVERT_H_
