// The Adam step written once over a small set of vector operations.
//
// Included only by the per-instruction-set translation units
// (adam_kernel_<isa>.cc), each compiled with its own target flags. All
// definitions have internal linkage (see float_convert.h for why).

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_IMPL_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_IMPL_H_

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/float_convert.h"

#define JSO_INLINE inline __attribute__((always_inline))

namespace jax_superoffload {
namespace {

// Squares each lane adds up in fp32 before they go into a double: 64 keeps
// the fp32 rounding to a few 1e-8 typically (at most 64 * 2^-24 relative).
inline constexpr int64_t kSumSquaresPerLane = 64;

// Where the block of squares from element `i` that one fp32 lane sum holds
// ends: kSumSquaresPerLane vectors of `lanes` on, or at `end`.
inline int64_t SumSquaresBlockEnd(int64_t i, int64_t end, int64_t lanes) {
  return end - i < kSumSquaresPerLane * lanes ? end
                                              : i + kSumSquaresPerLane * lanes;
}

// One fp32 lane: the reference the vector paths must match bit for bit, and
// the tail loop of every vectorised path.
struct ScalarOps {
  using V = float;
  static constexpr int64_t kLanes = 1;
  static JSO_INLINE V Set(float x) { return x; }
  static JSO_INLINE V Add(V a, V b) { return a + b; }
  static JSO_INLINE V Sub(V a, V b) { return a - b; }
  static JSO_INLINE V Mul(V a, V b) { return a * b; }
  static JSO_INLINE V Div(V a, V b) { return a / b; }
  static JSO_INLINE V Sqrt(V a) { return __builtin_sqrtf(a); }
  // `a` where `g` is finite (g - g == 0), else `b`.
  static JSO_INLINE V SelectFinite(V g, V a, V b) {
    return g - g == 0.0f ? a : b;
  }
  static JSO_INLINE V Load(const float* p) { return *p; }
  static JSO_INLINE void Store(float* p, V x) { *p = x; }
  // A non-temporal store of an aligned vector, where the instruction set
  // has one (else a plain store), and the fence that orders such stores
  // before the results are handed on.
  static JSO_INLINE void StoreStream(float* p, V x) { *p = x; }
  static JSO_INLINE void Fence() {}
  static JSO_INLINE V LoadBf16(const uint16_t* p) {
    return Bf16BitsToFloat(*p);
  }
  static JSO_INLINE V LoadF16(const uint16_t* p) { return F16BitsToFloat(*p); }
  static JSO_INLINE void StoreBf16(uint16_t* p, V x) {
    *p = FloatToBf16Bits(x);
  }
  static JSO_INLINE void StoreF16(uint16_t* p, V x) { *p = FloatToF16Bits(x); }
};

// The Adam formula of adam_kernel.h on one vector of lanes. Returns g * g
// (the scaled gradient squared, unguarded), which callers that do not sum
// squares simply drop.
template <class Ops, bool kNesterov, bool kDecay, bool kGuard>
JSO_INLINE typename Ops::V AdamMath(const AdamConstants& k,
                                    typename Ops::V grad,
                                    typename Ops::V& master,
                                    typename Ops::V& mu, typename Ops::V& nu) {
  using V = typename Ops::V;
  // Kept only for the guard; dead (and removed) otherwise.
  const V old_master = master, old_mu = mu, old_nu = nu;
  const V g = Ops::Mul(grad, Ops::Set(k.grad_scale));
  mu = Ops::Add(Ops::Mul(Ops::Set(k.b1), mu),
                Ops::Mul(Ops::Set(k.one_minus_b1), g));
  const V g_squared = Ops::Mul(g, g);
  nu = Ops::Add(Ops::Mul(Ops::Set(k.b2), nu),
                Ops::Mul(Ops::Set(k.one_minus_b2), g_squared));
  V mu_hat;
  if constexpr (kNesterov) {
    mu_hat = Ops::Add(
        Ops::Mul(Ops::Set(k.b1), Ops::Mul(mu, Ops::Set(k.c1_next))),
        Ops::Mul(Ops::Set(k.one_minus_b1), Ops::Mul(g, Ops::Set(k.c1))));
  } else {
    mu_hat = Ops::Mul(mu, Ops::Set(k.c1));
  }
  const V nu_hat = Ops::Mul(nu, Ops::Set(k.c2));
  V update = Ops::Div(
      mu_hat, Ops::Add(Ops::Sqrt(Ops::Add(nu_hat, Ops::Set(k.eps_root))),
                       Ops::Set(k.eps)));
  if constexpr (kDecay) {
    update = Ops::Add(update, Ops::Mul(Ops::Set(k.weight_decay), master));
  }
  master = Ops::Sub(master, Ops::Mul(Ops::Set(k.learning_rate), update));
  if constexpr (kGuard) {
    // Speculative steps leave an element whose gradient is NaN or Inf as it
    // was, so that a step found non-finite can be undone exactly.
    master = Ops::SelectFinite(g, master, old_master);
    mu = Ops::SelectFinite(g, mu, old_mu);
    nu = Ops::SelectFinite(g, nu, old_nu);
  }
  return g_squared;
}

template <class Ops, ElementType kGrad>
JSO_INLINE typename Ops::V LoadGrad(const void* grad, int64_t i) {
  if constexpr (kGrad == ElementType::kF32) {
    return Ops::Load(static_cast<const float*>(grad) + i);
  } else if constexpr (kGrad == ElementType::kBF16) {
    return Ops::LoadBf16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return Ops::LoadF16(static_cast<const uint16_t*>(grad) + i);
  }
}

template <class Ops, ElementType kLowp>
JSO_INLINE void StoreLowp(void* out, int64_t i, typename Ops::V x) {
  if constexpr (kLowp == ElementType::kF32) {
    Ops::Store(static_cast<float*>(out) + i, x);
  } else if constexpr (kLowp == ElementType::kBF16) {
    Ops::StoreBf16(static_cast<uint16_t*>(out) + i, x);
  } else if constexpr (kLowp == ElementType::kF16) {
    Ops::StoreF16(static_cast<uint16_t*>(out) + i, x);
  }
}

// How far ahead of the current element the loops ask for the input
// streams, in elements (1 KiB of fp32): two threads walk seven streams at
// once, more than the hardware prefetchers follow. 128 to 512 elements
// measured alike on AMD Zen 3.
inline constexpr int64_t kPrefetchElements = 256;
// fp32 elements per 64-byte cache line.
inline constexpr int64_t kLineElements = 16;

// Prefetches the line `kPrefetchElements` ahead of i in each input stream,
// with locality hint kLocality (a compile-time constant for the builtin).
// Out-of-range addresses are fine: a prefetch never faults.
template <ElementType kGrad, int kLocality>
JSO_INLINE void PrefetchLines(const AdamBuffers& b, int64_t i) {
  const int64_t ahead = i + kPrefetchElements;
  constexpr int64_t kGradBytes = kGrad == ElementType::kF32 ? 4 : 2;
  __builtin_prefetch(b.master_in + ahead, 1, kLocality);
  __builtin_prefetch(b.mu_in + ahead, 1, kLocality);
  __builtin_prefetch(b.nu_in + ahead, 1, kLocality);
  __builtin_prefetch(static_cast<const char*>(b.grad) + ahead * kGradBytes, 0,
                     kLocality);
}

// The buffers' prefetch policy, once per line; the branch is loop-invariant.
template <ElementType kGrad>
JSO_INLINE void PrefetchInputs(const AdamBuffers& b, int64_t i) {
  switch (b.prefetch) {
    case Prefetch::kT0:
      PrefetchLines<kGrad, 3>(b, i);
      break;
    case Prefetch::kNta:
      PrefetchLines<kGrad, 0>(b, i);
      break;
    case Prefetch::kNone:
      break;
  }
}

// True for one vector in each line's worth of elements, whatever the
// alignment of the range: when the lane count divides kLineElements, the
// vectors' starts mod kLineElements step through kLineElements / lanes
// residues and exactly one of them is below `lanes`.
JSO_INLINE bool StartsLine(int64_t i, int64_t lanes) {
  return (i & (kLineElements - 1)) < lanes;
}

// One vector of elements at i: load, step, store (streaming the state with
// kStream). Returns g * g.
template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov,
          bool kDecay, bool kGuard, bool kStream = false>
JSO_INLINE typename Ops::V AdamElements(const AdamConstants& k,
                                        const AdamBuffers& b, int64_t i) {
  if constexpr (Ops::kLanes > 1) {
    if (StartsLine(i, Ops::kLanes)) PrefetchInputs<kGrad>(b, i);
  }
  typename Ops::V master = Ops::Load(b.master_in + i);
  typename Ops::V mu = Ops::Load(b.mu_in + i);
  typename Ops::V nu = Ops::Load(b.nu_in + i);
  const typename Ops::V grad = LoadGrad<Ops, kGrad>(b.grad, i);
  const typename Ops::V g_squared =
      AdamMath<Ops, kNesterov, kDecay, kGuard>(k, grad, master, mu, nu);
  if constexpr (kStream) {
    Ops::StoreStream(b.master_out + i, master);
    Ops::StoreStream(b.mu_out + i, mu);
    Ops::StoreStream(b.nu_out + i, nu);
    if (b.grad_copy != nullptr) Ops::StoreStream(b.grad_copy + i, grad);
  } else {
    Ops::Store(b.master_out + i, master);
    Ops::Store(b.mu_out + i, mu);
    Ops::Store(b.nu_out + i, nu);
  }
  StoreLowp<Ops, kLowp>(b.lowp_out, i, master);
  return g_squared;
}

// Fixed-width loop: full vectors, then the scalar tail with the same math.
// With kSumSquares it also returns the sum of g * g over [begin, end) (see
// AdamStepSumSquaresRange): each lane adds up to kSumSquaresPerLane fp32
// squares, one per vector, then goes into its own double; the doubles are
// added in lane order, then the tail's sum. The order depends on the
// instruction set and the range only.
template <class Ops, ElementType kGrad, ElementType kLowp, bool kNesterov,
          bool kDecay, bool kGuard, bool kSumSquares, bool kStream = false>
double AdamLoop(const AdamConstants& constants, const AdamBuffers& buffers,
                int64_t begin, int64_t end) {
  // Streaming stores serve steps that write the state elsewhere than they
  // read it (STV's speculative rows, fp32 parameters read as the master);
  // only the sum-of-squares loops get the streaming instantiations.
  if constexpr (kSumSquares && !kStream) {
    if (buffers.stream_state) {
      return AdamLoop<Ops, kGrad, kLowp, kNesterov, kDecay, kGuard, true, true>(
          constants, buffers, begin, end);
    }
  }
  using V = typename Ops::V;
  constexpr int64_t kLanes = Ops::kLanes;
  // Local copies: the output buffers are float*, which may alias the float
  // fields of the caller's structs, so without copies the compiler reloads
  // and re-broadcasts every constant on every iteration.
  const AdamConstants k = constants;
  const AdamBuffers b = buffers;
  int64_t i = begin;
  double total = 0.0;
  // Four vectors per iteration keep more loads of the seven streams in
  // flight: on the 2-core CI VM the step went from 0.86-0.94 to 0.94-1.00
  // of the same-traffic roofline (medians of 15, interleaved runs).
  if constexpr (!kSumSquares) {
#pragma GCC unroll 4
    for (; i + kLanes <= end; i += kLanes) {
      AdamElements<Ops, kGrad, kLowp, kNesterov, kDecay, kGuard>(k, b, i);
    }
  } else {
    double lane_totals[kLanes] = {};
    while (i + kLanes <= end) {
      const int64_t stop = SumSquaresBlockEnd(i, end, kLanes);
      V sum = Ops::Set(0.0f);
#pragma GCC unroll 4
      for (; i + kLanes <= stop; i += kLanes) {
        sum = Ops::Add(
            sum,
            AdamElements<Ops, kGrad, kLowp, kNesterov, kDecay, kGuard, kStream>(
                k, b, i));
      }
      alignas(64) float lanes[kLanes];
      Ops::Store(lanes, sum);
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        lane_totals[lane] += lanes[lane];
      }
    }
    for (int64_t lane = 0; lane < kLanes; ++lane) total += lane_totals[lane];
    if constexpr (kStream) Ops::Fence();
  }
  if constexpr (kLanes > 1) {
    total += AdamLoop<ScalarOps, kGrad, kLowp, kNesterov, kDecay, kGuard,
                      kSumSquares, kStream>(k, b, i, end);
  }
  return total;
}

template <class Ops>
void RooflineLoop(const AdamBuffers& b, int64_t begin, int64_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  int64_t i = begin;
  for (; i + Ops::kLanes <= end; i += Ops::kLanes) {
    // Prefetched like the Adam loop: this loop measures the kernel's own
    // access pattern, not an independent limit.
    if (StartsLine(i, Ops::kLanes)) PrefetchInputs<ElementType::kF32>(b, i);
    const typename Ops::V master = Ops::Load(b.master_in + i);
    const typename Ops::V mu = Ops::Load(b.mu_in + i);
    const typename Ops::V nu = Ops::Load(b.nu_in + i);
    Ops::Store(b.master_out + i, Ops::Add(master, Ops::Load(grad + i)));
    Ops::Store(b.mu_out + i, nu);
    Ops::Store(b.nu_out + i, mu);
  }
  if constexpr (Ops::kLanes > 1) RooflineLoop<ScalarOps>(b, i, end);
}

// Calls `f` with std::integral_constant<ElementType, T> for the first T of
// kType, kOthers... equal to `type`, or for the last of them when none is:
// a runtime storage type as a template argument.
template <ElementType kType, ElementType... kOthers, class F>
decltype(auto) VisitElementType(ElementType type, F&& f) {
  if constexpr (sizeof...(kOthers) == 0) {
    return f(std::integral_constant<ElementType, kType>{});
  } else {
    if (type == kType) return f(std::integral_constant<ElementType, kType>{});
    return VisitElementType<kOthers...>(type, std::forward<F>(f));
  }
}

// Calls `f(grad, copy, nesterov)` with the storage types of `b`'s gradient
// (bf16, f16 or f32) and of its copy of the new weights (f32, bf16, f16 or
// none), and with whether `k` asks for Nesterov's momentum, each as a
// std::integral_constant.
template <class Buffers, class F>
double VisitStepChoices(const AdamConstants& k, const Buffers& b, F&& f) {
  return VisitElementType<ElementType::kBF16, ElementType::kF16,
                          ElementType::kF32>(b.grad_type, [&](auto grad) {
    return VisitElementType<ElementType::kF32, ElementType::kBF16,
                            ElementType::kF16, ElementType::kNone>(
        b.lowp_type, [&](auto copy) {
          if (k.nesterov) return f(grad, copy, std::true_type{});
          return f(grad, copy, std::false_type{});
        });
  });
}

// Turns the runtime choices into template arguments, so the inner loop has
// no branches. `Loop<G, L, N, D, F, S>::Run(k, b, begin, end)` does the work
// and returns the sum of squares (S) or 0.
template <template <ElementType, ElementType, bool, bool, bool, bool>
          class Loop,
          ElementType kGrad, ElementType kLowp, bool kNesterov, bool kDecay,
          bool kGuard>
double DispatchSumSquares(const AdamConstants& k, const AdamBuffers& b,
                          int64_t begin, int64_t end, bool sum_squares) {
  if (sum_squares) {
    return Loop<kGrad, kLowp, kNesterov, kDecay, kGuard, true>::Run(k, b, begin,
                                                                    end);
  }
  return Loop<kGrad, kLowp, kNesterov, kDecay, kGuard, false>::Run(k, b, begin,
                                                                   end);
}

template <template <ElementType, ElementType, bool, bool, bool, bool>
          class Loop,
          ElementType kGrad, ElementType kLowp, bool kNesterov, bool kDecay>
double DispatchGuard(const AdamConstants& k, const AdamBuffers& b,
                     int64_t begin, int64_t end, bool sum_squares) {
  if (k.keep_nonfinite) {
    return DispatchSumSquares<Loop, kGrad, kLowp, kNesterov, kDecay, true>(
        k, b, begin, end, sum_squares);
  }
  return DispatchSumSquares<Loop, kGrad, kLowp, kNesterov, kDecay, false>(
      k, b, begin, end, sum_squares);
}

template <template <ElementType, ElementType, bool, bool, bool, bool>
          class Loop,
          ElementType kGrad, ElementType kLowp, bool kNesterov>
double DispatchDecay(const AdamConstants& k, const AdamBuffers& b,
                     int64_t begin, int64_t end, bool sum_squares) {
  if (k.weight_decay != 0.0f) {
    return DispatchGuard<Loop, kGrad, kLowp, kNesterov, true>(k, b, begin, end,
                                                              sum_squares);
  }
  return DispatchGuard<Loop, kGrad, kLowp, kNesterov, false>(k, b, begin, end,
                                                             sum_squares);
}

template <template <ElementType, ElementType, bool, bool, bool, bool>
          class Loop>
double DispatchAdam(const AdamConstants& k, const AdamBuffers& b, int64_t begin,
                    int64_t end, bool sum_squares) {
  return VisitStepChoices(k, b, [&](auto grad, auto copy, auto nesterov) {
    return DispatchDecay<Loop, decltype(grad)::value, decltype(copy)::value,
                         decltype(nesterov)::value>(k, b, begin, end,
                                                    sum_squares);
  });
}

// Adapts AdamLoop over a fixed-width Ops to the dispatcher's shape.
template <class Ops>
struct FixedWidth {
  template <ElementType kGrad, ElementType kLowp, bool kNesterov, bool kDecay,
            bool kGuard, bool kSumSquares>
  struct Loop {
    static double Run(const AdamConstants& k, const AdamBuffers& b,
                      int64_t begin, int64_t end) {
      return AdamLoop<Ops, kGrad, kLowp, kNesterov, kDecay, kGuard,
                      kSumSquares>(k, b, begin, end);
    }
  };
};

// Re-seeding of a master from bf16 parameters (ReseedBf16Range), in place.
// Plain C++, compiled in every instruction set's unit with that unit's
// flags, where the compiler vectorizes it; integer arithmetic and one exact
// subtraction, so every instruction set gives the same bits. One pointer,
// read and written, so that no aliasing check is needed.
inline void ReseedBf16Loop(float* master, const uint16_t* __restrict params,
                           float tolerance, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float m = master[i];
    const int32_t bits = static_cast<int32_t>(FloatBits(m));
    // The master rounded to bf16 (ties to even), as a 16-bit pattern.
    const int32_t rounded =
        ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) & 0xffff;
    const int32_t param = params[i];
    const float w = BitsToFloat(static_cast<uint32_t>(param) << 16);
    // Of one sign, adjacent patterns are adjacent values; across zero, the
    // tolerance decides.
    const bool adjacent = static_cast<uint32_t>(rounded - param + 1) <= 2u;
    const bool same = adjacent | (std::fabs(w - m) <= tolerance);
    master[i] = same ? m : w;
  }
}

}  // namespace
}  // namespace jax_superoffload

