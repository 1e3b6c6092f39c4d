// Tests of the Grace Adam kernel against an independent float64 AdamW.
//
// The reference below is written from the AdamW definition (Loshchilov &
// Hutter; optax's scale_by_adam + add_decayed_weights + scale by -lr), in
// double precision, and shares no code with the kernel. Every instruction
// set available on the running CPU must also agree with the scalar path bit
// for bit. Prints "N passed, N failed" and exits non-zero on any failure.

#include "xla_ffi/adam_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "xla_ffi/stv_kernel.h"
#include "xla_ffi/test_util.h"

namespace jax_superoffload {
namespace {

// Buffers that step `p`, `m` and `v` in place with the gradient `g`.
template <class Grad>
AdamBuffers InPlace(std::vector<float>& p, std::vector<float>& m,
                    std::vector<float>& v, const std::vector<Grad>& g) {
  AdamBuffers b;
  b.size = static_cast<int64_t>(p.size());
  b.master_in = b.master_out = p.data();
  b.mu_in = b.mu_out = m.data();
  b.nu_in = b.nu_out = v.data();
  b.grad = g.data();
  return b;
}

// --- Independent 16-bit references, by exhaustive tables and doubles. ---

double HalfValue(uint16_t h) {  // IEEE binary16 by its definition.
  const int sign = (h >> 15) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0x1f) {
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  }
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// Nearest binary16 to a finite float, ties to even mantissa, overflow to inf.
uint16_t ReferenceHalf(float x) {
  const double v = std::fabs(static_cast<double>(x));
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  // Largest finite half is 0x7bff; binary search the last h with value <= v.
  int lo = 0, hi = 0x7bff;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (HalfValue(static_cast<uint16_t>(mid)) <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  const double below = HalfValue(static_cast<uint16_t>(lo));
  const double above =
      lo == 0x7bff ? 65536.0 : HalfValue(static_cast<uint16_t>(lo + 1));
  int chosen;
  if (v - below < above - v)
    chosen = lo;
  else if (v - below > above - v)
    chosen = lo + 1;
  else
    chosen = (lo % 2 == 0) ? lo : lo + 1;
  return static_cast<uint16_t>(sign | chosen);  // lo + 1 == 0x7c00 is inf.
}

// Nearest bfloat16 to a finite float: bf16 values are the f32 values whose
// low 16 bits are zero, so the two candidates bracket the truncation.
uint16_t ReferenceBf16(float x) {
  const uint32_t b = Bits(x);
  const uint32_t down = b & 0xffff0000u;
  const uint32_t up = down + 0x10000u;
  const double v = std::fabs(static_cast<double>(x));
  const double dv = std::fabs(static_cast<double>(FromBits(down)));
  const double uv = std::isinf(FromBits(up))
                        ? std::ldexp(1.0, 128)
                        : std::fabs(static_cast<double>(FromBits(up)));
  uint32_t chosen;
  if (v - dv < uv - v)
    chosen = down;
  else if (v - dv > uv - v)
    chosen = up;
  else
    chosen = ((down >> 16) & 1) ? up : down;
  return static_cast<uint16_t>(chosen >> 16);
}

float Bf16Value(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

// --- The float64 AdamW reference. ---

struct Hyper {
  double lr, b1, b2, eps, eps_root, wd, grad_scale;
  bool nesterov;
};

// A float64 trajectory, plus the magnitudes each quantity's rounding error
// scales with (sums of absolute values of the terms that were added), since
// a moving average of mixed-sign gradients can cancel to near zero.
struct RefState {
  std::vector<double> master, mu, nu;
  std::vector<double> master_scale, mu_scale;
};

struct StepResult {
  double master, mu, nu;
  double master_scale, mu_scale;  // Error scales for this one step.
};

// One AdamW step on element i from the given state, by the definition.
StepResult ReferenceElement(const Hyper& h, int64_t t, double grad,
                            double master, double mu, double nu) {
  const double bc1 = 1.0 - std::pow(h.b1, static_cast<double>(t));
  const double bc1_next = 1.0 - std::pow(h.b1, static_cast<double>(t + 1));
  const double bc2 = 1.0 - std::pow(h.b2, static_cast<double>(t));
  const double g = grad * h.grad_scale;
  StepResult r;
  r.mu_scale = std::fabs(h.b1 * mu) + std::fabs((1.0 - h.b1) * g);
  r.mu = h.b1 * mu + (1.0 - h.b1) * g;
  r.nu = h.b2 * nu + (1.0 - h.b2) * g * g;
  const double mu_hat =
      h.nesterov ? h.b1 * r.mu / bc1_next + (1.0 - h.b1) * g / bc1 : r.mu / bc1;
  const double mu_hat_scale =
      h.nesterov ? r.mu_scale / bc1_next + std::fabs((1.0 - h.b1) * g / bc1)
                 : r.mu_scale / bc1;
  const double denominator = std::sqrt(r.nu / bc2 + h.eps_root) + h.eps;
  const double update = mu_hat / denominator + h.wd * master;
  r.master = master - h.lr * update;
  r.master_scale = std::fabs(r.master) + h.lr * (mu_hat_scale / denominator +
                                                 std::fabs(h.wd * master));
  return r;
}

// --- Buffers at chosen misalignments. ---

template <class T>
struct Misaligned {
  std::vector<T> storage;
  T* data;
  Misaligned(int64_t n, int offset) : storage(n + offset + 16) {
    data = storage.data() + offset;
  }
};

uint16_t EncodeGrad(double g, ElementType type) {
  return type == ElementType::kBF16 ? ReferenceBf16(static_cast<float>(g))
                                    : ReferenceHalf(static_cast<float>(g));
}

double DecodeGrad(uint16_t h, ElementType type) {
  return type == ElementType::kBF16 ? Bf16Value(h) : HalfValue(h);
}

struct Case {
  ElementType grad_type;
  ElementType lowp_type;
  bool nesterov;
  float weight_decay;
  float eps_root;
  float grad_scale;
};

const char* TypeName(ElementType t) {
  switch (t) {
    case ElementType::kF32:
      return "f32";
    case ElementType::kBF16:
      return "bf16";
    case ElementType::kF16:
      return "f16";
    default:
      return "none";
  }
}

// Ulps of fp32 at magnitude `scale`.
double UlpsAt(double diff, double scale) {
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(scale, 1e-30)) - 23);
  return std::fabs(diff) / ulp;
}

// The instruction sets this CPU runs, the scalar path first.
std::vector<Isa> AvailableIsas() {
  std::vector<Isa> out;
  for (Isa isa :
       {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
    if (IsaAvailable(isa)) out.push_back(isa);
  }
  return out;
}

// The same sums, bit for bit.
bool SameBits(double x, double y) {
  return std::memcmp(&x, &y, sizeof(double)) == 0;
}

// The fp32 state (both rows, where double-buffered) before a step.
struct Rows {
  std::vector<float> master, mu, nu;
};

// A copy of both rows (2n elements) of double-buffered state.
template <class Floats>
Rows BothRows(Floats& master, Floats& mu, Floats& nu, int64_t n) {
  return Rows{{master.data(), master.data() + 2 * n},
              {mu.data(), mu.data() + 2 * n},
              {nu.data(), nu.data() + 2 * n}};
}

// One copy of the fp32 state per instruction set, each misaligned
// differently from its neighbours and from 16/32/64-byte boundaries.
struct IsaStates {
  std::vector<Misaligned<float>> master, mu, nu;
  std::vector<Misaligned<uint16_t>> lowp;
  std::vector<Misaligned<float>> lowp32;
  IsaStates(int64_t n, int num_isas) {
    for (int k = 0; k < num_isas; ++k) {
      lowp32.emplace_back(n, 6 + k);
      master.emplace_back(n, 1 + k);
      mu.emplace_back(n, 2 + k);
      nu.emplace_back(n, 3 + k);
      lowp.emplace_back(n, 5 + k);
    }
  }
};

// Random weights, the same in every copy and in the float64 reference.
RefState InitialState(int64_t n, uint64_t& rng, IsaStates& s) {
  RefState ref{std::vector<double>(n), std::vector<double>(n, 0.0),
               std::vector<double>(n, 0.0), std::vector<double>(n, 0.0),
               std::vector<double>(n, 0.0)};
  for (int64_t i = 0; i < n; ++i) {
    const float w = static_cast<float>(Uniform(rng));
    ref.master[i] = w;
    for (size_t k = 0; k < s.master.size(); ++k) {
      s.master[k].data[i] = w;
      s.mu[k].data[i] = 0.0f;
      s.nu[k].data[i] = 0.0f;
    }
  }
  return ref;
}

// Gradients spanning several decades, so moments are not all alike, stored
// as `grad_type`; returns their values.
std::vector<double> FillGradients(int64_t n, ElementType grad_type,
                                  uint64_t& rng, Misaligned<float>& grad32,
                                  Misaligned<uint16_t>& grad16) {
  std::vector<double> grad(n);
  for (int64_t i = 0; i < n; ++i) {
    double g = Uniform(rng) * std::pow(10.0, Uniform(rng) * 3.0);
    if (grad_type == ElementType::kF32) {
      grad32.data[i] = static_cast<float>(g);
      g = grad32.data[i];
    } else {
      grad16.data[i] = EncodeGrad(g, grad_type);
      g = DecodeGrad(grad16.data[i], grad_type);
    }
    grad[i] = g;
  }
  return grad;
}

// One step of every instruction set's copy, split at an odd point so a
// chunk boundary falls mid-vector.
void StepEveryIsa(const AdamConstants& constants, const Case& c, int64_t n,
                  const std::vector<Isa>& isas, IsaStates& s,
                  const Misaligned<float>& grad32,
                  const Misaligned<uint16_t>& grad16, const char* context) {
  for (size_t k = 0; k < isas.size(); ++k) {
    AdamBuffers b;
    b.size = n;
    b.master_in = b.master_out = s.master[k].data;
    b.mu_in = b.mu_out = s.mu[k].data;
    b.nu_in = b.nu_out = s.nu[k].data;
    b.grad = c.grad_type == ElementType::kF32
                 ? static_cast<const void*>(grad32.data)
                 : static_cast<const void*>(grad16.data);
    b.grad_type = c.grad_type;
    b.lowp_type = c.lowp_type;
    b.lowp_out = c.lowp_type == ElementType::kF32
                     ? static_cast<void*>(s.lowp32[k].data)
                     : static_cast<void*>(s.lowp[k].data);
    Check(ValidateAdamBuffers(b) == nullptr, "buffers valid", context);
    const int64_t split = n / 3 + (n > 2 ? 1 : 0);
    AdamStepRange(constants, b, 0, split, isas[k]);
    AdamStepRange(constants, b, split, n, isas[k]);
  }
}

// Worst errors in ulps: of one step taken from the kernel's own state, and
// of the whole trajectory against the float64 one; and the bit checks.
struct CaseErrors {
  double worst_master = 0, worst_mu = 0, worst_nu = 0;
  double drift_master = 0, drift_mu = 0, drift_nu = 0;
  bool isas_agree = true, lowp_exact = true;
};

// Whether copy k's element i (state and low-precision copy) is copy 0's.
bool SameAsFirst(const IsaStates& s, ElementType lowp_type, int k, int64_t i) {
  const bool lowp16 =
      lowp_type == ElementType::kBF16 || lowp_type == ElementType::kF16;
  return Bits(s.master[k].data[i]) == Bits(s.master[0].data[i]) &&
         Bits(s.mu[k].data[i]) == Bits(s.mu[0].data[i]) &&
         Bits(s.nu[k].data[i]) == Bits(s.nu[0].data[i]) &&
         !(lowp_type == ElementType::kF32 &&
           Bits(s.lowp32[k].data[i]) != Bits(s.lowp32[0].data[i])) &&
         !(lowp16 && s.lowp[k].data[i] != s.lowp[0].data[i]);
}

// Element i of copy 0 (weights `p`, moments `mu` and `nu`) against one
// float64 step from `before` and against the float64 trajectory `ref`.
void CompareWithFloat64(const Hyper& h, int step, int64_t i, double grad,
                        float p, float mu, float nu, const Rows& before,
                        RefState& ref, CaseErrors& e) {
  const StepResult one = ReferenceElement(h, step + 1, grad, before.master[i],
                                          before.mu[i], before.nu[i]);
  e.worst_master =
      std::max(e.worst_master, UlpsAt(p - one.master, one.master_scale));
  e.worst_mu = std::max(e.worst_mu, UlpsAt(mu - one.mu, one.mu_scale));
  e.worst_nu = std::max(e.worst_nu, UlpsAt(nu - one.nu, one.nu));
  const StepResult traj =
      ReferenceElement(h, step + 1, grad, ref.master[i], ref.mu[i], ref.nu[i]);
  ref.master_scale[i] = std::max(ref.master_scale[i], traj.master_scale);
  ref.mu_scale[i] = std::max(ref.mu_scale[i] * h.b1, traj.mu_scale);
  ref.master[i] = traj.master;
  ref.mu[i] = traj.mu;
  ref.nu[i] = traj.nu;
  e.drift_master =
      std::max(e.drift_master, UlpsAt(p - ref.master[i], ref.master_scale[i]));
  e.drift_mu = std::max(e.drift_mu, UlpsAt(mu - ref.mu[i], ref.mu_scale[i]));
  e.drift_nu = std::max(e.drift_nu, UlpsAt(nu - ref.nu[i], ref.nu[i]));
}

// Every copy against copy 0, copy 0's low-precision copy against its
// weights, and copy 0 against the float64 references.
void CompareStep(const Case& c, const Hyper& h, int step,
                 const std::vector<double>& grad, const IsaStates& s,
                 const Rows& before, RefState& ref, CaseErrors& e) {
  for (int64_t i = 0; i < static_cast<int64_t>(grad.size()); ++i) {
    for (int k = 1; k < static_cast<int>(s.master.size()); ++k) {
      if (!SameAsFirst(s, c.lowp_type, k, i)) e.isas_agree = false;
    }
    const float p = s.master[0].data[i];
    if (c.lowp_type == ElementType::kF32) {
      e.lowp_exact &= Bits(s.lowp32[0].data[i]) == Bits(p);
    } else if (c.lowp_type == ElementType::kBF16) {
      e.lowp_exact &= s.lowp[0].data[i] == ReferenceBf16(p);
    } else if (c.lowp_type == ElementType::kF16) {
      e.lowp_exact &= s.lowp[0].data[i] == ReferenceHalf(p);
    }
    CompareWithFloat64(h, step, i, grad[i], p, s.mu[0].data[i], s.nu[0].data[i],
                       before, ref, e);
  }
}

// The checks of one case, over all its steps.
void ReportCase(const CaseErrors& e, int steps, const char* context) {
  Check(e.isas_agree, "every instruction set equals scalar bit for bit",
        context);
  Check(e.lowp_exact,
        "low-precision copy is the master rounded to nearest even", context);
  // One step is a handful of correctly rounded operations: a few ulps.
  Check(e.worst_master <= 4.0, "each step's master within 4 ulps of float64",
        context);
  Check(e.worst_mu <= 2.0, "each step's mu within 2 ulps of float64", context);
  Check(e.worst_nu <= 2.0, "each step's nu within 2 ulps of float64", context);
  // Over the trajectory rounding accumulates at most about an ulp a step.
  const double allowed = 0.5 * steps;
  Check(e.drift_master <= allowed && e.drift_mu <= allowed &&
            e.drift_nu <= allowed,
        "trajectory within half an ulp a step of float64", context);
  if (e.worst_master > 4.0 || e.worst_mu > 2.0 || e.worst_nu > 2.0 ||
      e.drift_master > allowed || e.drift_mu > allowed ||
      e.drift_nu > allowed) {
    std::printf(
        "  ulps: step master %.2f mu %.2f nu %.2f; trajectory %.2f %.2f %.2f\n",
        e.worst_master, e.worst_mu, e.worst_nu, e.drift_master, e.drift_mu,
        e.drift_nu);
  }
}

void RunCase(int64_t n, const Case& c, int steps) {
  char context[160];
  std::snprintf(context, sizeof(context),
                "n=%lld grad=%s lowp=%s nesterov=%d wd=%g eps_root=%g scale=%g",
                static_cast<long long>(n), TypeName(c.grad_type),
                TypeName(c.lowp_type), c.nesterov, c.weight_decay, c.eps_root,
                c.grad_scale);
  uint64_t rng = 1234 + n;
  const std::vector<Isa> isas = AvailableIsas();
  IsaStates s(n, static_cast<int>(isas.size()));
  RefState ref = InitialState(n, rng, s);
  Misaligned<float> grad32(n, 3);
  Misaligned<uint16_t> grad16(n, 1);
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  CaseErrors errors;
  Rows before{std::vector<float>(n), std::vector<float>(n),
              std::vector<float>(n)};
  for (int step = 0; step < steps; ++step) {
    // A warmup-then-decay learning-rate schedule, changing every step.
    const float lr =
        1e-2f * std::min(1.0f, (step + 1) / 5.0f) / (1.0f + 0.1f * step);
    const std::vector<double> grad =
        FillGradients(n, c.grad_type, rng, grad32, grad16);
    AdamConfig config;
    config.learning_rate = lr;
    config.b1 = b1;
    config.b2 = b2;
    config.eps = eps;
    config.eps_root = c.eps_root;
    config.weight_decay = c.weight_decay;
    config.grad_scale = c.grad_scale;
    config.nesterov = c.nesterov;
    config.count = step;
    const AdamConstants constants = MakeAdamConstants(config);
    std::copy(s.master[0].data, s.master[0].data + n, before.master.begin());
    std::copy(s.mu[0].data, s.mu[0].data + n, before.mu.begin());
    std::copy(s.nu[0].data, s.nu[0].data + n, before.nu.begin());
    StepEveryIsa(constants, c, n, isas, s, grad32, grad16, context);
    // The reference sees the same fp32-rounded hyperparameters.
    const Hyper h{lr,           b1,        b2, eps, c.eps_root, c.weight_decay,
                  c.grad_scale, c.nesterov};
    CompareStep(c, h, step, grad, s, before, ref, errors);
  }
  ReportCase(errors, steps, context);
}

void TestWideningExhaustively() {
  // Every binary16 widens exactly (checked through the kernel's f16 path:
  // with lr = 0 and b1 = 0, mu after one step is the widened gradient).
  std::vector<uint16_t> halves(1 << 16);
  for (int i = 0; i < (1 << 16); ++i) halves[i] = static_cast<uint16_t>(i);
  for (ElementType type : {ElementType::kF16, ElementType::kBF16}) {
    for (Isa isa :
         {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
      if (!IsaAvailable(isa)) continue;
      const int64_t n = 1 << 16;
      std::vector<float> master(n, 0.0f), mu(n, 0.0f), nu(n, 0.0f);
      AdamConfig config;
      config.learning_rate = 0.0f;
      config.b1 = 0.0f;
      config.one_minus_b1 = 1.0f;
      AdamBuffers b = InPlace(master, mu, nu, halves);
      b.grad_type = type;
      AdamStepRange(MakeAdamConstants(config), b, 0, n, isa);
      bool ok = true;
      for (int i = 0; i < n; ++i) {
        const double want = type == ElementType::kF16 ? HalfValue(halves[i])
                                                      : Bf16Value(halves[i]);
        const double got = mu[i];
        // +0 + (-0) is +0, so the sign of a zero gradient does not survive.
        ok &= std::isnan(want) ? std::isnan(got) : got == want;
      }
      Check(ok, "16-bit gradients widen exactly", IsaName(isa));
    }
  }
}

// Narrowing: random and edge-case floats through the low-precision copy.
void TestNarrowing() {
  uint64_t rng = 99;
  std::vector<float> values;
  for (uint32_t b :
       {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x477fe000u,
        0x477ff000u, 0x477fefffu, 0x38800000u, 0x387fffffu, 0x33800000u,
        0x33000000u, 0x33000001u, 0x7f7fffffu, 0xff7fffffu, 0x00000001u,
        0x3f808000u, 0x3f818000u, 0x3f80ffffu}) {
    values.push_back(FromBits(b));
  }
  for (int i = 0; i < 200000; ++i) {
    values.push_back(FromBits(static_cast<uint32_t>(SplitMix(rng))));
  }
  const int64_t n = static_cast<int64_t>(values.size());
  for (ElementType type : {ElementType::kF16, ElementType::kBF16}) {
    for (Isa isa :
         {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
      if (!IsaAvailable(isa)) continue;
      std::vector<float> master = values, mu(n, 0.0f), nu(n, 0.0f),
                         grad(n, 0.0f);
      std::vector<uint16_t> out(n);
      AdamConfig config;
      config.learning_rate = 0.0f;  // The master passes through unchanged...
      AdamBuffers b = InPlace(master, mu, nu, grad);
      b.lowp_type = type;
      b.lowp_out = out.data();
      AdamStepRange(MakeAdamConstants(config), b, 0, n, isa);
      bool ok = true;
      for (int64_t i = 0; i < n; ++i) {
        const float x = values[i];
        if (std::isnan(x)) {
          ok &= type == ElementType::kF16 ? std::isnan(HalfValue(out[i]))
                                          : std::isnan(Bf16Value(out[i]));
        } else {
          // ...except 0 * inf = NaN: lr * update is NaN only for inf weights
          // when weight decay is on, which it is not here.
          ok &= out[i] == (type == ElementType::kF16 ? ReferenceHalf(x)
                                                     : ReferenceBf16(x));
        }
      }
      Check(ok,
            type == ElementType::kF16 ? "f16 copy rounds to nearest even"
                                      : "bf16 copy rounds to nearest even",
            IsaName(isa));
    }
  }
}

void TestConversionsExhaustively() {
  TestWideningExhaustively();
  TestNarrowing();
}

void TestNonFiniteGradients() {
  const int64_t n = 1000;
  for (Isa isa :
       {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
    if (!IsaAvailable(isa)) continue;
    std::vector<float> clean_p(n, 0.5f), clean_m(n, 0.0f), clean_v(n, 0.0f);
    std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g(n, 0.25f);
    std::vector<float> clean_g = g;
    g[3] = std::numeric_limits<float>::quiet_NaN();
    g[17] = std::numeric_limits<float>::infinity();
    g[500] = -std::numeric_limits<float>::infinity();
    g[n - 1] = std::numeric_limits<float>::quiet_NaN();
    auto run = [&](std::vector<float>& pp, std::vector<float>& mm,
                   std::vector<float>& vv, const std::vector<float>& gg) {
      AdamConfig config;
      config.weight_decay = 0.01f;
      AdamBuffers b = InPlace(pp, mm, vv, gg);
      AdamStepRange(MakeAdamConstants(config), b, 0, n, isa);
    };
    run(p, m, v, g);
    run(clean_p, clean_m, clean_v, clean_g);
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) {
      const bool poisoned = !std::isfinite(g[i]);
      // As in optax: NaN stays NaN; +-inf gives inf moments and inf/inf = NaN.
      if (poisoned) {
        ok &= std::isnan(p[i]) && !std::isfinite(m[i]) && !std::isfinite(v[i]);
      } else {
        ok &= Bits(p[i]) == Bits(clean_p[i]) && Bits(m[i]) == Bits(clean_m[i]);
      }
    }
    Check(ok, "NaN/Inf gradients poison only their own elements", IsaName(isa));

    // With keep_nonfinite, poisoned elements keep their old values exactly.
    std::vector<float> kp(n, 0.5f), km(n, 0.125f), kv(n, 0.25f);
    AdamConfig config;
    config.weight_decay = 0.01f;
    config.keep_nonfinite = true;
    AdamBuffers b = InPlace(kp, km, kv, g);
    AdamStepRange(MakeAdamConstants(config), b, 0, n, isa);
    bool kept = true;
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(g[i])) {
        kept &= kp[i] == 0.5f && km[i] == 0.125f && kv[i] == 0.25f;
      } else {
        kept &= std::isfinite(kp[i]) && kp[i] != 0.5f;
      }
    }
    Check(kept, "keep_nonfinite leaves NaN/Inf elements untouched",
          IsaName(isa));
  }
}

void TestOutOfPlaceAndRoofline() {
  const int64_t n = 777;
  std::vector<float> p(n, 1.0f), m(n, 0.1f), v(n, 0.2f), g(n, 0.5f);
  std::vector<float> p2(n), m2(n), v2(n);
  AdamBuffers b;
  b.size = n;
  b.master_in = p.data();
  b.mu_in = m.data();
  b.nu_in = v.data();
  b.grad = g.data();
  b.master_out = p2.data();
  b.mu_out = m2.data();
  b.nu_out = v2.data();
  AdamStep(AdamConfig{}, b);
  bool inputs_kept = true, outputs_moved = true;
  for (int64_t i = 0; i < n; ++i) {
    inputs_kept &= p[i] == 1.0f && m[i] == 0.1f && v[i] == 0.2f;
    outputs_moved &= p2[i] < 1.0f && m2[i] != 0.1f;
  }
  Check(inputs_kept && outputs_moved, "out-of-place step leaves inputs", "");
  StreamRooflineRange(b, 0, n);
  bool roofline = true;
  for (int64_t i = 0; i < n; ++i) {
    roofline &= p2[i] == 1.5f && m2[i] == 0.2f && v2[i] == 0.1f;
  }
  Check(roofline, "roofline moves the same bytes", "");
  AdamBuffers bad = b;
  bad.lowp_type = static_cast<ElementType>(7);
  Check(ValidateAdamBuffers(bad) != nullptr, "unknown copy type rejected", "");
  bad = b;
  bad.lowp_type = ElementType::kF32;
  bad.lowp_out = nullptr;
  Check(ValidateAdamBuffers(bad) != nullptr, "null weights copy rejected", "");
  bad = b;
  bad.grad = nullptr;
  Check(ValidateAdamBuffers(bad) != nullptr, "null gradient rejected", "");
  AdamBuffers empty;
  Check(ValidateAdamBuffers(empty) == nullptr, "empty step is valid", "");
  AdamStep(AdamConfig{}, empty);  // Must not touch any (null) buffer.
}

// `n` floats starting `offset` floats past a 64-byte boundary.
class AlignedFloats {
 public:
  AlignedFloats(int64_t n, int64_t offset) : storage_(n + offset + 16) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - at % 64) % 64) / sizeof(float) + offset;
  }
  float* data() { return data_; }
  float& operator[](int64_t i) { return data_[i]; }

