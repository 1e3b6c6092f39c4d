// Tests of Grace Adam with low-precision moments (lowp_moments.h) against
// references written from the definitions: the 8-bit code maps by brute
// force over their values, the step in float64.
//
//   lowp_moments_test [--quick]

#include "xla_ffi/lowp_moments.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/float_convert.h"
#include "xla_ffi/moment_codec.h"
#include "xla_ffi/test_util.h"

namespace jax_superoffload {
namespace {

// The values of a 3-mantissa-bit magnitude code with exponent bias `bias`,
// from the definition (moment_codec.h), for codes 0 .. count - 1.
std::vector<double> CodeValues(int bias, int count) {
  std::vector<double> values(count);
  for (int c = 0; c < count; ++c) {
    values[c] = c < 8 ? std::ldexp(c, -2 - bias)
                      : std::ldexp(1.0 + (c & 7) / 8.0, (c >> 3) - bias);
  }
  return values;
}

// The nearest code to y in [0, 1], ties to the even code.
int NearestCode(const std::vector<double>& values, double y) {
  int best = 0;
  for (int c = 1; c < static_cast<int>(values.size()); ++c) {
    const double d = std::fabs(values[c] - y);
    const double e = std::fabs(values[best] - y);
    if (d < e || (d == e && c % 2 == 0)) best = c;
  }
  return best;
}

// Encoding is rounding to the nearest code value (ties to even), decoding
// is exact, over every code and over magnitudes spread across the octaves,
// midpoints between codes included.
void TestCodeMaps(bool quick) {
  const std::vector<double> mu = CodeValues(15, 128);
  const std::vector<double> nu = CodeValues(31, 256);
  bool exact = true;
  for (int c = 0; c < 128; ++c) {
    exact &= DecodeMu(static_cast<uint8_t>(c)) == static_cast<float>(mu[c]);
    exact &=
        DecodeMu(static_cast<uint8_t>(c | 0x80)) == -static_cast<float>(mu[c]);
  }
  for (int c = 0; c < 256; ++c) {
    exact &= DecodeNu(static_cast<uint8_t>(c)) == static_cast<float>(nu[c]);
  }
  Check(exact, "codes decode to their values exactly", "");
  uint64_t rng = 5;
  const int n = quick ? 20000 : 200000;
  bool mu_ok = true, nu_ok = true;
  for (int i = 0; i < n; ++i) {
    // Uniform exponents down to 2^-40, and every fifth a midpoint.
    float y = static_cast<float>(
        std::ldexp(1.0 + Unit(rng), -1 - static_cast<int>(Unit(rng) * 40)));
    if (i % 5 == 0) {
      const int c = static_cast<int>(Unit(rng) * 247);
      y = static_cast<float>((nu[c] + nu[c + 1]) / 2);
    }
    if (y > 1.0f) y = 1.0f;
    const uint32_t mu_code = static_cast<uint32_t>(NearestCode(mu, y));
    const uint32_t nu_code = static_cast<uint32_t>(NearestCode(nu, y));
    mu_ok &= EncodeMu(y) == mu_code && EncodeMu(-y) == (mu_code | 0x80u);
    nu_ok &= EncodeNu(y) == nu_code;
  }
  Check(mu_ok, "mu codes are the nearest value, ties to even", "");
  Check(nu_ok, "nu codes are the nearest value, ties to even", "");
  Check(EncodeMu(1.0f) == 120u && EncodeNu(1.0f) == 248u, "1.0 codes", "");
  Check(EncodeNu(std::nanf("")) == 0u && EncodeMu(std::nanf("")) == 0u &&
            EncodeMu(-std::nanf("")) == 0u,
        "NaN of either sign encodes as 0", "");
}

struct Format {
  MomentFormat mu, nu;
};

// Storage of one moment in `format`: bytes and per-block scales.
struct Moment {
  MomentFormat format;
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  Moment(MomentFormat f, int64_t n)
      : format(f),
        bytes(n * (f == MomentFormat::kF32    ? 4
                   : f == MomentFormat::kBF16 ? 2
                                              : 1)),
        scales((n + kQuantBlock - 1) / kQuantBlock, 0.0f) {}
  // Element i, dequantized (as the kernel reads it).
  float Get(int64_t i, bool is_mu) const {
    switch (format) {
      case MomentFormat::kF32: {
        float x;
        std::memcpy(&x, bytes.data() + 4 * i, 4);
        return x;
      }
      case MomentFormat::kBF16: {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        return Bf16BitsToFloat(h);
      }
      default:
        return (is_mu ? DecodeMu(bytes[i]) : DecodeNu(bytes[i])) *
               scales[i / kQuantBlock];
    }
  }
};

struct Setup {
  int64_t n;
  Format format;
  ElementType grad_type;
  bool nesterov;
  float weight_decay;
};

struct State {
  std::vector<float> master;
  Moment mu, nu;
  std::vector<uint16_t> lowp;
};

LowpMomentBuffers Buffers(State& s, const Setup& setup, const void* grad) {
  LowpMomentBuffers b;
  b.size = setup.n;
  b.master_in = b.master_out = s.master.data();
  b.grad = grad;
  b.grad_type = setup.grad_type;
  b.mu_format = setup.format.mu;
  b.nu_format = setup.format.nu;
  b.mu_in = b.mu_out = s.mu.bytes.data();
  b.nu_in = b.nu_out = s.nu.bytes.data();
  b.mu_scale_in = b.mu_scale_out = s.mu.scales.data();
  b.nu_scale_in = b.nu_scale_out = s.nu.scales.data();
  b.lowp_out = s.lowp.data();
  b.lowp_type = ElementType::kBF16;
  return b;
}

// One float64 AdamW step of element i from dequantized state.
struct Ref {
  double master, mu, nu, master_tol, mu_tol, nu_tol;
};

Ref ReferenceStep(const AdamConfig& c, double g, double master, double mu,
                  double nu) {
  const double t = static_cast<double>(c.count + 1);
  const double b1 = c.b1, b2 = c.b2;
  Ref r;
  r.mu = b1 * mu + (1 - b1) * g;
  r.nu = b2 * nu + (1 - b2) * g * g;
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  const double mu_hat =
      c.nesterov ? b1 * r.mu / (1 - std::pow(b1, t + 1)) + (1 - b1) * g / bc1
                 : r.mu / bc1;
  const double den = std::sqrt(r.nu / bc2) + c.eps;
  r.master =
      master - c.learning_rate * (mu_hat / den + c.weight_decay * master);
  // fp32 rounding of the kernel's few operations, relative to the terms.
  const double u = 0x1.0p-24;
  r.mu_tol = 4 * u * (std::fabs(b1 * mu) + std::fabs((1 - b1) * g));
  r.nu_tol = 4 * u * (b2 * nu + (1 - b2) * g * g);
  const double mu_hat_mag = (std::fabs(b1 * mu) + std::fabs((1 - b1) * g)) /
                            bc1 * (c.nesterov ? 2 : 1);
  r.master_tol = 8 * u *
                 (std::fabs(master) +
                  c.learning_rate *
                      (mu_hat_mag / den + std::fabs(c.weight_decay * master)));
  return r;
}

double Bf16Ulp(double x) {
  int e;
  std::frexp(x == 0 ? 1e-38 : x, &e);
  return std::ldexp(1.0, e - 8);
}

// Whether a stored moment `got` (its codes/scale or bf16) is the reference
// value `want` (tolerance `tol` from fp32 rounding) rounded by `format`.
// For 8-bit, `scale` and `want_scale` are the block's stored and float64
// scales; adjacent codes are accepted only within `tol` of a tie.
bool StoredMatches(MomentFormat format, bool is_mu, const Moment& m, int64_t i,
                   double want, double tol, double want_scale,
                   double scale_tol) {
  if (format == MomentFormat::kF32) {
    return std::fabs(m.Get(i, is_mu) - want) <= tol;
  }
  if (format == MomentFormat::kBF16) {
    return std::fabs(m.Get(i, is_mu) - want) <= 0.5 * Bf16Ulp(want) + tol;
  }
  const float scale = m.scales[i / kQuantBlock];
  if (std::fabs(scale - want_scale) > scale_tol) return false;
  static const std::vector<double> mu_values = CodeValues(15, 128);
  static const std::vector<double> nu_values = CodeValues(31, 256);
  const std::vector<double>& values = is_mu ? mu_values : nu_values;
  const double y = want_scale == 0 ? 0 : std::fabs(want) / want_scale;
  const int code = is_mu ? (m.bytes[i] & 0x7f) : m.bytes[i];
  const int nearest = NearestCode(values, y);
  if (code == nearest) return true;
  if (std::abs(code - nearest) != 1) return false;
  const double mid = (values[code] + values[nearest]) / 2;
  const double slack =
      want_scale == 0 ? 0 : (tol + scale_tol) / want_scale + 0x1.0p-23 * y;
  return std::fabs(y - mid) <= slack;
}

// Gradients of one step, shrinking by 2^-3 a step, as fp32 and as bf16.
struct StepGrads {
  std::vector<float> g32;
  std::vector<uint16_t> g16;
};

StepGrads RandomGrads(int64_t n, int step, uint64_t& rng) {
  StepGrads out{std::vector<float>(n), std::vector<uint16_t>(n)};
  const double octave = std::ldexp(1.0, -3 * step);  // Shrinking.
  for (int64_t i = 0; i < n; ++i) {
    const double g = (Unit(rng) - 0.5) * octave *
                     std::ldexp(1.0, static_cast<int>(Unit(rng) * 10) - 5);
    out.g32[i] = static_cast<float>(g);
    out.g16[i] = FloatToBf16Bits(out.g32[i]);
  }
  return out;
}

// Whether `o` holds the same bits as `s`.
bool SameState(const State& o, const State& s) {
  return o.master == s.master && o.lowp == s.lowp && o.mu.bytes == s.mu.bytes &&
         o.nu.bytes == s.nu.bytes &&
         std::memcmp(o.mu.scales.data(), s.mu.scales.data(),
                     4 * s.mu.scales.size()) == 0 &&
         std::memcmp(o.nu.scales.data(), s.nu.scales.data(),
                     4 * s.nu.scales.size()) == 0;
}

// Whether the stepped state `s` is the float64 step `refs` as its formats
// store it, block by block (an 8-bit block's scale from its largest value).
bool MatchesReference(const Format& format, const State& s,
                      const std::vector<Ref>& refs) {
  const int64_t n = static_cast<int64_t>(refs.size());
  bool close = true;
  for (int64_t b = 0; b < n; b += kQuantBlock) {
    const int64_t e = std::min(n, b + kQuantBlock);
    double mu_scale = 0, nu_scale = 0, mu_stol = 0, nu_stol = 0;
    for (int64_t i = b; i < e; ++i) {
      if (std::fabs(refs[i].mu) > mu_scale) mu_scale = std::fabs(refs[i].mu);
      if (refs[i].nu > nu_scale) nu_scale = refs[i].nu;
      mu_stol = std::max(mu_stol, refs[i].mu_tol);
      nu_stol = std::max(nu_stol, refs[i].nu_tol);
    }
    for (int64_t i = b; i < e; ++i) {
      close &= std::fabs(s.master[i] - refs[i].master) <= refs[i].master_tol;
      close &= StoredMatches(format.mu, true, s.mu, i, refs[i].mu,
                             refs[i].mu_tol, mu_scale, mu_stol);
      close &= StoredMatches(format.nu, false, s.nu, i, refs[i].nu,
                             refs[i].nu_tol, nu_scale, nu_stol);
    }
  }
  return close;
}

// Six steps of one setup on the scalar path, on every other instruction set
// and split at a block boundary; checks the scalar state against float64
// and the others against its bits.
void RunSteps(const Setup& setup, const char* context) {
  const int64_t n = setup.n;
  uint64_t rng = 17 + n;
  State s{std::vector<float>(n), Moment(setup.format.mu, n),
          Moment(setup.format.nu, n), std::vector<uint16_t>(n)};
  for (int64_t i = 0; i < n; ++i)
    s.master[i] = static_cast<float>(Unit(rng) - 0.5);
  // The other instruction sets' states, stepped alongside.
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
    if (IsaAvailable(isa)) isas.push_back(isa);
  }
  std::vector<State> others(isas.size(), s);
  State split = s;
  bool close = true, identical = true;
  for (int step = 0; step < 6; ++step) {
    const StepGrads grads = RandomGrads(n, step, rng);
    const bool f32 = setup.grad_type == ElementType::kF32;
    const void* grad = f32 ? static_cast<const void*>(grads.g32.data())
                           : static_cast<const void*>(grads.g16.data());
    AdamConfig config;
    config.learning_rate = 1e-2f;
    config.nesterov = setup.nesterov;
    config.weight_decay = setup.weight_decay;
    config.count = step;
    const AdamConstants k = MakeAdamConstants(config);
    std::vector<Ref> refs(n);
    for (int64_t i = 0; i < n; ++i) {
      const double g = f32 ? grads.g32[i] : Bf16BitsToFloat(grads.g16[i]);
      refs[i] = ReferenceStep(config, g, s.master[i], s.mu.Get(i, true),
                              s.nu.Get(i, false));
    }
    LowpAdamStepRange(k, Buffers(s, setup, grad), 0, n, Isa::kScalar, false);
    for (size_t j = 0; j < isas.size(); ++j) {
      LowpAdamStepRange(k, Buffers(others[j], setup, grad), 0, n, isas[j],
                        false);
    }
    const int64_t cut = n > kQuantBlock ? kQuantBlock : n;
    LowpAdamStepRange(k, Buffers(split, setup, grad), 0, cut, Isa::kScalar,
                      false);
    LowpAdamStepRange(k, Buffers(split, setup, grad), cut, n, Isa::kScalar,
                      false);
    identical &= SameState(split, s);
    for (const State& o : others) identical &= SameState(o, s);
    close &= MatchesReference(setup.format, s, refs);
  }
  Check(close, "steps match the float64 reference, rounded", context);
  Check(identical, "same bits from every ISA and range split", context);
}

// Several steps of every format, gradient type and option, each checked
// against the float64 step from the kernel's own previous (dequantized)
// state; and the same bits from every instruction set and range split.
void TestSteps(bool quick) {
  const Format formats[] = {{MomentFormat::kBF16, MomentFormat::kF32},
                            {MomentFormat::kBF16, MomentFormat::kBF16},
                            {MomentFormat::kQ8, MomentFormat::kQ8}};
  const int64_t sizes[] = {1, 255, 257, 3001};
  for (const Format& format : formats) {
    for (int64_t n : sizes) {
      for (ElementType grad_type : {ElementType::kF32, ElementType::kBF16}) {
        for (bool nesterov : {false, true}) {
          if (quick && nesterov && n != 3001) continue;
          const Setup setup{n, format, grad_type, nesterov,
                            nesterov ? 0.0f : 1e-2f};
          char context[96];
          std::snprintf(context, sizeof(context),
                        "mu=%s nu=%s n=%lld grad=%d nesterov=%d",
                        MomentFormatName(format.mu),
                        MomentFormatName(format.nu), static_cast<long long>(n),
                        static_cast<int>(grad_type), nesterov);
          RunSteps(setup, context);
        }
      }
    }
  }
}

// A NaN gradient poisons its own 8-bit block only (scale NaN, codes 0).
void TestNonFiniteBlock() {
  const int64_t n = 3 * kQuantBlock;
  const Setup setup{n,
                    {MomentFormat::kQ8, MomentFormat::kQ8},
                    ElementType::kF32,
                    false,
                    0.0f};
  State s{std::vector<float>(n, 0.5f), Moment(MomentFormat::kQ8, n),
          Moment(MomentFormat::kQ8, n), std::vector<uint16_t>(n)};
  std::vector<float> g(n, 1e-3f);
  g[kQuantBlock + 7] = std::nanf("");
  AdamConfig config;
  LowpAdamStepRange(MakeAdamConstants(config), Buffers(s, setup, g.data()), 0,
                    n, BestIsa(), false);
  bool ok = std::isnan(s.mu.scales[1]) && std::isnan(s.nu.scales[1]) &&
            s.mu.scales[0] > 0 && s.mu.scales[2] > 0;
  for (int64_t i = kQuantBlock; i < 2 * kQuantBlock; ++i) {
    ok &= s.mu.bytes[i] == 0 && s.nu.bytes[i] == 0 &&
          std::isnan(s.mu.Get(i, true));
  }
  Check(ok, "a NaN poisons its own block only", "");
}

}  // namespace
}  // namespace jax_superoffload

int main(int argc, char** argv) {
  using namespace jax_superoffload;
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::printf("best instruction set: %s\n", IsaName(BestIsa()));
  TestCodeMaps(quick);
  TestSteps(quick);
  TestNonFiniteBlock();
  return Report();
}
