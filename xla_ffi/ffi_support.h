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
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/host_pool.h"

namespace jax_superoffload {

namespace ffi = xla::ffi;

// How many helper threads a step takes from the process's HostPool beside
// the caller, or -1 when it uses XLA's intra-op pool. JAX_SUPEROFFLOAD_HOST_
// THREADS=N asks for N threads in all. Otherwise XLA's pool, when it has
// more than one thread (XLA:CPU); where XLA hands the kernel a one-thread
// pool (the GPU plugin's host compute ran it at about one core's speed on
// an H200 machine), or none (a step ordered on a GPU stream, pool_threads
// 0), up to the CPUs the calling thread may run on. A malformed value counts
// as unset here; ReadEnvironment reports it.
int64_t OwnHelperThreads(int64_t pool_threads);

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

// RunChunks on the process's pool, with OwnHelperThreads(pool_threads)
// helpers (pool_threads: the threads of XLA's pool, 0 where there is none).
template <class Fn>
void RunChunksOnHostPool(int64_t pool_threads, int64_t num_chunks,
                         const Fn& fn) {
  HostPool& host = HostPool::Process();
  const int64_t want =
      std::min<int64_t>(std::max<int64_t>(OwnHelperThreads(pool_threads), 0),
                        num_chunks - 1);
  const int64_t helpers = want > 0 ? std::min(want, host.Reserve(want)) : 0;
  RunChunks([&host](auto task) { host.Schedule(std::move(task)); }, helpers,
            num_chunks, fn);
}

// Where the work of a step runs: XLA's intra-op pool (`xla` set; CPU
// handlers) or only the process's pool (a step run from a GPU stream).
struct Workers {
  ffi::ThreadPool* xla = nullptr;
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
  if (OwnHelperThreads(pool_threads) >= 0) {
    RunChunksOnHostPool(pool_threads, num_chunks, fn);
    return;
  }
  ffi::ThreadPool& pool = *workers.xla;
  RunChunks([&pool](auto task) { pool.Schedule(std::move(task)); },
            pool_threads - 1, num_chunks, fn);
}

template <class Fn>
void ParallelChunks(ffi::ThreadPool& pool, int64_t num_chunks, const Fn& fn) {
  ParallelChunks(Workers{&pool}, num_chunks, fn);
}

ffi::Error InvalidArgument(const std::string& message);

// The kernel's prefetch policy, or the one JAX_SUPEROFFLOAD_PREFETCH names
// (t0, nta or none), for experiments; and an error for a malformed
// JAX_SUPEROFFLOAD_HOST_THREADS (see OwnHelperThreads). Read on every call:
// the environment is the only state, and a getenv costs nothing beside a
// step.
ffi::Error ReadEnvironment(Prefetch* out);

bool ToElementType(ffi::DataType dtype, ElementType* out);

// Scalars per set in the f32 scalars operand (ScalarIndex in the .cc).
inline constexpr int64_t kNumScalarsPerSet = 9;

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

// Checks the scalars and splits the arrays into one block per scalar set.
ffi::Error ReadScalarSets(ffi::Buffer<ffi::S32> count,
                          ffi::Buffer<ffi::F32> scalars, bool nesterov,
                          int64_t size, std::vector<AdamConstants>* sets,
                          int64_t* block, bool keep_nonfinite = false);

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
      return InvalidArgument(
          "expected " + std::to_string(args) + " and " + std::to_string(rets) +
          " runs of " + std::to_string(k_) + " leaves, got " +
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
double ReseedThenStep(const float* master, const void* params,
                      ElementType type, const AdamConstants& constants,
                      float* out, int64_t begin, int64_t end, Isa isa,
                      const Step& step) {
  double total = 0.0;
  for (int64_t from = begin; from < end; from += kReseedBlock) {
    const int64_t to = std::min(end, from + kReseedBlock);
    ReseedRange(master, params, type, ReseedTolerance(constants), out, from,
                to, isa);
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

// One scalar set, checked for its sizes while decoding and read (`Read`)
// when the step runs: on a GPU stream its values are written by copies
// that have not run yet when the handler is called.
struct ScalarSet {
  const int32_t* count = nullptr;
  const float* scalars = nullptr;
  bool nesterov = false;
  bool keep_nonfinite = false;

  AdamConstants Read() const;
};

ffi::Error CheckOneScalarSet(ffi::Buffer<ffi::S32> count,
                             ffi::Buffer<ffi::F32> scalars, bool nesterov,
                             bool keep_nonfinite, ScalarSet* out);

// A bucket's scalar set and its f32[1] sum of squares checked, and the
// number of fixed work chunks over its `starts.back()` elements.
ffi::Error BucketSetup(ffi::Buffer<ffi::S32> count,
                       ffi::Buffer<ffi::F32> scalars, bool nesterov,
                       bool keep_nonfinite, const std::vector<int64_t>& starts,
                       ffi::ResultBuffer<ffi::F32>& sumsq, ScalarSet* set,
                       int64_t* num_chunks);

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_FFI_SUPPORT_H_
