// XLA FFI handlers for the Grace Adam kernel (CPU platform).
//
// Scalars arrive as buffers, not attributes, so that a learning-rate
// schedule, a changing step count or injected hyperparameters never trigger
// a recompilation. Under vmap (`vmap_method="broadcast_all"`) the scalars
// gain the same leading batch dimensions as the arrays: set s of the scalars
// then applies to the s-th contiguous block of the flattened arrays.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/stv_kernel.h"

namespace ffi = xla::ffi;

namespace jax_superoffload {
namespace {

// Layout of the f32 scalars buffer's last dimension.
enum ScalarIndex : int64_t {
  kLearningRate = 0,
  kB1,
  kOneMinusB1,
  kB2,
  kOneMinusB2,
  kEps,
  kEpsRoot,
  kWeightDecay,
  kGradScale,
  kNumScalars,
};

// Runs fn(chunk) for chunk in [0, num_chunks) on the calling thread and up to
// `pool.num_threads() - 1` pool threads. The caller takes chunks too, so it
// never blocks on work nobody has started; a pool task that starts after all
// chunks are claimed returns without touching `fn`.
template <class Fn>
void ParallelChunks(ffi::ThreadPool& pool, int64_t num_chunks, const Fn& fn) {
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads() - 1, num_chunks - 1);
  if (helpers <= 0) {
    for (int64_t c = 0; c < num_chunks; ++c) fn(c);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    int64_t done = 0;  // Guarded by mutex.
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, num_chunks, &fn]() {
    int64_t finished = 0;
    for (int64_t c = shared->next.fetch_add(1); c < num_chunks;
         c = shared->next.fetch_add(1)) {
      fn(c);
      ++finished;
    }
    if (finished == 0) return;
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->done += finished;
    if (shared->done == num_chunks) shared->all_done.notify_all();
  };
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = work;  // Schedule takes ownership of its own copy.
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->done == num_chunks; });
}

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "jax_superoffload adam_step: " + message);
}

// The kernel's prefetch policy, or the one JAX_SUPEROFFLOAD_PREFETCH names
// (t0, nta or none), for experiments. Read on every call: the environment is
// the only state, and a getenv costs nothing beside a step.
ffi::Error ReadPrefetch(Prefetch* out) {
  const char* name = std::getenv("JAX_SUPEROFFLOAD_PREFETCH");
  if (ParsePrefetch(name, out)) return ffi::Error::Success();
  return InvalidArgument(std::string("JAX_SUPEROFFLOAD_PREFETCH must be t0, "
                                     "nta, none or unset, not '") +
                         name + "'");
}

bool ToElementType(ffi::DataType dtype, ElementType* out) {
  switch (dtype) {
    case ffi::DataType::F32:
      *out = ElementType::kF32;
      return true;
    case ffi::DataType::BF16:
      *out = ElementType::kBF16;
      return true;
    case ffi::DataType::F16:
      *out = ElementType::kF16;
      return true;
    default:
      return false;
  }
}

// Checks the scalars and splits the arrays into one block per scalar set.
ffi::Error ReadScalarSets(ffi::Buffer<ffi::S32> count,
                          ffi::Buffer<ffi::F32> scalars, bool nesterov,
                          int64_t size, std::vector<AdamConstants>* sets,
                          int64_t* block, bool keep_nonfinite = false) {
  const int64_t num_sets = static_cast<int64_t>(count.element_count());
  if (num_sets < 1 ||
      static_cast<int64_t>(scalars.element_count()) != num_sets * kNumScalars) {
    return InvalidArgument("expected " + std::to_string(kNumScalars) +
                           " scalars per count, got " +
                           std::to_string(scalars.element_count()) + " for " +
                           std::to_string(num_sets) + " counts");
  }
  if (size % num_sets != 0) {
    return InvalidArgument("array size " + std::to_string(size) +
                           " is not a multiple of the scalar sets " +
                           std::to_string(num_sets));
  }
  *block = size / num_sets;
  sets->resize(num_sets);
  for (int64_t s = 0; s < num_sets; ++s) {
    const float* x = scalars.typed_data() + s * kNumScalars;
    AdamConfig config;
    config.learning_rate = x[kLearningRate];
    config.b1 = x[kB1];
    config.one_minus_b1 = x[kOneMinusB1];
    config.b2 = x[kB2];
    config.one_minus_b2 = x[kOneMinusB2];
    config.eps = x[kEps];
    config.eps_root = x[kEpsRoot];
    config.weight_decay = x[kWeightDecay];
    config.grad_scale = x[kGradScale];
    config.nesterov = nesterov;
    config.keep_nonfinite = keep_nonfinite;
    config.count = count.typed_data()[s];
    (*sets)[s] = MakeAdamConstants(config);
  }
  return ffi::Error::Success();
}

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
  if (ffi::Error error = ReadPrefetch(&b.prefetch); error.failure()) {
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
  if (ffi::Error error = ReadPrefetch(&b.prefetch); error.failure()) {
    return error;
  }
  const int64_t num_chunks = (size + kChunkElements - 1) / kChunkElements;
  ParallelChunks(pool, num_chunks, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkElements;
    StreamRooflineRange(b, begin, std::min(size, begin + kChunkElements));
  });
  return ffi::Error::Success();
}

