// The stream launches (start and join, stream_launch.h) against a fake
// CUDA driver (fake_cuda_driver.h) that, like CUDA, runs copies and host
// functions later on a thread of its own. One test per rule the launches
// keep (a failed step writes nothing back and its error reaches the join;
// a failed stream stays failed until joined; no exception leaves a host
// function; only "not registered" means host memory; capture is refused;
// concurrent launches share no staging; the host function returns within
// microseconds), per rule of their staging (allocated once, portable, in
// the stream's context, freed; small device state is staged), and
// a Grace Adam bucket step staged through the fake, bit for bit equal to
// the same step run at once on the CPU; and the row step of stacked state
// (row_ffi.h): its row staged and read when the step runs, no staging
// shared between two rows in flight, a row out of range a sticky error,
// a row's 16-bit weights written with the rounding of its new master.

#include "xla_ffi/stream_launch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla_ffi/adam_kernel.h"
#include "xla_ffi/fake_cuda_driver.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/float_convert.h"
#include "xla_ffi/host_pool.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/row_ffi.h"
#include "xla_ffi/test_util.h"

namespace jax_superoffload {
namespace {

using Clock = std::chrono::steady_clock;
using Role = Touched::Role;

void Expect(bool ok, const std::string& what) {
  Check(ok, what.c_str(), "stream_launch_test");
}

// A fake driver, the launches on it and one compute stream. Members are
// destroyed in reverse: the launches (workers, staging) before the fake.
struct Rig {
  FakeCuda fake;
  CudaDriver driver = fake.driver();
  std::unique_ptr<StreamLaunches> launches =
      std::make_unique<StreamLaunches>(&driver);
  void* stream = fake.NewStream("compute");

  // Joins `stream` and waits for the compute stream (as the program's next
  // read of the results would).
  ffi::Error Join() {
    ffi::Error e = launches->Join(stream);
    fake.Synchronize();
    return e;
  }
};

// A step over `in` (read) and `out` (written): out = 2 * in, summed.
struct Doubling {
  const float* in;
  float* out;
  float* sum;
  int64_t n;
};

std::vector<Touched> Touches(Doubling& d) {
  return {Touch(d.in, 4 * d.n, Role::kInput),
          Touch(d.out, 4 * d.n, Role::kOutput), Touch(d.sum, 4, Role::kOutput)};
}

Work DoublingWork(const Doubling& d) {
  return [d](Workers workers) {
    std::vector<double> partial(4, 0.0);
    ParallelChunks(workers, 4, [&](int64_t c) {
      for (int64_t i = c; i < d.n; i += 4) {
        d.out[i] = 2.0f * d.in[i];
        partial[c] += d.in[i];
      }
    });
    TotalInChunkOrder(partial, d.sum);
    return ffi::Error::Success();
  };
}

// Starts `d` from the rig's stream: Place, then Run of `work` (the doubling
// step by default) as a bucket handler does, with slots of `reserve` bytes.
ffi::Error Start(Rig& rig, Doubling& d,
                 std::function<Work(Doubling)> make = nullptr,
                 size_t reserve = 0) {
  OnStream launch(rig.launches.get(), rig.stream, reserve);
  std::vector<Touched> touched = Touches(d);
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return launch.Run(make ? make(d) : DoublingWork(d));
}

// Device buffers of a doubling step: in[i] = i, out and sum preset to
// `sentinel`.
struct DeviceBuffers {
  std::vector<float> in, out;
  float sum;
  DeviceBuffers(Rig& rig, int64_t n, float sentinel)
      : in(n), out(n, sentinel), sum(sentinel) {
    for (int64_t i = 0; i < n; ++i) in[i] = static_cast<float>(i);
    rig.fake.MarkDevice(in.data(), 4 * n);
    rig.fake.MarkDevice(out.data(), 4 * n);
    rig.fake.MarkDevice(&sum, 4);
  }
  Doubling step() {
    return Doubling{in.data(), out.data(), &sum,
                    static_cast<int64_t>(in.size())};
  }
};

// A step that writes garbage into its outputs, then fails.
Work Failing(Doubling d, const std::string& why) {
  return [d, why](Workers) {
    for (int64_t i = 0; i < d.n; ++i) d.out[i] = -0.3725f;
    *d.sum = -0.3725f;
    return InvalidArgument(why);
  };
}

// In the log: the compute stream's first wait completes after every copy
// to staging (when it runs against the step on the side stream is free).
bool CopiesBeforeComputeWaits(const std::vector<std::string>& log) {
  int last_copy = -1, wait = -1;
  for (int i = 0; i < static_cast<int>(log.size()); ++i) {
    if (log[i].find("copy to host") != std::string::npos) last_copy = i;
    if (wait < 0 && log[i].find("compute: wait event") != std::string::npos) {
      wait = i;
    }
  }
  return last_copy >= 0 && last_copy < wait;
}

void TestStartReturnsAndJoinWaits() {
  Rig rig;
  DeviceBuffers b(rig, 1000, -1.0f);
  rig.fake.Hold(true);
  Doubling d = b.step();
  ffi::Error e = Start(rig, d);
  Expect(e.success(), "start succeeds: " + e.message());
  Expect(d.in != b.in.data() && d.out != b.out.data() && d.sum != &b.sum,
         "the step reads and writes staged stand-ins");
  b.in[0] = 7.0f;  // Written before the stream reaches the copy.
  Expect(rig.fake.Log().empty(), "nothing ran when the start returned");
  rig.fake.Hold(false);
  rig.fake.Synchronize(rig.stream);
  // Before the join the compute stream waits once: for the copies of the
  // step's device operands into staging (so XLA may reuse those buffers),
  // never for the step itself.
  Expect(rig.fake.Count("compute: wait event") == 1,
         "the compute stream waits only for the copies before the join");
  Expect(CopiesBeforeComputeWaits(rig.fake.Log()),
         "that wait comes after the copies to staging");
  e = rig.Join();
  Expect(e.success(), "join succeeds: " + e.message());
  Expect(b.out[0] == 14.0f && b.out[999] == 1998.0f && b.sum == 499507.0f,
         "results copied back by the join: " + std::to_string(b.out[0]) + " " +
             std::to_string(b.sum));
  Expect(rig.fake.Count("compute: wait event") == 2,
         "the join makes the compute stream wait once more");
  std::vector<std::string> log = rig.fake.Log();
  size_t host = 0, back = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i] == "side: host function") host = i;
    if (log[i].find("side: copy to device") == 0 && back == 0) back = i;
  }
  Expect(host > 0 && back > host, "copies back come after the host function");
}

// Rule: a failed host step writes nothing back, and its error reaches the
// join of the same step.
void TestFailedStepWritesNothingBack() {
  Rig rig;
  DeviceBuffers b(rig, 256, 5.0f);
  Doubling d = b.step();
  ffi::Error e = Start(rig, d, [](Doubling d) {
    return Failing(d, "row must be 0 or 1, got 7");
  });
  Expect(e.success(), "the failing step is only started: " + e.message());
  e = rig.Join();
  Expect(e.failure() && e.message().find("got 7") != std::string::npos,
         "the join reports the step's error: " + e.message());
  Expect(b.out[0] == 5.0f && b.out[255] == 5.0f && b.sum == 5.0f,
         "nothing written back: out[0] " + std::to_string(b.out[0]));
  Expect(rig.fake.Count("copy to device") == 0, "no copy back was enqueued");
  Expect(rig.launches->Join(rig.stream).success(), "reported once");
}

