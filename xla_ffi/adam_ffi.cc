// XLA FFI handlers for the Grace Adam kernel (CPU platform).
//
// Scalars arrive as buffers, not attributes, so that a learning-rate
// schedule, a changing step count or injected hyperparameters never trigger
// a recompilation. Under vmap (`vmap_method="broadcast_all"`) the scalars
// gain the same leading batch dimensions as the arrays: set s of the scalars
// then applies to the s-th contiguous block of the flattened arrays.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/stream_launch.h"
#include "xla_ffi/float_convert.h"
#include "xla_ffi/stv_kernel.h"

namespace ffi = xla::ffi;

namespace jax_superoffload {
namespace {

ffi::Error AdamStepImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
                        ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> mu,
                        ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::S32> count,
                        ffi::Buffer<ffi::F32> scalars,
                        ffi::ResultBuffer<ffi::F32> master_out,
                        ffi::ResultBuffer<ffi::F32> mu_out,
                        ffi::ResultBuffer<ffi::F32> nu_out,
                        void* lowp_out,
                        ffi::DataType lowp_dtype, bool nesterov) {
  const int64_t size = static_cast<int64_t>(master.element_count());
  if (static_cast<int64_t>(grad.element_count()) != size ||
      static_cast<int64_t>(mu.element_count()) != size ||
      static_cast<int64_t>(nu.element_count()) != size) {
    return InvalidArgument("master, grad, mu and nu must have the same size");
  }
  AdamBuffers b;
  b.size = size;
  if (!ToElementType(grad.element_type(), &b.grad_type)) {
    return InvalidArgument("gradient dtype must be f32, bf16 or f16");
  }
  b.master_in = master.typed_data();
  b.grad = grad.untyped_data();
  b.mu_in = mu.typed_data();
  b.nu_in = nu.typed_data();
  b.master_out = master_out->typed_data();
  b.mu_out = mu_out->typed_data();
  b.nu_out = nu_out->typed_data();
  if (lowp_out != nullptr) {
    if (lowp_dtype == ffi::DataType::BF16) {
      b.lowp_type = ElementType::kBF16;
    } else if (lowp_dtype == ffi::DataType::F16) {
      b.lowp_type = ElementType::kF16;
    } else {
      return InvalidArgument("low-precision copy dtype must be bf16 or f16");
    }
    b.lowp_out = lowp_out;
  }
  if (const char* error = ValidateAdamBuffers(b)) return InvalidArgument(error);
  if (ffi::Error error = ReadEnvironment(&b.prefetch); error.failure()) {
    return error;
  }
  std::vector<AdamConstants> sets;
  int64_t block = 0;
  if (ffi::Error error =
          ReadScalarSets(count, scalars, nesterov, size, &sets, &block);
      error.failure()) {
    return error;
  }
  if (size == 0) return ffi::Error::Success();
  const Isa isa = BestIsa();
  const int64_t num_chunks = (size + kChunkElements - 1) / kChunkElements;
  ParallelChunks(pool, num_chunks, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkElements;
    const int64_t end = std::min(size, begin + kChunkElements);
    // A chunk may straddle the blocks of two scalar sets.
    for (int64_t i = begin; i < end;) {
      const int64_t set = i / block;
      const int64_t stop = std::min(end, (set + 1) * block);
      AdamStepRange(sets[set], b, i, stop, isa);
      i = stop;
    }
  });
  return ffi::Error::Success();
}

ffi::Error AdamStepHandler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
                    ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> mu,
                    ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::S32> count,
                    ffi::Buffer<ffi::F32> scalars,
                    ffi::ResultBuffer<ffi::F32> master_out,
                    ffi::ResultBuffer<ffi::F32> mu_out,
                    ffi::ResultBuffer<ffi::F32> nu_out, bool nesterov) {
  return AdamStepImpl(pool, master, grad, mu, nu, count, scalars, master_out,
                      mu_out, nu_out, nullptr, ffi::DataType::F32,
                      nesterov);
}

ffi::Error AdamStepLowpHandler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
                        ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> mu,
                        ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::S32> count,
                        ffi::Buffer<ffi::F32> scalars,
                        ffi::ResultBuffer<ffi::F32> master_out,
                        ffi::ResultBuffer<ffi::F32> mu_out,
                        ffi::ResultBuffer<ffi::F32> nu_out,
                        ffi::Result<ffi::AnyBuffer> lowp_out, bool nesterov) {
  if (static_cast<int64_t>(lowp_out->element_count()) !=
      static_cast<int64_t>(master.element_count())) {
    return InvalidArgument("low-precision copy must have the master's size");
  }
  return AdamStepImpl(pool, master, grad, mu, nu, count, scalars, master_out,
                      mu_out, nu_out, lowp_out->untyped_data(),
                      lowp_out->element_type(), nesterov);
}

