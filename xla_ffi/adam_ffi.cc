// XLA FFI handlers for the Grace Adam kernel with fp32 moments.
//
// Scalars arrive as buffers, not attributes, so that a learning-rate
// schedule, a changing step count or injected hyperparameters never trigger
// a recompilation. The kernel's settings (prefetch, helper threads) are
// attributes, fixed when the call is traced (BucketAttrs).

#include "xla_ffi/adam_ffi.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/stream_launch.h"
#include "xla_ffi/stv_kernel.h"

namespace ffi = xla::ffi;

namespace jax_superoffload {
namespace {

// Leaf j of a Segments call (see AdamStepSegments).
ffi::Error GetSegmentLeaf(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                          const LeafRuns& runs, const BucketAttrs& attrs,
                          size_t j, SegmentLeaf* leaf) {
  const int64_t k = runs.k();
  ffi::AnyBuffer master(nullptr), mu(nullptr), nu(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, 0, j, -1, &master));
  const int64_t n = static_cast<int64_t>(master.element_count());
  JSO_RETURN_IF_ERROR(GetArg(args, k, 1, j, n, &mu));
  JSO_RETURN_IF_ERROR(GetArg(args, k, 2, j, n, &nu));
  for (const ffi::AnyBuffer* x : {&master, &mu, &nu}) {
    JSO_RETURN_IF_ERROR(F32(*x, j, "state"));
  }
  AdamBuffers& b = leaf->b;
  b.size = n;
  JSO_RETURN_IF_ERROR(
      GetTyped(args, k, 3, j, n, "gradient", &b.grad, &b.grad_type));
  b.master_in = static_cast<const float*>(master.untyped_data());
  b.mu_in = static_cast<const float*>(mu.untyped_data());
  b.nu_in = static_cast<const float*>(nu.untyped_data());
  JSO_RETURN_IF_ERROR(GetRetAs(rets, k, 0, j, n, &b.master_out));
  JSO_RETURN_IF_ERROR(GetRetAs(rets, k, 1, j, n, &b.mu_out));
  JSO_RETURN_IF_ERROR(GetRetAs(rets, k, 2, j, n, &b.nu_out));
  if (runs.CopiesWeights(3)) {
    JSO_RETURN_IF_ERROR(GetRet(rets, k, 3, j, n, &b.lowp_out, &b.lowp_type));
  } else if (attrs.weights_over_grads) {
    b.lowp_out = const_cast<void*>(b.grad);
    b.lowp_type = b.grad_type;
  }
  if (attrs.reseed) {
    JSO_RETURN_IF_ERROR(GetTyped(args, k, 4, j, n, "parameter", &leaf->params,
                                 &leaf->param_type));
  }
  if (const char* error = ValidateAdamBuffers(b)) return LeafError(j, error);
  return ffi::Error::Success();
}

// The buffers of Segments leaves, for a launch to place.
void TouchSegmentLeaves(std::vector<SegmentLeaf>& leaves,
                        std::vector<Touched>* touched) {
  using Role = Touched::Role;
  for (SegmentLeaf& leaf : leaves) {
    AdamBuffers& b = leaf.b;
    const int64_t n = b.size;
    for (const float** x : {&b.master_in, &b.mu_in, &b.nu_in}) {
      touched->push_back(Touch(*x, 4 * n, Role::kState));
    }
    for (float** x : {&b.master_out, &b.mu_out, &b.nu_out}) {
      touched->push_back(Touch(*x, 4 * n, Role::kState));
    }
    touched->push_back(
        Touch(b.grad, ElementBytes(b.grad_type, n), Role::kInput));
    touched->push_back(
        Touch(b.lowp_out, ElementBytes(b.lowp_type, n), Role::kOutput));
    touched->push_back(
        Touch(leaf.params, ElementBytes(leaf.param_type, n), Role::kOnDemand));
  }
}

// One bucket of k leaves, each with its own fp32 state. Operands: k masters,
// k mu, k nu, k gradients (f32, bf16 or f16), with `reseed` the k
// parameters the step starts from (see ReseedRange; read only where
// `unchanged` is zero, see ReadsParams) and, with a weights
// copy, optionally k destinations for it (aliased to the copies; their
// contents are ignored). Results: the sum of the squared scaled gradients
// (f32[1], zero unless `compute_sumsq`), the k new masters, mu and nu
// (aliased to their operands by the caller), and optionally k new weights
// in the parameters' dtypes, written by the same pass. One leaf may come
// with S scalar sets (a vmapped `kernels.adam_step`): set s then steps the
// s-th of S equal blocks of it.
ffi::Error AdamStepSegments(Launch& launch, Counts count, Scalars scalars,
                            Flag unchanged, ffi::RemainingArgs args,
                            SumSq sumsq, ffi::RemainingRets rets,
                            BucketAttrs attrs) {
  const int32_t* unchanged_data = nullptr;
  JSO_RETURN_IF_ERROR(CheckUnchanged(unchanged, &unchanged_data));
  const LeafRuns runs(attrs.num_leaves, args.size(), rets.size());
  const bool copy_weights = runs.CopiesWeights(3);
  const int64_t leaf_args = attrs.reseed ? 5 : 4;
  const bool destinations =
      copy_weights && runs.k() > 0 &&
      static_cast<int64_t>(args.size()) == (leaf_args + 1) * runs.k();
  JSO_RETURN_IF_ERROR(
      runs.Expect(leaf_args + (destinations ? 1 : 0), copy_weights ? 4 : 3));
  Prefetch prefetch;
  JSO_RETURN_IF_ERROR(ReadPrefetch(attrs.prefetch, &prefetch));
  std::vector<SegmentLeaf> leaves(runs.k());
  std::vector<int64_t> sizes(runs.k());
  for (int64_t j = 0; j < runs.k(); ++j) {
    JSO_RETURN_IF_ERROR(GetSegmentLeaf(args, rets, runs, attrs, j, &leaves[j]));
    leaves[j].b.prefetch = prefetch;
    sizes[j] = leaves[j].b.size;
  }
  ScalarSet set;
  const std::vector<int64_t> starts = Starts(sizes);
  int64_t num_chunks = 0;
  JSO_RETURN_IF_ERROR(BucketSetup(count, scalars, attrs, starts, &sumsq,
                                  runs.k() == 1, &set, &num_chunks));
  float* sumsq_out = sumsq->typed_data();
  std::vector<Touched> touched = TouchScalars(set);
  touched.push_back(Touch(unchanged_data, 4, Touched::Role::kInput));
  touched.push_back(Touch(sumsq_out, 4 * set.num_sets, Touched::Role::kOutput));
  TouchSegmentLeaves(leaves, &touched);
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  const bool compute_sumsq = attrs.compute_sumsq;
  const bool reseed = attrs.reseed;
  return RunWith(launch, attrs, [=](Workers workers) mutable {
    bool reads_params = false;
    JSO_RETURN_IF_ERROR(
        ReadsParams(unchanged_data, reseed, workers, &reads_params));
    if (!reads_params) {
      for (SegmentLeaf& leaf : leaves) leaf.params = nullptr;
    }
    const std::vector<AdamConstants> constants = set.ReadAll();
    const int64_t block = starts.back() / set.num_sets;
    // Per-chunk sums of squared (scaled) gradients, for speculation-then-
    // validation's global norm: taken by the step's own pass over the
    // chunk, and added in chunk order. Chunks are fixed, so the result does
    // not depend on the number of threads.
    std::vector<double> partial(compute_sumsq ? num_chunks : 0, 0.0);
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts,
                 [&](size_t j, int64_t begin, int64_t end, int64_t chunk) {
                   double* sum = compute_sumsq ? &partial[chunk] : nullptr;
                   // Several sets come with one leaf only, whose offsets are
                   // global.
                   for (int64_t i = begin; i < end;) {
                     const int64_t s = i / block;
                     const int64_t stop = std::min(end, (s + 1) * block);
                     StepSegmentPiece(constants[s], leaves[j], i, stop, isa,
                                      sum);
                     i = stop;
                   }
                 });
    TotalInChunkOrder(partial, sumsq_out);
    std::fill(sumsq_out + 1, sumsq_out + set.num_sets, 0.0f);  // Batched.
    return ffi::Error::Success();
  });
}