 private:
  std::vector<float> storage_;
  float* data_;
};

// The plain kernel's out-of-place step of n elements from `master`, `mu`
// and `nu`, with a bf16 copy of the new weights.
struct PlainStep {
  std::vector<float> master, mu, nu;
  std::vector<uint16_t> lowp;
};

PlainStep PlainStepFrom(const AdamConstants& constants, const float* master,
                        const float* mu, const float* nu, const void* grad,
                        ElementType grad_type, int64_t n, Isa isa) {
  PlainStep out{std::vector<float>(n), std::vector<float>(n),
                std::vector<float>(n), std::vector<uint16_t>(n)};
  AdamBuffers b;
  b.size = n;
  b.master_in = master;
  b.mu_in = mu;
  b.nu_in = nu;
  b.master_out = out.master.data();
  b.mu_out = out.mu.data();
  b.nu_out = out.nu.data();
  b.grad = grad;
  b.grad_type = grad_type;
  b.lowp_out = out.lowp.data();
  b.lowp_type = ElementType::kBF16;
  AdamStepRange(constants, b, 0, n, isa);
  return out;
}

// One case of TestSpeculateThenRedo: rows aligned alike (streamed) for
// ratios 0.5 and 1e2, else not.
struct RedoCase {
  ElementType grad_type;
  bool nesterov;
  int from;
  double ratio;  // Of the gradients' norm to the clip, 1.
  bool aligned() const { return ratio == 0.5 || ratio == 1e2; }
};

