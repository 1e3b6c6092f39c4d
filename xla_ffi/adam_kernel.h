// Grace Adam: a fused, vectorised Adam/AdamW step over fp32 master weights.
//
// Pure C++17: no XLA or Python headers, so the kernel can be tested,
// benchmarked and cross-compiled on its own. One pass per element reads the
// fp32 master weight, the gradient (f32, bf16 or f16) and both fp32 moments,
// writes the new weight and moments, and optionally a bf16/f16 copy of the new
// weight rounded to nearest even.
//
// Every instruction set computes bit-identical results: each step of the
// formula below is one correctly rounded IEEE operation (no fused
// multiply-add, no reciprocal estimates), in the same order everywhere.
//
//   g     = grad * grad_scale
//   mu    = b1 * mu + (1 - b1) * g
//   nu    = b2 * nu + (1 - b2) * (g * g)
//   mu^   = mu * c1                     (c1 = 1 / (1 - b1^t))
//         or, with Nesterov, b1 * (mu * c1_next) + (1 - b1) * (g * c1)
//   nu^   = nu * c2                     (c2 = 1 / (1 - b2^t))
//   u     = mu^ / (sqrt(nu^ + eps_root) + eps)
//   u     = u + weight_decay * master   (only when weight_decay != 0)
//   master = master - learning_rate * u
//
// and, with `keep_nonfinite`, master, mu and nu are left as they were where
// g is NaN or Inf.
//
// with t = count + 1, as in optax's scale_by_adam.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_H_

#include <cstdint>
#include <limits>