// The double-buffered leaves of speculation-then-validation (stv_kernel.h):
// each leaf's master, mu and nu hold two rows (f32[2, n]) of which `row`
// (s32[1]) names the current one; `kept` (f32[n] per leaf) receives the
// gradients as fp32. Operands from `first_run` on: k masters, k mu, k nu,
// k kept. The state must alias its results. The row itself is read when
// the step runs (ReadRow).
ffi::Error PairLeaf(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                    int64_t k, size_t j, Prefetch prefetch, PairBuffers* p) {
  ffi::AnyBuffer kept(nullptr);
  JSO_RETURN_IF_ERROR(GetArg(args, k, 3, j, -1, &kept));
  const int64_t n = static_cast<int64_t>(kept.element_count());
  float* state[3];
  for (int run = 0; run < 3; ++run) {
    ffi::AnyBuffer x(nullptr);
    JSO_RETURN_IF_ERROR(GetArg(args, k, run, j, 2 * n, &x));
    JSO_RETURN_IF_ERROR(F32(x, j, "state"));
    JSO_RETURN_IF_ERROR(GetRetAs(rets, k, run, j, 2 * n, &state[run]));
    if (state[run] != x.untyped_data()) {
      return LeafError(j, "double-buffered state must alias its results");
    }
  }
  p->prefetch = prefetch;
  p->size = n;
  p->row_stride = n;
  p->master = state[0];
  p->mu = state[1];
  p->nu = state[2];
  p->kept_grad = static_cast<float*>(kept.untyped_data());
  return ffi::Error::Success();
}