// Double-buffered state, row `from` random and the spare row NaN, the kept
// gradient, the bf16 weights copy, and the gradients in both types.
struct RedoInputs {
  AlignedFloats master, mu, nu, kept;
  std::vector<float> grad32;
  std::vector<uint16_t> grad16, lowp;
  std::vector<double> grad;  // The values the kernel sees, of grad_type.
  double sumsq = 0.0;
  RedoInputs(int64_t n, bool aligned)
      : master(2 * n, 0),
        mu(2 * n, aligned ? 0 : 1),
        nu(2 * n, aligned ? 0 : 2),
        kept(n, aligned ? 0 : 3),
        grad32(n),
        grad16(n),
        lowp(n),
        grad(n) {}
};

void FillRedoInputs(const RedoCase& c, int64_t n, RedoInputs& in) {
  uint64_t rng = 11 + c.from + (c.nesterov ? 2 : 0);
  for (int64_t i = 0; i < 2 * n; ++i) {  // The spare row: garbage.
    in.master[i] = in.mu[i] = in.nu[i] =
        std::numeric_limits<float>::quiet_NaN();
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = c.from * n + i;
    in.master[at] = static_cast<float>(Uniform(rng));
    in.mu[at] = static_cast<float>(Uniform(rng) * 1e-3);
    in.nu[at] = static_cast<float>((Uniform(rng) + 1.0) * 1e-6);
    const double g = Uniform(rng) * std::pow(10.0, Uniform(rng));
    in.grad32[i] = static_cast<float>(g);
    in.grad16[i] = EncodeGrad(g, ElementType::kBF16);
    in.grad[i] = c.grad_type == ElementType::kF32
                     ? in.grad32[i]
                     : DecodeGrad(in.grad16[i], ElementType::kBF16);
    in.sumsq += in.grad[i] * in.grad[i];
  }
}