// As AdamStepLowpHandler, with the copy's destination passed in as well:
// aliased to the copy's output, so a donated destination is written in place
// instead of a fresh buffer being mapped (and faulted in) on every step.
ffi::Error AdamStepLowpIntoHandler(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master, ffi::AnyBuffer grad,
    ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
    ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
    ffi::AnyBuffer /*destination*/, ffi::ResultBuffer<ffi::F32> master_out,
    ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
    ffi::Result<ffi::AnyBuffer> lowp_out, bool nesterov) {
  return AdamStepLowpHandler(pool, master, grad, mu, nu, count, scalars,
                             master_out, mu_out, nu_out, lowp_out, nesterov);
}

ffi::Error StreamRooflineHandler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
                          ffi::Buffer<ffi::F32> grad, ffi::Buffer<ffi::F32> mu,
                          ffi::Buffer<ffi::F32> nu,
                          ffi::ResultBuffer<ffi::F32> master_out,
                          ffi::ResultBuffer<ffi::F32> mu_out,
                          ffi::ResultBuffer<ffi::F32> nu_out) {
  const int64_t size = static_cast<int64_t>(master.element_count());
  if (static_cast<int64_t>(grad.element_count()) != size ||
      static_cast<int64_t>(mu.element_count()) != size ||
      static_cast<int64_t>(nu.element_count()) != size) {
    return InvalidArgument("roofline buffers must have the same size");
  }
  AdamBuffers b;
  b.size = size;
  b.master_in = master.typed_data();
  b.grad = grad.typed_data();
  b.mu_in = mu.typed_data();
  b.nu_in = nu.typed_data();
  b.master_out = master_out->typed_data();
  b.mu_out = mu_out->typed_data();
  b.nu_out = nu_out->typed_data();
  if (ffi::Error error = ReadEnvironment(&b.prefetch); error.failure()) {
    return error;
  }
  const int64_t num_chunks = (size + kChunkElements - 1) / kChunkElements;
  ParallelChunks(pool, num_chunks, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkElements;
    StreamRooflineRange(b, begin, std::min(size, begin + kChunkElements));
  });
  return ffi::Error::Success();
}


// A plain step whose master is written to another buffer than the one it
// reads (the parameters): the state is written with streaming stores from
// the first element at which master_out, mu_out and nu_out are all 64-byte
// aligned. A plain store to master_out would first read its line (4 more
// bytes per parameter); mu and nu, updated in place, are streamed too, as
// one instantiation of the loop streams all three. On the Intel Xeon VM
// this took bench_step's one-leaf step from 73.8 to 67.5 ms. The values
// written are those of the plain step.
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