ffi::Error PairLeaves(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                      const BucketAttrs& attrs, int64_t k, Flag row,
                      std::vector<PairBuffers>* pairs,
                      std::vector<int64_t>* sizes) {
  if (row.element_count() != 1) {
    return InvalidArgument("row must be one s32 scalar, 0 or 1");
  }
  Prefetch prefetch;
  JSO_RETURN_IF_ERROR(ReadPrefetch(attrs.prefetch, &prefetch));
  pairs->assign(k, PairBuffers{});
  sizes->assign(k, 0);
  for (int64_t j = 0; j < k; ++j) {
    JSO_RETURN_IF_ERROR(PairLeaf(args, rets, k, j, prefetch, &(*pairs)[j]));
    (*sizes)[j] = (*pairs)[j].size;
  }
  return ffi::Error::Success();
}

ffi::Error ReadRow(const int32_t* row, int* from) {
  if ((*row & ~1) != 0) {
    return InvalidArgument("row must be 0 or 1, got " + std::to_string(*row));
  }
  *from = *row;
  return ffi::Error::Success();
}

// The buffers of double-buffered leaves: both rows of the state and the
// kept gradients in place; the gradients (`grads`) read; the weights
// copies written, or read and written (`weights`).
void TouchPairs(std::vector<PairBuffers>& pairs, bool grads,
                Touched::Role weights, std::vector<Touched>* touched) {
  using Role = Touched::Role;
  for (PairBuffers& p : pairs) {
    const int64_t n = p.size;
    for (float** x : {&p.master, &p.mu, &p.nu}) {
      touched->push_back(Touch(*x, 8 * n, Role::kState));
    }
    touched->push_back(Touch(p.kept_grad, 4 * n, Role::kState));
    touched->push_back(
        Touch(p.lowp_out, ElementBytes(p.lowp_type, n), weights));
    if (grads) {
      touched->push_back(
          Touch(p.grad, ElementBytes(p.grad_type, n), Role::kInput));
    }
  }
}

ffi::Error PairWeights(ffi::RemainingRets& rets, int64_t k, int64_t run,
                       size_t j, PairBuffers* p) {
  return GetRet(rets, k, run, j, p->size, &p->lowp_out, &p->lowp_type);
}

// The speculative step's own operands and results of leaf j (see
// AdamStepSpeculative), beside its double-buffered state.
ffi::Error GetSpeculativeLeaf(ffi::RemainingArgs& args,
                              ffi::RemainingRets& rets, const LeafRuns& runs,
                              const BucketAttrs& attrs, size_t j,
                              PairBuffers* pair, const void** params,
                              ElementType* param_type) {
  const int64_t k = runs.k();
  float* kept_out = nullptr;
  JSO_RETURN_IF_ERROR(GetRetAs(rets, k, 3, j, pair->size, &kept_out));
  if (kept_out != pair->kept_grad) {
    return LeafError(j, "kept gradients must alias their result");
  }
  JSO_RETURN_IF_ERROR(GetTyped(args, k, 4, j, pair->size, "gradient",
                               &pair->grad, &pair->grad_type));
  if (runs.CopiesWeights(4)) {
    JSO_RETURN_IF_ERROR(PairWeights(rets, k, 4, j, pair));
  }
  if (attrs.reseed) {
    JSO_RETURN_IF_ERROR(
        GetTyped(args, k, 5, j, pair->size, "parameter", params, param_type));
  }
  return ffi::Error::Success();
}