// The speculation left row `from` untouched, streamed as aligned, kept the
// gradient exactly, wrote the scalar path's bits and summed the squares.
void CheckSpeculation(const RedoCase& c, int64_t n, const AdamConstants& k,
                      const PairBuffers& pair, RedoInputs& in,
                      const Rows& before, bool streams, double sum,
                      const char* context) {
  bool untouched = true, kept_exact = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = c.from * n + i;
    untouched &= Bits(in.master[at]) == Bits(before.master[at]) &&
                 Bits(in.mu[at]) == Bits(before.mu[at]) &&
                 Bits(in.nu[at]) == Bits(before.nu[at]);
    kept_exact &= static_cast<double>(in.kept[i]) == in.grad[i];
  }
  Check(untouched, "speculation leaves the current row untouched", context);
  Check(streams == c.aligned(), "rows aligned alike are streamed", context);
  Check(kept_exact, "speculation keeps the gradient exactly", context);
  const int64_t cur = c.from * n;
  const PlainStep s = PlainStepFrom(
      k, before.master.data() + cur, before.mu.data() + cur,
      before.nu.data() + cur, pair.grad, c.grad_type, n, Isa::kScalar);
  bool same = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = (1 - c.from) * n + i;
    same &= Bits(in.master[at]) == Bits(s.master[i]) &&
            Bits(in.mu[at]) == Bits(s.mu[i]) &&
            Bits(in.nu[at]) == Bits(s.nu[i]) && in.lowp[i] == s.lowp[i];
  }
  Check(same, "speculation writes the scalar path's bits", context);
  const double want_sum = c.ratio * c.ratio;  // Of the scaled gradients.
  Check(std::fabs(sum - want_sum) <= 1e-5 * want_sum,
        "speculation sums the squared scaled gradients", context);
}

// The redo of the step with the clipped scale, from row `from`: the plain
// kernel's bits, and within a few ulps of float64.
void CheckRedo(const RedoCase& c, int64_t n, const AdamConstants& again,
               const PairBuffers& pair, RedoInputs& in, const Rows& before,
               const char* context) {
  RedoStepRange(again, pair, c.from, 0, n, BestIsa());
  const int64_t cur = c.from * n, out = (1 - c.from) * n;
  const PlainStep plain = PlainStepFrom(
      again, before.master.data() + cur, before.mu.data() + cur,
      before.nu.data() + cur, pair.grad, c.grad_type, n, BestIsa());
  const Hyper h{1e-2, 0.9f,  0.999f,           1e-8f,
                0.0,  1e-4f, again.grad_scale, c.nesterov};
  bool same = true;
  double worst_master = 0, worst_mu = 0, worst_nu = 0;
  for (int64_t i = 0; i < n; ++i) {
    same &= Bits(in.master[out + i]) == Bits(plain.master[i]) &&
            Bits(in.mu[out + i]) == Bits(plain.mu[i]) &&
            Bits(in.nu[out + i]) == Bits(plain.nu[i]) &&
            in.lowp[i] == plain.lowp[i];
    const StepResult r =
        ReferenceElement(h, 7, in.grad[i], before.master[cur + i],
                         before.mu[cur + i], before.nu[cur + i]);
    worst_master = std::max(
        worst_master, UlpsAt(in.master[out + i] - r.master, r.master_scale));
    worst_mu = std::max(worst_mu, UlpsAt(in.mu[out + i] - r.mu, r.mu_scale));
    worst_nu = std::max(worst_nu, UlpsAt(in.nu[out + i] - r.nu, r.nu));
  }
  Check(same, "redo equals the plain step with the clipped scale", context);
  // The clipped scale is not a power of two: g = grad * scale is
  // one more rounding, doubled in nu by the square (3 ulps, not 2).
  const bool close = worst_master <= 4.0 && worst_mu <= 2.0 && worst_nu <= 3.0;
  Check(close, "redo within a few ulps of float64", context);
  if (!close) {
    std::printf("  ulps: master %.2f mu %.2f nu %.2f\n", worst_master, worst_mu,
                worst_nu);
  }
}

void RunRedoCase(const RedoCase& c) {
  const int64_t n = 3001;
  RedoInputs in(n, c.aligned());
  FillRedoInputs(c, n, in);
  // Gradients scaled so that their norm is `ratio` times the clip 1.
  const float scale = static_cast<float>(c.ratio / std::sqrt(in.sumsq));
  const Rows before = BothRows(in.master, in.mu, in.nu, n);
  AdamConfig config;
  config.learning_rate = 1e-2f;
  config.weight_decay = 1e-4f;
  config.nesterov = c.nesterov;
  config.grad_scale = scale;
  config.count = 6;
  const AdamConstants speculative = MakeAdamConstants(config);
  const PairBuffers pair{n,
                         n,
                         in.master.data(),
                         in.mu.data(),
                         in.nu.data(),
                         c.grad_type == ElementType::kF32
                             ? static_cast<const void*>(in.grad32.data())
                             : static_cast<const void*>(in.grad16.data()),
                         c.grad_type,
                         in.kept.data(),
                         in.lowp.data(),
                         ElementType::kBF16};
  const bool streams =
      StreamableHead(RowStep(pair, c.from, pair.grad, c.grad_type), 0, n) >= 0;
  // Two sub-ranges, one boundary mid-vector, as chunks split them.
  const double sum =
      SpeculativeStepRange(speculative, pair, c.from, 0, n / 3 + 1, BestIsa()) +
      SpeculativeStepRange(speculative, pair, c.from, n / 3 + 1, n, BestIsa());
  char context[112];
  std::snprintf(context, sizeof(context),
                "grad=%s nesterov=%d from=%d ratio=%g aligned=%d",
                TypeName(c.grad_type), c.nesterov, c.from, c.ratio,
                c.aligned());
  CheckSpeculation(c, n, speculative, pair, in, before, streams, sum, context);
  // Validation: clip to norm 1, so the redo's scale is scale / ratio.
  AdamConstants again = speculative;
  again.grad_scale = static_cast<float>(scale / c.ratio);
  again.keep_nonfinite = false;
  CheckRedo(c, n, again, pair, in, before, context);
}

// Speculation-then-validation on double-buffered state: the speculative
// step leaves the current row untouched, writes the other and keeps the
// gradient (with streaming stores when the rows and the kept gradient share
// their alignment, plain ones when not); the redo of a clipped step, from that
// row, is within a few ulps of a float64 step with the clipped gradient, and
// bit for bit the plain kernel's step with that scale, at clip ratios from 0.5
// to 1e4.
void TestSpeculateThenRedo() {
  for (ElementType grad_type : {ElementType::kF32, ElementType::kBF16}) {
    for (bool nesterov : {false, true}) {
      for (int from : {0, 1}) {
        for (double ratio : {0.5, 3.0, 1e2, 1e4}) {
          RunRedoCase({grad_type, nesterov, from, ratio});
        }
      }
    }
  }
}

// The squares the kernel sums, exactly as it forms them: g = grad * scale in
// fp32, then g * g in fp32. Summed here in double, in element order.
double ReferenceSumSquares(const std::vector<float>& grad, float scale) {
  double sum = 0.0;
  for (float x : grad) {
    const float g = x * scale;
    const float square = g * g;
    sum += square;
  }
  return sum;
}

// Random state and gradients of type `grad_type`; `grad` holds the
// gradients' fp32 values, `grad16` their 16-bit encoding.
struct SumSquaresInputs {
  std::vector<float> master, mu, nu, grad;
  std::vector<uint16_t> grad16;
};

SumSquaresInputs RandomSumSquaresInputs(int64_t n, ElementType grad_type,
                                        uint64_t& rng) {
  SumSquaresInputs in{std::vector<float>(n), std::vector<float>(n),
                      std::vector<float>(n), std::vector<float>(n),
                      std::vector<uint16_t>(n)};
  for (int64_t i = 0; i < n; ++i) {
    in.master[i] = static_cast<float>(Uniform(rng));
    in.mu[i] = static_cast<float>(Uniform(rng) * 0.01);
    in.nu[i] = static_cast<float>((Uniform(rng) + 1.0) * 1e-4);
    const double g = Uniform(rng) * std::pow(10.0, Uniform(rng) * 3.0);
    if (grad_type == ElementType::kF32) {
      in.grad[i] = static_cast<float>(g);
    } else {
      in.grad16[i] = EncodeGrad(g, grad_type);
      in.grad[i] = static_cast<float>(DecodeGrad(in.grad16[i], grad_type));
    }
  }
  return in;
}