// Rule: a failed step keeps its stream failed (later launches run no step
// and write nothing) until a join has reported it.
void TestFailureIsStickyUntilJoined() {
  Rig rig;
  DeviceBuffers a(rig, 64, 5.0f), b(rig, 64, 6.0f), c(rig, 64, 8.0f);
  Doubling da = a.step(), db = b.step(), dc = c.step();
  Expect(
      Start(rig, da, [](Doubling d) { return Failing(d, "first"); }).success(),
      "start a");
  auto ran = std::make_shared<std::atomic<bool>>(false);
  Expect(Start(rig, db,
               [ran](Doubling d) {
                 Work w = DoublingWork(d);
                 return Work([ran, w](Workers ws) {
                   ran->store(true);
                   return w(ws);
                 });
               })
             .success(),
         "start b");
  ffi::Error e = rig.Join();
  Expect(e.failure() && e.message().find("first") != std::string::npos,
         "the join reports the first failure: " + e.message());
  Expect(!ran->load(), "the launch after the failure ran no step");
  Expect(b.out[0] == 6.0f && b.sum == 6.0f, "and wrote nothing back");
  Expect(Start(rig, dc).success(), "start after the join");
  e = rig.Join();
  Expect(e.success() && c.out[3] == 6.0f && c.sum == 2016.0f,
         "a launch after the join runs again: " + e.message());
}

// Rule: no exception leaves a host function or the worker.
void TestNoExceptionEscapes() {
  Rig rig;
  DeviceBuffers a(rig, 16, 1.0f);
  Doubling d = a.step();
  Expect(Start(rig, d,
               [](Doubling) {
                 return Work([](Workers) -> ffi::Error {
                   throw std::runtime_error("boom in the step");
                 });
               })
             .success(),
         "start a throwing step");
  ffi::Error e = rig.Join();
  Expect(
      e.failure() && e.message().find("boom in the step") != std::string::npos,
      "the exception is the join's error: " + e.message());
  Expect(a.out[0] == 1.0f, "nothing written back after the exception");
}

// Rule: only "not registered" (CUDA_ERROR_INVALID_VALUE) from the pointer
// query means host memory; any other failure is an error.
void TestOnlyNotRegisteredMeansHost() {
  Rig rig;
  FakeCuda::Knobs knobs;
  knobs.query_error = 201;  // CUDA_ERROR_INVALID_CONTEXT
  rig.fake.set_knobs(knobs);
  std::vector<float> in(8, 1.0f), out(8, 0.0f);
  float sum = 0.0f;
  Doubling d{in.data(), out.data(), &sum, 8};
  ffi::Error e = Start(rig, d);
  Expect(
      e.failure() && e.message().find("buffer 0") != std::string::npos &&
          e.message().find("cuPointerGetAttribute") != std::string::npos &&
          e.message().find("201") != std::string::npos,
      "a failed pointer query is an error naming the buffer: " + e.message());
  rig.fake.Synchronize();
  Expect(rig.fake.Log().empty(), "nothing was enqueued");
  knobs.query_error = 0;
  rig.fake.set_knobs(knobs);
  e = Start(rig, d);  // Unregistered: host memory, read where it is.
  Expect(e.success() && rig.Join().success() && out[7] == 2.0f &&
             rig.fake.stats().allocations == 0,
         "unregistered memory is host memory, not staged: " + e.message());
}

// Rule: capture into a CUDA graph is refused with a clear error.
void TestCaptureIsRefused() {
  Rig rig;
  FakeCuda::Knobs knobs;
  knobs.capturing.insert(rig.stream);
  rig.fake.set_knobs(knobs);
  DeviceBuffers b(rig, 8, 0.0f);
  Doubling d = b.step();
  ffi::Error e = Start(rig, d);
  Expect(e.failure() && e.message().find("CUDA graph") != std::string::npos,
         "a capturing stream is refused: " + e.message());
  e = rig.launches->Join(rig.stream);
  Expect(e.failure() && e.message().find("CUDA graph") != std::string::npos,
         "so is a capturing join: " + e.message());
  rig.fake.Synchronize();
  Expect(rig.fake.Log().empty() && rig.fake.stats().allocations == 0,
         "nothing enqueued or allocated");
}

bool Overlap(const void* a, size_t an, const void* b, size_t bn) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bn && y < x + an;
}

// Rule: launches in flight together never share staging bytes; a third
// waits for the first's slot.
void TestConcurrentLaunchesShareNoStaging() {
  Rig rig;
  DeviceBuffers a(rig, 300, 0.0f), b(rig, 300, 0.0f), c(rig, 300, 0.0f);
  for (int64_t i = 0; i < 300; ++i) b.in[i] = 1000.0f + i;
  rig.fake.Hold(true);
  Doubling da = a.step(), db = b.step(), dc = c.step();
  Expect(Start(rig, da).success() && Start(rig, db).success(), "two starts");
  const size_t bytes = 4 * 300;
  Expect(!Overlap(da.in, bytes, db.in, bytes) &&
             !Overlap(da.out, bytes, db.out, bytes) &&
             !Overlap(da.out, bytes, db.in, bytes) &&
             !Overlap(da.in, bytes, db.out, bytes) &&
             !Overlap(da.sum, 4, db.sum, 4),
         "the two launches' staging is disjoint");
  rig.fake.Hold(false);
  Expect(Start(rig, dc).success(), "a third start (waits for slot 0)");
  Expect(rig.Join().success(), "join");
  Expect(a.out[299] == 598.0f && b.out[299] == 2598.0f && c.out[1] == 2.0f &&
             b.sum == 300000.0f + 44850.0f,
         "each launch's own results: " + std::to_string(b.out[299]));
}

// Rule: the host function only hands the launch over (microseconds) while
// the step takes 200 ms, and the compute stream runs on meanwhile.
void TestHostFunctionReturnsAtOnce() {
  Rig rig;
  DeviceBuffers b(rig, 64, 0.0f);
  Doubling d = b.step();
  auto step_done = std::make_shared<Clock::time_point>();
  Expect(Start(rig, d,
               [step_done](Doubling d) {
                 Work w = DoublingWork(d);
                 return Work([w, step_done](Workers ws) {
                   std::this_thread::sleep_for(std::chrono::milliseconds(200));
                   *step_done = Clock::now();
                   return w(ws);
                 });
               })
             .success(),
         "start a 200 ms step");
  auto kernel_done = std::make_shared<Clock::time_point>();
  rig.fake.Enqueue(rig.stream, "next kernel",
                   [kernel_done] { *kernel_done = Clock::now(); });
  rig.fake.Synchronize(rig.stream);
  Expect(rig.Join().success(), "join");
  const double host = rig.fake.stats().longest_host_function;
  const double lead =
      std::chrono::duration<double>(*step_done - *kernel_done).count();
  std::printf(
      "host function: %.3f us; the next kernel ran %.0f ms before "
      "the step ended\n",
      1e6 * host, 1e3 * lead);
  Expect(host < 5e-3,
         "the host function returns in < 5 ms: " + std::to_string(host) + " s");
  Expect(lead > 0.0, "the compute stream ran on during the step");
}