// Leaf `pair`'s speculative step over [begin, end) from row `from`,
// re-seeded first from `params` where they are set; returns its sum of
// squares.
double SpeculativePiece(const AdamConstants& constants, const PairBuffers& pair,
                        const void* params, ElementType param_type, int from,
                        int64_t begin, int64_t end, Isa isa) {
  if (params == nullptr) {
    return SpeculativeStepRange(constants, pair, from, begin, end, isa);
  }
  // The current row re-seeded in place and stepped from cache.
  float* current = pair.master + from * pair.row_stride;
  return ReseedThenStep(current, params, param_type, constants, current, begin,
                        end, isa, [&](int64_t lo, int64_t hi) {
                          return SpeculativeStepRange(constants, pair, from, lo,
                                                      hi, isa);
                        });
}

// The speculative step of double-buffered leaves: reads row `row`, writes
// the other, keeps the gradients (fp32) and sums their squares. Operands:
// k masters, mu, nu, kept (see PairLeaves), k gradients and, with `reseed`,
// k parameters copied into the current row where they differ from it.
// Results: the sum of squares (f32[1]), the 4k state buffers (aliased) and
// optionally k weights.
ffi::Error AdamStepSpeculative(Launch& launch, Counts count, Scalars scalars,
                               Flag row, Flag unchanged,
                               ffi::RemainingArgs args, SumSq sumsq,
                               ffi::RemainingRets rets, BucketAttrs attrs) {
  const int32_t* unchanged_data = nullptr;
  JSO_RETURN_IF_ERROR(CheckUnchanged(unchanged, &unchanged_data));
  const LeafRuns runs(attrs.num_leaves, args.size(), rets.size());
  JSO_RETURN_IF_ERROR(
      runs.Expect(attrs.reseed ? 6 : 5, runs.CopiesWeights(4) ? 5 : 4));
  const int64_t k = runs.k();
  std::vector<PairBuffers> pairs;
  std::vector<int64_t> sizes;
  JSO_RETURN_IF_ERROR(PairLeaves(args, rets, attrs, k, row, &pairs, &sizes));
  std::vector<const void*> params(k, nullptr);
  std::vector<ElementType> param_types(k, ElementType::kF32);
  for (int64_t j = 0; j < k; ++j) {
    JSO_RETURN_IF_ERROR(GetSpeculativeLeaf(
        args, rets, runs, attrs, j, &pairs[j], &params[j], &param_types[j]));
  }
  ScalarSet set;
  const std::vector<int64_t> starts = Starts(sizes);
  int64_t num_chunks = 0;
  JSO_RETURN_IF_ERROR(BucketSetup(count, scalars, attrs, starts, &sumsq, false,
                                  &set, &num_chunks));
  const int32_t* row_data = row.typed_data();
  float* sumsq_out = sumsq->typed_data();
  using Role = Touched::Role;
  std::vector<Touched> touched = TouchScalars(set);
  touched.push_back(Touch(row_data, 4, Role::kInput));
  touched.push_back(Touch(unchanged_data, 4, Role::kInput));
  touched.push_back(Touch(sumsq_out, 4, Role::kOutput));
  TouchPairs(pairs, true, Role::kOutput, &touched);
  for (int64_t j = 0; j < k; ++j) {
    touched.push_back(Touch(params[j], ElementBytes(param_types[j], sizes[j]),
                            Role::kOnDemand));
  }
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  const bool reseed = attrs.reseed;
  return RunWith(launch, attrs, [=](Workers workers) mutable {
    bool reads_params = false;
    JSO_RETURN_IF_ERROR(
        ReadsParams(unchanged_data, reseed, workers, &reads_params));
    if (!reads_params) params.assign(params.size(), nullptr);
    int from = 0;
    JSO_RETURN_IF_ERROR(ReadRow(row_data, &from));
    const AdamConstants constants = set.Read(0);
    // Per-chunk partial sums, added in chunk order: independent of threads.
    std::vector<double> partial(num_chunks, 0.0);
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts,
                 [&](size_t j, int64_t begin, int64_t end, int64_t chunk) {
                   partial[chunk] +=
                       SpeculativePiece(constants, pairs[j], params[j],
                                        param_types[j], from, begin, end, isa);
                 });
    TotalInChunkOrder(partial, sumsq_out);
    return ffi::Error::Success();
  });
}

