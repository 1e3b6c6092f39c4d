// Definitions of ffi_support.h.

#include "xla_ffi/ffi_support.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/float_convert.h"

namespace jax_superoffload {
namespace {

// Whether two 16-bit floats are equal or adjacent. A low-precision update
// cannot always land exactly on the rounded master (a weight that crosses
// zero or more than halves), so a parameter one unit in the last place away
// is still the one the last step produced.
inline int Ordered(uint16_t x) {
  const int magnitude = x & 0x7fff;
  const int sign = x >> 15;  // 0 or 1.
  return magnitude - 2 * sign * magnitude;
}

}  // namespace

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "jax_superoffload adam_step: " + message);
}

namespace {

// The CPUs the calling thread may run on (its affinity mask, which the
// helpers it starts inherit), at least 1.
int64_t AllowedCpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

int64_t ParseThreads(const char* value) {
  if (value == nullptr || *value == '\0') return 0;
  int64_t n = 0;
  for (const char* c = value; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9' || n > 4096) return -1;
    n = 10 * n + (*c - '0');
  }
  return (n >= 1 && n <= 4096) ? n : -1;
}

int64_t OwnHelperThreads(int64_t requested, int64_t pool_threads) {
  if (requested > 0) return requested - 1;
  if (pool_threads > 1) return -1;
  return AllowedCpus() - 1;
}

ffi::Error ReadPrefetch(std::string_view name, Prefetch* out) {
  if (ParsePrefetch(std::string(name).c_str(), out)) {
    return ffi::Error::Success();
  }
  return InvalidArgument("prefetch must be t0, nta or none, not '" +
                         std::string(name) + "'");
}

bool ToElementType(ffi::DataType dtype, ElementType* out) {
  static constexpr std::pair<ffi::DataType, ElementType> kTypes[] = {
      {ffi::DataType::F32, ElementType::kF32},
      {ffi::DataType::BF16, ElementType::kBF16},
      {ffi::DataType::F16, ElementType::kF16},
  };
  return LookUp(kTypes, dtype, out);
}

ffi::Error LeafError(size_t j, const std::string& message) {
  return InvalidArgument("leaf " + std::to_string(j) + ": " + message);
}

// Operand `run * k + j` as a buffer of `n` elements (n < 0: any size).
ffi::Error GetArg(ffi::RemainingArgs& args, int64_t k, int64_t run, size_t j,
                  int64_t n, ffi::AnyBuffer* out) {
  auto buffer = args.get<ffi::AnyBuffer>(run * k + j);
  if (buffer.has_error()) return buffer.error();
  if (n >= 0 && static_cast<int64_t>(buffer->element_count()) != n) {
    return LeafError(j, "operand " + std::to_string(run) + " has " +
                            std::to_string(buffer->element_count()) +
                            " elements, expected " + std::to_string(n));
  }
  *out = *buffer;
  return ffi::Error::Success();
}

// Operand `run * k + j`, `n` elements of f32, bf16 or f16 (a gradient or a
// parameter, named by `what`): its data and element type.
ffi::Error GetTyped(ffi::RemainingArgs& args, int64_t k, int64_t run, size_t j,
                    int64_t n, const char* what, const void** data,
                    ElementType* type) {
  ffi::AnyBuffer buffer(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, run, j, n, &buffer));
  if (!ToElementType(buffer.element_type(), type)) {
    return LeafError(j, std::string(what) + " dtype must be f32, bf16 or f16");
  }
  *data = buffer.untyped_data();
  return ffi::Error::Success();
}

// The per-chunk partial sums of squares added in chunk order (independent of
// threads), into the f32[1] result.
void TotalInChunkOrder(const std::vector<double>& partial, float* sumsq) {
  double total = 0.0;
  for (double p : partial) total += p;
  *sumsq = static_cast<float>(total);
}

ffi::Error GetRet(ffi::RemainingRets& rets, int64_t k, int64_t run, size_t j,
                  int64_t n, void** data, ElementType* type) {
  auto buffer = rets.get<ffi::AnyBuffer>(run * k + j);
  if (buffer.has_error()) return buffer.error();
  if (static_cast<int64_t>((*buffer)->element_count()) != n) {
    return LeafError(j, "result " + std::to_string(run) + " has " +
                            std::to_string((*buffer)->element_count()) +
                            " elements, expected " + std::to_string(n));
  }
  if (type != nullptr && !ToElementType((*buffer)->element_type(), type)) {
    return LeafError(j, "weights dtype must be f32, bf16 or f16");
  }
  *data = (*buffer)->untyped_data();
  return ffi::Error::Success();
}

