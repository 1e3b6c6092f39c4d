// The low-precision-moment step (lowp_moments.h) over a set of vector
// operations. Included after adam_kernel_impl.h by the per-instruction-set
// translation units; internal linkage throughout.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_LOWP_MOMENTS_IMPL_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_LOWP_MOMENTS_IMPL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla_ffi/adam_kernel_impl.h"
#include "xla_ffi/lowp_moments.h"
#include "xla_ffi/moment_codec.h"

namespace jax_superoffload {
namespace {

// How a moment is stored. Elementwise formats (fp32, bf16) are read and
// written by vectors in the step's own loop; 8-bit ones a block at a time
// through fp32 (`x`, n values from element `start`, which begins a block).
struct F32Codec {
  static constexpr bool kElementwise = true;
  static constexpr int kBytes = 4;
  template <class Ops>
  static JSO_INLINE typename Ops::V Load(const void* p, int64_t i) {
    return Ops::Load(static_cast<const float*>(p) + i);
  }
  template <class Ops>
  static JSO_INLINE void Store(void* p, int64_t i, typename Ops::V x) {
    Ops::Store(static_cast<float*>(p) + i, x);
  }
};

struct Bf16Codec {
  static constexpr bool kElementwise = true;
  static constexpr int kBytes = 2;
  template <class Ops>
  static JSO_INLINE typename Ops::V Load(const void* p, int64_t i) {
    return Ops::LoadBf16(static_cast<const uint16_t*>(p) + i);
  }
  template <class Ops>
  static JSO_INLINE void Store(void* p, int64_t i, typename Ops::V x) {
    Ops::StoreBf16(static_cast<uint16_t*>(p) + i, x);
  }
};

// 8-bit codes, kSigned for mu (moment_codec.h). Plain loops, branch-free,
// which the compiler vectorises with the unit's target flags.
template <bool kSigned>
struct Q8Codec {
  static constexpr bool kElementwise = false;
  static void Decode(const void* in, const float* scales, int64_t start,
                     int64_t n, float* x) {
    const uint8_t* code = static_cast<const uint8_t*>(in) + start;
    const float scale = scales[start / kQuantBlock];
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const Floats16 v = Decode16<kSigned>(code + i, scale);
      std::memcpy(x + i, &v, sizeof(v));
    }
    for (; i < n; ++i) {
      x[i] = (kSigned ? DecodeMu(code[i]) : DecodeNu(code[i])) * scale;
    }
  }
  static void Encode(const float* x, int64_t n, void* out, float* scales,
                     int64_t start) {
    uint8_t* code = static_cast<uint8_t*>(out) + start;
    // The largest magnitude, by its bits (ordered as the values are for
    // non-negative floats; a NaN's bits exceed every number's, so a NaN
    // becomes the scale). Order-free.
    Bits16 largest16 = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      Bits16 bits;
      std::memcpy(&bits, x + i, sizeof(bits));
      bits &= 0x7fffffffu;
      largest16 = bits > largest16 ? bits : largest16;
    }
    uint32_t largest = 0;
    for (int lane = 0; lane < 16; ++lane) {
      largest = largest16[lane] > largest ? largest16[lane] : largest;
    }
    for (int64_t j = i; j < n; ++j) {
      const uint32_t magnitude = FloatBits(x[j]) & 0x7fffffffu;
      largest = magnitude > largest ? magnitude : largest;
    }
    const float scale = BitsToFloat(largest);
    scales[start / kQuantBlock] = scale;
    // 0 * (1 / 0) and x * (1 / NaN) give NaN, which encodes as code 0; an
    // infinite scale gives 0 * x.
    const float inverse = 1.0f / scale;
    for (i = 0; i + 16 <= n; i += 16) {
      Floats16 y;
      std::memcpy(&y, x + i, sizeof(y));
      Encode16<kSigned>(y * inverse, code + i);
    }
    for (; i < n; ++i) {
      const float y = x[i] * inverse;
      code[i] = static_cast<uint8_t>(kSigned ? EncodeMu(y) : EncodeNu(y));
    }
  }
};

// Prefetches each input stream `kPrefetchElements` past element i (as
// PrefetchLines does for fp32 moments), the moments at their own width.
template <ElementType kGrad, int kMuBytes, int kNuBytes, int kLocality>
JSO_INLINE void PrefetchLowpLines(const LowpMomentBuffers& b, int64_t i) {
  const int64_t ahead = i + kPrefetchElements;
  constexpr int64_t kGradBytes = kGrad == ElementType::kF32 ? 4 : 2;
  __builtin_prefetch(b.master_in + ahead, 1, kLocality);
  __builtin_prefetch(static_cast<const char*>(b.grad) + ahead * kGradBytes, 0,
                     kLocality);
  // Once per fp32 line: a line of a narrower moment is prefetched twice or
  // more, which costs an instruction and no traffic.
  __builtin_prefetch(static_cast<const char*>(b.mu_in) + ahead * kMuBytes, 1,
                     kLocality);
  __builtin_prefetch(static_cast<const char*>(b.nu_in) + ahead * kNuBytes, 1,
                     kLocality);
}

