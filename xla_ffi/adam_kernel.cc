#include "xla_ffi/adam_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "xla_ffi/adam_kernel_isa.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace jax_superoffload {
namespace {

bool CpuSupports(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#if defined(__x86_64__)
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f");
#endif
#if defined(__aarch64__)
    case Isa::kNeon:
      return true;
#if defined(__linux__) && defined(HWCAP_SVE)
    case Isa::kSve:
      return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;
#endif
#endif
    default:
      return false;
  }
}

// Indexed by Isa. SVE has no low-precision loop of its own: the scalar one.
#define JSO_ISA_ENTRIES(Name, Lowp)                                \
  {internal::Name##Compiled, internal::AdamStepRange##Name,        \
   internal::RooflineRange##Name, internal::ReseedBf16Range##Name, \
   internal::LowpStepRange##Lowp}
const internal::IsaEntries kIsaEntries[] = {
    JSO_ISA_ENTRIES(Scalar, Scalar), JSO_ISA_ENTRIES(Avx2, Avx2),
    JSO_ISA_ENTRIES(Avx512, Avx512), JSO_ISA_ENTRIES(Neon, Neon),
    JSO_ISA_ENTRIES(Sve, Scalar)};
#undef JSO_ISA_ENTRIES

bool Compiled(Isa isa) { return internal::Entries(isa).compiled(); }

// 1 / (1 - decay^t) in double, then rounded once to fp32.
float InverseBiasCorrection(float decay, double t) {
  return static_cast<float>(1.0 /
                            (1.0 - std::pow(static_cast<double>(decay), t)));
}

bool IsSixteenBit(ElementType type) {
  return type == ElementType::kBF16 || type == ElementType::kF16;
}

}  // namespace

const internal::IsaEntries& internal::Entries(Isa isa) {
  return kIsaEntries[static_cast<int>(isa)];
}

const char* IsaName(Isa isa) {
  static constexpr const char* kNames[] = {"scalar", "avx2", "avx512", "neon",
                                           "sve"};
  return internal::EnumName(kNames, isa, "unknown");
}

const char* PrefetchName(Prefetch prefetch) {
  static constexpr const char* kNames[] = {"none", "t0", "nta"};
  return internal::EnumName(kNames, prefetch, "unknown");
}

bool ParsePrefetch(const char* name, Prefetch* out) {
  if (name == nullptr || *name == '\0') {
    *out = kDefaultPrefetch;
    return true;
  }
  for (Prefetch p : {Prefetch::kNone, Prefetch::kT0, Prefetch::kNta}) {
    if (std::strcmp(name, PrefetchName(p)) == 0) {
      *out = p;
      return true;
    }
  }
  return false;
}

bool IsaAvailable(Isa isa) { return Compiled(isa) && CpuSupports(isa); }

Isa BestIsa() {
  for (Isa isa : {Isa::kAvx512, Isa::kSve, Isa::kAvx2, Isa::kNeon}) {
    if (IsaAvailable(isa)) return isa;
  }
  return Isa::kScalar;
}

AdamConstants MakeAdamConstants(const AdamConfig& config) {
  const double t = static_cast<double>(config.count) + 1.0;
  AdamConstants k;
  static_cast<AdamConfig&>(k) = config;
  if (std::isnan(k.one_minus_b1)) k.one_minus_b1 = 1.0f - config.b1;
  if (std::isnan(k.one_minus_b2)) k.one_minus_b2 = 1.0f - config.b2;
  k.c1 = InverseBiasCorrection(config.b1, t);
  k.c1_next = InverseBiasCorrection(config.b1, t + 1.0);
  k.c2 = InverseBiasCorrection(config.b2, t);
  return k;
}

const char* ValidateAdamBuffers(const AdamBuffers& b) {
  if (b.size < 0) return "size must be non-negative";
  if (b.grad_type != ElementType::kF32 && !IsSixteenBit(b.grad_type)) {
    return "gradient type must be f32, bf16 or f16";
  }
  if (b.lowp_type != ElementType::kNone && b.lowp_type != ElementType::kF32 &&
      !IsSixteenBit(b.lowp_type)) {
    return "weights copy type must be none, f32, bf16 or f16";
  }
  if (b.size == 0) return nullptr;
  if (!b.master_in || !b.grad || !b.mu_in || !b.nu_in || !b.master_out ||
      !b.mu_out || !b.nu_out) {
    return "null buffer";
  }
  if (b.lowp_type != ElementType::kNone && !b.lowp_out) {
    return "null low-precision output buffer";
  }
  return nullptr;
}

namespace {

double StepRange(const AdamConstants& constants, const AdamBuffers& buffers,
                 int64_t begin, int64_t end, Isa isa, bool sum_squares) {
  if (begin >= end) return 0.0;
  if (!IsaAvailable(isa)) isa = Isa::kScalar;
  return internal::Entries(isa).step(constants, buffers, begin, end,
                                     sum_squares);
}

}  // namespace

void AdamStepRange(const AdamConstants& constants, const AdamBuffers& buffers,
                   int64_t begin, int64_t end, Isa isa) {
  StepRange(constants, buffers, begin, end, isa, /*sum_squares=*/false);
}

double AdamStepSumSquaresRange(const AdamConstants& constants,
                               const AdamBuffers& buffers, int64_t begin,
                               int64_t end, Isa isa) {
  return StepRange(constants, buffers, begin, end, isa, /*sum_squares=*/true);
}

void ReseedBf16Range(float* master, const uint16_t* params, float tolerance,
                     int64_t begin, int64_t end, Isa isa) {
  if (begin >= end) return;
  if (!IsaAvailable(isa)) isa = Isa::kScalar;
  internal::Entries(isa).reseed_bf16(master, params, tolerance, begin, end);
}

int64_t StreamableHead(const AdamBuffers& b, int64_t begin, int64_t end) {
  if (b.master_out == b.master_in || b.mu_out == b.mu_in ||
      b.nu_out == b.nu_in) {
    return -1;
  }
  return AlignedOutputsHead(b, begin, end);
}

int64_t AlignedOutputsHead(const AdamBuffers& b, int64_t begin, int64_t end) {
  const auto phase = [begin](const float* p) {
    return reinterpret_cast<uintptr_t>(p + begin) % 64;
  };
  const uintptr_t master = phase(b.master_out);
  if (master % sizeof(float) != 0 || phase(b.mu_out) != master ||
      phase(b.nu_out) != master ||
      (b.grad_copy != nullptr && phase(b.grad_copy) != master)) {
    return -1;
  }
  const int64_t head = static_cast<int64_t>((64 - master) % 64 / sizeof(float));
  return std::min(head, end - begin);
}

bool IsaStreams(Isa isa) { return isa != Isa::kSve; }

void AdamStep(const AdamConfig& config, const AdamBuffers& buffers) {
  AdamStepRange(MakeAdamConstants(config), buffers, 0, buffers.size, BestIsa());
}

void StreamRooflineRange(const AdamBuffers& buffers, int64_t begin,
                         int64_t end) {
  if (begin >= end) return;
  internal::Entries(BestIsa()).roofline(buffers, begin, end);
}

}  // namespace jax_superoffload