// One bucket of k leaves, each with its own fp32 state. Operands: k masters,
// k mu, k nu, k gradients (f32, bf16 or f16) and, with `reseed`, the k
// parameters the step starts from (see ReseedRange). Results: the sum of
// the squared scaled gradients (f32[1], zero unless `compute_sumsq`), the k
// new masters, mu and nu (aliased to their operands by the caller), and
// optionally k new weights in the parameters' dtypes, written by the same
// pass.
ffi::Error AdamStepSegments(
    Launch& launch, ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
    ffi::RemainingArgs args, ffi::ResultBuffer<ffi::F32> sumsq,
    ffi::RemainingRets rets, bool nesterov, bool keep_nonfinite,
    bool compute_sumsq, int64_t num_leaves, bool reseed) {
  const LeafRuns runs(num_leaves, args.size(), rets.size());
  const bool copy_weights = runs.CopiesWeights(3);
  if (ffi::Error error = runs.Expect(reseed ? 5 : 4, copy_weights ? 4 : 3);
      error.failure()) {
    return error;
  }
  const int64_t k = runs.k();
  Prefetch prefetch;
  if (ffi::Error error = ReadEnvironment(&prefetch); error.failure()) {
    return error;
  }
  std::vector<AdamBuffers> leaves(k);
  std::vector<int64_t> sizes(k);
  std::vector<const void*> params(k, nullptr);
  std::vector<ElementType> param_types(k, ElementType::kF32);
  for (int64_t j = 0; j < k; ++j) {
    ffi::AnyBuffer master(nullptr), mu(nullptr), nu(nullptr);
    if (ffi::Error e = GetArg(args, k, 0, j, -1, &master); e.failure()) return e;
    const int64_t n = static_cast<int64_t>(master.element_count());
    if (ffi::Error e = GetArg(args, k, 1, j, n, &mu); e.failure()) return e;
    if (ffi::Error e = GetArg(args, k, 2, j, n, &nu); e.failure()) return e;
    for (const ffi::AnyBuffer* x : {&master, &mu, &nu}) {
      if (ffi::Error e = F32(*x, j, "state"); e.failure()) return e;
    }
    AdamBuffers& b = leaves[j];
    b.size = n;
    b.prefetch = prefetch;
    if (ffi::Error e =
            GetTyped(args, k, 3, j, n, "gradient", &b.grad, &b.grad_type);
        e.failure()) {
      return e;
    }
    b.master_in = static_cast<const float*>(master.untyped_data());
    b.mu_in = static_cast<const float*>(mu.untyped_data());
    b.nu_in = static_cast<const float*>(nu.untyped_data());
    void* out = nullptr;
    if (ffi::Error e = GetRet(rets, k, 0, j, n, &out); e.failure()) return e;
    b.master_out = static_cast<float*>(out);
    if (ffi::Error e = GetRet(rets, k, 1, j, n, &out); e.failure()) return e;
    b.mu_out = static_cast<float*>(out);
    if (ffi::Error e = GetRet(rets, k, 2, j, n, &out); e.failure()) return e;
    b.nu_out = static_cast<float*>(out);
    if (copy_weights) {
      if (ffi::Error e = GetRet(rets, k, 3, j, n, &b.lowp_out, &b.lowp_type);
          e.failure()) {
        return e;
      }
    }
    if (reseed) {
      if (ffi::Error e = GetTyped(args, k, 4, j, n, "parameter", &params[j],
                                  &param_types[j]);
          e.failure()) {
        return e;
      }
    }
    if (const char* error = ValidateAdamBuffers(b)) {
      return LeafError(j, error);
    }
    sizes[j] = n;
  }
  ScalarSet set;
  std::vector<int64_t> starts = Starts(sizes);
  int64_t num_chunks = 0;
  if (ffi::Error error = BucketSetup(count, scalars, nesterov, keep_nonfinite,
                                     starts, sumsq, &set, &num_chunks);
      error.failure()) {
    return error;
  }
  float* sumsq_out = sumsq->typed_data();
  using Role = Touched::Role;
  std::vector<Touched> touched = {
      Touch(set.count, 4, Role::kInput),
      Touch(set.scalars, 4 * kNumScalarsPerSet, Role::kInput),
      Touch(sumsq_out, 4, Role::kOutput)};
  for (int64_t j = 0; j < k; ++j) {
    AdamBuffers& b = leaves[j];
    const int64_t n = b.size;
    for (const float** x : {&b.master_in, &b.mu_in, &b.nu_in}) {
      touched.push_back(Touch(*x, 4 * n, Role::kState));
    }
    for (float** x : {&b.master_out, &b.mu_out, &b.nu_out}) {
      touched.push_back(Touch(*x, 4 * n, Role::kState));
    }
    touched.push_back(Touch(b.grad, ElementBytes(b.grad_type, n), Role::kInput));
    touched.push_back(
        Touch(b.lowp_out, ElementBytes(b.lowp_type, n), Role::kOutput));
    touched.push_back(
        Touch(params[j], ElementBytes(param_types[j], n), Role::kInput));
  }
  if (ffi::Error error = launch.Place(touched); error.failure()) return error;
  Work work = [=](Workers workers) {
    const AdamConstants constants = set.Read();
    // Per-chunk sums of squared (scaled) gradients, for speculation-then-
    // validation's global norm: taken by the step's own pass over the
    // chunk, and added in chunk order. Chunks are fixed, so the result does
    // not depend on the number of threads.
    std::vector<double> partial(compute_sumsq ? num_chunks : 0, 0.0);
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts, [&](size_t j, int64_t begin, int64_t end,
                                      int64_t chunk) {
      const AdamBuffers& b = leaves[j];
      auto step = [&](const AdamBuffers& buffers, int64_t from, int64_t to) {
        if (compute_sumsq) {
          partial[chunk] +=
              AdamStepSumSquaresRange(constants, buffers, from, to, isa);
        } else {
          AdamStepRange(constants, buffers, from, to, isa);
        }
      };
      if (params[j] == nullptr) {
        step(b, begin, end);
        return;
      }
      if (param_types[j] == ElementType::kF32) {
        // fp32 parameters are the master itself: the step reads them in its
        // place, which adds no traffic (ReseedRange would copy them over).
        AdamBuffers from_params = b;
        from_params.master_in = static_cast<const float*>(params[j]);
        if (compute_sumsq) {
          step(from_params, begin, end);
        } else {
          StepStreamingState(constants, from_params, begin, end, isa);
        }
        return;
      }
      // Re-seeded into the output and stepped there from cache.
      AdamBuffers fixed = b;
      fixed.master_in = b.master_out;
      ReseedThenStep(b.master_in, params[j], param_types[j], constants,
                     b.master_out, begin, end, isa,
                     [&](int64_t from, int64_t to) {
                       step(fixed, from, to);
                       return 0.0;
                     });
    });
    TotalInChunkOrder(partial, sumsq_out);
    return ffi::Error::Success();
  };
  return launch.Run(std::move(work));
}