// The speculative weights copies a Validated call rewrites on a redo: read
// and aliased to their results.
ffi::Error GetValidatedWeights(ffi::RemainingArgs& args,
                               ffi::RemainingRets& rets, int64_t k,
                               std::vector<PairBuffers>* pairs) {
  for (int64_t j = 0; j < k; ++j) {
    PairBuffers& pair = (*pairs)[j];
    ffi::AnyBuffer in(nullptr);
    JSO_RETURN_IF_ERROR(GetArg(args, k, 4, j, pair.size, &in));
    JSO_RETURN_IF_ERROR(PairWeights(rets, k, 3, j, &pair));
    if (in.untyped_data() != pair.lowp_out) {
      return LeafError(j, "weights copies must alias their results");
    }
  }
  return ffi::Error::Success();
}

// After validation: for a clipped step (flags[0]), the step again from the
// untouched row with `redo_scale` times the kept gradients, over the
// speculative row and weights copies; otherwise nothing (an accepted step
// is already in place; a dropped one leaves row `row` current). Everything
// aliases its output, so a step that validates costs a call that returns.
// Operands: k masters, mu, nu, kept (see PairLeaves) and optionally the k
// speculative weights copies; results: the 3k state buffers and the copies.
ffi::Error AdamStepValidated(Launch& launch, Counts count, Scalars scalars,
                             Flag row, Flag flags, Scalars redo_scale,
                             ffi::RemainingArgs args, ffi::RemainingRets rets,
                             BucketAttrs attrs) {
  if (flags.element_count() != 2 || redo_scale.element_count() != 1) {
    return InvalidArgument("validation needs flags [redo, skip] and a scale");
  }
  const LeafRuns runs(attrs.num_leaves, args.size(), rets.size());
  const bool copy_weights = runs.CopiesWeights(3);
  JSO_RETURN_IF_ERROR(runs.Expect(copy_weights ? 5 : 4, copy_weights ? 4 : 3));
  const int64_t k = runs.k();
  std::vector<PairBuffers> pairs;
  std::vector<int64_t> sizes;
  JSO_RETURN_IF_ERROR(PairLeaves(args, rets, attrs, k, row, &pairs, &sizes));
  if (copy_weights)
    JSO_RETURN_IF_ERROR(GetValidatedWeights(args, rets, k, &pairs));
  ScalarSet set;
  attrs.keep_nonfinite = false;  // The redo steps every element it kept.
  JSO_RETURN_IF_ERROR(CheckScalarSets(count, scalars, attrs, -1, &set));
  const std::vector<int64_t> starts = Starts(sizes);
  const int32_t* row_data = row.typed_data();
  const int32_t* flag_data = flags.typed_data();
  const float* scale_data = redo_scale.typed_data();
  using Role = Touched::Role;
  std::vector<Touched> touched = TouchScalars(set);
  touched.push_back(Touch(row_data, 4, Role::kInput));
  touched.push_back(Touch(flag_data, 8, Role::kInput));
  touched.push_back(Touch(scale_data, 4, Role::kInput));
  // The weights copies the speculative step wrote: rewritten on a redo.
  TouchPairs(pairs, false, Role::kInOut, &touched);
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return RunWith(launch, attrs, [=](Workers workers) {
    if (flag_data[0] == 0) return ffi::Error::Success();
    int from = 0;
    JSO_RETURN_IF_ERROR(ReadRow(row_data, &from));
    AdamConstants again = set.Read(0);
    again.grad_scale = scale_data[0];
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts,
                 [&](size_t j, int64_t begin, int64_t end, int64_t) {
                   RedoStepRange(again, pairs[j], from, begin, end, isa);
                 });
    return ffi::Error::Success();
  });
}

// The same-traffic stream of the kernel (StreamRooflineRange), for
// benchmarks: master += grad, mu and nu swapped.
ffi::Error StreamRoofline(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
                          ffi::Buffer<ffi::F32> grad, ffi::Buffer<ffi::F32> mu,
                          ffi::Buffer<ffi::F32> nu,
                          ffi::ResultBuffer<ffi::F32> master_out,
                          ffi::ResultBuffer<ffi::F32> mu_out,
                          ffi::ResultBuffer<ffi::F32> nu_out,
                          std::string_view prefetch, int64_t host_threads) {
  const int64_t size = static_cast<int64_t>(master.element_count());
  for (size_t n :
       {grad.element_count(), mu.element_count(), nu.element_count()}) {
    if (static_cast<int64_t>(n) != size) {
      return InvalidArgument("roofline buffers must have the same size");
    }
  }
  AdamBuffers b;
  JSO_RETURN_IF_ERROR(ReadPrefetch(prefetch, &b.prefetch));
  b.size = size;
  b.master_in = master.typed_data();
  b.grad = grad.typed_data();
  b.mu_in = mu.typed_data();
  b.nu_in = nu.typed_data();
  b.master_out = master_out->typed_data();
  b.mu_out = mu_out->typed_data();
  b.nu_out = nu_out->typed_data();
  const int64_t num_chunks = (size + kChunkElements - 1) / kChunkElements;
  Workers workers;
  workers.xla = &pool;
  workers.host_threads = host_threads;
  ParallelChunks(workers, num_chunks, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkElements;
    StreamRooflineRange(b, begin, std::min(size, begin + kChunkElements));
  });
  return ffi::Error::Success();
}