template <ElementType kGrad, int kMuBytes, int kNuBytes>
JSO_INLINE void PrefetchLowp(const LowpMomentBuffers& b, int64_t i) {
  switch (b.prefetch) {
    case Prefetch::kT0:
      PrefetchLowpLines<kGrad, kMuBytes, kNuBytes, 3>(b, i);
      break;
    case Prefetch::kNta:
      PrefetchLowpLines<kGrad, kMuBytes, kNuBytes, 0>(b, i);
      break;
    case Prefetch::kNone:
      break;
  }
}

// The step over [begin, end) with elementwise moment formats: one loop of
// vectors, as AdamLoop, reading and writing the moments in their storage.
template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov,
          bool kDecay, class MuCodec, class NuCodec, bool kSumSquares>
double LowpElementwiseLoop(const AdamConstants& k, const LowpMomentBuffers& b,
                           int64_t begin, int64_t end) {
  using V = typename Ops::V;
  constexpr int64_t kLanes = Ops::kLanes;
  double total = 0.0;
  int64_t i = begin;
  while (i + kLanes <= end) {
    const int64_t stop = SumSquaresBlockEnd(i, end, kLanes);
    V sum = Ops::Set(0.0f);
#pragma GCC unroll 4
    for (; i + kLanes <= stop; i += kLanes) {
      if (StartsLine(i, kLanes)) {
        PrefetchLowp<kGrad, MuCodec::kBytes, NuCodec::kBytes>(b, i);
      }
      V master = Ops::Load(b.master_in + i);
      V mu = MuCodec::template Load<Ops>(b.mu_in, i);
      V nu = NuCodec::template Load<Ops>(b.nu_in, i);
      const V grad = LoadGrad<Ops, kGrad>(b.grad, i);
      const V g_squared =
          AdamMath<Ops, kNesterov, kDecay, false>(k, grad, master, mu, nu);
      Ops::Store(b.master_out + i, master);
      MuCodec::template Store<Ops>(b.mu_out, i, mu);
      NuCodec::template Store<Ops>(b.nu_out, i, nu);
      StoreLowp<Ops, kLowp>(b.lowp_out, i, master);
      if constexpr (kSumSquares) sum = Ops::Add(sum, g_squared);
    }
    if constexpr (kSumSquares) {
      alignas(64) float lanes[kLanes];
      Ops::Store(lanes, sum);
      for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
    }
  }
  if constexpr (kLanes > 1) {
    total += LowpElementwiseLoop<ScalarOps, kGrad, kLowp, kNesterov, kDecay,
                                 MuCodec, NuCodec, kSumSquares>(k, b, i, end);
  }
  return total;
}

// The Adam step over one block of decoded moments (`mu`, `nu`: n values
// from element `start`), in place there; the master and the weights copy
// go to their buffers. Returns the sum of g * g when kSumSquares, in the
// same order as AdamLoop for a range of n.
template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov,
          bool kDecay, bool kSumSquares>
double LowpBlockMath(const AdamConstants& k, const LowpMomentBuffers& b,
                     int64_t start, int64_t n, float* mu, float* nu) {
  using V = typename Ops::V;
  constexpr int64_t kLanes = Ops::kLanes;
  V sum = Ops::Set(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    V master = Ops::Load(b.master_in + start + i);
    V m = Ops::Load(mu + i);
    V v = Ops::Load(nu + i);
    const V grad = LoadGrad<Ops, kGrad>(b.grad, start + i);
    const V g_squared =
        AdamMath<Ops, kNesterov, kDecay, false>(k, grad, master, m, v);
    Ops::Store(b.master_out + start + i, master);
    StoreLowp<Ops, kLowp>(b.lowp_out, start + i, master);
    Ops::Store(mu + i, m);
    Ops::Store(nu + i, v);
    if constexpr (kSumSquares) sum = Ops::Add(sum, g_squared);
  }
  double total = 0.0;
  if constexpr (kSumSquares) {
    alignas(64) float lanes[kLanes];
    Ops::Store(lanes, sum);
    for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  }
  if constexpr (kLanes > 1) {
    total +=
        LowpBlockMath<ScalarOps, kGrad, kLowp, kNesterov, kDecay, kSumSquares>(
            k, b, start + i, n - i, mu + i, nu + i);
  }
  return total;
}

// The lines of the 8-bit block starting at element `start` (one block
// ahead: kPrefetchElements), with the policy's locality.
template <ElementType kGrad>
JSO_INLINE void PrefetchBlock(const LowpMomentBuffers& b, int64_t start) {
  static_assert(kQuantBlock % kLineElements == 0);
  for (int64_t i = start; i < start + kQuantBlock; i += kLineElements) {
    PrefetchLowp<kGrad, 1, 1>(b, i - kPrefetchElements);
  }
}