// The double-buffered leaves of speculation-then-validation (stv_kernel.h):
// each leaf's master, mu and nu hold two rows (f32[2, n]) of which `row`
// (s32[1]) names the current one; `kept` (f32[n] per leaf) receives the
// gradients as fp32. Operands from `first_run` on: k masters, k mu, k nu,
// k kept. The state must alias its results. The row itself is read when
// the step runs (ReadRow).
ffi::Error PairLeaves(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                      int64_t k, ffi::Buffer<ffi::S32> row,
                      std::vector<PairBuffers>* pairs,
                      std::vector<int64_t>* sizes) {
  if (row.element_count() != 1) {
    return InvalidArgument("row must be one s32 scalar, 0 or 1");
  }
  Prefetch prefetch;
  if (ffi::Error error = ReadEnvironment(&prefetch); error.failure()) {
    return error;
  }
  pairs->assign(k, PairBuffers{});
  sizes->assign(k, 0);
  for (int64_t j = 0; j < k; ++j) {
    ffi::AnyBuffer kept(nullptr);
    if (ffi::Error e = GetArg(args, k, 3, j, -1, &kept); e.failure()) return e;
    const int64_t n = static_cast<int64_t>(kept.element_count());
    float* state[3];
    for (int run = 0; run < 3; ++run) {
      ffi::AnyBuffer x(nullptr);
      if (ffi::Error e = GetArg(args, k, run, j, 2 * n, &x); e.failure()) {
        return e;
      }
      if (ffi::Error e = F32(x, j, "state"); e.failure()) return e;
      void* out = nullptr;
      if (ffi::Error e = GetRet(rets, k, run, j, 2 * n, &out); e.failure()) {
        return e;
      }
      if (out != x.untyped_data()) {
        return LeafError(j, "double-buffered state must alias its results");
      }
      state[run] = static_cast<float*>(out);
    }
    PairBuffers& p = (*pairs)[j];
    p.prefetch = prefetch;
    p.size = n;
    p.row_stride = n;
    p.master = state[0];
    p.mu = state[1];
    p.nu = state[2];
    p.kept_grad = static_cast<float*>(kept.untyped_data());
    (*sizes)[j] = n;
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
    touched->push_back(Touch(p.lowp_out, ElementBytes(p.lowp_type, n), weights));
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

// The speculative step of double-buffered leaves: reads row `row`, writes
// the other, keeps the gradients (fp32) and sums their squares. Operands:
// k masters, mu, nu, kept (see PairLeaves), k gradients and, with `reseed`,
// k parameters copied into the current row where they differ from it.
// Results: the sum of squares (f32[1]), the 4k state buffers (aliased) and
// optionally k weights.
ffi::Error AdamStepSpeculative(
    Launch& launch, ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
    ffi::Buffer<ffi::S32> row, ffi::RemainingArgs args,
    ffi::ResultBuffer<ffi::F32> sumsq, ffi::RemainingRets rets, bool nesterov,
    bool keep_nonfinite, int64_t num_leaves, bool reseed) {
  const LeafRuns runs(num_leaves, args.size(), rets.size());
  const bool copy_weights = runs.CopiesWeights(4);
  if (ffi::Error error = runs.Expect(reseed ? 6 : 5, copy_weights ? 5 : 4);
      error.failure()) {
    return error;
  }
  const int64_t k = runs.k();
  std::vector<PairBuffers> pairs;
  std::vector<int64_t> sizes;
  if (ffi::Error e = PairLeaves(args, rets, k, row, &pairs, &sizes);
      e.failure()) {
    return e;
  }
  std::vector<const void*> params(k, nullptr);
  std::vector<ElementType> param_types(k, ElementType::kF32);
  for (int64_t j = 0; j < k; ++j) {
    void* kept_out = nullptr;
    if (ffi::Error e = GetRet(rets, k, 3, j, sizes[j], &kept_out);
        e.failure()) {
      return e;
    }
    if (kept_out != pairs[j].kept_grad) {
      return LeafError(j, "kept gradients must alias their result");
    }
    if (ffi::Error e = GetTyped(args, k, 4, j, sizes[j], "gradient",
                                &pairs[j].grad, &pairs[j].grad_type);
        e.failure()) {
      return e;
    }
    if (copy_weights) {
      if (ffi::Error e = PairWeights(rets, k, 4, j, &pairs[j]); e.failure()) {
        return e;
      }
    }
    if (reseed) {
      if (ffi::Error e = GetTyped(args, k, 5, j, sizes[j], "parameter",
                                  &params[j], &param_types[j]);
          e.failure()) {
        return e;
      }
    }
  }
  ScalarSet set;
  const std::vector<int64_t> starts = Starts(sizes);
  int64_t num_chunks = 0;
  if (ffi::Error error = BucketSetup(count, scalars, nesterov, keep_nonfinite,
                                     starts, sumsq, &set, &num_chunks);
      error.failure()) {
    return error;
  }
  const int32_t* row_data = row.typed_data();
  float* sumsq_out = sumsq->typed_data();
  using Role = Touched::Role;
  std::vector<Touched> touched = {
      Touch(set.count, 4, Role::kInput),
      Touch(set.scalars, 4 * kNumScalarsPerSet, Role::kInput),
      Touch(row_data, 4, Role::kInput), Touch(sumsq_out, 4, Role::kOutput)};
  TouchPairs(pairs, true, Role::kOutput, &touched);
  for (int64_t j = 0; j < k; ++j) {
    touched.push_back(Touch(params[j], ElementBytes(param_types[j], sizes[j]),
                            Role::kInput));
  }
  if (ffi::Error error = launch.Place(touched); error.failure()) return error;
  Work work = [=](Workers workers) {
    int from = 0;
    if (ffi::Error e = ReadRow(row_data, &from); e.failure()) return e;
    const AdamConstants constants = set.Read();
    // Per-chunk partial sums, added in chunk order: independent of threads.
    std::vector<double> partial(num_chunks, 0.0);
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts, [&](size_t j, int64_t begin, int64_t end,
                                      int64_t chunk) {
      if (params[j] == nullptr) {
        partial[chunk] +=
            SpeculativeStepRange(constants, pairs[j], from, begin, end, isa);
        return;
      }
      // The current row re-seeded in place and stepped from cache.
      float* current = pairs[j].master + from * pairs[j].row_stride;
      partial[chunk] += ReseedThenStep(
          current, params[j], param_types[j], constants, current, begin, end,
          isa, [&](int64_t lo, int64_t hi) {
            return SpeculativeStepRange(constants, pairs[j], from, lo, hi,
                                        isa);
          });
    });
    TotalInChunkOrder(partial, sumsq_out);
    return ffi::Error::Success();
  };
  return launch.Run(std::move(work));
}

// After validation: for a clipped step (flags[0]), the step again from the
// untouched row with `redo_scale` times the kept gradients, over the
// speculative row and weights copies; otherwise nothing (an accepted step
// is already in place; a dropped one leaves row `row` current). Everything
// aliases its output, so a step that validates costs a call that returns.
// Operands: k masters, mu, nu, kept (see PairLeaves) and optionally the k
// speculative weights copies; results: the 3k state buffers and the copies.
ffi::Error AdamStepValidated(
    Launch& launch, ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
    ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> flags,
    ffi::Buffer<ffi::F32> redo_scale, ffi::RemainingArgs args,
    ffi::RemainingRets rets, bool nesterov, int64_t num_leaves) {
  if (flags.element_count() != 2 || redo_scale.element_count() != 1) {
    return InvalidArgument("validation needs flags [redo, skip] and a scale");
  }
  const LeafRuns runs(num_leaves, args.size(), rets.size());
  const bool copy_weights = runs.CopiesWeights(3);
  if (ffi::Error error = runs.Expect(copy_weights ? 5 : 4, copy_weights ? 4 : 3);
      error.failure()) {
    return error;
  }
  const int64_t k = runs.k();
  std::vector<PairBuffers> pairs;
  std::vector<int64_t> sizes;
  if (ffi::Error e = PairLeaves(args, rets, k, row, &pairs, &sizes);
      e.failure()) {
    return e;
  }
  for (int64_t j = 0; copy_weights && j < k; ++j) {
    ffi::AnyBuffer in(nullptr);
    if (ffi::Error e = GetArg(args, k, 4, j, sizes[j], &in); e.failure()) {
      return e;
    }
    if (ffi::Error e = PairWeights(rets, k, 3, j, &pairs[j]); e.failure()) {
      return e;
    }
    if (in.untyped_data() != pairs[j].lowp_out) {
      return LeafError(j, "weights copies must alias their results");
    }
  }
  ScalarSet set;
  if (ffi::Error error =
          CheckOneScalarSet(count, scalars, nesterov, false, &set);
      error.failure()) {
    return error;
  }
  const std::vector<int64_t> starts = Starts(sizes);
  const int32_t* row_data = row.typed_data();
  const int32_t* flag_data = flags.typed_data();
  const float* scale_data = redo_scale.typed_data();
  using Role = Touched::Role;
  std::vector<Touched> touched = {
      Touch(set.count, 4, Role::kInput),
      Touch(set.scalars, 4 * kNumScalarsPerSet, Role::kInput),
      Touch(row_data, 4, Role::kInput), Touch(flag_data, 8, Role::kInput),
      Touch(scale_data, 4, Role::kInput)};
  // The weights copies the speculative step wrote: rewritten on a redo.
  TouchPairs(pairs, false, Role::kInOut, &touched);
  if (ffi::Error error = launch.Place(touched); error.failure()) return error;
  Work work = [=](Workers workers) {
    if (flag_data[0] == 0) return ffi::Error::Success();
    int from = 0;
    if (ffi::Error e = ReadRow(row_data, &from); e.failure()) return e;
    AdamConstants again = set.Read();
    again.grad_scale = scale_data[0];
    const Isa isa = BestIsa();
    ForEachPiece(workers, starts, [&](size_t j, int64_t begin, int64_t end,
                                      int64_t) {
      RedoStepRange(again, pairs[j], from, begin, end, isa);
    });
    return ffi::Error::Success();
  };
  return launch.Run(std::move(work));
}

// The bindings of the bucket handlers, behind the context: XLA:CPU's pool,
// or the CUDA stream (launch.h's OnCpu and OnStream).
template <class Context>
auto SegmentsBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .RemainingArgs()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .RemainingRets()
      .template Attr<bool>("nesterov")
      .template Attr<bool>("keep_nonfinite")
      .template Attr<bool>("compute_sumsq")
      .template Attr<int64_t>("num_leaves")
      .template Attr<bool>("reseed");
}

