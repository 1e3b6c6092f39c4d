// Shared by the FFI handlers of the Grace Adam kernels (adam_ffi.cc,
// lowp_ffi.cc): the scalars and the per-leaf operand runs read and checked,
// the parallel loop over fixed work chunks, and the master re-seeded from
// the parameters.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_FFI_SUPPORT_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_FFI_SUPPORT_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/host_pool.h"

// Returns the ffi::Error of `expr` from the enclosing function if it failed.
#define JSO_RETURN_IF_ERROR(expr)                                    \
  do {                                                               \
    if (::xla::ffi::Error jso_error = (expr); jso_error.failure()) { \
      return jso_error;                                              \
    }                                                                \
  } while (0)

namespace jax_superoffload {

namespace ffi = xla::ffi;

// The operands of the bucket handlers, by their job: the step counts
// (s32, one per scalar set), f32 scalars (kPackedScalars per set), an s32
// flag (a row, skip, ...), and the f32 sum of squares they return.
using Counts = ffi::Buffer<ffi::S32>;
using Scalars = ffi::Buffer<ffi::F32>;
using Flag = ffi::Buffer<ffi::S32>;
using SumSq = ffi::ResultBuffer<ffi::F32>;

// The attributes of every bucket handler, fixed when the call is traced
// (grace_adam.py passes them all to each). A handler ignores those it has
// no use for.
struct BucketAttrs {
  bool nesterov;
  bool keep_nonfinite;
  bool compute_sumsq;
  int64_t num_leaves;
  bool reseed;
  bool quantized;
  // The kernel's software prefetch: t0, nta or none (PrefetchName).
  std::string_view prefetch;
  // Threads in all a step asks for (0: the default; see OwnHelperThreads).
  int64_t host_threads;
  // Started from a CUDA stream: the staging bytes of the largest bucket of
  // the step, which each staging slot is sized to at once (0: no bound).
  int64_t staging_bytes;
  // Started from a CUDA stream: the call's device operands stay alive until
  // the step's join (its results alias them, or the join takes them), so
  // the compute stream need not wait for their copies to staging.
  bool hold_inputs;
  // The new weights are written over the gradients, in their dtype (a
  // joined start, whose gradient buffers a stream claim handed over to the
  // weights; grace_adam.py), instead of into results of their own.
  bool weights_over_grads;
};

}  // namespace jax_superoffload

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_superoffload::BucketAttrs, ::xla::ffi::StructMember<bool>("nesterov"),
    ::xla::ffi::StructMember<bool>("keep_nonfinite"),
    ::xla::ffi::StructMember<bool>("compute_sumsq"),
    ::xla::ffi::StructMember<int64_t>("num_leaves"),
    ::xla::ffi::StructMember<bool>("reseed"),
    ::xla::ffi::StructMember<bool>("quantized"),
    ::xla::ffi::StructMember<std::string_view>("prefetch"),
    ::xla::ffi::StructMember<int64_t>("host_threads"),
    ::xla::ffi::StructMember<int64_t>("staging_bytes"),
    ::xla::ffi::StructMember<bool>("hold_inputs"),
    ::xla::ffi::StructMember<bool>("weights_over_grads"));

namespace jax_superoffload {

// How many helper threads a step takes from the process's HostPool beside
// the caller, or -1 when it uses XLA's intra-op pool. `requested` (the
// host_threads attribute, which JAX_SUPEROFFLOAD_HOST_THREADS sets) > 0
// asks for that many threads in all. Otherwise XLA's pool, when it has more
// than one thread (XLA:CPU); where XLA hands the kernel a one-thread pool
// (the GPU plugin's host compute ran it at about one core's speed on an
// H200 machine), or none (a step ordered on a GPU stream, pool_threads 0),
// up to the CPUs the calling thread may run on.
int64_t OwnHelperThreads(int64_t requested, int64_t pool_threads);

// The thread count `value` (JAX_SUPEROFFLOAD_HOST_THREADS) asks for: 0 when
// unset or empty, -1 unless it is only the digits of a number from 1 to
// 4096.
int64_t ParseThreads(const char* value);

// Runs fn(chunk) for chunk in [0, num_chunks) on the calling thread and up
// to `helpers` tasks handed to `schedule`. The caller takes chunks too, so
// it never blocks on work nobody has started, and a task that starts after
// all chunks are claimed returns without touching `fn` (which may then be
// gone). Chunks are fixed, so the thread count never changes a result.
// `fn` must not throw.
template <class Schedule, class Fn>
void RunChunks(const Schedule& schedule, int64_t helpers, int64_t num_chunks,
               const Fn& fn) {
  helpers = std::min<int64_t>(helpers, num_chunks - 1);
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
  for (int64_t i = 0; i < helpers; ++i) schedule(work);
  work();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->done == num_chunks; });
}