// One bucket of several leaves: flat fp32 state, one gradient buffer per
// leaf and, optionally, one new-weights buffer per leaf (in the leaf's
// dtype), so no gradient is concatenated and no weight sliced on the way in
// or out. With no weights outputs, the new master itself is the result.
ffi::Error AdamStepSegmentsHandler(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
    ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
    ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
    ffi::RemainingArgs grads, ffi::ResultBuffer<ffi::F32> master_out,
    ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
    ffi::ResultBuffer<ffi::F32> sumsq, ffi::RemainingRets weights,
    bool nesterov, bool keep_nonfinite, bool compute_sumsq) {
  const int64_t size = static_cast<int64_t>(master.element_count());
  if (static_cast<int64_t>(mu.element_count()) != size ||
      static_cast<int64_t>(nu.element_count()) != size) {
    return InvalidArgument("master, mu and nu must have the same size");
  }
  const bool copy_weights = weights.size() != 0;
  if (copy_weights && grads.size() != weights.size()) {
    return InvalidArgument("need one weights output per gradient, or none");
  }
  std::vector<AdamBuffers> segments(grads.size());
  std::vector<int64_t> starts(grads.size() + 1, 0);
  for (size_t j = 0; j < grads.size(); ++j) {
    auto grad = grads.get<ffi::AnyBuffer>(j);
    if (grad.has_error()) return grad.error();
    const int64_t n = static_cast<int64_t>(grad->element_count());
    AdamBuffers& b = segments[j];
    if (!ToElementType(grad->element_type(), &b.grad_type)) {
      return InvalidArgument("leaf " + std::to_string(j) +
                             ": gradient dtype must be f32, bf16 or f16");
    }
    if (copy_weights) {
      auto weight = weights.get<ffi::AnyBuffer>(j);
      if (weight.has_error()) return weight.error();
      if (static_cast<int64_t>((*weight)->element_count()) != n) {
        return InvalidArgument("leaf " + std::to_string(j) +
                               ": gradient and weights sizes differ");
      }
      if (!ToElementType((*weight)->element_type(), &b.lowp_type)) {
        return InvalidArgument("leaf " + std::to_string(j) +
                               ": weights dtype must be f32, bf16 or f16");
      }
      b.lowp_out = (*weight)->untyped_data();
    }
    starts[j + 1] = starts[j] + n;
    b.size = n;
    b.grad = grad->untyped_data();
  }
  if (starts.back() != size) {
    return InvalidArgument("leaves hold " + std::to_string(starts.back()) +
                           " elements, the bucket " + std::to_string(size));
  }
  Prefetch prefetch;
  if (ffi::Error error = ReadPrefetch(&prefetch); error.failure()) {
    return error;
  }
  for (AdamBuffers& b : segments) b.prefetch = prefetch;
  std::vector<AdamConstants> sets;
  int64_t block = 0;
  if (ffi::Error error = ReadScalarSets(count, scalars, nesterov, size, &sets,
                                       &block, keep_nonfinite);
      error.failure()) {
    return error;
  }
  if (sets.size() != 1) return InvalidArgument("segments cannot be batched");
  if (sumsq->element_count() != 1) return InvalidArgument("sumsq is a scalar");
  sumsq->typed_data()[0] = 0.0f;
  for (size_t j = 0; j < segments.size(); ++j) {
    AdamBuffers& b = segments[j];
    b.master_in = master.typed_data() + starts[j];
    b.mu_in = mu.typed_data() + starts[j];
    b.nu_in = nu.typed_data() + starts[j];
    b.master_out = master_out->typed_data() + starts[j];
    b.mu_out = mu_out->typed_data() + starts[j];
    b.nu_out = nu_out->typed_data() + starts[j];
    if (const char* error = ValidateAdamBuffers(b)) {
      return InvalidArgument(error);
    }
  }
  if (size == 0) return ffi::Error::Success();
  const Isa isa = BestIsa();
  const int64_t num_chunks = (size + kChunkElements - 1) / kChunkElements;
  // Per-chunk sums of squared (scaled) gradients, for speculation-then-
  // validation's global norm: taken by the step's own pass over the chunk,
  // and added in chunk order. Chunks are fixed, so the result does not
  // depend on the number of threads.
  std::vector<double> partial(compute_sumsq ? num_chunks : 0, 0.0);
  ParallelChunks(pool, num_chunks, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkElements;
    const int64_t end = std::min(size, begin + kChunkElements);
    // The chunk's first leaf, then every leaf it overlaps.
    size_t j = std::upper_bound(starts.begin(), starts.end(), begin) -
               starts.begin() - 1;
    for (int64_t i = begin; i < end; ++j) {
      const int64_t stop = std::min(end, starts[j + 1]);
      // Segment j's pointers start at its leaf: take [i, stop) of it.
      if (compute_sumsq) {
        partial[chunk] += AdamStepSumSquaresRange(
            sets[0], segments[j], i - starts[j], stop - starts[j], isa);
      } else {
        AdamStepRange(sets[0], segments[j], i - starts[j], stop - starts[j],
                      isa);
      }
      i = stop;
    }
  });
  if (compute_sumsq) {
    double total = 0.0;
    for (double p : partial) total += p;
    sumsq->typed_data()[0] = static_cast<float>(total);
  }
  return ffi::Error::Success();
}