template <class Context>
auto SpeculativeBinding() {
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
      .template Attr<int64_t>("num_leaves")
      .template Attr<bool>("reseed");
}

template <class Context>
auto ValidatedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<bool>("nesterov")
      .template Attr<int64_t>("num_leaves");
}

}  // namespace
}  // namespace jax_superoffload

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoAdamStep, jax_superoffload::AdamStepHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nesterov"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoAdamStepLowp, jax_superoffload::AdamStepLowpHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("nesterov"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoAdamStepLowpInto,
                              jax_superoffload::AdamStepLowpIntoHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("nesterov"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoStreamRoofline,
                              jax_superoffload::StreamRooflineHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepSegments,
    jax_superoffload::kOnCpu<jax_superoffload::AdamStepSegments>,
    jax_superoffload::SegmentsBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepSegmentsStream,
    jax_superoffload::kOnStream<jax_superoffload::AdamStepSegments>,
    jax_superoffload::SegmentsBinding<ffi::PlatformStream<void*>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepSpeculative,
    jax_superoffload::kOnCpu<jax_superoffload::AdamStepSpeculative>,
    jax_superoffload::SpeculativeBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepSpeculativeStream,
    jax_superoffload::kOnStream<jax_superoffload::AdamStepSpeculative>,
    jax_superoffload::SpeculativeBinding<ffi::PlatformStream<void*>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepValidated,
    jax_superoffload::kOnCpu<jax_superoffload::AdamStepValidated>,
    jax_superoffload::ValidatedBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JsoAdamStepValidatedStream,
    jax_superoffload::kOnStream<jax_superoffload::AdamStepValidated>,
    jax_superoffload::ValidatedBinding<ffi::PlatformStream<void*>>());