// Point 4: staging in the stream's context, portable, allocated in the
// first step only, and freed with the launches.
void TestStagingAllocatedOnceAndFreed() {
  Rig rig;
  DeviceBuffers big(rig, 4096, 0.0f), small(rig, 100, 0.0f);
  int64_t first = 0;
  for (int step = 0; step < 5; ++step) {
    Doubling d1 = big.step(), d2 = small.step();
    Expect(Start(rig, d1).success() && Start(rig, d2).success() &&
               rig.Join().success(),
           "step " + std::to_string(step));
    if (step == 0) first = rig.launches->staging_allocations();
  }
  const int64_t steady = rig.launches->staging_allocations() - first;
  std::printf(
      "staging allocations: %lld in the first step, %lld in the next "
      "four\n",
      static_cast<long long>(first), static_cast<long long>(steady));
  Expect(first == 2 && steady == 0, "two slots, then no allocation");
  Expect(big.out[4095] == 8190.0f && small.out[99] == 198.0f, "results");
  FakeCuda::Stats stats = rig.fake.stats();
  Expect(stats.alloc_flags_seen == kHostAllocPortable,
         "allocated with CU_MEMHOSTALLOC_PORTABLE");
  Expect(stats.context_violations == 0,
         "every call made with the stream's context current" +
             (stats.violations.empty() ? "" : ": " + stats.violations[0]));
  rig.launches.reset();
  Expect(rig.fake.stats().live_allocations == 0, "staging freed at the end");
}

// Point 4: slots sized from the plan. Three buckets a step (small, big,
// small) take the two slots in turns, so a bucket's slot changes from one
// step to the next: grown on demand, a slot sized for a small bucket is
// reallocated when a big one comes to it. Sized to the largest bucket of the
// step (the plan's bound, BucketAttrs::staging_bytes), each slot is
// allocated once.
int64_t SteadyAllocations(size_t reserve) {
  Rig rig;
  DeviceBuffers big(rig, 4096, 0.0f), small(rig, 100, 0.0f);
  int64_t first = 0;
  for (int step = 0; step < 4; ++step) {
    Doubling a = small.step(), b = big.step(), c = small.step();
    Expect(Start(rig, a, nullptr, reserve).success() &&
               Start(rig, b, nullptr, reserve).success() &&
               Start(rig, c, nullptr, reserve).success() &&
               rig.Join().success(),
           "step " + std::to_string(step));
    if (step == 0) first = rig.launches->staging_allocations();
  }
  Expect(big.out[4095] == 8190.0f && small.out[99] == 198.0f, "results");
  return rig.launches->staging_allocations() - first;
}

void TestStagingSizedFromThePlan() {
  const size_t bound = 2 * 4 * 4096 + 256;  // In, out, the sum: aligned.
  const int64_t grown = SteadyAllocations(0), sized = SteadyAllocations(bound);
  std::printf("steady-state staging allocations: %lld grown, %lld sized\n",
              static_cast<long long>(grown), static_cast<long long>(sized));
  Expect(grown > 0, "grown on demand, the slots are reallocated");
  Expect(sized == 0, "sized from the plan, never after the first step");
}

// Point 6: small state in device memory (a 0-d count) is staged in and
// out; large device state is still refused.
void TestSmallDeviceStateIsStaged() {
  Rig rig;
  float state = 3.0f;
  rig.fake.MarkDevice(&state, 4);
  // Read and written in place, as a step's master_in and master_out.
  const float* in = &state;
  float* out = &state;
  OnStream launch(rig.launches.get(), rig.stream);
  std::vector<Touched> touched = {Touch(in, 4, Role::kState),
                                  Touch(out, 4, Role::kState)};
  ffi::Error e = launch.Place(touched);
  Expect(e.success() && out != &state && in == out,
         "0-d device state is staged, once: " + e.message());
  Expect(launch.Run([in, out](Workers) {
                 *out = *in + 1.0f;
                 return ffi::Error::Success();
               }).success() &&
             rig.Join().success() && state == 4.0f,
         "and written back: " + std::to_string(state));
  Expect(rig.fake.Count("copy to host 4") == 1 &&
             rig.fake.Count("copy to device 4") == 1,
         "one copy each way");
  std::vector<float> big(2048, 0.0f);
  rig.fake.MarkDevice(big.data(), 4 * big.size());
  float* p = big.data();
  OnStream refused(rig.launches.get(), rig.stream);
  std::vector<Touched> large = {Touch(p, 4 * 2048, Role::kState)};
  e = refused.Place(large);
  Expect(e.failure() && e.message().find("optimizer state in device memory") !=
                            std::string::npos,
         "large device state is refused: " + e.message());
}

void TestDriverFailuresAreErrors() {
  Rig rig;
  FakeCuda::Knobs knobs;
  knobs.fail_launch = 700;
  rig.fake.set_knobs(knobs);
  DeviceBuffers b(rig, 8, 0.0f);
  Doubling d = b.step();
  ffi::Error e = Start(rig, d);
  Expect(e.failure() && e.message().find("700") != std::string::npos,
         "a failed cuLaunchHostFunc is an error: " + e.message());
  Expect(rig.Join().success(), "and leaves nothing to join");
  knobs.fail_launch = 0;
  rig.fake.set_knobs(knobs);
  d = b.step();
  Expect(Start(rig, d).success() && rig.Join().success() && b.out[7] == 14.0f,
         "its slot was released");
  StreamLaunches none(nullptr);
  OnStream no_driver(&none, rig.stream);
  std::vector<Touched> nothing;
  Expect(no_driver.Place(nothing).failure(), "no driver is an error");
  OnStream unplaced(rig.launches.get(), rig.stream);
  Expect(unplaced.Run([](Workers) { return ffi::Error::Success(); }).failure(),
         "Run without Place is an error");
}

// A Grace Adam bucket (two leaves, bf16 gradients and weights on the
// device, fp32 state in host memory, sum of squares) through the fake, and
// the same step at once on the CPU: the same bits.
struct AdamBucket {
  int64_t n[2] = {3000, 517};
  std::vector<float> master[2], mu[2], nu[2];
  std::vector<uint16_t> grad[2], weights[2];
  float sumsq = 0.0f;
  // The new weights written over the gradients (a joined start's, with
  // BucketAttrs::weights_over_grads) rather than into `weights`.
  bool over = false;

