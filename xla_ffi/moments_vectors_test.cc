// Steps of low-precision moments against the NumPy float64 reference, on
// every instruction set this build has (the NEON and SVE builds run under
// qemu in CI). The vectors and what each output may be come from
// tests/moments_vectors.py (the layout is described there); this test only
// steps the inputs and checks each output against its allowed interval.
//
//   moments_vectors_test [PATH]   (default: JSO_MOMENTS_VECTORS)

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/float_convert.h"
#include "xla_ffi/lowp_moments.h"
#include "xla_ffi/moment_codec.h"

#ifndef JSO_MOMENTS_VECTORS
#define JSO_MOMENTS_VECTORS "xla_ffi/testdata/moments_vectors.bin"
#endif

namespace jax_superoffload {
namespace {

// Reads the little-endian vectors file front to back.
class Reader {
 public:
  explicit Reader(std::vector<char> data) : data_(std::move(data)) {}

  template <class T>
  std::vector<T> Take(int64_t count) {
    std::vector<T> out(count);
    const size_t bytes = sizeof(T) * count;
    if (pos_ + bytes > data_.size()) {
      ok_ = false;
      return out;
    }
    if (bytes > 0) std::memcpy(out.data(), data_.data() + pos_, bytes);
    pos_ += bytes;
    return out;
  }
  template <class T>
  T One() {
    std::vector<T> x = Take<T>(1);
    return x[0];
  }
  bool ok() const { return ok_; }
  bool done() const { return pos_ == data_.size(); }

 private:
  std::vector<char> data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

int64_t Blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// A moment as stored (bytes, and scales for 8-bit) and what the new one
// may be: [lo, hi] per element (f32, bf16), or per block the scale's
// interval and per element the code magnitude's and the signs allowed.
struct Moment {
  MomentFormat format;
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  std::vector<double> lo, hi;
  std::vector<uint8_t> finite, code_lo, code_hi, neg_ok, pos_ok;
  std::vector<double> scale_lo, scale_hi;

  void ReadInput(Reader& r, int64_t n) {
    const int width = format == MomentFormat::kF32    ? 4
                      : format == MomentFormat::kBF16 ? 2
                                                      : 1;
    bytes = r.Take<uint8_t>(width * n);
    scales = r.Take<float>(format == MomentFormat::kQ8 ? Blocks(n) : 0);
  }

  void ReadExpectation(Reader& r, int64_t n) {
    if (format != MomentFormat::kQ8) {
      lo = r.Take<double>(n);
      hi = r.Take<double>(n);
      return;
    }
    finite = r.Take<uint8_t>(Blocks(n));
    scale_lo = r.Take<double>(Blocks(n));
    scale_hi = r.Take<double>(Blocks(n));
    code_lo = r.Take<uint8_t>(n);
    code_hi = r.Take<uint8_t>(n);
    neg_ok = r.Take<uint8_t>(n);
    pos_ok = r.Take<uint8_t>(n);
  }