ffi::Error F32(const ffi::AnyBuffer& buffer, size_t j, const char* what) {
  if (buffer.element_type() != ffi::DataType::F32) {
    return LeafError(j, std::string(what) + " must be f32");
  }
  return ffi::Error::Success();
}

// The parameters as the source of truth: over [begin, end), `out` receives
// the master where it rounds to the parameter, or to a neighbour of it for
// 16-bit parameters (keeping its extra precision), and the parameter
// otherwise (weights loaded, surgery, an EMA swap). `out`
// may be `master`.
void ReseedRange(const float* master, const void* params, ElementType type,
                 float tolerance, float* out, int64_t begin, int64_t end,
                 Isa isa) {
  if (type == ElementType::kF32) {  // The master is the parameter itself.
    const float* p = static_cast<const float*>(params);
    if (out != master) {
      std::memcpy(out + begin, p + begin, (end - begin) * sizeof(float));
      return;
    }
    // In place, a line's worth at a time, written only where it differs:
    // STV's current row is otherwise only read, and a write would make it
    // dirty (4 B/param more traffic when the line is evicted).
    for (int64_t i = begin; i < end; i += 16) {
      const int64_t stop = std::min(end, i + 16);
      uint32_t differ = 0;
      for (int64_t j = i; j < stop; ++j) {
        uint32_t a, b;
        std::memcpy(&a, out + j, sizeof(a));
        std::memcpy(&b, p + j, sizeof(b));
        differ |= a ^ b;
      }
      if (differ != 0) {
        std::memcpy(out + i, p + i, (stop - i) * sizeof(float));
      }
    }
    return;
  }
  // Branch-free, so that the compiler vectorizes it: the range is then
  // stepped while it is still in cache, and the parameters' read is the
  // only traffic this adds.
  const uint16_t* p = static_cast<const uint16_t*>(params);
  if (type == ElementType::kBF16) {
    if (out != master) {
      std::memcpy(out + begin, master + begin, (end - begin) * sizeof(float));
    }
    ReseedBf16Range(out, p, tolerance, begin, end, isa);
    return;
  }
  for (int64_t i = begin; i < end; ++i) {
    const float m = master[i];
    const float w = F16BitsToFloat(p[i]);
    const int diff = Ordered(FloatToF16Bits(m)) - Ordered(p[i]);
    const bool same =
        (diff >= -1 && diff <= 1) || std::fabs(w - m) <= tolerance;
    out[i] = same ? m : w;
  }
}

namespace {

// A plain step whose master is written to another buffer than the one it
// reads (the parameters): the state is written with streaming stores from
// the first element at which master_out, mu_out and nu_out are all 64-byte
// aligned. A plain store to master_out would first read its line (4 more
// bytes per parameter); mu and nu, updated in place, are streamed too, as
// one instantiation of the loop streams all three. The values written are
// those of the plain step.
void StepStreamingState(const AdamConstants& constants, AdamBuffers b,
                        int64_t begin, int64_t end, Isa isa) {
  const int64_t head = IsaStreams(isa) ? AlignedOutputsHead(b, begin, end) : -1;
  if (head < 0) {
    AdamStepRange(constants, b, begin, end, isa);
    return;
  }
  AdamStepRange(constants, b, begin, begin + head, isa);
  b.stream_state = true;
  AdamStepSumSquaresRange(constants, b, begin + head, end, isa);
}

}  // namespace

