// What the kernel's C++ tests share: pass/fail counting and a seeded
// generator (SplitMix64), so that every test binary reports alike.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_TEST_UTIL_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_TEST_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace jax_superoffload {

inline int g_passed = 0;
inline int g_failed = 0;

inline void Check(bool ok, const char* what, const char* context) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAILED: %s [%s]\n", what, context);
  }
}

// Prints the counts; the exit status of the test binary.
inline int Report() {
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

inline uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline double Uniform(uint64_t& state) {  // In [-1, 1).
  return static_cast<double>(SplitMix(state) >> 11) * 0x1.0p-52 - 1.0;
}

inline double Unit(uint64_t& state) {  // In [0, 1).
  return static_cast<double>(SplitMix(state) >> 11) * 0x1.0p-53;
}

inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_TEST_UTIL_H_