// Speculation-then-validation over double-buffered state (stv_kernel.h).
// master, mu and nu hold two rows each (f32[2n]); `row` (s32[1]) names the
// current one; `kept_grad` holds the bucket's elements and kKeptGradPad
// more (stv_kernel.h). Builds one PairBuffers per leaf from the leaves'
// sizes.
ffi::Error PairSegments(ffi::Buffer<ffi::F32> master, ffi::Buffer<ffi::F32> mu,
                        ffi::Buffer<ffi::F32> nu, float* kept_grad,
                        ffi::Buffer<ffi::S32> row,
                        const std::vector<int64_t>& sizes,
                        std::vector<PairBuffers>* segments,
                        std::vector<int64_t>* starts, int* from) {
  const int64_t rows = static_cast<int64_t>(master.element_count());
  if (static_cast<int64_t>(mu.element_count()) != rows ||
      static_cast<int64_t>(nu.element_count()) != rows || rows % 2 != 0) {
    return InvalidArgument("master, mu and nu must be two rows of one size");
  }
  if (row.element_count() != 1 || (row.typed_data()[0] & ~1) != 0) {
    return InvalidArgument("row must be one s32 scalar, 0 or 1");
  }
  *from = row.typed_data()[0];
  const int64_t size = rows / 2;
  segments->assign(sizes.size(), PairBuffers{});
  starts->assign(sizes.size() + 1, 0);
  for (size_t j = 0; j < sizes.size(); ++j) {
    (*starts)[j + 1] = (*starts)[j] + sizes[j];
  }
  if (starts->back() != size) {
    return InvalidArgument("leaves hold " + std::to_string(starts->back()) +
                           " elements, the bucket " + std::to_string(size));
  }
  Prefetch prefetch;
  if (ffi::Error error = ReadPrefetch(&prefetch); error.failure()) {
    return error;
  }
  for (size_t j = 0; j < sizes.size(); ++j) {
    PairBuffers& p = (*segments)[j];
    p.prefetch = prefetch;
    const int64_t at = (*starts)[j];
    p.size = sizes[j];
    p.row_stride = size;
    p.master = master.typed_data() + at;
    p.mu = mu.typed_data() + at;
    p.nu = nu.typed_data() + at;
    p.kept_grad = kept_grad + KeptGradShift(size, *from) + at;
  }
  return ffi::Error::Success();
}

// Runs fn(segment, begin, end, chunk) over every leaf piece of every chunk.
template <class Fn>
void ForEachPiece(ffi::ThreadPool& pool, const std::vector<int64_t>& starts,
                  const Fn& fn) {
  const int64_t size = starts.back();
  const int64_t num_chunks = (size + kChunkElements - 1) / kChunkElements;
  ParallelChunks(pool, num_chunks, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkElements;
    const int64_t end = std::min(size, begin + kChunkElements);
    size_t j = std::upper_bound(starts.begin(), starts.end(), begin) -
               starts.begin() - 1;
    for (int64_t i = begin; i < end; ++j) {
      const int64_t stop = std::min(end, starts[j + 1]);
      if (stop > i) fn(j, i - starts[j], stop - starts[j], chunk);
      i = stop;
    }
  });
}