// One copy of the state stepped in place, with both kinds of copy output.
struct StateCopy {
  std::vector<float> master, mu, nu;
  std::vector<uint16_t> lowp;
  std::vector<float> lowp32;
};

StateCopy CopyOf(const std::vector<float>& master, const std::vector<float>& mu,
                 const std::vector<float>& nu) {
  return StateCopy{master, mu, nu, std::vector<uint16_t>(master.size(), 0),
                   std::vector<float>(master.size(), 0.0f)};
}

AdamBuffers CopyBuffers(StateCopy& s, const SumSquaresInputs& in,
                        ElementType grad_type, ElementType lowp_type) {
  AdamBuffers b;
  b.size = static_cast<int64_t>(s.master.size());
  b.master_in = b.master_out = s.master.data();
  b.mu_in = b.mu_out = s.mu.data();
  b.nu_in = b.nu_out = s.nu.data();
  b.grad = grad_type == ElementType::kF32
               ? static_cast<const void*>(in.grad.data())
               : static_cast<const void*>(in.grad16.data());
  b.grad_type = grad_type;
  b.lowp_type = lowp_type;
  b.lowp_out = lowp_type == ElementType::kF32
                   ? static_cast<void*>(s.lowp32.data())
                   : static_cast<void*>(s.lowp.data());
  return b;
}

// What held over one instruction set's and size's cases.
struct SumSquaresFlags {
  bool same_state = true, within = true, repeatable = true;
  double worst = 0.0;
};

// One configuration: the summing step equals the plain one, its sum is
// within `tolerance` of the reference and repeatable.
void SumSquaresCase(int64_t n, Isa isa, ElementType grad_type,
                    ElementType lowp_type, int config_bits, double tolerance,
                    SumSquaresFlags& f) {
  uint64_t rng = 77 + n + config_bits;
  const SumSquaresInputs in = RandomSumSquaresInputs(n, grad_type, rng);
  AdamConfig config;
  config.learning_rate = 1e-2f;
  config.nesterov = (config_bits & 1) != 0;
  config.weight_decay = (config_bits & 2) ? 0.01f : 0.0f;
  config.keep_nonfinite = (config_bits & 4) != 0;
  config.grad_scale = 0.75f;
  config.count = 3;
  const AdamConstants k = MakeAdamConstants(config);
  // Two copies of everything: one for each entry point.
  StateCopy p = CopyOf(in.master, in.mu, in.nu), s = p;
  const AdamBuffers plain = CopyBuffers(p, in, grad_type, lowp_type);
  const AdamBuffers summing = CopyBuffers(s, in, grad_type, lowp_type);
  // A split that falls mid-vector, as a chunk boundary may.
  const int64_t split = n / 3 + (n > 2 ? 1 : 0);
  AdamStepRange(k, plain, 0, split, isa);
  AdamStepRange(k, plain, split, n, isa);
  const double sum = AdamStepSumSquaresRange(k, summing, 0, split, isa) +
                     AdamStepSumSquaresRange(k, summing, split, n, isa);
  for (int64_t i = 0; i < n; ++i) {
    f.same_state &= Bits(p.master[i]) == Bits(s.master[i]) &&
                    Bits(p.mu[i]) == Bits(s.mu[i]) &&
                    Bits(p.nu[i]) == Bits(s.nu[i]) && p.lowp[i] == s.lowp[i] &&
                    Bits(p.lowp32[i]) == Bits(s.lowp32[i]);
  }
  const double want = ReferenceSumSquares(in.grad, config.grad_scale);
  const double error =
      want == 0.0 ? std::fabs(sum) : std::fabs(sum - want) / want;
  f.worst = std::max(f.worst, error);
  f.within &= error <= tolerance;
  // The same call again (state restored) gives the same bits.
  StateCopy r = CopyOf(s.master, s.mu, s.nu);
  const AdamBuffers again = CopyBuffers(r, in, grad_type, lowp_type);
  const double first = AdamStepSumSquaresRange(k, again, 0, n, isa);
  std::copy(s.master.begin(), s.master.end(), r.master.begin());
  std::copy(s.mu.begin(), s.mu.end(), r.mu.begin());
  std::copy(s.nu.begin(), s.nu.end(), r.nu.begin());
  const double second = AdamStepSumSquaresRange(k, again, 0, n, isa);
  f.repeatable &= SameBits(first, second);
}

// Non-finite squares make the sum non-finite, guarded or not: NaN, +-Inf,
// and a finite gradient whose fp32 square overflows.
void CheckNonFiniteSums(Isa isa) {
  struct Poison {
    float value;
    bool nan;  // Whether the sum must be NaN (else +Inf).
  };
  for (bool keep : {false, true}) {
    for (const Poison poison :
         {Poison{std::numeric_limits<float>::quiet_NaN(), true},
          Poison{std::numeric_limits<float>::infinity(), false},
          Poison{-std::numeric_limits<float>::infinity(), false},
          Poison{1e20f, false}}) {
      for (int64_t where : {0, 5, 700, 1036}) {
        const int64_t n = 1037;
        std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g(n, 0.25f);
        g[where] = poison.value;
        AdamConfig config;
        config.keep_nonfinite = keep;
        AdamBuffers b = InPlace(p, m, v, g);
        const double sum =
            AdamStepSumSquaresRange(MakeAdamConstants(config), b, 0, n, isa);
        const bool ok =
            poison.nan ? std::isnan(sum) : std::isinf(sum) && sum > 0;
        char context[64];
        std::snprintf(context, sizeof(context), "%s keep=%d g=%g at %lld",
                      IsaName(isa), keep, poison.value,
                      static_cast<long long>(where));
        Check(ok, "a non-finite square makes the sum non-finite", context);
      }
    }
  }
}

// AdamStepSumSquaresRange steps exactly as AdamStepRange does and returns
// the sum of the squared scaled gradients within 64 fp32 roundings.
void TestSumSquares(bool quick) {
  const std::vector<Isa> isas = AvailableIsas();
  const ElementType kGrads[] = {ElementType::kF32, ElementType::kBF16,
                                ElementType::kF16};
  const ElementType kLowps[] = {ElementType::kNone, ElementType::kF32,
                                ElementType::kBF16, ElementType::kF16};
  // Each lane adds at most 64 positive squares in fp32.
  const double tolerance = 64.0 * std::ldexp(1.0, -24);
  struct Shape {
    int64_t n;
    bool all_configs;
  };
  for (const Shape shape :
       {Shape{0, false}, Shape{1, false}, Shape{7, false}, Shape{100, false},
        Shape{1000, true}, Shape{4099, false}, Shape{70001, false}}) {
    const int64_t n = shape.n;
    if (quick && n > 4099) continue;
    for (Isa isa : isas) {
      SumSquaresFlags f;
      for (ElementType grad_type : kGrads) {
        for (ElementType lowp_type : kLowps) {
          for (int config_bits = 0; config_bits < 8; ++config_bits) {
            if (!shape.all_configs &&
                (lowp_type != ElementType::kBF16 || config_bits != 5)) {
              continue;
            }
            SumSquaresCase(n, isa, grad_type, lowp_type, config_bits, tolerance,
                           f);
          }
        }
      }
      char context[64];
      std::snprintf(context, sizeof(context), "%s n=%lld", IsaName(isa),
                    static_cast<long long>(n));
      Check(f.same_state, "summing squares leaves the step bit for bit",
            context);
      Check(f.within, "sum of squares within 64 fp32 roundings", context);
      Check(f.repeatable, "sum of squares is repeatable", context);
      if (!f.within || std::getenv("JSO_VERBOSE")) {
        std::printf("  %s: sum of squares relative error %.3g\n", context,
                    f.worst);
      }
    }
  }
  for (Isa isa : isas) CheckNonFiniteSums(isa);
}