// Defines the entry points of adam_kernel_isa.h for a fixed-width Ops.
#define JSO_DEFINE_FIXED_WIDTH_ISA(Name, Ops)                                  \
  namespace jax_superoffload::internal {                                       \
  bool Name##Compiled() { return true; }                                       \
  double AdamStepRange##Name(const AdamConstants& k, const AdamBuffers& b,     \
                             int64_t begin, int64_t end, bool sum_squares) {   \
    return DispatchAdam<FixedWidth<Ops>::template Loop>(k, b, begin, end,      \
                                                        sum_squares);          \
  }                                                                            \
  void RooflineRange##Name(const AdamBuffers& b, int64_t begin, int64_t end) { \
    RooflineLoop<Ops>(b, begin, end);                                          \
  }                                                                            \
  void ReseedBf16Range##Name(float* master, const uint16_t* params,            \
                             float tolerance, int64_t begin, int64_t end) {    \
    ReseedBf16Loop(master, params, tolerance, begin, end);                     \
  }                                                                            \
  }  // namespace jax_superoffload::internal

// Defines the entry points of an instruction set this build does not target.
#define JSO_DEFINE_MISSING_ISA(Name)                                   \
  namespace jax_superoffload::internal {                               \
  bool Name##Compiled() { return false; }                              \
  double AdamStepRange##Name(const AdamConstants&, const AdamBuffers&, \
                             int64_t, int64_t, bool) {                 \
    return 0.0;                                                        \
  }                                                                    \
  void RooflineRange##Name(const AdamBuffers&, int64_t, int64_t) {}    \
  void ReseedBf16Range##Name(float*, const uint16_t*, float, int64_t,  \
                             int64_t) {}                               \
  }  // namespace jax_superoffload::internal

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_IMPL_H_