ffi::Error LeafWeights(ffi::RemainingRets& weights, size_t j, int64_t n,
                       PairBuffers* p) {
  auto weight = weights.get<ffi::AnyBuffer>(j);
  if (weight.has_error()) return weight.error();
  if (static_cast<int64_t>((*weight)->element_count()) != n) {
    return InvalidArgument("leaf " + std::to_string(j) +
                           ": gradient and weights sizes differ");
  }
  if (!ToElementType((*weight)->element_type(), &p->lowp_type)) {
    return InvalidArgument("leaf " + std::to_string(j) +
                           ": weights dtype must be f32, bf16 or f16");
  }
  p->lowp_out = (*weight)->untyped_data();
  return ffi::Error::Success();
}

// The speculative step of a double-buffered bucket: reads row `row`, writes
// the other, keeps the gradients (fp32) and sums their squares. The state
// and the kept gradients alias their outputs.
ffi::Error AdamStepSpeculativeHandler(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
    ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
    ffi::Buffer<ffi::F32> kept_grad, ffi::Buffer<ffi::S32> count,
    ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> row,
    ffi::RemainingArgs grads, ffi::ResultBuffer<ffi::F32> master_out,
    ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
    ffi::ResultBuffer<ffi::F32> kept_grad_out,
    ffi::ResultBuffer<ffi::F32> sumsq, ffi::RemainingRets weights,
    bool nesterov, bool keep_nonfinite) {
  if (master.typed_data() != master_out->typed_data() ||
      mu.typed_data() != mu_out->typed_data() ||
      nu.typed_data() != nu_out->typed_data() ||
      kept_grad.typed_data() != kept_grad_out->typed_data()) {
    return InvalidArgument("speculative state must alias its outputs");
  }
  if (weights.size() != 0 && grads.size() != weights.size()) {
    return InvalidArgument("need one weights output per gradient, or none");
  }
  std::vector<int64_t> sizes(grads.size());
  for (size_t j = 0; j < grads.size(); ++j) {
    auto grad = grads.get<ffi::AnyBuffer>(j);
    if (grad.has_error()) return grad.error();
    sizes[j] = static_cast<int64_t>(grad->element_count());
  }
  std::vector<PairBuffers> segments;
  std::vector<int64_t> starts;
  int from = 0;
  if (ffi::Error error =
          PairSegments(master, mu, nu, kept_grad_out->typed_data(), row, sizes,
                       &segments, &starts, &from);
      error.failure()) {
    return error;
  }
  if (static_cast<int64_t>(kept_grad.element_count()) !=
      starts.back() + kKeptGradPad) {
    return InvalidArgument("kept gradients must hold the bucket's size + " +
                           std::to_string(kKeptGradPad) + " elements");
  }
  for (size_t j = 0; j < grads.size(); ++j) {
    auto grad = grads.get<ffi::AnyBuffer>(j);
    if (!ToElementType(grad->element_type(), &segments[j].grad_type)) {
      return InvalidArgument("leaf " + std::to_string(j) +
                             ": gradient dtype must be f32, bf16 or f16");
    }
    segments[j].grad = grad->untyped_data();
    if (weights.size() != 0) {
      if (ffi::Error error = LeafWeights(weights, j, sizes[j], &segments[j]);
          error.failure()) {
        return error;
      }
    }
  }
  std::vector<AdamConstants> sets;
  int64_t block = 0;
  if (ffi::Error error = ReadScalarSets(count, scalars, nesterov,
                                       starts.back(), &sets, &block,
                                       keep_nonfinite);
      error.failure()) {
    return error;
  }
  if (sets.size() != 1) return InvalidArgument("segments cannot be batched");
  if (sumsq->element_count() != 1) return InvalidArgument("sumsq is a scalar");
  // The padding around the kept gradients is read by the finiteness check
  // (stv.all_finite): zeros, not an older step's gradients.
  float* kept = kept_grad_out->typed_data();
  const int64_t shift = KeptGradShift(starts.back(), from);
  std::fill(kept, kept + shift, 0.0f);
  std::fill(kept + shift + starts.back(), kept + starts.back() + kKeptGradPad,
            0.0f);
  const int64_t num_chunks = (starts.back() + kChunkElements - 1) /
                             kChunkElements;
  // Per-chunk partial sums, added in chunk order: independent of threads.
  std::vector<double> partial(num_chunks, 0.0);
  const Isa isa = BestIsa();
  ForEachPiece(pool, starts, [&](size_t j, int64_t begin, int64_t end,
                                 int64_t chunk) {
    partial[chunk] +=
        SpeculativeStepRange(sets[0], segments[j], from, begin, end, isa);
  });
  double total = 0.0;
  for (double p : partial) total += p;
  sumsq->typed_data()[0] = static_cast<float>(total);
  return ffi::Error::Success();
}