// Every prefetch policy computes the same bits on every instruction set,
// with and without the fused sum of squares and a low-precision copy; and
// the policy names parse back to themselves.
void TestPrefetchPolicies() {
  const Prefetch kPolicies[] = {Prefetch::kT0, Prefetch::kNta, Prefetch::kNone};
  for (Prefetch p : kPolicies) {
    Prefetch parsed = Prefetch::kNone;
    Check(ParsePrefetch(PrefetchName(p), &parsed) && parsed == p,
          "prefetch names parse back", PrefetchName(p));
  }
  Prefetch parsed = Prefetch::kNone;
  Check(ParsePrefetch(nullptr, &parsed) && parsed == kDefaultPrefetch &&
            ParsePrefetch("", &parsed) && parsed == kDefaultPrefetch,
        "no prefetch name means the default", "null, empty");
  Check(!ParsePrefetch("T0", &parsed) && !ParsePrefetch("t1", &parsed),
        "unknown prefetch names are refused", "T0, t1");
  const int64_t n = 4099;  // Not a whole number of lines or vectors.
  for (Isa isa :
       {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
    if (!IsaAvailable(isa)) continue;
    std::vector<uint32_t> first;
    bool same = true;
    for (Prefetch policy : kPolicies) {
      uint64_t rng = 31;
      std::vector<float> p(n), m(n), v(n), g(n);
      std::vector<uint16_t> lowp(n);
      for (int64_t i = 0; i < n; ++i) {
        p[i] = static_cast<float>(Uniform(rng));
        m[i] = static_cast<float>(Uniform(rng) * 0.01);
        v[i] = static_cast<float>((Uniform(rng) + 1.0) * 1e-4);
        g[i] = static_cast<float>(Uniform(rng));
      }
      AdamConfig config;
      config.weight_decay = 0.01f;
      AdamBuffers b = InPlace(p, m, v, g);
      b.lowp_type = ElementType::kBF16;
      b.lowp_out = lowp.data();
      b.prefetch = policy;
      const AdamConstants k = MakeAdamConstants(config);
      AdamStepRange(k, b, 0, n / 2, isa);
      const double sum = AdamStepSumSquaresRange(k, b, n / 2, n, isa);
      std::vector<uint32_t> bits;
      for (int64_t i = 0; i < n; ++i) {
        bits.insert(bits.end(), {Bits(p[i]), Bits(m[i]), Bits(v[i]), lowp[i]});
      }
      uint64_t sum_bits;
      std::memcpy(&sum_bits, &sum, sizeof(sum));
      bits.insert(bits.end(), {static_cast<uint32_t>(sum_bits),
                               static_cast<uint32_t>(sum_bits >> 32)});
      if (first.empty()) {
        first = bits;
      } else {
        same &= bits == first;
      }
    }
    Check(same, "every prefetch policy computes the same bits", IsaName(isa));
  }
}

// --- Review of the streamed speculative step (review_stream). ---

// `n` floats `offset_bytes` past a 64-byte boundary, with 256 guard bytes
// on either side; every byte of the storage starts as 0xA5, so a write
// outside [data, data + n) shows.
class GuardedFloats {
 public:
  static constexpr int64_t kGuard = 256;
  GuardedFloats(int64_t n, int64_t offset_bytes)
      : n_(n), storage_(n * 4 + offset_bytes + 2 * kGuard + 64, 0xA5) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(storage_.data());
    const uintptr_t pad = (64 - at % 64) % 64;
    start_ = static_cast<int64_t>(pad + kGuard + offset_bytes);
    data_ = reinterpret_cast<float*>(storage_.data() + start_);
  }
  float* data() { return data_; }
  float& operator[](int64_t i) { return data_[i]; }
  // No byte outside the data changed.
  bool GuardsIntact() const {
    for (int64_t i = 0; i < static_cast<int64_t>(storage_.size()); ++i) {
      if (i >= start_ && i < start_ + 4 * n_) continue;
      if (storage_[i] != 0xA5) return false;
    }
    return true;
  }

 private:
  int64_t n_;
  std::vector<unsigned char> storage_;
  int64_t start_ = 0;
  float* data_ = nullptr;
};

// Same bits, or both NaN (NaN payloads may differ between paths).
bool SameOrBothNan(float a, float b) {
  return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b));
}

// A 16-bit gradient element's value as fp32, from its definition (HalfValue
// for f16, the top half of the fp32 for bf16).
float Decode16(uint16_t h, ElementType t) {
  if (t == ElementType::kBF16) return FromBits(static_cast<uint32_t>(h) << 16);
  return static_cast<float>(HalfValue(h));
}

struct AttackOffsets {
  int64_t master, mu, nu, kept;  // Bytes past a 64-byte boundary.
};

// One case of TestStreamedSpeculationAttack.
struct AttackCase {
  Isa isa;
  ElementType grad_type;
  bool guard;
  ElementType lowp_type;
  int64_t n;
  int from;
  AttackOffsets off;  // off.kept -1: no kept gradient (kept_grad null).
  int split;
};

// Which properties held over one instruction set's cases, the first failure
// described, and how many sub-ranges streamed.
struct AttackFlags {
  bool bits_ok = true, kept_ok = true, row_ok = true, guards_ok = true;
  bool sum_ok = true, again_ok = true, decision_ok = true;
  char first[200] = "";
  int64_t streamed_cases = 0;
  void Fail(bool& flag, const char* what, const char* context) {
    if (flag && first[0] == '\0') {
      std::snprintf(first, sizeof(first), "%s: %s", what, context);
    }
    flag = false;
  }
};

// The double-buffered rows, kept gradient, weights copy and gradients of one
// case, each at its offset with guard bytes around it.
struct AttackBuffers {
  GuardedFloats master, mu, nu, kept;
  GuardedFloats lowp;  // As uint16_t: 2n bytes used.
  std::vector<float> g32;
  std::vector<uint16_t> g16;
  AttackBuffers(int64_t n, const AttackOffsets& off)
      : master(2 * n, off.master),
        mu(2 * n, off.mu),
        nu(2 * n, off.nu),
        kept(n, off.kept >= 0 ? off.kept : 0),
        lowp(n, 2),
        g32(n),
        g16(n) {}
};

// A random current row and gradients, with NaN, +-Inf, -0 and a subnormal
// at the ends and the middle.
void FillAttackInputs(uint64_t& rng, const AttackCase& c, AttackBuffers& a) {
  const int64_t n = c.n, cur = c.from * n;
  for (int64_t i = 0; i < n; ++i) {
    a.master[cur + i] = static_cast<float>(Uniform(rng));
    a.mu[cur + i] = static_cast<float>(Uniform(rng) * 0.01);
    a.nu[cur + i] = static_cast<float>((Uniform(rng) + 1.0) * 1e-4);
    const float g = static_cast<float>(Uniform(rng) * 3.0);
    a.g32[i] = g;
    a.g16[i] = c.grad_type == ElementType::kF16
                   ? ReferenceHalf(g)
                   : static_cast<uint16_t>(Bits(g) >> 16);
  }
  if (n < 8) return;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const struct {
    int64_t at;
    float value;
    uint16_t half;
  } specials[] =
      {
          {0, nan, 0x7e00},        {n - 1, inf, 0x7c00},
          {n / 2, -inf, 0xfc00},   {n / 3, -0.0f, 0x8000},
          {n / 4, 1e-40f, 0x0001},  // Subnormal in fp32 / f16.
      };
  for (const auto& s : specials) {
    a.g32[s.at] = s.value;
    a.g16[s.at] = c.grad_type == ElementType::kF16
                      ? s.half
                      : static_cast<uint16_t>(Bits(s.value) >> 16);
  }
}

// Sub-ranges: whole; a third; 1, middle, 1 and a cut at 37.
std::vector<int64_t> AttackCuts(int64_t n, int split) {
  std::vector<int64_t> cuts = {0, n};
  if (split == 1) cuts = {0, n / 3 + 1 > n ? n : n / 3 + 1, n};
  if (split == 2 && n >= 40) cuts = {0, 1, 37, n - 1, n};
  return cuts;
}

// The speculative step over the sub-ranges `cuts`, each checked to stream
// exactly when its four out pointers share their phase; returns the sum.
double StepAttackRanges(const AdamConstants& k, const PairBuffers& pair,
                        const AttackCase& c, const std::vector<int64_t>& cuts,
                        const char* context, AttackFlags& flags) {
  const bool with_kept = c.off.kept >= 0;
  double sum = 0.0;
  for (size_t j = 0; j + 1 < cuts.size(); ++j) {
    AdamBuffers probe = RowStep(pair, c.from, pair.grad, c.grad_type);
    probe.grad_copy = pair.kept_grad;
    const int64_t b = cuts[j], e = cuts[j + 1];
    const int64_t head = StreamableHead(probe, b, e);
    // Independent: the four out pointers' phases at b.
    const auto ph = [b](const float* p) {
      return reinterpret_cast<uintptr_t>(p + b) % 64;
    };
    const bool alike =
        ph(probe.master_out) == ph(probe.mu_out) &&
        ph(probe.master_out) == ph(probe.nu_out) &&
        (!with_kept || ph(probe.master_out) == ph(probe.grad_copy));
    if (e > b && alike != (head >= 0)) {
      flags.Fail(flags.decision_ok, "StreamableHead decision", context);
    }
    if (head >= 0 && e > b) {
      const int64_t want =
          std::min<int64_t>(e - b, (64 - ph(probe.master_out)) % 64 / 4);
      if (head != want) {
        flags.Fail(flags.decision_ok, "StreamableHead head", context);
      }
      ++flags.streamed_cases;
    }
    sum += SpeculativeStepRange(k, pair, c.from, b, e, c.isa);
  }
  return sum;
}

// The reference: a scalar out-of-place step from the current row, and its
// sum of squares.
struct ScalarStep {
  std::vector<float> master, mu, nu;
  std::vector<uint16_t> lowp;
  double sum;
};

ScalarStep ScalarStepFromRow(const AdamConstants& k, const AttackCase& c,
                             const Rows& before, const void* grad) {
  const int64_t n = c.n, cur = c.from * n;
  ScalarStep r{std::vector<float>(n), std::vector<float>(n),
               std::vector<float>(n), std::vector<uint16_t>(n, 0), 0.0};
  AdamBuffers ref;
  ref.size = n;
  ref.master_in = before.master.data() + cur;
  ref.mu_in = before.mu.data() + cur;
  ref.nu_in = before.nu.data() + cur;
  ref.master_out = r.master.data();
  ref.mu_out = r.mu.data();
  ref.nu_out = r.nu.data();
  ref.grad = grad;
  ref.grad_type = c.grad_type;
  ref.lowp_out = r.lowp.data();
  ref.lowp_type = c.lowp_type;
  r.sum = AdamStepSumSquaresRange(k, ref, 0, n, Isa::kScalar);
  return r;
}