  AdamBucket() {
    uint64_t seed = 37;
    for (int j = 0; j < 2; ++j) {
      for (auto* v : {&master[j], &mu[j], &nu[j]}) v->resize(n[j]);
      grad[j].resize(n[j]);
      weights[j].assign(n[j], 0);
      for (int64_t i = 0; i < n[j]; ++i) {
        master[j][i] = static_cast<float>(Uniform(seed));
        mu[j][i] = static_cast<float>(0.1 * Uniform(seed));
        nu[j][i] = static_cast<float>(0.01 * Unit(seed));
        const float g = static_cast<float>(Uniform(seed));
        uint32_t bits;
        std::memcpy(&bits, &g, 4);
        grad[j][i] = static_cast<uint16_t>(bits >> 16);
      }
    }
  }

  ffi::Error Step(Launch& launch) {
    AdamConfig config;
    config.learning_rate = 1e-2f;
    config.weight_decay = 0.01f;
    config.count = 3;
    const AdamConstants constants = MakeAdamConstants(config);
    std::vector<AdamBuffers> leaves(2);
    std::vector<Touched> touched;
    float* sum = &sumsq;
    touched.push_back(Touch(sum, 4, Role::kOutput));
    for (int j = 0; j < 2; ++j) {
      AdamBuffers& b = leaves[j];
      b.size = n[j];
      b.master_in = master[j].data();
      b.master_out = master[j].data();
      b.mu_in = mu[j].data();
      b.mu_out = mu[j].data();
      b.nu_in = nu[j].data();
      b.nu_out = nu[j].data();
      b.grad = grad[j].data();
      b.grad_type = ElementType::kBF16;
      b.lowp_out =
          over ? static_cast<void*>(grad[j].data()) : weights[j].data();
      b.lowp_type = ElementType::kBF16;
      for (const float** x : {&b.master_in, &b.mu_in, &b.nu_in}) {
        touched.push_back(Touch(*x, 4 * n[j], Role::kState));
      }
      for (float** x : {&b.master_out, &b.mu_out, &b.nu_out}) {
        touched.push_back(Touch(*x, 4 * n[j], Role::kState));
      }
      touched.push_back(Touch(b.grad, 2 * n[j], Role::kInput));
      touched.push_back(Touch(b.lowp_out, 2 * n[j], Role::kOutput));
    }
    JSO_RETURN_IF_ERROR(launch.Place(touched));
    const std::vector<int64_t> starts = Starts({n[0], n[1]});
    const int64_t chunks = (n[0] + n[1] + kChunkElements - 1) / kChunkElements;
    return launch.Run([=](Workers workers) {
      std::vector<double> partial(chunks, 0.0);
      ForEachPiece(workers, starts,
                   [&](size_t j, int64_t begin, int64_t end, int64_t chunk) {
                     partial[chunk] += AdamStepSumSquaresRange(
                         constants, leaves[j], begin, end, BestIsa());
                   });
      TotalInChunkOrder(partial, sum);
      return ffi::Error::Success();
    });
  }
};

void TestAdamBucketMatchesTheCpu() {
  AdamBucket cpu, staged;
  RunNow now(nullptr);
  Expect(cpu.Step(now).success(), "the CPU step");
  Rig rig;
  for (int j = 0; j < 2; ++j) {
    rig.fake.MarkDevice(staged.grad[j].data(), 2 * staged.n[j]);
    rig.fake.MarkDevice(staged.weights[j].data(), 2 * staged.n[j]);
  }
  rig.fake.MarkDevice(&staged.sumsq, 4);
  OnStream launch(rig.launches.get(), rig.stream);
  Expect(staged.Step(launch).success(), "the staged step starts");
  Expect(rig.Join().success(), "and joins");
  bool same = std::memcmp(&cpu.sumsq, &staged.sumsq, 4) == 0;
  for (int j = 0; j < 2; ++j) {
    same = same && cpu.master[j] == staged.master[j] &&
           cpu.mu[j] == staged.mu[j] && cpu.nu[j] == staged.nu[j] &&
           cpu.weights[j] == staged.weights[j];
  }
  Expect(same, "the staged Adam step equals the CPU's bit for bit");
  Expect(cpu.sumsq > 0.0f && cpu.weights[1][516] != 0, "and did something");
  Expect(rig.fake.Count("copy to host") == 2 &&
             rig.fake.Count("copy to device") == 2 + 1,
         "gradients staged in; weights and the sum staged out");
}

// The same bucket started as a GPU step starts it: holding its inputs
// (the compute stream never waits before the join) and writing its new
// weights over its gradients, whose buffers the worker fills from their
// own staging once the step is done: the CPU's weights, bit for bit.
void TestAdamBucketWeightsOverGradsMatchTheCpu() {
  AdamBucket cpu, staged;
  RunNow now(nullptr);
  Expect(cpu.Step(now).success(), "the CPU step");
  staged.over = true;
  Rig rig;
  for (int j = 0; j < 2; ++j) {
    rig.fake.MarkDevice(staged.grad[j].data(), 2 * staged.n[j]);
  }
  rig.fake.MarkDevice(&staged.sumsq, 4);
  OnStream launch(rig.launches.get(), rig.stream, 0, /*hold_inputs=*/true);
  Expect(staged.Step(launch).success(), "the staged step starts");
  rig.fake.Synchronize(rig.stream);
  Expect(rig.fake.Count("compute: wait event") == 0,
         "the compute stream does not wait before the join");
  Expect(rig.Join().success(), "and joins");
  bool same = std::memcmp(&cpu.sumsq, &staged.sumsq, 4) == 0;
  for (int j = 0; j < 2; ++j) {
    same = same && cpu.master[j] == staged.master[j] &&
           cpu.mu[j] == staged.mu[j] && cpu.nu[j] == staged.nu[j] &&
           cpu.weights[j] == staged.grad[j];
  }
  Expect(same, "the weights over the gradients equal the CPU's bit for bit");
  Expect(rig.fake.Count("copy to host") == 2 &&
             rig.fake.Count("side: copy to device") == 2 + 1,
         "gradients staged in; weights and the sum staged out by the worker");
}