// RunChunks on the process's pool, with OwnHelperThreads helpers (pool_threads:
// the threads of XLA's pool, 0 where there is none).
template <class Fn>
void RunChunksOnHostPool(int64_t requested, int64_t pool_threads,
                         int64_t num_chunks, const Fn& fn) {
  HostPool& host = HostPool::Process();
  const int64_t want = std::min<int64_t>(
      std::max<int64_t>(OwnHelperThreads(requested, pool_threads), 0),
      num_chunks - 1);
  const int64_t helpers = want > 0 ? std::min(want, host.Reserve(want)) : 0;
  RunChunks([&host](auto task) { host.Schedule(std::move(task)); }, helpers,
            num_chunks, fn);
}

// Where the work of a step runs: XLA's intra-op pool (`xla` set; CPU
// handlers) or only the process's pool (a step run from a GPU stream).
struct Workers {
  ffi::ThreadPool* xla = nullptr;
  int64_t host_threads = 0;  // The call's host_threads attribute.
  // Brings the step's on-demand inputs (Touched::Role::kOnDemand) to where
  // it reads them, each `window` of its own size on from where it was
  // touched (a row of a stack touched at its first row); null where they
  // are read in place (XLA:CPU).
  std::function<ffi::Error(int64_t window)> fetch;

  ffi::Error Fetch(int64_t window = 0) const {
    return fetch ? fetch(window) : ffi::Error::Success();
  }
};

// RunChunks on XLA's pool where it has more than one thread and nothing
// asks otherwise, else on the process's pool (see OwnHelperThreads).
template <class Fn>
void ParallelChunks(Workers workers, int64_t num_chunks, const Fn& fn) {
  if (num_chunks <= 1) {
    if (num_chunks == 1) fn(0);
    return;
  }
  const int64_t pool_threads =
      workers.xla == nullptr ? 0 : workers.xla->num_threads();
  if (OwnHelperThreads(workers.host_threads, pool_threads) >= 0) {
    RunChunksOnHostPool(workers.host_threads, pool_threads, num_chunks, fn);
    return;
  }
  ffi::ThreadPool& pool = *workers.xla;
  RunChunks([&pool](auto task) { pool.Schedule(std::move(task)); },
            pool_threads - 1, num_chunks, fn);
}

ffi::Error InvalidArgument(const std::string& message);

// The prefetch policy an attribute names (t0, nta or none), or an error.
ffi::Error ReadPrefetch(std::string_view name, Prefetch* out);

// The value `table` pairs with `key`, into `out`; false where none does.
template <class Key, class Value, size_t kSize>
bool LookUp(const std::pair<Key, Value> (&table)[kSize], Key key, Value* out) {
  for (const auto& [k, v] : table) {
    if (k == key) {
      *out = v;
      return true;
    }
  }
  return false;
}

bool ToElementType(ffi::DataType dtype, ElementType* out);

// Bytes of `n` elements of `type` (0 for kNone).
inline int64_t ElementBytes(ElementType type, int64_t n) {
  switch (type) {
    case ElementType::kF32:
      return 4 * n;
    case ElementType::kBF16:
    case ElementType::kF16:
      return 2 * n;
    default:
      return 0;
  }
}

// The per-leaf buffers of a bucket arrive as runs of `num_leaves` buffers
// each in the variadic operands and results (all masters, then all mu, ...),
// so the state of every leaf is its own array, shaped like its parameter,
// and nothing is concatenated or sliced on the way in or out.
class LeafRuns {
 public:
  LeafRuns(int64_t num_leaves, int64_t num_args, int64_t num_rets)
      : k_(num_leaves), num_args_(num_args), num_rets_(num_rets) {}

  // Checks that there are `args` runs of operands and `rets` of results.
  ffi::Error Expect(int64_t args, int64_t rets) const {
    if (k_ < 0 || num_args_ != args * k_ || num_rets_ != rets * k_) {
      return InvalidArgument("expected " + std::to_string(args) + " and " +
                             std::to_string(rets) + " runs of " +
                             std::to_string(k_) + " leaves, got " +
                             std::to_string(num_args_) + " operands and " +
                             std::to_string(num_rets_) + " results");
    }
    return ffi::Error::Success();
  }

  int64_t k() const { return k_; }

  // Whether the results hold one more run, the k new weights, than the
  // `rets_without` runs every call has.
  bool CopiesWeights(int64_t rets_without) const {
    return k_ > 0 && num_rets_ == (rets_without + 1) * k_;
  }

 private:
  int64_t k_;
  int64_t num_args_;
  int64_t num_rets_;
};

ffi::Error LeafError(size_t j, const std::string& message);

// Operand `run * k + j` as a buffer of `n` elements (n < 0: any size).
ffi::Error GetArg(ffi::RemainingArgs& args, int64_t k, int64_t run, size_t j,
                  int64_t n, ffi::AnyBuffer* out);

// Operand `run * k + j`, `n` elements of f32, bf16 or f16 (a gradient or a
// parameter, named by `what`): its data and element type.
ffi::Error GetTyped(ffi::RemainingArgs& args, int64_t k, int64_t run, size_t j,
                    int64_t n, const char* what, const void** data,
                    ElementType* type);