// The spare row and weights copy are the scalar step's bits (NaNs: NaN), the
// current row is untouched and the kept gradient is the gradient's value.
void CheckAttackOutputs(const AttackCase& c, AttackBuffers& a,
                        const Rows& before, const ScalarStep& ref,
                        const char* context, AttackFlags& flags) {
  const int64_t n = c.n, cur = c.from * n, out = (1 - c.from) * n;
  const uint16_t* low = reinterpret_cast<const uint16_t*>(a.lowp.data());
  for (int64_t i = 0; i < n; ++i) {
    if (!SameOrBothNan(a.master[out + i], ref.master[i]) ||
        !SameOrBothNan(a.mu[out + i], ref.mu[i]) ||
        !SameOrBothNan(a.nu[out + i], ref.nu[i])) {
      flags.Fail(flags.bits_ok, "spare row differs from scalar step", context);
    }
    if (c.lowp_type == ElementType::kBF16 &&
        !SameOrBothNan(Decode16(low[i], ElementType::kBF16),
                       Decode16(ref.lowp[i], ElementType::kBF16))) {
      flags.Fail(flags.bits_ok, "weights copy differs", context);
    }
    if (Bits(a.master[cur + i]) != Bits(before.master[cur + i]) ||
        Bits(a.mu[cur + i]) != Bits(before.mu[cur + i]) ||
        Bits(a.nu[cur + i]) != Bits(before.nu[cur + i])) {
      flags.Fail(flags.row_ok, "current row touched", context);
    }
    if (c.off.kept >= 0) {
      const float want = c.grad_type == ElementType::kF32
                             ? a.g32[i]
                             : Decode16(a.g16[i], c.grad_type);
      const bool same = std::isnan(want) ? std::isnan(a.kept[i])
                                         : Bits(a.kept[i]) == Bits(want);
      if (!same) flags.Fail(flags.kept_ok, "kept gradient", context);
    }
  }
}

// One case: steps, then checks every property against the scalar step.
void RunAttackCase(const AttackCase& c, uint64_t& rng, AttackFlags& flags) {
  const int64_t n = c.n;
  char context[160];
  std::snprintf(
      context, sizeof(context),
      "isa=%s grad=%s guard=%d lowp=%s n=%lld from=%d "
      "off=%lld/%lld/%lld/%lld split=%d",
      IsaName(c.isa), TypeName(c.grad_type), c.guard, TypeName(c.lowp_type),
      static_cast<long long>(n), c.from, static_cast<long long>(c.off.master),
      static_cast<long long>(c.off.mu), static_cast<long long>(c.off.nu),
      static_cast<long long>(c.off.kept), c.split);
  AttackBuffers a(n, c.off);
  FillAttackInputs(rng, c, a);
  const void* grad = c.grad_type == ElementType::kF32
                         ? static_cast<const void*>(a.g32.data())
                         : a.g16.data();
  const Rows before = BothRows(a.master, a.mu, a.nu, n);
  AdamConfig config;
  config.learning_rate = 1e-2f;
  config.weight_decay = 1e-4f;
  config.count = 5;
  config.keep_nonfinite = c.guard;
  const AdamConstants k = MakeAdamConstants(config);
  const PairBuffers pair{n,
                         n,
                         a.master.data(),
                         a.mu.data(),
                         a.nu.data(),
                         grad,
                         c.grad_type,
                         c.off.kept >= 0 ? a.kept.data() : nullptr,
                         a.lowp.data(),
                         c.lowp_type};
  const std::vector<int64_t> cuts = AttackCuts(n, c.split);
  const double sum = StepAttackRanges(k, pair, c, cuts, context, flags);
  const ScalarStep ref = ScalarStepFromRow(k, c, before, grad);
  CheckAttackOutputs(c, a, before, ref, context, flags);
  if (!a.master.GuardsIntact() || !a.mu.GuardsIntact() ||
      !a.nu.GuardsIntact() || !a.kept.GuardsIntact()) {
    flags.Fail(flags.guards_ok, "write outside the buffers", context);
  }
  const bool sum_close = (std::isnan(sum) && std::isnan(ref.sum)) ||
                         sum == ref.sum ||
                         std::fabs(sum - ref.sum) <= 1e-6 * std::fabs(ref.sum);
  if (!sum_close) flags.Fail(flags.sum_ok, "sum of squares", context);
  // Again over the same inputs: the same sum, bit for bit.
  double again = 0.0;
  for (size_t j = 0; j + 1 < cuts.size(); ++j) {
    again += SpeculativeStepRange(k, pair, c.from, cuts[j], cuts[j + 1], c.isa);
  }
  if (!SameBits(sum, again)) {
    flags.Fail(flags.again_ok, "sum not repeatable", context);
  }
}

// The speculative step at every phase of the four output streams (the two
// rows, mu, nu and the kept gradient), on every instruction set, for sizes
// around vectors, lines and sum-of-squares blocks, split into sub-ranges as
// chunks split leaves, with NaN/Inf/subnormal/-0 gradients at the ends:
// the spare row, the weights copy and the kept gradient are bit for bit a
// scalar out-of-place step's (NaNs: NaN), the kept gradient is the
// gradient's exact fp32 value, the current row is untouched, nothing outside
// the buffers is written, the sum of squares agrees with the scalar sum and
// is the same bits when run again, and StreamableHead streams exactly when
// the four phases agree.
void TestStreamedSpeculationAttack() {
  const AttackOffsets kOffsets[] = {
      {0, 0, 0, 0},  {4, 4, 4, 4}, {60, 60, 60, 60}, {32, 32, 32, 32},
      {0, 0, 0, 4},  {0, 8, 0, 0}, {0, 0, 32, 0},    {4, 8, 12, 16},
      {0, 0, 0, -1},  // -1: no kept gradient (kept_grad null).
  };
  const int64_t kSizes[] = {0,  1,  2,   15,  16,   17,   31,   33,  63,
                            64, 65, 127, 129, 1000, 1031, 2053, 4099};
  const ElementType kGradTypes[] = {ElementType::kF32, ElementType::kBF16,
                                    ElementType::kF16};
  int64_t streamed_cases = 0;
  for (Isa isa : AvailableIsas()) {
    AttackFlags flags;
    uint64_t rng = 1234 + static_cast<int>(isa);
    for (ElementType grad_type : kGradTypes) {
      for (bool guard : {false, true}) {
        for (ElementType lowp_type : {ElementType::kNone, ElementType::kBF16}) {
          for (int64_t n : kSizes) {
            for (int from : {0, 1}) {
              for (const AttackOffsets& off : kOffsets) {
                for (int split = 0; split < 3; ++split) {
                  RunAttackCase(
                      {isa, grad_type, guard, lowp_type, n, from, off, split},
                      rng, flags);
                }
              }
            }
          }
        }
      }
    }
    streamed_cases += flags.streamed_cases;
    const char* context = flags.first[0] ? flags.first : IsaName(isa);
    Check(flags.bits_ok, "streamed speculation: spare row and weights bits",
          context);
    Check(flags.kept_ok, "streamed speculation: kept gradient exact", context);
    Check(flags.row_ok, "streamed speculation: current row untouched", context);
    Check(flags.guards_ok, "streamed speculation: no write outside", context);
    Check(flags.sum_ok, "streamed speculation: sum of squares", context);
    Check(flags.again_ok, "streamed speculation: sum repeatable", context);
    Check(flags.decision_ok, "streamed speculation: StreamableHead", context);
  }
  char context[64];
  std::snprintf(context, sizeof(context), "%lld streamed ranges",
                static_cast<long long>(streamed_cases));
  Check(streamed_cases > 0, "streamed speculation: some ranges stream",
        context);
}

// Double-buffered state (both rows) and bf16 gradients, at random.
void FillPairs(uint64_t& rng, GuardedFloats& master, GuardedFloats& mu,
               GuardedFloats& nu, std::vector<uint16_t>& g16) {
  const int64_t n = static_cast<int64_t>(g16.size());
  for (int64_t i = 0; i < 2 * n; ++i) {
    master[i] = static_cast<float>(Uniform(rng));
    mu[i] = static_cast<float>(Uniform(rng) * 0.01);
    nu[i] = static_cast<float>((Uniform(rng) + 1.0) * 1e-4);
  }
  for (int64_t i = 0; i < n; ++i) {
    g16[i] =
        static_cast<uint16_t>(Bits(static_cast<float>(Uniform(rng))) >> 16);
  }
}

// The speculative step of the bucket `segs` (laid end to end from
// `starts`) in fixed chunks of `chunk` elements, as the handler splits it;
// returns the pieces it took and how many of them could stream.
std::pair<int64_t, int64_t> StepInChunks(const AdamConstants& k,
                                         std::vector<PairBuffers>& segs,
                                         const std::vector<int64_t>& starts,
                                         int64_t chunk, int from, Isa isa) {
  const int64_t n = starts.back();
  int64_t pieces = 0, streamed = 0;
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t e = std::min(n, b + chunk);
    for (size_t j = 0; j < segs.size(); ++j) {
      const int64_t lo = std::max(b, starts[j]);
      const int64_t hi = std::min(e, starts[j + 1]);
      if (hi <= lo) continue;
      const AdamBuffers probe =
          RowStep(segs[j], from, segs[j].grad, ElementType::kBF16);
      ++pieces;
      streamed += StreamableHead(probe, lo - starts[j], hi - starts[j]) >= 0;
      SpeculativeStepRange(k, segs[j], from, lo - starts[j], hi - starts[j],
                           isa);
    }
  }
  return {pieces, streamed};
}

// The leaves of one bucket, laid end to end in the double-buffered rows.
std::vector<PairBuffers> BucketSegments(const std::vector<int64_t>& starts,
                                        int64_t n, GuardedFloats& master,
                                        GuardedFloats& mu, GuardedFloats& nu,
                                        GuardedFloats& kept,
                                        std::vector<uint16_t>& g16) {
  std::vector<PairBuffers> segs(starts.size() - 1);
  for (size_t j = 0; j + 1 < starts.size(); ++j) {
    segs[j] = PairBuffers{starts[j + 1] - starts[j], n,
                          master.data() + starts[j], mu.data() + starts[j],
                          nu.data() + starts[j],     g16.data() + starts[j],
                          ElementType::kBF16,        kept.data() + starts[j]};
  }
  return segs;
}

