// The XLA FFI handler of Grace Adam with low-precision moments
// (lowp_moments.h): one bucket of leaves, each with its own fp32 master and
// its bf16 or 8-bit blockwise moments, shaped like its parameter.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/stream_launch.h"
#include "xla_ffi/lowp_moments.h"

namespace ffi = xla::ffi;

namespace jax_superoffload {
namespace {

// A moment's storage format from its buffer's dtype.
bool ToMomentFormat(ffi::DataType dtype, MomentFormat* out) {
  switch (dtype) {
    case ffi::DataType::F32:
      *out = MomentFormat::kF32;
      return true;
    case ffi::DataType::BF16:
      *out = MomentFormat::kBF16;
      return true;
    case ffi::DataType::U8:
      *out = MomentFormat::kQ8;
      return true;
    default:
      return false;
  }
}

int64_t NumBlocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// The operand and result runs of one call, in order (see the handler).
struct LowpRuns {
  bool quantized;
  bool reseed;
  bool copy_weights;
  int64_t mu_scale() const { return 3; }
  int64_t nu_scale() const { return 4; }
  int64_t grad() const { return quantized ? 5 : 3; }
  int64_t params() const { return grad() + 1; }
  int64_t weights() const { return quantized ? 5 : 3; }
  int64_t args() const { return params() + (reseed ? 1 : 0); }
  int64_t rets() const { return weights() + (copy_weights ? 1 : 0); }
};

// Leaf j's state: master (f32), mu and nu (f32, bf16 or u8 codes) and, for
// 8-bit moments, their f32 scales (one per block of kQuantBlock).
ffi::Error GetLowpState(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                        const LowpRuns& runs, int64_t k, size_t j,
                        LowpMomentBuffers* b) {
  ffi::AnyBuffer master(nullptr), mu(nullptr), nu(nullptr);
  if (ffi::Error e = GetArg(args, k, 0, j, -1, &master); e.failure()) return e;
  if (ffi::Error e = F32(master, j, "master"); e.failure()) return e;
  const int64_t n = static_cast<int64_t>(master.element_count());
  if (ffi::Error e = GetArg(args, k, 1, j, n, &mu); e.failure()) return e;
  if (ffi::Error e = GetArg(args, k, 2, j, n, &nu); e.failure()) return e;
  if (!ToMomentFormat(mu.element_type(), &b->mu_format) ||
      !ToMomentFormat(nu.element_type(), &b->nu_format) ||
      !LowpFormatsSupported(b->mu_format, b->nu_format) ||
      (b->mu_format == MomentFormat::kQ8) != runs.quantized) {
    return LeafError(j, std::string("moments must be (bf16, f32), (bf16, "
                                    "bf16)") +
                            (runs.quantized ? " or (u8, u8) with scales"
                                            : ""));
  }
  b->size = n;
  b->master_in = static_cast<const float*>(master.untyped_data());
  b->mu_in = mu.untyped_data();
  b->nu_in = nu.untyped_data();
  void* out = nullptr;
  if (ffi::Error e = GetRet(rets, k, 0, j, n, &out); e.failure()) return e;
  b->master_out = static_cast<float*>(out);
  if (ffi::Error e = GetRet(rets, k, 1, j, n, &b->mu_out); e.failure()) {
    return e;
  }
  if (ffi::Error e = GetRet(rets, k, 2, j, n, &b->nu_out); e.failure()) {
    return e;
  }
  if (!runs.quantized) return ffi::Error::Success();
  const int64_t blocks = NumBlocks(n);
  const float** scales_in[2] = {&b->mu_scale_in, &b->nu_scale_in};
  float** scales_out[2] = {&b->mu_scale_out, &b->nu_scale_out};
  const int64_t run[2] = {runs.mu_scale(), runs.nu_scale()};
  for (int m = 0; m < 2; ++m) {
    ffi::AnyBuffer scale(nullptr);
    if (ffi::Error e = GetArg(args, k, run[m], j, blocks, &scale);
        e.failure()) {
      return e;
    }
    if (ffi::Error e = F32(scale, j, "scales"); e.failure()) return e;
    *scales_in[m] = static_cast<const float*>(scale.untyped_data());
    if (ffi::Error e = GetRet(rets, k, run[m], j, blocks, &out); e.failure()) {
      return e;
    }
    *scales_out[m] = static_cast<float*>(out);
  }
  return ffi::Error::Success();
}

// Leaf j's buffers: its state, gradient, optional weights copy and
// optional parameters (`params`, `param_type`).
ffi::Error GetLowpLeaf(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                       const LowpRuns& runs, int64_t k, size_t j,
                       LowpMomentBuffers* b, const void** params,
                       ElementType* param_type) {
  if (ffi::Error e = GetLowpState(args, rets, runs, k, j, b); e.failure()) {
    return e;
  }
  const int64_t n = b->size;
  if (ffi::Error e = GetTyped(args, k, runs.grad(), j, n, "gradient", &b->grad,
                              &b->grad_type);
      e.failure()) {
    return e;
  }
  if (runs.copy_weights) {
    if (ffi::Error e = GetRet(rets, k, runs.weights(), j, n, &b->lowp_out,
                              &b->lowp_type);
        e.failure()) {
      return e;
    }
  }
  if (runs.reseed) {
    if (ffi::Error e = GetTyped(args, k, runs.params(), j, n, "parameter",
                                params, param_type);
        e.failure()) {
      return e;
    }
  }
  if (const char* error = ValidateLowpMomentBuffers(*b)) {
    return LeafError(j, error);
  }
  return ffi::Error::Success();
}

// Leaf `b`'s step over [begin, end) (block-aligned for 8-bit moments),
// starting from `params` where the master no longer rounds to them.
double StepLowpPiece(const AdamConstants& constants, const LowpMomentBuffers& b,
                     const void* params, ElementType param_type,
                     int64_t begin, int64_t end, Isa isa, bool sum_squares) {
  if (params == nullptr) {
    return LowpAdamStepRange(constants, b, begin, end, isa, sum_squares);
  }
  LowpMomentBuffers from = b;
  if (param_type == ElementType::kF32) {  // The parameters are the master.
    from.master_in = static_cast<const float*>(params);
    return LowpAdamStepRange(constants, from, begin, end, isa, sum_squares);
  }
  // Re-seeded into the output and stepped there from cache.
  from.master_in = b.master_out;
  return ReseedThenStep(b.master_in, params, param_type, constants,
                        b.master_out, begin, end, isa,
                        [&](int64_t lo, int64_t hi) {
                          return LowpAdamStepRange(constants, from, lo, hi,
                                                   isa, sum_squares);
                        });
}

// One bucket of k leaves with low-precision moments. Operands: the count
// and scalars, then runs of k: masters (f32), mu, nu (bf16 and f32, bf16
// and bf16, or u8 and u8), with `quantized` mu scales and nu scales (f32,
// one per block of kQuantBlock), gradients (f32, bf16 or f16) and, with
// `reseed`, the parameters the step starts from. Results: the sum of the
// squared scaled gradients (f32[1], zero unless `compute_sumsq`), the new
// masters, mu, nu (and scales), aliased to their operands, and optionally
// the new weights in the parameters' dtypes. Work is split in fixed chunks
// over the leaves laid end to end, each leaf padded to whole blocks, so
// that a piece of a leaf starts on a block and nothing depends on the
// number of threads. `skip` (s32[1]) nonzero: no step (STV dropped it);
// the state is left as it is and the weights are not written.
ffi::Error AdamStepLowpSegments(
    Launch& launch, ffi::Buffer<ffi::S32> count,
    ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> skip,
    ffi::RemainingArgs args,
    ffi::ResultBuffer<ffi::F32> sumsq, ffi::RemainingRets rets,
    bool nesterov, bool keep_nonfinite, bool compute_sumsq,
    int64_t num_leaves, bool reseed, bool quantized) {
  LowpRuns runs{quantized, reseed, false};
  const LeafRuns leaf_runs(num_leaves, args.size(), rets.size());
  runs.copy_weights = leaf_runs.CopiesWeights(runs.weights());
  if (ffi::Error e = leaf_runs.Expect(runs.args(), runs.rets()); e.failure()) {
    return e;
  }
  const int64_t k = leaf_runs.k();
  Prefetch prefetch;
  if (ffi::Error e = ReadEnvironment(&prefetch); e.failure()) return e;
  std::vector<LowpMomentBuffers> leaves(k);
  std::vector<const void*> params(k, nullptr);
  std::vector<ElementType> param_types(k, ElementType::kF32);
  std::vector<int64_t> padded(k);
  for (int64_t j = 0; j < k; ++j) {
    if (ffi::Error e = GetLowpLeaf(args, rets, runs, k, j, &leaves[j],
                                   &params[j], &param_types[j]);
        e.failure()) {
      return e;
    }
    leaves[j].prefetch = prefetch;
    padded[j] = NumBlocks(leaves[j].size) * kQuantBlock;
  }
  ScalarSet set;
  const std::vector<int64_t> starts = Starts(padded);
  int64_t num_chunks = 0;
  if (ffi::Error error = BucketSetup(count, scalars, nesterov, keep_nonfinite,
                                     starts, sumsq, &set, &num_chunks);
      error.failure()) {
    return error;
  }
  if (skip.element_count() != 1) return InvalidArgument("skip is a scalar");
  const int32_t* skip_data = skip.typed_data();
  float* sumsq_out = sumsq->typed_data();
  using Role = Touched::Role;
  std::vector<Touched> touched = {
      Touch(set.count, 4, Role::kInput),
      Touch(set.scalars, 4 * kNumScalarsPerSet, Role::kInput),
      Touch(skip_data, 4, Role::kInput), Touch(sumsq_out, 4, Role::kOutput)};
  for (int64_t j = 0; j < k; ++j) {
    LowpMomentBuffers& b = leaves[j];
    // State is only checked, never staged: its size does not matter here.
    for (const void** x : {reinterpret_cast<const void**>(&b.master_in),
                           &b.mu_in, &b.nu_in,
                           reinterpret_cast<const void**>(&b.mu_scale_in),
                           reinterpret_cast<const void**>(&b.nu_scale_in)}) {
      touched.push_back(Touch(*x, 1, Role::kState));
    }
    for (void** x : {reinterpret_cast<void**>(&b.master_out), &b.mu_out,
                     &b.nu_out, reinterpret_cast<void**>(&b.mu_scale_out),
                     reinterpret_cast<void**>(&b.nu_scale_out)}) {
      touched.push_back(Touch(*x, 1, Role::kState));
    }
    touched.push_back(
        Touch(b.grad, ElementBytes(b.grad_type, b.size), Role::kInput));
    touched.push_back(
        Touch(b.lowp_out, ElementBytes(b.lowp_type, b.size), Role::kOutput));
    touched.push_back(Touch(params[j], ElementBytes(param_types[j], b.size),
                            Role::kInput));
  }
  if (ffi::Error error = launch.Place(touched); error.failure()) return error;
  Work work = [=](Workers workers) {
    if (skip_data[0] != 0) {
      *sumsq_out = 0.0f;
      return ffi::Error::Success();
    }
    const AdamConstants constants = set.Read();
    std::vector<double> partial(num_chunks, 0.0);
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts, [&](size_t j, int64_t begin, int64_t end,
                                      int64_t chunk) {
      end = std::min(end, leaves[j].size);  // The padding is not stepped.
      if (begin >= end) return;
      partial[chunk] +=
          StepLowpPiece(constants, leaves[j], params[j], param_types[j], begin,
                        end, isa, compute_sumsq);
    });
    TotalInChunkOrder(partial, sumsq_out);
    return ffi::Error::Success();
  };
  return launch.Run(std::move(work));
}

template <class Context>
auto LowpSegmentsBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .RemainingArgs()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .RemainingRets()
      .template Attr<bool>("nesterov")
      .template Attr<bool>("keep_nonfinite")
      .template Attr<bool>("compute_sumsq")
      .template Attr<int64_t>("num_leaves")
      .template Attr<bool>("reseed")
      .template Attr<bool>("quantized");
}

}  // namespace
}  // namespace jax_superoffload

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepLowpSegments,
    jax_superoffload::kOnCpu<jax_superoffload::AdamStepLowpSegments>,
    jax_superoffload::LowpSegmentsBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepLowpSegmentsStream,
    jax_superoffload::kOnStream<jax_superoffload::AdamStepLowpSegments>,
    jax_superoffload::LowpSegmentsBinding<ffi::PlatformStream<void*>>());