// After validation: for a clipped step (flags[0]), the step again from the
// untouched row with `redo_scale` times the kept gradients, over the
// speculative row and weights copies; otherwise nothing (an accepted step
// is already in place; a dropped one leaves row `row` current). Everything
// aliases its output, so a step that validates costs a call that returns.
// RemainingArgs: the speculative weights copies, one per leaf, or none.
ffi::Error AdamStepValidatedHandler(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> master,
    ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
    ffi::Buffer<ffi::F32> kept_grad, ffi::Buffer<ffi::S32> count,
    ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> row,
    ffi::Buffer<ffi::S32> flags, ffi::Buffer<ffi::F32> redo_scale,
    ffi::RemainingArgs weights_in, ffi::ResultBuffer<ffi::F32> master_out,
    ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
    ffi::RemainingRets weights, bool nesterov) {
  if (flags.element_count() != 2 || redo_scale.element_count() != 1) {
    return InvalidArgument("validation needs flags [redo, skip] and a scale");
  }
  if (master.typed_data() != master_out->typed_data() ||
      mu.typed_data() != mu_out->typed_data() ||
      nu.typed_data() != nu_out->typed_data()) {
    return InvalidArgument("validated state must alias its outputs");
  }
  if (weights_in.size() != weights.size()) {
    return InvalidArgument("weights inputs and outputs differ in number");
  }
  std::vector<int64_t> sizes;
  for (size_t j = 0; j < weights.size(); ++j) {
    auto in = weights_in.get<ffi::AnyBuffer>(j);
    auto out = weights.get<ffi::AnyBuffer>(j);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    if (in->untyped_data() != (*out)->untyped_data()) {
      return InvalidArgument("weights copies must alias their outputs");
    }
    sizes.push_back(static_cast<int64_t>(in->element_count()));
  }
  if (sizes.empty()) sizes.push_back(master.element_count() / 2);
  const bool redo = flags.typed_data()[0] != 0;
  if (!redo) return ffi::Error::Success();
  std::vector<PairBuffers> segments;
  std::vector<int64_t> starts;
  int from = 0;
  if (ffi::Error error =
          PairSegments(master, mu, nu, const_cast<float*>(kept_grad.typed_data()),
                       row, sizes, &segments, &starts, &from);
      error.failure()) {
    return error;
  }
  if (static_cast<int64_t>(kept_grad.element_count()) !=
      starts.back() + kKeptGradPad) {
    return InvalidArgument("kept gradients must hold the bucket's size + " +
                           std::to_string(kKeptGradPad) + " elements");
  }
  for (size_t j = 0; j < weights.size(); ++j) {
    if (ffi::Error error = LeafWeights(weights, j, sizes[j], &segments[j]);
        error.failure()) {
      return error;
    }
  }
  std::vector<AdamConstants> sets;
  int64_t block = 0;
  if (ffi::Error error = ReadScalarSets(count, scalars, nesterov,
                                       starts.back(), &sets, &block);
      error.failure()) {
    return error;
  }
  AdamConstants again = sets[0];
  again.grad_scale = redo_scale.typed_data()[0];
  again.keep_nonfinite = false;
  const Isa isa = BestIsa();
  ForEachPiece(pool, starts, [&](size_t j, int64_t begin, int64_t end,
                                 int64_t) {
    RedoStepRange(again, segments[j], from, begin, end, isa);
  });
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoAdamStepSegments,
                              jax_superoffload::AdamStepSegmentsHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("nesterov")
                                  .Attr<bool>("keep_nonfinite")
                                  .Attr<bool>("compute_sumsq"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoAdamStepSpeculative,
                              jax_superoffload::AdamStepSpeculativeHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("nesterov")
                                  .Attr<bool>("keep_nonfinite"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsoAdamStepValidated,
                              jax_superoffload::AdamStepValidatedHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("nesterov"));