// Whether the spare row (of `from`) holds the scalar step from row `from`
// of `before` (the rows as they were) with the bf16 gradients `g16`.
bool SpareRowIsScalarStep(const AdamConstants& k, int from, int64_t n,
                          const Rows& before, const std::vector<uint16_t>& g16,
                          GuardedFloats& master, GuardedFloats& mu,
                          GuardedFloats& nu) {
  std::vector<float> rm(n), rmu(n), rnu(n);
  AdamBuffers ref{n,
                  before.master.data() + from * n,
                  g16.data(),
                  before.mu.data() + from * n,
                  before.nu.data() + from * n,
                  rm.data(),
                  rmu.data(),
                  rnu.data()};
  ref.grad_type = ElementType::kBF16;
  AdamStepRange(k, ref, 0, n, Isa::kScalar);
  bool same = true;
  const int64_t out = (1 - from) * n;
  for (int64_t i = 0; i < n; ++i) {
    same &= Bits(master[out + i]) == Bits(rm[i]) &&
            Bits(mu[out + i]) == Bits(rmu[i]) &&
            Bits(nu[out + i]) == Bits(rnu[i]);
  }
  return same;
}

// A bucket of odd leaves over more than one kChunkElements chunk, split as
// the FFI handler splits it (chunks, then leaves), buffers 64-aligned: the
// rows stream in every piece (the kept gradient where it shares their
// alignment), and every element is the scalar step's, the kept gradient
// exact.
// One bucket of speculative steps from row `from` over chunks of `chunk`.
void CheckBucketOverChunks(Isa isa, int from, int64_t chunk) {
  std::vector<int64_t> sizes = {1, 15, 17, 3 * chunk / 2 + 7, 33, chunk / 2 + 1,
                                5};
  std::vector<int64_t> starts = {0};
  for (int64_t s : sizes) starts.push_back(starts.back() + s);
  const int64_t n = starts.back();
  GuardedFloats master(2 * n, 0), mu(2 * n, 0), nu(2 * n, 0);
  GuardedFloats kept(n, 0);
  std::vector<uint16_t> g16(n);
  uint64_t rng = 99 + from;
  FillPairs(rng, master, mu, nu, g16);
  const Rows before = BothRows(master, mu, nu, n);
  for (int64_t i = 0; i < n; ++i) kept[i] = -7.0f;
  AdamConfig config;
  config.learning_rate = 1e-3f;
  const AdamConstants k = MakeAdamConstants(config);
  std::vector<PairBuffers> segs =
      BucketSegments(starts, n, master, mu, nu, kept, g16);
  const auto [pieces, streamed] =
      StepInChunks(k, segs, starts, chunk, from, isa);
  const bool same =
      SpareRowIsScalarStep(k, from, n, before, g16, master, mu, nu);
  bool kept_exact = true;
  for (int64_t i = 0; i < n; ++i) {
    kept_exact &= Bits(kept[i]) == (static_cast<uint32_t>(g16[i]) << 16);
  }
  char context[96];
  std::snprintf(context, sizeof(context),
                "isa=%s from=%d n=%lld %lld/%lld pieces streamed", IsaName(isa),
                from, static_cast<long long>(n),
                static_cast<long long>(streamed),
                static_cast<long long>(pieces));
  Check(same, "chunked bucket: rows are the scalar step's", context);
  Check(kept_exact, "chunked bucket: kept gradient exact", context);
  Check(master.GuardsIntact() && mu.GuardsIntact() && nu.GuardsIntact() &&
            kept.GuardsIntact(),
        "chunked bucket: no write outside", context);
  // Each piece's three rows share their phase: all stream.
  Check(streamed == pieces, "chunked bucket: every piece streams", context);
}

void TestStreamedBucketOverChunks(bool quick) {
  const int64_t chunk = quick ? 4099 : kChunkElements;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kScalar}) {
    if (!IsaAvailable(isa)) continue;
    for (int from : {0, 1}) CheckBucketOverChunks(isa, from, chunk);
  }
}

// The bf16 parameter nearest `m` (ties to the even pattern), found by
// comparing the two truncations around it in double: written apart from the
// kernel's integer rounding. `m` is finite.
uint16_t NearestBf16(float m) {
  uint32_t bits;
  std::memcpy(&bits, &m, sizeof(bits));
  const uint32_t low = bits & 0xffff0000u;
  const uint32_t high = low + 0x10000u;  // One pattern further from zero.
  float a, b;
  std::memcpy(&a, &low, sizeof(a));
  std::memcpy(&b, &high, sizeof(b));
  const double da = std::fabs(static_cast<double>(m) - a);
  const double db = std::fabs(static_cast<double>(m) - b);
  if (da != db) return static_cast<uint16_t>((da < db ? low : high) >> 16);
  return static_cast<uint16_t>(((low >> 16) & 1) == 0 ? low >> 16 : high >> 16);
}

// ReseedBf16Range keeps the master where the parameter is its nearest bf16
// pattern or a neighbour of it, or within the tolerance, and takes the
// parameter elsewhere; every instruction set gives the scalar path's bits,
// NaN, Inf and signed zeros included.
void TestReseedBf16() {
  const int64_t n = 4099;  // Not a multiple of any vector width.
  uint64_t rng = 17;
  std::vector<float> master(n);
  std::vector<uint16_t> params(n);
  const uint32_t kSpecial[] = {0x7f800000u, 0xff800000u, 0x7fc00000u,
                               0x80000000u, 0x00000000u, 0x00000001u,
                               0x807fffffu, 0x3f7fffffu, 0x7f7fffffu};
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(SplitMix(rng));
    if (i % 11 == 0) bits = kSpecial[(i / 11) % 9];
    // Mostly ordinary weights, some of any bit pattern.
    if (i % 3 != 0) bits = (bits & 0x807fffffu) | (0x3c000000u + (i % 8 << 23));
    std::memcpy(&master[i], &bits, sizeof(bits));
    const uint16_t near =
        std::isfinite(master[i]) ? NearestBf16(master[i]) : bits >> 16;
    const int offset = static_cast<int>(SplitMix(rng) % 7) - 3;
    params[i] = i % 5 == 0 ? static_cast<uint16_t>(SplitMix(rng))
                           : static_cast<uint16_t>(near + offset);
  }
  const float tolerance = 1e-3f;
  std::vector<float> scalar = master;
  ReseedBf16Range(scalar.data(), params.data(), tolerance, 0, n, Isa::kScalar);
  bool semantics = true;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(master[i])) continue;
    const uint32_t p32 = static_cast<uint32_t>(params[i]) << 16;
    float w;
    std::memcpy(&w, &p32, sizeof(w));
    const int distance = std::abs(static_cast<int>(NearestBf16(master[i])) -
                                  static_cast<int>(params[i]));
    const bool keep = distance <= 1 || std::fabs(w - master[i]) <= tolerance;
    const float want = keep ? master[i] : w;
    semantics &= std::memcmp(&want, &scalar[i], sizeof(want)) == 0;
  }
  Check(semantics, "re-seeding keeps the master only where bf16 says so",
        "scalar");
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
    if (!IsaAvailable(isa)) continue;
    for (int64_t begin : {int64_t{0}, int64_t{1}, int64_t{5}}) {
      std::vector<float> out = master;
      ReseedBf16Range(out.data(), params.data(), tolerance, begin, n, isa);
      std::vector<float> want = master;
      ReseedBf16Range(want.data(), params.data(), tolerance, begin, n,
                      Isa::kScalar);
      Check(std::memcmp(out.data(), want.data(), n * sizeof(float)) == 0,
            "re-seeding equals the scalar path bit for bit", IsaName(isa));
    }
  }
}

}  // namespace
}  // namespace jax_superoffload

// With --quick (the qemu runs, 100x slower than native), the large cases
// shrink from 2^18 + 3 to 2^12 + 3 elements: every path still runs, on every
// instruction set, over many lines and prefetch distances.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  using namespace jax_superoffload;
  std::printf("best instruction set: %s\n", IsaName(BestIsa()));
  TestConversionsExhaustively();
  TestNonFiniteGradients();
  TestOutOfPlaceAndRoofline();
  TestSpeculateThenRedo();
  TestSumSquares(quick);
  TestPrefetchPolicies();
  TestStreamedSpeculationAttack();
  TestStreamedBucketOverChunks(quick);
  TestReseedBf16();
  const ElementType kGrads[] = {ElementType::kF32, ElementType::kBF16,
                                ElementType::kF16};
  const ElementType kLowps[] = {ElementType::kNone, ElementType::kF32,
                                ElementType::kBF16, ElementType::kF16};
  for (int64_t n : {0, 1, 7, 22, 64, 1000}) {
    for (ElementType grad : kGrads) {
      for (ElementType lowp : kLowps) {
        RunCase(n, Case{grad, lowp, false, 0.0f, 0.0f, 1.0f}, 32);
        RunCase(n, Case{grad, lowp, true, 0.01f, 1e-12f, 0.5f}, 32);
      }
    }
  }
  const int64_t big = quick ? (1 << 12) + 3 : (1 << 18) + 3;
  RunCase(big,
          Case{ElementType::kF32, ElementType::kBF16, false, 0.1f, 0.0f, 1.0f},
          30);
  RunCase(big,
          Case{ElementType::kBF16, ElementType::kNone, true, 0.0f, 0.0f, 0.25f},
          30);
  RunCase(
      big,
      Case{ElementType::kF16, ElementType::kF16, false, 0.01f, 1e-10f, 1.0f},
      30);
  return Report();
}