// The new weights reach the device by copies on the compute stream after
// the join's wait for the launch: from the pinned host memory the worker
// wrote them to, or from device memory where XLA placed the launch's
// results (the worker filled them from staging); a copy to host memory is
// refused, none enqueued.
void TestWeightsCopiedToDeviceAfterTheJoin() {
  Rig rig;
  std::vector<float> in(64), host(64, -1.0f), device(64, 9.0f);
  float sum = 0.0f;
  for (int i = 0; i < 64; ++i) in[i] = static_cast<float>(i);
  rig.fake.MarkDevice(device.data(), 4 * 64);
  Doubling d{in.data(), host.data(), &sum, 64};
  Expect(Start(rig, d).success(), "started");
  Expect(rig.launches->Join(rig.stream).success(), "joined");
  ffi::Error e = rig.launches->CopyToDevice(
      rig.stream, {{device.data(), host.data(), 4 * 64}});
  rig.fake.Synchronize();
  std::vector<std::string> log = rig.fake.Log();
  int wait = -1, copy = -1;
  for (int i = 0; i < static_cast<int>(log.size()); ++i) {
    if (log[i] == "compute: wait event") wait = i;
    if (log[i].find("compute: copy to device") == 0) copy = i;
  }
  Expect(e.success() && device[5] == 10.0f && device[63] == 126.0f,
         "the device gets the new weights: " + std::to_string(device[5]));
  Expect(wait >= 0 && copy > wait,
         "copied on the compute stream after its wait for the launch");

  std::vector<float> from(8, 3.0f), to(8, 0.0f);
  rig.fake.MarkDevice(from.data(), 32);
  rig.fake.MarkDevice(to.data(), 32);
  const int to_device = rig.fake.Count("copy to device");
  e = rig.launches->CopyToDevice(rig.stream, {{to.data(), from.data(), 32}});
  rig.fake.Synchronize();
  Expect(e.success() && to[7] == 3.0f &&
             rig.fake.Count("compute: copy device to device 32") == 1 &&
             rig.fake.Count("copy to device") == to_device,
         "weights XLA left in device memory are copied on the device: " +
             e.message());

  std::vector<float> a(8), b(8);
  rig.fake.MarkDevice(a.data(), 32);
  const int copies = rig.fake.Count("copy ");
  e = rig.launches->CopyToDevice(
      rig.stream, {{device.data(), b.data(), 32}, {b.data(), a.data(), 32}});
  rig.fake.Synchronize();
  Expect(e.failure() &&
             e.message().find("from device to host") != std::string::npos &&
             rig.fake.Count("copy ") == copies,
         "a copy to host memory is refused, none enqueued: " + e.message());
}