// The join on the CPU: every step has run before its call returned, and
// the results alias the operands.
ffi::Error StreamJoinOnCpu(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return CheckJoin(args, rets);
}

// The join from a CUDA stream (StreamLaunches::Join): its operands are the
// launches' device results (and the host ones read after it), which XLA
// keeps until the compute stream has waited for the launches.
ffi::Error StreamJoin(void* stream, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  JSO_RETURN_IF_ERROR(CheckJoin(args, rets));
  return StreamLaunches::Process().Join(stream);
}

// A stream claim: its results (aliased to its operands, gradient buffers)
// are, from here on, the new weights a joined start writes over them
// (BucketAttrs::weights_over_grads). Nothing runs: the call only tells XLA
// that those buffers are written after this point, so that it orders every
// other read of the gradients before it, or copies them, and reuses them
// for nothing else until the join that passes them on. On the CPU and from
// a CUDA stream alike; its operands after the results only order it.
ffi::Error StreamClaim(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return CheckJoin(args, rets);
}
ffi::Error StreamClaimOnStream(void*, ffi::RemainingArgs args,
                               ffi::RemainingRets rets) {
  return CheckJoin(args, rets);
}

// The new weights of joined launches to the device, on the CPU: plain
// copies (a CPU program joins nothing, so nothing calls it but tests).
ffi::Error StreamToDeviceOnCpu(ffi::RemainingArgs args,
                               ffi::RemainingRets rets) {
  std::vector<StreamLaunches::ToDevice> copies;
  JSO_RETURN_IF_ERROR(ToDeviceCopies(args, rets, &copies));
  for (const StreamLaunches::ToDevice& c : copies) {
    std::memcpy(c.device, c.source, c.bytes);
  }
  return ffi::Error::Success();
}

// From a CUDA stream: enqueued on it after the join, whose results (the
// new weights) are its operands. Its results are device buffers of its
// own: XLA would copy a host result to the device asynchronously, opening a
// window its scheduler fills with work moved from earlier. The operands are
// pinned host memory, or device memory where XLA placed the launch's
// results there (StreamLaunches::CopyToDevice).
ffi::Error StreamToDevice(void* stream, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  std::vector<StreamLaunches::ToDevice> copies;
  JSO_RETURN_IF_ERROR(ToDeviceCopies(args, rets, &copies));
  return StreamLaunches::Process().CopyToDevice(stream, copies);
}

}  // namespace
}  // namespace jax_superoffload

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamToDevice,
                              jax_superoffload::StreamToDeviceOnCpu,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamToDeviceStream,
                              jax_superoffload::StreamToDevice,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamClaim, jax_superoffload::StreamClaim,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamClaimStream,
                              jax_superoffload::StreamClaimOnStream,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamJoin, jax_superoffload::StreamJoinOnCpu,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamJoinStream, jax_superoffload::StreamJoin,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamRoofline,
                              jax_superoffload::StreamRoofline,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<std::string_view>("prefetch")
                                  .Attr<int64_t>("host_threads"));

JSO_DEFINE_BUCKET_HANDLERS(JsoAdamStepSegments, JsoAdamStepSegmentsStream,
                           ::jax_superoffload::AdamStepSegments, true,
                           ::jax_superoffload::Flag);
JSO_DEFINE_BUCKET_HANDLERS(JsoAdamStepSpeculative, JsoAdamStepSpeculativeStream,
                           ::jax_superoffload::AdamStepSpeculative, true,
                           ::jax_superoffload::Flag, ::jax_superoffload::Flag);
JSO_DEFINE_BUCKET_HANDLERS(JsoAdamStepValidated, JsoAdamStepValidatedStream,
                           ::jax_superoffload::AdamStepValidated, false,
                           ::jax_superoffload::Flag, ::jax_superoffload::Flag,
                           ::jax_superoffload::Scalars);