  // The first element (or block) that is not allowed, or -1.
  int64_t FirstBad(const std::vector<uint8_t>& got_bytes,
                   const std::vector<float>& got_scales, bool is_mu) const {
    const int64_t n = static_cast<int64_t>(lo.size() + code_lo.size());
    for (int64_t i = 0; i < n; ++i) {
      if (format == MomentFormat::kF32) {
        float x;
        std::memcpy(&x, got_bytes.data() + 4 * i, 4);
        if (!(lo[i] <= x && x <= hi[i])) return i;
        continue;
      }
      if (format == MomentFormat::kBF16) {
        uint16_t h;
        std::memcpy(&h, got_bytes.data() + 2 * i, 2);
        const double x = Bf16BitsToFloat(h);
        if (!(lo[i] <= x && x <= hi[i])) return i;
        continue;
      }
      const int64_t b = i / kQuantBlock;
      const double scale = got_scales[b];
      if (!finite[b]) {
        if (!std::isnan(scale) && !std::isinf(scale)) return i;
        continue;
      }
      if (!(scale_lo[b] <= scale && scale <= scale_hi[b])) return i;
      const int code = got_bytes[i];
      const int magnitude = is_mu ? (code & 0x7f) : code;
      const bool negative = is_mu && code >= 0x80;
      const bool sign_ok = magnitude == 0 || (negative ? neg_ok[i] : pos_ok[i]);
      if (magnitude < code_lo[i] || magnitude > code_hi[i] || !sign_ok) {
        return i;
      }
    }
    return -1;
  }
};

struct Case {
  MomentFormat mu_format, nu_format;
  bool nesterov;
  AdamConfig config;
  int64_t n;
  std::vector<float> master, grad;
  Moment mu, nu;
  std::vector<double> master_lo, master_hi;
};

bool ReadCase(Reader& r, Case* c) {
  const std::vector<uint8_t> head = r.Take<uint8_t>(4);
  c->mu_format = static_cast<MomentFormat>(head[0]);
  c->nu_format = static_cast<MomentFormat>(head[1]);
  c->nesterov = head[2] != 0;
  const uint32_t count = r.One<uint32_t>();
  const std::vector<float> s = r.Take<float>(8);
  c->config.learning_rate = s[0];
  c->config.b1 = s[1];
  c->config.one_minus_b1 = s[2];
  c->config.b2 = s[3];
  c->config.one_minus_b2 = s[4];
  c->config.eps = s[5];
  c->config.eps_root = s[6];
  c->config.weight_decay = s[7];
  c->config.nesterov = c->nesterov;
  c->config.count = count;
  c->n = static_cast<int64_t>(r.One<uint64_t>());
  if (!r.ok() || c->n < 0 || c->n > (int64_t{1} << 26)) return false;
  c->master = r.Take<float>(c->n);
  c->grad = r.Take<float>(c->n);
  c->mu.format = c->mu_format;
  c->nu.format = c->nu_format;
  c->mu.ReadInput(r, c->n);
  c->nu.ReadInput(r, c->n);
  c->master_lo = r.Take<double>(c->n);
  c->master_hi = r.Take<double>(c->n);
  c->mu.ReadExpectation(r, c->n);
  c->nu.ReadExpectation(r, c->n);
  return r.ok();
}

// Steps a copy of the case's inputs on `isa`; returns what is wrong, or "".
std::string StepAndCheck(const Case& c, Isa isa) {
  std::vector<float> master = c.master;
  std::vector<uint8_t> mu = c.mu.bytes, nu = c.nu.bytes;
  std::vector<float> mu_scales = c.mu.scales, nu_scales = c.nu.scales;
  LowpMomentBuffers b;
  b.size = c.n;
  b.master_in = b.master_out = master.data();
  b.grad = c.grad.data();
  b.grad_type = ElementType::kF32;
  b.mu_format = c.mu_format;
  b.nu_format = c.nu_format;
  b.mu_in = b.mu_out = mu.data();
  b.nu_in = b.nu_out = nu.data();
  b.mu_scale_in = b.mu_scale_out = mu_scales.data();
  b.nu_scale_in = b.nu_scale_out = nu_scales.data();
  LowpAdamStepRange(MakeAdamConstants(c.config), b, 0, c.n, isa, false);
  for (int64_t i = 0; i < c.n; ++i) {
    if (!(c.master_lo[i] <= master[i] && master[i] <= c.master_hi[i])) {
      return "master element " + std::to_string(i);
    }
  }
  if (int64_t i = c.mu.FirstBad(mu, mu_scales, true); i >= 0) {
    return "mu element " + std::to_string(i);
  }
  if (int64_t i = c.nu.FirstBad(nu, nu_scales, false); i >= 0) {
    return "nu element " + std::to_string(i);
  }
  return "";
}

int Run(const char* path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    std::printf("FAILED: cannot read %s\n", path);
    return 1;
  }
  Reader r(std::vector<char>((std::istreambuf_iterator<char>(file)),
                             std::istreambuf_iterator<char>()));
  const std::vector<char> magic = r.Take<char>(8);
  const uint32_t cases = r.One<uint32_t>();
  if (!r.ok() || std::memcmp(magic.data(), "JSOMVEC1", 8) != 0) {
    std::printf("FAILED: %s is not a vectors file\n", path);
    return 1;
  }
  int passed = 0, failed = 0;
  for (uint32_t k = 0; k < cases; ++k) {
    Case c;
    if (!ReadCase(r, &c)) {
      std::printf("FAILED: case %u is truncated\n", k);
      return 1;
    }
    for (Isa isa :
         {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon, Isa::kSve}) {
      if (!IsaAvailable(isa)) continue;
      const std::string bad = StepAndCheck(c, isa);
      if (bad.empty()) {
        ++passed;
        continue;
      }
      ++failed;
      std::printf("FAILED: case %u (mu %s, nu %s, n %lld) on %s: %s\n", k,
                  MomentFormatName(c.mu_format), MomentFormatName(c.nu_format),
                  static_cast<long long>(c.n), IsaName(isa), bad.c_str());
    }
  }
  if (!r.done()) {
    std::printf("FAILED: bytes left after %u cases\n", cases);
    ++failed;
  }
  std::printf("%u cases; %d passed, %d failed\n", cases, passed, failed);
  return failed == 0 && passed > 0 ? 0 : 1;
}

}  // namespace
}  // namespace jax_superoffload

int main(int argc, char** argv) {
  return jax_superoffload::Run(
      argc > 1 && argv[1][0] != '-' ? argv[1] : JSO_MOMENTS_VECTORS);
}