// Leaf `leaf`'s step over [begin, end), adding the sum of squares to `sumsq`
// where it is set.
void StepSegmentPiece(const AdamConstants& constants, const SegmentLeaf& leaf,
                      int64_t begin, int64_t end, Isa isa, double* sumsq) {
  auto step = [&](const AdamBuffers& buffers, int64_t from, int64_t to) {
    if (sumsq != nullptr) {
      *sumsq += AdamStepSumSquaresRange(constants, buffers, from, to, isa);
    } else {
      AdamStepRange(constants, buffers, from, to, isa);
    }
  };
  const AdamBuffers& b = leaf.b;
  if (leaf.params == nullptr) return step(b, begin, end);
  AdamBuffers from = b;
  if (leaf.param_type == ElementType::kF32) {
    // fp32 parameters are the master itself: the step reads them in its
    // place, which adds no traffic (ReseedRange would copy them over).
    from.master_in = static_cast<const float*>(leaf.params);
    if (sumsq != nullptr) return step(from, begin, end);
    return StepStreamingState(constants, from, begin, end, isa);
  }
  // Re-seeded into the output and stepped there from cache.
  from.master_in = b.master_out;
  ReseedThenStep(b.master_in, leaf.params, leaf.param_type, constants,
                 b.master_out, begin, end, isa, [&](int64_t lo, int64_t hi) {
                   step(from, lo, hi);
                   return 0.0;
                 });
}

std::vector<int64_t> Starts(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t j = 0; j < sizes.size(); ++j) {
    starts[j + 1] = starts[j] + sizes[j];
  }
  return starts;
}

AdamConstants ScalarSet::Read(int64_t s) const {
  AdamConfig config;
  const float* x = scalars + s * kNumScalarsPerSet;
  for (int64_t i = 0; i < kNumScalarsPerSet; ++i) {
    config.*kPackedScalars[i].field = x[i];
  }
  config.nesterov = nesterov;
  config.keep_nonfinite = keep_nonfinite;
  config.count = count[s];
  return MakeAdamConstants(config);
}

std::vector<AdamConstants> ScalarSet::ReadAll() const {
  std::vector<AdamConstants> sets(num_sets);
  for (int64_t s = 0; s < num_sets; ++s) sets[s] = Read(s);
  return sets;
}

namespace {

ffi::Error CheckBatchedSets(int64_t num_sets, int64_t num_scalars,
                            int64_t size) {
  if (num_sets < 1 || num_scalars != num_sets * kNumScalarsPerSet) {
    return InvalidArgument("expected " + std::to_string(kNumScalarsPerSet) +
                           " scalars per count, got " +
                           std::to_string(num_scalars) + " for " +
                           std::to_string(num_sets) + " counts");
  }
  if (size % num_sets != 0) {
    return InvalidArgument("array size " + std::to_string(size) +
                           " is not a multiple of the scalar sets " +
                           std::to_string(num_sets));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CheckScalarSets(Counts count, Scalars scalars,
                           const BucketAttrs& attrs, int64_t batched_size,
                           ScalarSet* out) {
  const int64_t num_sets = static_cast<int64_t>(count.element_count());
  const int64_t num_scalars = static_cast<int64_t>(scalars.element_count());
  if (batched_size >= 0) {
    JSO_RETURN_IF_ERROR(CheckBatchedSets(num_sets, num_scalars, batched_size));
  } else if (num_sets != 1 || num_scalars != kNumScalarsPerSet) {
    return InvalidArgument(
        "expected one count and " + std::to_string(kNumScalarsPerSet) +
        " scalars, got " + std::to_string(num_sets) + " and " +
        std::to_string(num_scalars) + " (leaves cannot be batched)");
  }
  out->count = count.typed_data();
  out->scalars = scalars.typed_data();
  out->num_sets = num_sets;
  out->nesterov = attrs.nesterov;
  out->keep_nonfinite = attrs.keep_nonfinite;
  return ffi::Error::Success();
}

ffi::Error BucketSetup(Counts count, Scalars scalars, const BucketAttrs& attrs,
                       const std::vector<int64_t>& starts, SumSq* sumsq,
                       bool batched, ScalarSet* set, int64_t* num_chunks) {
  JSO_RETURN_IF_ERROR(CheckScalarSets(count, scalars, attrs,
                                      batched ? starts.back() : -1, set));
  // A batched call's sum of squares is batched too: one per set.
  if (static_cast<int64_t>((*sumsq)->element_count()) != set->num_sets) {
    return InvalidArgument("sumsq must have one element per scalar set");
  }
  *num_chunks = (starts.back() + kChunkElements - 1) / kChunkElements;
  return ffi::Error::Success();
}

}  // namespace jax_superoffload
