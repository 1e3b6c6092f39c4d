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
#include "xla_ffi/lowp_moments.h"
#include "xla_ffi/stream_launch.h"

namespace ffi = xla::ffi;

namespace jax_superoffload {
namespace {

// A moment's storage format from its buffer's dtype: f32, bf16 (as the
// element types) or u8 codes.
bool ToMomentFormat(ffi::DataType dtype, MomentFormat* out) {
  ElementType type;
  if (dtype == ffi::DataType::U8) {
    *out = MomentFormat::kQ8;
  } else if (ToElementType(dtype, &type) && type != ElementType::kF16) {
    *out = type == ElementType::kF32 ? MomentFormat::kF32 : MomentFormat::kBF16;
  } else {
    return false;
  }
  return true;
}

int64_t NumBlocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// The operand and result runs of one call, in order (see the handler).
struct LowpRuns {
  bool quantized;
  bool reseed;
  bool copy_weights;
  bool weights_over_grads = false;  // BucketAttrs::weights_over_grads.
  int64_t mu_scale() const { return 3; }
  int64_t nu_scale() const { return 4; }
  int64_t grad() const { return quantized ? 5 : 3; }
  int64_t params() const { return grad() + 1; }
  int64_t weights() const { return quantized ? 5 : 3; }
  int64_t args() const { return params() + (reseed ? 1 : 0); }
  int64_t rets() const { return weights() + (copy_weights ? 1 : 0); }
};

// Leaf j's 8-bit moments' f32 scales (one per block of kQuantBlock).
ffi::Error GetLowpScales(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                         const LowpRuns& runs, int64_t k, size_t j,
                         LowpMomentBuffers* b) {
  const int64_t blocks = NumBlocks(b->size);
  const float** scales_in[2] = {&b->mu_scale_in, &b->nu_scale_in};
  float** scales_out[2] = {&b->mu_scale_out, &b->nu_scale_out};
  const int64_t run[2] = {runs.mu_scale(), runs.nu_scale()};
  for (int m = 0; m < 2; ++m) {
    ffi::AnyBuffer scale(nullptr);
    JSO_RETURN_IF_ERROR(GetArg(args, k, run[m], j, blocks, &scale));
    JSO_RETURN_IF_ERROR(F32(scale, j, "scales"));
    *scales_in[m] = static_cast<const float*>(scale.untyped_data());
    JSO_RETURN_IF_ERROR(GetRetAs(rets, k, run[m], j, blocks, scales_out[m]));
  }
  return ffi::Error::Success();
}

// Leaf j's state: master (f32), mu and nu (f32, bf16 or u8 codes) and, for
// 8-bit moments, their f32 scales (one per block of kQuantBlock).
ffi::Error GetLowpState(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                        const LowpRuns& runs, int64_t k, size_t j,
                        LowpMomentBuffers* b) {
  ffi::AnyBuffer master(nullptr), mu(nullptr), nu(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, 0, j, -1, &master));
  JSO_RETURN_IF_ERROR(F32(master, j, "master"));
  const int64_t n = static_cast<int64_t>(master.element_count());
  JSO_RETURN_IF_ERROR(GetArg(args, k, 1, j, n, &mu));
  JSO_RETURN_IF_ERROR(GetArg(args, k, 2, j, n, &nu));
  if (!ToMomentFormat(mu.element_type(), &b->mu_format) ||
      !ToMomentFormat(nu.element_type(), &b->nu_format) ||
      !LowpFormatsSupported(b->mu_format, b->nu_format) ||
      (b->mu_format == MomentFormat::kQ8) != runs.quantized) {
    return LeafError(j, std::string("moments must be (bf16, f32), (bf16, "
                                    "bf16)") +
                            (runs.quantized ? " or (u8, u8) with scales" : ""));
  }
  b->size = n;
  b->master_in = static_cast<const float*>(master.untyped_data());
  b->mu_in = mu.untyped_data();
  b->nu_in = nu.untyped_data();
  JSO_RETURN_IF_ERROR(GetRetAs(rets, k, 0, j, n, &b->master_out));
  JSO_RETURN_IF_ERROR(GetRet(rets, k, 1, j, n, &b->mu_out));
  JSO_RETURN_IF_ERROR(GetRet(rets, k, 2, j, n, &b->nu_out));
  if (!runs.quantized) return ffi::Error::Success();
  return GetLowpScales(args, rets, runs, k, j, b);
}

// Leaf j's buffers: its state, gradient, optional weights copy and
// optional parameters (`params`, `param_type`).
ffi::Error GetLowpLeaf(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                       const LowpRuns& runs, int64_t k, size_t j,
                       LowpMomentBuffers* b, const void** params,
                       ElementType* param_type) {
  JSO_RETURN_IF_ERROR(GetLowpState(args, rets, runs, k, j, b));
  const int64_t n = b->size;
  JSO_RETURN_IF_ERROR(GetTyped(args, k, runs.grad(), j, n, "gradient", &b->grad,
                               &b->grad_type));
  if (runs.copy_weights) {
    JSO_RETURN_IF_ERROR(
        GetRet(rets, k, runs.weights(), j, n, &b->lowp_out, &b->lowp_type));
  } else if (runs.weights_over_grads) {
    b->lowp_out = const_cast<void*>(b->grad);
    b->lowp_type = b->grad_type;
  }
  if (runs.reseed) {
    JSO_RETURN_IF_ERROR(GetTyped(args, k, runs.params(), j, n, "parameter",
                                 params, param_type));
  }
  if (const char* error = ValidateLowpMomentBuffers(*b)) {
    return LeafError(j, error);
  }
  return ffi::Error::Success();
}

// Leaf `b`'s step over [begin, end) (block-aligned for 8-bit moments),
// starting from `params` where the master no longer rounds to them.
double StepLowpPiece(const AdamConstants& constants, const LowpMomentBuffers& b,
                     const void* params, ElementType param_type, int64_t begin,
                     int64_t end, Isa isa, bool sum_squares) {
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
  return ReseedThenStep(
      b.master_in, params, param_type, constants, b.master_out, begin, end, isa,
      [&](int64_t lo, int64_t hi) {
        return LowpAdamStepRange(constants, from, lo, hi, isa, sum_squares);
      });
}

// The buffers of low-precision leaves, for a launch to place. The state is
// only checked, never staged: its size does not matter here.
void TouchLowpLeaves(std::vector<LowpMomentBuffers>& leaves,
                     std::vector<const void*>& params,
                     const std::vector<ElementType>& param_types,
                     std::vector<Touched>* touched) {
  using Role = Touched::Role;
  for (size_t j = 0; j < leaves.size(); ++j) {
    LowpMomentBuffers& b = leaves[j];
    for (const void** x :
         {reinterpret_cast<const void**>(&b.master_in), &b.mu_in, &b.nu_in,
          reinterpret_cast<const void**>(&b.mu_scale_in),
          reinterpret_cast<const void**>(&b.nu_scale_in)}) {
      touched->push_back(Touch(*x, 1, Role::kState));
    }
    for (void** x : {reinterpret_cast<void**>(&b.master_out), &b.mu_out,
                     &b.nu_out, reinterpret_cast<void**>(&b.mu_scale_out),
                     reinterpret_cast<void**>(&b.nu_scale_out)}) {
      touched->push_back(Touch(*x, 1, Role::kState));
    }
    touched->push_back(
        Touch(b.grad, ElementBytes(b.grad_type, b.size), Role::kInput));
    touched->push_back(
        Touch(b.lowp_out, ElementBytes(b.lowp_type, b.size), Role::kOutput));
    touched->push_back(Touch(params[j], ElementBytes(param_types[j], b.size),
                             Role::kOnDemand));
  }
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
ffi::Error AdamStepLowpSegments(Launch& launch, Counts count, Scalars scalars,
                                Flag skip, Flag unchanged,
                                ffi::RemainingArgs args, SumSq sumsq,
                                ffi::RemainingRets rets, BucketAttrs attrs) {
  const int32_t* unchanged_data = nullptr;
  JSO_RETURN_IF_ERROR(CheckUnchanged(unchanged, &unchanged_data));
  LowpRuns runs{attrs.quantized, attrs.reseed, false};
  const LeafRuns leaf_runs(attrs.num_leaves, args.size(), rets.size());
  runs.copy_weights = leaf_runs.CopiesWeights(runs.weights());
  runs.weights_over_grads = attrs.weights_over_grads;
  JSO_RETURN_IF_ERROR(leaf_runs.Expect(runs.args(), runs.rets()));
  const int64_t k = leaf_runs.k();
  Prefetch prefetch;
  JSO_RETURN_IF_ERROR(ReadPrefetch(attrs.prefetch, &prefetch));
  std::vector<LowpMomentBuffers> leaves(k);
  std::vector<const void*> params(k, nullptr);
  std::vector<ElementType> param_types(k, ElementType::kF32);
  std::vector<int64_t> padded(k);
  for (int64_t j = 0; j < k; ++j) {
    JSO_RETURN_IF_ERROR(GetLowpLeaf(args, rets, runs, k, j, &leaves[j],
                                    &params[j], &param_types[j]));
    leaves[j].prefetch = prefetch;
    padded[j] = NumBlocks(leaves[j].size) * kQuantBlock;
  }
  ScalarSet set;
  const std::vector<int64_t> starts = Starts(padded);
  int64_t num_chunks = 0;
  JSO_RETURN_IF_ERROR(BucketSetup(count, scalars, attrs, starts, &sumsq, false,
                                  &set, &num_chunks));
  if (skip.element_count() != 1) return InvalidArgument("skip is a scalar");
  const int32_t* skip_data = skip.typed_data();
  float* sumsq_out = sumsq->typed_data();
  std::vector<Touched> touched = TouchScalars(set);
  touched.push_back(Touch(skip_data, 4, Touched::Role::kInput));
  touched.push_back(Touch(unchanged_data, 4, Touched::Role::kInput));
  touched.push_back(Touch(sumsq_out, 4, Touched::Role::kOutput));
  TouchLowpLeaves(leaves, params, param_types, &touched);
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  const bool compute_sumsq = attrs.compute_sumsq;
  const bool reseed = attrs.reseed;
  return RunWith(launch, attrs, [=](Workers workers) mutable {
    if (skip_data[0] != 0) {
      *sumsq_out = 0.0f;
      return ffi::Error::Success();
    }
    bool reads_params = false;
    JSO_RETURN_IF_ERROR(
        ReadsParams(unchanged_data, reseed, workers, &reads_params));
    if (!reads_params) params.assign(params.size(), nullptr);
    const AdamConstants constants = set.Read(0);
    std::vector<double> partial(num_chunks, 0.0);
    const Isa isa = BestIsa();
    ForEachPiece(
        workers, starts,
        [&](size_t j, int64_t begin, int64_t end, int64_t chunk) {
          end = std::min(end, leaves[j].size);  // The padding is not stepped.
          if (begin >= end) return;
          partial[chunk] +=
              StepLowpPiece(constants, leaves[j], params[j], param_types[j],
                            begin, end, isa, compute_sumsq);
        });
    TotalInChunkOrder(partial, sumsq_out);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_superoffload

JSO_DEFINE_BUCKET_HANDLERS(JsoAdamStepLowpSegments,
                           JsoAdamStepLowpSegmentsStream,
                           ::jax_superoffload::AdamStepLowpSegments, true,
                           ::jax_superoffload::Flag, ::jax_superoffload::Flag);