// Rule: a start that holds its inputs (BucketAttrs::hold_inputs: XLA keeps
// them alive until the join) never makes the compute stream wait before
// the join, and an output placed in its input's buffer (the new weights
// aliased to the gradients) gets a stand-in of its own and is copied back
// by the worker as soon as its step is done, before any join.
void TestHeldInputsAndWeightsBackBeforeTheJoin() {
  Rig rig;
  const int64_t n = 1000;
  std::vector<float> grads(n);
  float sum = -1.0f;
  for (int64_t i = 0; i < n; ++i) grads[i] = static_cast<float>(i);
  rig.fake.MarkDevice(grads.data(), 4 * n);
  rig.fake.MarkDevice(&sum, 4);
  Doubling d{grads.data(), grads.data(), &sum, n};
  OnStream launch(rig.launches.get(), rig.stream, 0, /*hold_inputs=*/true);
  std::vector<Touched> touched = Touches(d);
  ffi::Error e = launch.Place(touched);
  Expect(e.success() && d.in != d.out && d.in != grads.data(),
         "the aliased output has a stand-in apart from its input's");
  Expect(launch.Run(DoublingWork(d)).success(), "started");
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (rig.fake.Count("side: copy to device") < 2 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  rig.fake.Synchronize();
  Expect(rig.fake.Count("side: copy to device") == 2,
         "the worker copied the results back before any join");
  Expect(
      grads[1] == 2.0f && grads[n - 1] == 2.0f * (n - 1) && sum == 499500.0f,
      "the results landed in the input's buffer: " + std::to_string(grads[1]));
  Expect(rig.fake.Count("compute: wait event") == 0,
         "the compute stream never waited for the copies to staging");
  Expect(rig.Join().success(), "joined");
  Expect(rig.fake.Count("compute: wait event") == 1,
         "the join is the compute stream's one wait");
}

// Whether the log shows a copy of `bytes` to the host on the fetch stream
// after the side stream's host function: a worker's fetch on demand.
bool FetchedAfterHostFunction(const std::vector<std::string>& log,
                              int64_t bytes) {
  int host = -1, fetch = -1;
  for (int i = 0; i < static_cast<int>(log.size()); ++i) {
    if (log[i] == "side: host function") host = i;
    if (log[i] == "side#2: copy to host " + std::to_string(bytes)) fetch = i;
  }
  return host >= 0 && fetch > host;
}

// Point 5: a re-seeding step's parameters (Role::kOnDemand) are copied to
// the host only when the step asks, that is when its device-side
// `unchanged` flag (staged with the start) is zero; then by the worker,
// after the side stream has passed the start, so they hold what the compute
// stream wrote before it. Returns the step's view of params[0] (-1: not
// read) through `seen`.
ffi::Error StartReseeding(Rig& rig, const float* params, int64_t n,
                          const int32_t* unchanged, float* seen) {
  OnStream launch(rig.launches.get(), rig.stream);
  std::vector<Touched> touched = {Touch(unchanged, 4, Role::kInput),
                                  Touch(params, 4 * n, Role::kOnDemand),
                                  Touch(seen, 4, Role::kOutput)};
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return launch.Run([=](Workers workers) {
    bool reads = false;
    JSO_RETURN_IF_ERROR(ReadsParams(unchanged, true, workers, &reads));
    *seen = reads ? params[0] + params[n - 1] : -1.0f;
    return ffi::Error::Success();
  });
}

void TestParamsCopiedOnlyWhenChanged() {
  Rig rig;
  const int64_t n = 4096;
  std::vector<float> params(n, 1.0f);
  int32_t unchanged = 1;
  float seen = 0.0f;
  rig.fake.MarkDevice(params.data(), 4 * n);
  rig.fake.MarkDevice(&unchanged, 4);
  rig.fake.MarkDevice(&seen, 4);
  auto param_copies = [&] {
    int copies = 0;
    for (const FakeCuda::CopyRecord& c : rig.fake.Copies()) {
      copies += c.to_host && c.bytes == 4 * n;
    }
    return copies;
  };
  for (int step = 0; step < 3; ++step) {  // Steady steps: never copied.
    Expect(StartReseeding(rig, params.data(), n, &unchanged, &seen).success(),
           "an unchanged step starts");
    Expect(rig.Join().success(), "and joins");
    Expect(seen == -1.0f, "it does not read the parameters");
  }
  Expect(
      param_copies() == 0 && rig.launches->fetched_inputs() == 0,
      "no parameter copy in steady steps: " + std::to_string(param_copies()));
  // Changed: the compute stream writes the flag and the parameters (a
  // kernel) before the start; the step sees what it wrote.
  rig.fake.Hold(true);
  rig.fake.Enqueue(rig.stream, "kernel", [&] {
    unchanged = 0;
    params[0] = 5.0f;
    params[n - 1] = 7.0f;
  });
  Expect(StartReseeding(rig, params.data(), n, &unchanged, &seen).success(),
         "a changed step starts");
  rig.fake.Hold(false);
  Expect(rig.Join().success(), "and joins");
  Expect(seen == 12.0f,
         "it reads the parameters the compute stream wrote "
         "before the start: " +
             std::to_string(seen));
  Expect(param_copies() == 1 && rig.launches->fetched_inputs() == 1,
         "one parameter copy");
  Expect(FetchedAfterHostFunction(rig.fake.Log(), 4 * n),
         "copied on the fetch stream after the start's host function");
}

// Row steps (row_ffi.h) of one leaf's stacked fp32 state in host memory:
// kRows rows of n elements; the row's bf16 gradient, the count, the scalars
// and the row itself in "device" memory, as a scan's loop hands them over.
struct RowStack {
  static constexpr int64_t kRows = 3;
  int64_t n;
  std::vector<float> master, mu, nu;
  std::vector<uint16_t> grad;
  int32_t count = 3;
  std::vector<float> scalars;
  int32_t row = 0;
  // Stacked 16-bit weights of `weights_type`, kRows rows of n, where set.
  std::vector<uint16_t> weights;
  ElementType weights_type = ElementType::kNone;

  RowStack(int64_t size, uint64_t seed) : n(size) {
    for (auto* v : {&master, &mu, &nu}) v->resize(kRows * n);
    for (int64_t i = 0; i < kRows * n; ++i) {
      master[i] = static_cast<float>(Uniform(seed));
      mu[i] = static_cast<float>(0.1 * Uniform(seed));
      nu[i] = static_cast<float>(0.01 * Unit(seed));
    }
    grad.resize(n);
    SetGradient(seed);
    AdamConfig config;
    config.learning_rate = 1e-2f;
    config.weight_decay = 0.01f;
    for (const PackedScalar& p : kPackedScalars) {
      scalars.push_back(config.*p.field);
    }
  }

  void SetGradient(uint64_t seed) {
    for (uint16_t& g : grad) {
      const float x = static_cast<float>(Uniform(seed));
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      g = static_cast<uint16_t>(bits >> 16);
    }
  }

  void MarkDevice(FakeCuda& fake) {
    fake.MarkDevice(grad.data(), 2 * n);
    fake.MarkDevice(&count, 4);
    fake.MarkDevice(scalars.data(), 4 * scalars.size());
    fake.MarkDevice(&row, 4);
  }

  RowStep Step() {
    RowStep step;
    step.set.count = &count;
    step.set.scalars = scalars.data();
    step.row = &row;
    step.rows = kRows;
    SegmentLeaf leaf;
    AdamBuffers& b = leaf.b;
    b.size = n;
    b.master_in = b.master_out = master.data();
    b.mu_in = b.mu_out = mu.data();
    b.nu_in = b.nu_out = nu.data();
    b.grad = grad.data();
    b.grad_type = ElementType::kBF16;
    if (!weights.empty()) {
      b.lowp_out = weights.data();
      b.lowp_type = weights_type;
    }
    step.leaves = {leaf};
    return step;
  }

  // Row `r` stepped with the current gradient by the kernel itself.
  void StepRowDirectly(int64_t r) {
    AdamBuffers b = Step().leaves[0].b;
    for (float** x : {&b.master_out, &b.mu_out, &b.nu_out}) *x += r * n;
    b.master_in = b.master_out;
    b.mu_in = b.mu_out;
    b.nu_in = b.nu_out;
    AdamStepRange(Step().set.Read(0), b, 0, n, BestIsa());
  }

  bool SameState(const RowStack& other) const {
    return master == other.master && mu == other.mu && nu == other.nu;
  }
};

const BucketAttrs kRowAttrs = {false, false, false, 1, false,
                               false, "t0",  0,     0};

ffi::Error StartRow(Rig& rig, RowStack& stack) {
  OnStream launch(rig.launches.get(), rig.stream);
  return StartRowStep(launch, stack.Step(), kRowAttrs);
}

// The row is staged from device memory and read by the worker when the
// step runs: written after the start returned, before the copies ran, its
// new value is the row stepped.
void TestRowIsReadWhenTheStepRuns() {
  Rig rig;
  RowStack stack(517, 41);
  stack.MarkDevice(rig.fake);
  RowStack want = stack;
  want.StepRowDirectly(2);
  rig.fake.Hold(true);
  ffi::Error e = StartRow(rig, stack);
  Expect(e.success(), "the row step starts: " + e.message());
  stack.row = 2;  // The start saw 0; the copies have not run.
  Expect(rig.fake.Log().empty(), "nothing ran when the start returned");
  rig.fake.Hold(false);
  e = rig.Join();
  Expect(e.success(), "and joins: " + e.message());
  Expect(stack.SameState(want), "row 2, the value at the copy, was stepped");
  bool staged = false;
  for (const FakeCuda::CopyRecord& c : rig.fake.Copies()) {
    staged |= c.to_host && c.device == reinterpret_cast<uint64_t>(&stack.row) &&
              c.bytes == 4 && c.host != &stack.row;
  }
  Expect(staged, "the row was copied from the device to staging");
}

// A scan's loop: one counter and one gradient buffer on the device, which
// the compute stream rewrites between two row starts in flight together.
// Each launch steps its own row with its own gradient (staged at its
// place in the stream), and their staging is disjoint.
void TestTwoRowLaunchesShareNoStaging() {
  Rig rig;
  RowStack stack(300, 43);
  stack.MarkDevice(rig.fake);
  RowStack want = stack;
  want.StepRowDirectly(0);
  want.SetGradient(44);
  want.StepRowDirectly(1);
  rig.fake.Hold(true);
  Expect(StartRow(rig, stack).success(), "the start of row 0");
  RowStack* s = &stack;
  rig.fake.Enqueue(rig.stream, "next iteration", [s] {
    s->row = 1;
    s->SetGradient(44);
  });
  Expect(StartRow(rig, stack).success(), "the start of row 1");
  const size_t starts = rig.fake.Copies().size();
  rig.fake.Hold(false);
  Expect(rig.Join().success(), "join");
  Expect(stack.SameState(want), "rows 0 and 1 stepped with their gradients");
  std::vector<FakeCuda::CopyRecord> copies = rig.fake.Copies();
  Expect(starts % 2 == 0 && starts >= 8, "each start staged its operands");
  bool disjoint = true;
  for (size_t i = 0; i < starts / 2; ++i) {
    for (size_t j = starts / 2; j < starts; ++j) {
      disjoint &= !Overlap(copies[i].host, copies[i].bytes, copies[j].host,
                           copies[j].bytes);
    }
  }
  Expect(disjoint, "the two launches' staging is disjoint");
}

// A row outside [0, L) is the launch's error, read when it runs: it writes
// nothing, keeps the stream failed (a later row start steps nothing) and
// reaches the join.
void TestRowOutOfRangeIsAStickyError() {
  Rig rig;
  RowStack bad(64, 45), later(64, 46);
  bad.MarkDevice(rig.fake);
  later.MarkDevice(rig.fake);
  const RowStack bad_before = bad, later_before = later;
  rig.fake.Hold(true);
  Expect(StartRow(rig, bad).success(), "a start with row 0");
  bad.row = 3;  // Before its copies run.
  Expect(StartRow(rig, later).success(), "a later start, row 0");
  rig.fake.Hold(false);
  ffi::Error e = rig.Join();
  Expect(e.failure() &&
             e.message().find("row 3 is outside [0, 3)") != std::string::npos &&
             e.message().find("L = 3") != std::string::npos,
         "the join reports the row and L: " + e.message());
  Expect(bad.SameState(bad_before), "the failed launch wrote nothing");
  Expect(later.SameState(later_before), "the later launch stepped nothing");
  Expect(StartRow(rig, later).success() && rig.Join().success(),
         "after the join a row start runs again");
  RowStack want = later_before;
  want.StepRowDirectly(0);
  Expect(later.SameState(want), "and steps its row");
}

// A row step with stacked 16-bit weights writes the row's new master,
// rounded to nearest even, into the weights' row and leaves their other
// rows as they were.
void TestRowWritesItsRoundedWeights() {
  for (ElementType type : {ElementType::kBF16, ElementType::kF16}) {
    Rig rig;
    RowStack stack(517, 49);
    stack.MarkDevice(rig.fake);
    stack.row = 2;
    RowStack want = stack;
    want.StepRowDirectly(2);
    stack.weights.assign(RowStack::kRows * stack.n, 0x7bcd);
    stack.weights_type = type;
    want.weights = stack.weights;
    const int64_t n = stack.n;
    for (int64_t i = 2 * n; i < 3 * n; ++i) {
      want.weights[i] = type == ElementType::kBF16
                            ? FloatToBf16Bits(want.master[i])
                            : FloatToF16Bits(want.master[i]);
    }
    ffi::Error e = StartRow(rig, stack);
    Expect(e.success() && rig.Join().success(),
           "the row step with weights runs: " + e.message());
    Expect(stack.SameState(want), "row 2's state stepped");
    Expect(stack.weights == want.weights,
           "row 2's weights are its new master rounded, rows 0 and 1 as "
           "they were");
  }
}

// Two row steps of a stacked gradient (every row's, in device memory, held
// by XLA until the join) in a backward loop's order: the row is a cursor
// in host memory, set to L = 3, so the first steps row 2 and the second
// row 1, and leaves it at 1. The starts hold their inputs: the compute
// stream waits for nothing before the join (it rewrites row 0 meanwhile,
// the loop's next iteration, which no step reads), and each worker fetches
// its own row, on the fetch stream, after its start's host function.
void TestStackedGradientRowsAreFetchedByTheWorker() {
  Rig rig;
  RowStack stack(517, 51);
  const int64_t n = stack.n;
  std::vector<uint16_t> stacked(RowStack::kRows * n, 0);
  for (int64_t r = 0; r < RowStack::kRows; ++r) {
    stack.SetGradient(60 + r);
    std::copy(stack.grad.begin(), stack.grad.end(), stacked.begin() + r * n);
  }
  rig.fake.MarkDevice(stacked.data(), 2 * RowStack::kRows * n);
  rig.fake.MarkDevice(&stack.count, 4);
  rig.fake.MarkDevice(stack.scalars.data(), 4 * stack.scalars.size());
  stack.row = RowStack::kRows;  // The cursor, in host memory.
  RowStack want = stack;
  for (int64_t r : {2, 1}) {
    std::copy(stacked.begin() + r * n, stacked.begin() + (r + 1) * n,
              want.grad.begin());
    want.StepRowDirectly(r);
  }
  rig.fake.Hold(true);
  for (int k = 0; k < 2; ++k) {
    OnStream launch(rig.launches.get(), rig.stream, 0, /*hold_inputs=*/true);
    RowStep step = stack.Step();
    step.leaves[0].b.grad = stacked.data();
    step.stacked_grads = true;
    ffi::Error e = StartRowStep(launch, std::move(step), kRowAttrs);
    Expect(e.success(),
           "a row step of a stacked gradient starts: " + e.message());
  }
  uint16_t* next = stacked.data();  // Row 0: the loop's next iteration.
  rig.fake.Enqueue(rig.stream, "next iteration", [next, n] {
    std::fill(next, next + n, uint16_t{0x7f80});  // +Inf in bf16.
  });
  rig.fake.Hold(false);
  rig.fake.Synchronize();
  Expect(rig.fake.Count("compute: wait event") == 0,
         "the compute stream waited for nothing before the join");
  ffi::Error e = rig.Join();
  Expect(e.success(), "and joins: " + e.message());
  Expect(stack.SameState(want), "rows 2 then 1 stepped with their gradients");
  Expect(stack.row == 1, "the cursor is left at the last row stepped");
  std::vector<uint64_t> rows;
  for (const FakeCuda::CopyRecord& c : rig.fake.Copies()) {
    const uint64_t base = reinterpret_cast<uint64_t>(stacked.data());
    if (c.to_host && c.device >= base && c.device < base + 6 * n) {
      Expect(c.bytes == static_cast<size_t>(2 * n), "a row's bytes");
      rows.push_back((c.device - base) / (2 * n));
    }
  }
  Expect(rows == std::vector<uint64_t>{2, 1} &&
             rig.launches->fetched_inputs() == 2,
         "rows 2 and 1 fetched by the workers, nothing else");
  Expect(FetchedAfterHostFunction(rig.fake.Log(), 2 * n),
         "copied on the fetch stream after the start's host function");
}

// Row steps of a stacked gradient with the new weights over it
// (RowStep::over_grads), in a backward loop's order: each worker fetches its
// row, steps it, and copies the row's new master, rounded to the
// gradient's bf16, back over that row of the device buffer, so that after
// the join the buffer holds every row's new weights. Three launches share
// two staging slots: the third fetches into the first's slot only after
// that one's copy back out of it.
void TestStackedGradientRowsGetTheirNewWeightsBack() {
  Rig rig;
  RowStack stack(517, 53);
  const int64_t n = stack.n, rows = RowStack::kRows;
  std::vector<uint16_t> stacked(rows * n, 0);
  for (int64_t r = 0; r < rows; ++r) {
    stack.SetGradient(70 + r);
    std::copy(stack.grad.begin(), stack.grad.end(), stacked.begin() + r * n);
  }
  rig.fake.MarkDevice(stacked.data(), 2 * rows * n);
  rig.fake.MarkDevice(&stack.count, 4);
  rig.fake.MarkDevice(stack.scalars.data(), 4 * stack.scalars.size());
  stack.row = rows;  // The cursor, in host memory.
  RowStack want = stack;
  std::vector<uint16_t> weights(rows * n);
  for (int64_t r : {2, 1, 0}) {
    std::copy(stacked.begin() + r * n, stacked.begin() + (r + 1) * n,
              want.grad.begin());
    want.StepRowDirectly(r);
    for (int64_t i = r * n; i < (r + 1) * n; ++i) {
      weights[i] = FloatToBf16Bits(want.master[i]);
    }
  }
  rig.fake.Hold(true);
  for (int k = 0; k < 3; ++k) {
    OnStream launch(rig.launches.get(), rig.stream, 0, /*hold_inputs=*/true);
    RowStep step = stack.Step();
    AdamBuffers& b = step.leaves[0].b;
    b.grad = b.lowp_out = stacked.data();
    b.lowp_type = ElementType::kBF16;
    step.stacked_grads = step.over_grads = true;
    ffi::Error e = StartRowStep(launch, std::move(step), kRowAttrs);
    Expect(e.success(),
           "a row step with weights over its stacked gradient "
           "starts: " +
               e.message());
    if (k == 0) rig.fake.Hold(false);  // The next start waits for a slot.
  }
  ffi::Error e = rig.Join();
  Expect(e.success(), "and joins: " + e.message());
  Expect(stack.SameState(want), "rows 2, 1, 0 stepped with their gradients");
  Expect(stacked == weights,
         "every row of the device buffer holds its new weights");
  const std::vector<std::string> log = rig.fake.Log();
  const std::string back = "side: copy to device " + std::to_string(2 * n);
  const std::string fetched = "side#2: copy to host " + std::to_string(2 * n);
  std::vector<int> backs, fetches;
  for (int i = 0; i < static_cast<int>(log.size()); ++i) {
    if (log[i] == back) backs.push_back(i);
    if (log[i] == fetched) fetches.push_back(i);
  }
  Expect(backs.size() == 3 && fetches.size() == 3,
         "three rows fetched and three copied back");
  Expect(backs.size() == 3 && fetches.size() == 3 && fetches[2] > backs[0],
         "the third fetch, into the first's slot, follows its copy back");
}

// Point 5 for the rows: a stack's re-seed (AdamReseedRows) reads nothing
// while `unchanged` is set; cleared, its worker fetches the stack's
// parameters a row at a time (on demand, through one row of staging) and
// re-seeds each row of the master as ReseedRange does.
void TestStackReseedFetchesRowByRowOnlyWhenChanged() {
  Rig rig;
  RowStack stack(1000, 47);
  stack.MarkDevice(rig.fake);
  const int64_t n = stack.n, rows = RowStack::kRows;
  std::vector<uint16_t> params(rows * n);
  for (int64_t i = 0; i < rows * n; ++i) {  // Far from every master.
    params[i] = FloatToBf16Bits(stack.master[i] + 0.5f * (i % 3));
  }
  int32_t unchanged = 1;
  rig.fake.MarkDevice(params.data(), 2 * rows * n);
  rig.fake.MarkDevice(&unchanged, 4);
  auto start = [&] {
    StackReseed reseed;
    reseed.set = stack.Step().set;
    reseed.unchanged = &unchanged;
    reseed.rows = rows;
    reseed.leaves.push_back(
        {stack.master.data(), params.data(), ElementType::kBF16, n});
    OnStream launch(rig.launches.get(), rig.stream);
    return StartReseedRows(launch, std::move(reseed), kRowAttrs);
  };
  const std::vector<float> before = stack.master;
  Expect(start().success() && rig.Join().success(), "an unchanged re-seed");
  Expect(stack.master == before && rig.launches->fetched_inputs() == 0,
         "reads and writes nothing while unchanged");
  unchanged = 0;
  Expect(start().success() && rig.Join().success(), "a changed re-seed");
  std::vector<float> want = before;
  const float tolerance = ReseedTolerance(stack.Step().set.Read(0));
  ReseedRange(want.data(), params.data(), ElementType::kBF16, tolerance,
              want.data(), 0, rows * n, Isa::kScalar);
  Expect(stack.master == want && want != before,
         "re-seeds every row as ReseedRange");
  std::vector<int64_t> fetched;  // Row of each copy from the parameters.
  bool row_sized = true;
  const char* first = reinterpret_cast<const char*>(params.data());
  for (const FakeCuda::CopyRecord& c : rig.fake.Copies()) {
    const char* from = reinterpret_cast<const char*>(c.device);
    if (!c.to_host || from < first || from >= first + 2 * rows * n) continue;
    fetched.push_back((from - first) / (2 * n));
    row_sized &= c.bytes == static_cast<size_t>(2 * n);
  }
  Expect(fetched == std::vector<int64_t>{0, 1, 2} && row_sized &&
             rig.launches->fetched_inputs() == rows,
         "fetches each row once, in order, a row at a time: " +
             std::to_string(fetched.size()));
}

void TestHostPoolResultsDoNotDependOnWorkers() {
  std::vector<double> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = 1.0 / (1.0 + i);
  auto total = [&](int64_t helpers) {
    HostPool pool;
    const int64_t workers = pool.Reserve(helpers);
    std::vector<double> partial(97, 0.0);
    RunChunks([&pool](auto task) { pool.Schedule(std::move(task)); }, workers,
              97,
              [&](int64_t c) {
                for (size_t i = c; i < data.size(); i += 97) {
                  partial[c] += data[i];
                }
              });
    double sum = 0.0;
    for (double p : partial) sum += p;
    return sum;
  };
  const double one = total(0);
  for (int64_t helpers : {1, 3, 8}) {
    Expect(total(helpers) == one,
           "same sum with " + std::to_string(helpers) + " workers");
  }
  HostPool pool;
  Expect(pool.Reserve(3) == 3 && pool.Reserve(2) == 3,
         "Reserve never shrinks the pool");
}

}  // namespace
}  // namespace jax_superoffload