template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov,
          bool kDecay, class MuCodec, class NuCodec, bool kSumSquares>
double LowpLoop(const AdamConstants& constants,
                const LowpMomentBuffers& buffers, int64_t begin, int64_t end) {
  const AdamConstants k = constants;  // Local copies, as in AdamLoop.
  const LowpMomentBuffers b = buffers;
  if constexpr (MuCodec::kElementwise && NuCodec::kElementwise) {
    return LowpElementwiseLoop<Ops, kGrad, kLowp, kNesterov, kDecay, MuCodec,
                               NuCodec, kSumSquares>(k, b, begin, end);
  } else {
    alignas(64) float mu[kQuantBlock];
    alignas(64) float nu[kQuantBlock];
    double total = 0.0;
    for (int64_t start = begin; start < end; start += kQuantBlock) {
      PrefetchBlock<kGrad>(b, start + kQuantBlock);
      const int64_t n = std::min(kQuantBlock, end - start);
      MuCodec::Decode(b.mu_in, b.mu_scale_in, start, n, mu);
      NuCodec::Decode(b.nu_in, b.nu_scale_in, start, n, nu);
      total += LowpBlockMath<Ops, kGrad, kLowp, kNesterov, kDecay, kSumSquares>(
          k, b, start, n, mu, nu);
      MuCodec::Encode(mu, n, b.mu_out, b.mu_scale_out, start);
      NuCodec::Encode(nu, n, b.nu_out, b.nu_scale_out, start);
    }
    return total;
  }
}

template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov,
          bool kDecay, bool kSumSquares>
double LowpDispatchFormats(const AdamConstants& k, const LowpMomentBuffers& b,
                           int64_t begin, int64_t end) {
  if (b.mu_format == MomentFormat::kQ8) {
    return LowpLoop<Ops, kGrad, kLowp, kNesterov, kDecay, Q8Codec<true>,
                    Q8Codec<false>, kSumSquares>(k, b, begin, end);
  }
  if (b.nu_format == MomentFormat::kBF16) {
    return LowpLoop<Ops, kGrad, kLowp, kNesterov, kDecay, Bf16Codec, Bf16Codec,
                    kSumSquares>(k, b, begin, end);
  }
  return LowpLoop<Ops, kGrad, kLowp, kNesterov, kDecay, Bf16Codec, F32Codec,
                  kSumSquares>(k, b, begin, end);
}

template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov>
double LowpDispatchDecay(const AdamConstants& k, const LowpMomentBuffers& b,
                         int64_t begin, int64_t end, bool sum_squares) {
  const bool decay = k.weight_decay != 0.0f;
  if (decay && sum_squares) {
    return LowpDispatchFormats<Ops, kGrad, kLowp, kNesterov, true, true>(
        k, b, begin, end);
  }
  if (decay) {
    return LowpDispatchFormats<Ops, kGrad, kLowp, kNesterov, true, false>(
        k, b, begin, end);
  }
  if (sum_squares) {
    return LowpDispatchFormats<Ops, kGrad, kLowp, kNesterov, false, true>(
        k, b, begin, end);
  }
  return LowpDispatchFormats<Ops, kGrad, kLowp, kNesterov, false, false>(
      k, b, begin, end);
}

template <class Ops>
double LowpDispatch(const AdamConstants& k, const LowpMomentBuffers& b,
                    int64_t begin, int64_t end, bool sum_squares) {
  return VisitStepChoices(k, b, [&](auto grad, auto copy, auto nesterov) {
    return LowpDispatchDecay<Ops, decltype(grad)::value, decltype(copy)::value,
                             decltype(nesterov)::value>(k, b, begin, end,
                                                        sum_squares);
  });
}

}  // namespace
}  // namespace jax_superoffload

// Defines the entry point of lowp_moments.h for a fixed-width Ops.
#define JSO_DEFINE_LOWP_ISA(Name, Ops)                                  \
  namespace jax_superoffload::internal {                                \
  double LowpStepRange##Name(const AdamConstants& k,                    \
                             const LowpMomentBuffers& b, int64_t begin, \
                             int64_t end, bool sum_squares) {           \
    return LowpDispatch<Ops>(k, b, begin, end, sum_squares);            \
  }                                                                     \
  }  // namespace jax_superoffload::internal

#define JSO_DEFINE_MISSING_LOWP_ISA(Name)                                    \
  namespace jax_superoffload::internal {                                     \
  double LowpStepRange##Name(const AdamConstants&, const LowpMomentBuffers&, \
                             int64_t, int64_t, bool) {                       \
    return 0.0;                                                              \
  }                                                                          \
  }  // namespace jax_superoffload::internal

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_LOWP_MOMENTS_IMPL_H_