namespace jax_superoffload {

// Storage type of the gradient and of the optional low-precision copy.
enum class ElementType : int {
  kNone = 0,  // Only valid for the low-precision copy: no copy is written.
  kF32 = 1,
  kBF16 = 2,
  kF16 = 3,
};

// Instruction sets the kernel is compiled for.
enum class Isa : int {
  kScalar = 0,
  kAvx2 = 1,
  kAvx512 = 2,
  kNeon = 3,
  kSve = 4,
};

const char* IsaName(Isa isa);

// True when this binary contains `isa` and the running CPU supports it.
bool IsaAvailable(Isa isa);

// The fastest available instruction set.
Isa BestIsa();

// Software prefetch of the input streams, a few lines ahead of the loop.
//
// kT0 (`__builtin_prefetch(p, rw, 3)`, PREFETCHT0 / PRFM PLDL1KEEP) is the
// default: it matched or beat the others on both x86 vendors measured (see
// the README's bench_adam tables). kNta (locality 0) is PREFETCHNTA on x86,
// which on Intel Xeon keeps the lines out of the outer caches and halved the
// bandwidth; kNone leaves the streams to the hardware prefetchers. Every
// policy computes the same bits: a prefetch only moves cache lines.
enum class Prefetch : int {
  kNone = 0,
  kT0 = 1,
  kNta = 2,
};

inline constexpr Prefetch kDefaultPrefetch = Prefetch::kT0;

const char* PrefetchName(Prefetch prefetch);

// Parses "t0", "nta" or "none" (as PrefetchName spells them); an empty or
// null name gives kDefaultPrefetch. Returns false for anything else.
bool ParsePrefetch(const char* name, Prefetch* out);

// Hyperparameters and per-step scalars, as given by the caller: the one
// C++ form of Python's `Hyperparams` (the FFI handlers fill it from the f32
// scalars operand, laid out as kPackedScalars says).
struct AdamConfig {
  float learning_rate = 1e-3f;
  float b1 = 0.9f;
  float b2 = 0.999f;
  // 1 - b1 and 1 - b2. Callers that hold the betas in higher precision (as
  // Python floats) pass the rounded differences here, which is what optax
  // multiplies by; NaN means "compute 1 - b in fp32".
  float one_minus_b1 = std::numeric_limits<float>::quiet_NaN();
  float one_minus_b2 = std::numeric_limits<float>::quiet_NaN();
  float eps = 1e-8f;
  float eps_root = 0.0f;
  float weight_decay = 0.0f;
  float grad_scale = 1.0f;
  bool nesterov = false;
  // Leave elements whose (scaled) gradient is NaN or Inf unchanged, so that
  // a step with some invalid elements leaves them as they were.
  bool keep_nonfinite = false;
  // Steps already taken (optax's `count`); this step uses t = count + 1.
  int64_t count = 0;
};

// One set of the FFI handlers' f32 scalars operand: these AdamConfig fields
// in this order. Declared only here; the nanobind module hands the names to
// Python (`PACKED_SCALARS`), which packs its `Hyperparams` in this order.
struct PackedScalar {
  const char* name;
  float AdamConfig::*field;
};

inline constexpr PackedScalar kPackedScalars[] = {
    {"learning_rate", &AdamConfig::learning_rate},
    {"b1", &AdamConfig::b1},
    {"one_minus_b1", &AdamConfig::one_minus_b1},
    {"b2", &AdamConfig::b2},
    {"one_minus_b2", &AdamConfig::one_minus_b2},
    {"eps", &AdamConfig::eps},
    {"eps_root", &AdamConfig::eps_root},
    {"weight_decay", &AdamConfig::weight_decay},
    {"grad_scale", &AdamConfig::grad_scale},
};

inline constexpr int64_t kNumScalarsPerSet =
    sizeof(kPackedScalars) / sizeof(kPackedScalars[0]);

// An AdamConfig with its constants derived once per step: 1 - b resolved
// (never NaN) and the bias corrections.
struct AdamConstants : AdamConfig {
  float c1 = 0.0f;       // 1 / (1 - b1^t)
  float c1_next = 0.0f;  // 1 / (1 - b1^(t+1)), used by Nesterov only.
  float c2 = 0.0f;       // 1 / (1 - b2^t)
};

AdamConstants MakeAdamConstants(const AdamConfig& config);

// The buffers of one step. `*_in` and `*_out` may alias (in-place update) but
// must not partially overlap. `grad` holds `grad_type` elements; `lowp_out`
// receives a copy of the new master in `lowp_type` (rounded to nearest even
// for bf16/f16; an exact copy for f32) and is ignored when that is kNone.
struct AdamBuffers {
  int64_t size = 0;
  const float* master_in = nullptr;
  const void* grad = nullptr;
  const float* mu_in = nullptr;
  const float* nu_in = nullptr;
  float* master_out = nullptr;
  float* mu_out = nullptr;
  float* nu_out = nullptr;
  void* lowp_out = nullptr;
  ElementType grad_type = ElementType::kF32;
  ElementType lowp_type = ElementType::kNone;
  // How the loops prefetch master, mu, nu and grad (not the results).
  Prefetch prefetch = kDefaultPrefetch;
  // Write master_out, mu_out and nu_out with non-temporal (streaming)
  // stores where the instruction set has them (AVX2, AVX-512), and the
  // gradient, as fp32, to `grad_copy` (when set) the same way. For outputs
  // that are not the inputs: a plain store to a line not in cache first
  // reads it. Honoured by sum-of-squares steps on instruction sets for which
  // IsaStreams is true, whose outputs at `begin` are aligned as
  // StreamableHead requires; the values written are the same either way.
  bool stream_state = false;
  float* grad_copy = nullptr;
};

// Elements from `begin` until master_out, mu_out, nu_out and grad_copy
// (when set) are all aligned to 64 bytes (at most `end - begin`), or -1
// when no element aligns them all at once, or when the outputs are the
// inputs (streaming would evict the lines the loop has just read).
int64_t StreamableHead(const AdamBuffers& buffers, int64_t begin, int64_t end);

// StreamableHead without the in-place test: for a step whose master is read
// from elsewhere (fp32 parameters), where streaming all three outputs was
// measured faster although mu and nu are updated in place.
int64_t AlignedOutputsHead(const AdamBuffers& buffers, int64_t begin,
                           int64_t end);

// Whether AdamStepSumSquaresRange honours `stream_state` and `grad_copy`
// with `isa` (every instruction set but SVE, whose loop has no such
// variant; NEON's streams with plain stores).
bool IsaStreams(Isa isa);

// Returns an error message for invalid buffers or types, nullptr if valid.
const char* ValidateAdamBuffers(const AdamBuffers& buffers);

// Updates elements [begin, end) of `buffers` with instruction set `isa`,
// which must be available. Single-threaded: callers split the range.
void AdamStepRange(const AdamConstants& constants, const AdamBuffers& buffers,
                   int64_t begin, int64_t end, Isa isa);

// AdamStepRange that also returns the sum over [begin, end) of g * g, the
// squared scaled gradients (g = grad * grad_scale in fp32, squared in fp32,
// whether or not keep_nonfinite keeps the element), taken in the same pass.
// Each vector lane adds up to 64 squares in fp32 before they go into a
// double, so the result is within 64 * 2^-24 (typically a few 1e-8) relative
// of the exact sum of those squares; it is NaN or Inf when any g * g is.
// The order of the additions is fixed by `isa` and the range alone (not by
// threads or timing): the same call gives the same bits every time, while
// two instruction sets or two ways of splitting a range may differ in the
// last bits.
double AdamStepSumSquaresRange(const AdamConstants& constants,
                               const AdamBuffers& buffers, int64_t begin,
                               int64_t end, Isa isa);

// Convenience: the whole range with the best instruction set.
void AdamStep(const AdamConfig& config, const AdamBuffers& buffers);

// Re-seeds a master from bf16 parameters over [begin, end), in place: each
// element keeps the master where it rounds to the parameter (ties to even)
// or to a neighbouring bf16 value, or where the two are within `tolerance`,
// and becomes the parameter otherwise. Bit-identical with every `isa`.
void ReseedBf16Range(float* master, const uint16_t* params, float tolerance,
                     int64_t begin, int64_t end, Isa isa);

// The same-traffic stream: reads master, grad (f32), mu and nu and writes
// master, mu and nu with no Adam math (master += grad, mu and nu swapped),
// with the kernel's own loop structure and prefetch. It shows what the
// kernel's memory access alone costs; it is no independent limit, since it
// shares whatever the kernel gets wrong (experiments/bench_adam.py compiles
// its limit apart).
void StreamRooflineRange(const AdamBuffers& buffers, int64_t begin,
                         int64_t end);

// Elements per work chunk when a step is split across threads: large enough
// to amortise scheduling, small enough to balance a few threads.
inline constexpr int64_t kChunkElements = 1 << 18;

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_ADAM_KERNEL_H_