// Runs every test, or those named on the command line.
int main(int argc, char** argv) {
  using namespace jax_superoffload;  // NOLINT: a test's main.
  const std::pair<const char*, void (*)()> tests[] = {
      {"start_join", TestStartReturnsAndJoinWaits},
      {"failed_writes_nothing", TestFailedStepWritesNothingBack},
      {"sticky", TestFailureIsStickyUntilJoined},
      {"no_exception", TestNoExceptionEscapes},
      {"not_registered", TestOnlyNotRegisteredMeansHost},
      {"capture", TestCaptureIsRefused},
      {"no_shared_staging", TestConcurrentLaunchesShareNoStaging},
      {"host_function_at_once", TestHostFunctionReturnsAtOnce},
      {"staging_once", TestStagingAllocatedOnceAndFreed},
      {"staging_sized", TestStagingSizedFromThePlan},
      {"small_state", TestSmallDeviceStateIsStaged},
      {"driver_failures", TestDriverFailuresAreErrors},
      {"adam_bucket", TestAdamBucketMatchesTheCpu},
      {"adam_bucket_over_grads", TestAdamBucketWeightsOverGradsMatchTheCpu},
      {"weights_to_device", TestWeightsCopiedToDeviceAfterTheJoin},
      {"held_inputs", TestHeldInputsAndWeightsBackBeforeTheJoin},
      {"params_on_demand", TestParamsCopiedOnlyWhenChanged},
      {"row_read_when_run", TestRowIsReadWhenTheStepRuns},
      {"row_no_shared_staging", TestTwoRowLaunchesShareNoStaging},
      {"row_out_of_range", TestRowOutOfRangeIsAStickyError},
      {"row_weights", TestRowWritesItsRoundedWeights},
      {"row_stacked_gradient", TestStackedGradientRowsAreFetchedByTheWorker},
      {"row_weights_over_stacked_gradient",
       TestStackedGradientRowsGetTheirNewWeightsBack},
      {"stack_reseed_on_demand", TestStackReseedFetchesRowByRowOnlyWhenChanged},
      {"host_pool", TestHostPoolResultsDoNotDependOnWorkers},
  };
  std::vector<std::string> names;  // Flags (--quick) name no test.
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] != '-') names.push_back(argv[i]);
  }
  for (const auto& [name, test] : tests) {
    if (!names.empty() &&
        std::find(names.begin(), names.end(), name) == names.end()) {
      continue;
    }
    const int failed = g_failed;
    test();
    std::printf("%s: %s\n", name, g_failed == failed ? "ok" : "FAILED");
  }
  return Report();
}