// The per-chunk partial sums of squares added in chunk order (independent of
// threads), into the f32[1] result.
void TotalInChunkOrder(const std::vector<double>& partial, float* sumsq);

ffi::Error GetRet(ffi::RemainingRets& rets, int64_t k, int64_t run, size_t j,
                  int64_t n, void** data, ElementType* type = nullptr);

// GetRet's data as a `T*`.
template <class T>
ffi::Error GetRetAs(ffi::RemainingRets& rets, int64_t k, int64_t run, size_t j,
                    int64_t n, T** data) {
  void* out = nullptr;
  JSO_RETURN_IF_ERROR(GetRet(rets, k, run, j, n, &out));
  *data = static_cast<T*>(out);
  return ffi::Error::Success();
}

ffi::Error F32(const ffi::AnyBuffer& buffer, size_t j, const char* what);

// How far a 16-bit parameter may be from the master and still be the one
// the last step produced: a 16-bit update cannot always land on the rounded
// master when the step is larger than the weight (its own rounding, 2^-8 of
// the step for bf16, is then more than an ulp of the weight). Adam's step
// is a few learning rates at most, so lr / 16 covers steps up to 16 lr.
inline float ReseedTolerance(const AdamConstants& constants) {
  return std::fabs(constants.learning_rate) * 0.0625f;
}

// Elements re-seeded and then stepped at a time: 16K floats (64 KiB of
// master) stay in L2 between the two.
inline constexpr int64_t kReseedBlock = 1 << 14;

// The parameters as the source of truth: over [begin, end), `out` receives
// the master where it rounds to the parameter, or to a neighbour of it for
// 16-bit parameters (keeping its extra precision), and the parameter
// otherwise (weights loaded, surgery, an EMA swap). `out`
// may be `master`.
void ReseedRange(const float* master, const void* params, ElementType type,
                 float tolerance, float* out, int64_t begin, int64_t end,
                 Isa isa);

// Re-seeds [begin, end) of `out` from `master` and 16-bit `params` a block
// at a time, and runs step(from, to) on each block at once, while it is
// still in L1/L2: the parameters' read is then the only traffic re-seeding
// adds. Returns the sum of what the steps return.
template <class Step>
double ReseedThenStep(const float* master, const void* params, ElementType type,
                      const AdamConstants& constants, float* out, int64_t begin,
                      int64_t end, Isa isa, const Step& step) {
  double total = 0.0;
  for (int64_t from = begin; from < end; from += kReseedBlock) {
    const int64_t to = std::min(end, from + kReseedBlock);
    ReseedRange(master, params, type, ReseedTolerance(constants), out, from, to,
                isa);
    total += step(from, to);
  }
  return total;
}

// Runs fn(leaf, begin, end, chunk) over every leaf piece of every chunk of
// the leaves laid (virtually) end to end; `starts` are their offsets.
template <class Pool, class Fn>
void ForEachPiece(Pool&& pool, const std::vector<int64_t>& starts,
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

std::vector<int64_t> Starts(const std::vector<int64_t>& sizes);

// A leaf of a Segments or row step: its buffers and the parameters it
// starts from (null without `reseed`).
struct SegmentLeaf {
  AdamBuffers b;
  const void* params = nullptr;
  ElementType param_type = ElementType::kF32;
};

// Leaf `leaf`'s step over [begin, end), adding the sum of squares to `sumsq`
// where it is set: Grace Adam's math for the fp32-state handlers
// (AdamStepSegments, AdamStepRow), re-seeded first where `leaf.params` is.
void StepSegmentPiece(const AdamConstants& constants, const SegmentLeaf& leaf,
                      int64_t begin, int64_t end, Isa isa, double* sumsq);

// The scalar sets of a call, checked for their sizes while decoding and
// read (`Read`) when the step runs: on a GPU stream their values are
// written by copies that have not run yet when the handler is called.
struct ScalarSet {
  const int32_t* count = nullptr;
  const float* scalars = nullptr;
  int64_t num_sets = 1;
  bool nesterov = false;
  bool keep_nonfinite = false;

  // Set s as constants (its count and kPackedScalars).
  AdamConstants Read(int64_t s) const;
  std::vector<AdamConstants> ReadAll() const;
};

// Checks count (s32[S]) and scalars (f32[S * kNumScalarsPerSet]). S is 1
// unless `batched_size` >= 0: the elements of a batched (vmapped) leaf,
// whose S equal blocks take one set each.
ffi::Error CheckScalarSets(Counts count, Scalars scalars,
                           const BucketAttrs& attrs, int64_t batched_size,
                           ScalarSet* out);

// A bucket's scalar sets (several only where `batched`: one leaf) and its
// sum of squares (f32, one per set) checked, and the number of fixed work
// chunks over its `starts.back()` elements.
ffi::Error BucketSetup(Counts count, Scalars scalars, const BucketAttrs& attrs,
                       const std::vector<int64_t>& starts, SumSq* sumsq,
                       bool batched, ScalarSet* set, int64_t* num_chunks);

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_FFI_SUPPORT_H_
