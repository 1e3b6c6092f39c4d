// OnStream against a fake CUDA driver (no GPU): work runs when the "stream"
// reaches it, not when the handler returns; device pointers are refused
// before anything is enqueued; a step's failure reaches the next launch;
// and the process's host pool runs chunked work to the same result with
// any number of workers.

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "xla_ffi/ffi_support.h"
#include "xla_ffi/host_pool.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/stream_launch.h"

namespace jax_superoffload {
namespace {

int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// A stream that holds host functions until Drain(), and a set of pointers
// it reports as device memory.
struct FakeStream {
  std::vector<std::pair<void (*)(void*), void*>> queued;
  std::vector<const void*> device;
  int fail_launch = 0;
};
FakeStream* fake = nullptr;

int FakeLaunch(void* stream, void (*fn)(void*), void* data) {
  if (stream != fake) return 999;
  if (fake->fail_launch != 0) return fake->fail_launch;
  fake->queued.emplace_back(fn, data);
  return 0;
}

int FakeAttribute(void* data, int attribute, uint64_t pointer) {
  if (attribute != kPointerMemoryType) return 1;
  for (const void* p : fake->device) {
    if (reinterpret_cast<uint64_t>(p) == pointer) {
      *static_cast<unsigned*>(data) = kMemoryTypeDevice;
      return 0;
    }
  }
  return 1;  // CUDA_ERROR_INVALID_VALUE: memory the driver does not know.
}

void Drain() {
  auto queued = std::move(fake->queued);
  fake->queued.clear();
  for (auto& [fn, data] : queued) fn(data);
}

void TestDefersUntilTheStreamRuns() {
  FakeStream stream;
  fake = &stream;
  const CudaDriver driver{&FakeLaunch, &FakeAttribute, nullptr};
  OnStream launch(&driver, &stream);
  std::vector<float> host(1000, 1.0f);
  float sum = 0.0f;
  ffi::Error e = launch.Run(
      [&host, &sum](Workers workers) {
        std::vector<double> partial(10, 0.0);
        ParallelChunks(workers, 10, [&](int64_t c) {
          for (int i = 0; i < 100; ++i) partial[c] += host[c * 100 + i];
        });
        TotalInChunkOrder(partial, &sum);
        return ffi::Error::Success();
      },
      {host.data(), &sum});
  Check(e.success(), "launch succeeds: " + e.message());
  Check(sum == 0.0f, "nothing runs before the stream reaches it");
  Drain();
  Check(sum == 1000.0f, "the work ran on the stream: " + std::to_string(sum));
}

void TestRefusesDevicePointers() {
  FakeStream stream;
  fake = &stream;
  const CudaDriver driver{&FakeLaunch, &FakeAttribute, nullptr};
  OnStream launch(&driver, &stream);
  float host = 0.0f, on_device = 0.0f;
  stream.device.push_back(&on_device);
  bool ran = false;
  ffi::Error e = launch.Run(
      [&ran](Workers) {
        ran = true;
        return ffi::Error::Success();
      },
      {&host, &on_device});
  Check(e.failure(), "a device pointer is refused");
  Check(e.message().find("buffer 1") != std::string::npos &&
            e.message().find("device memory") != std::string::npos,
        "the error names the buffer: " + e.message());
  Check(stream.queued.empty(), "nothing was enqueued");
  Drain();
  Check(!ran, "the refused work never runs");
}

void TestDeferredErrorReachesTheNextLaunch() {
  FakeStream stream;
  fake = &stream;
  const CudaDriver driver{&FakeLaunch, &FakeAttribute, nullptr};
  OnStream launch(&driver, &stream);
  ffi::Error e = launch.Run(
      [](Workers) { return InvalidArgument("row must be 0 or 1, got 7"); },
      {});
  Check(e.success(), "the failing work is only enqueued");
  Drain();
  int next_ran = 0;
  e = launch.Run(
      [&next_ran](Workers) {
        ++next_ran;
        return ffi::Error::Success();
      },
      {});
  Check(e.failure() && e.message().find("got 7") != std::string::npos,
        "the next launch reports the earlier failure: " + e.message());
  Check(TakeDeferredError().success(), "and clears it");
  e = launch.Run([](Workers) { return ffi::Error::Success(); }, {});
  Check(e.success(), "a later launch runs again");
  Drain();
  Check(next_ran == 0, "the launch that reported the error ran nothing");
}

void TestLaunchFailureIsAnError() {
  FakeStream stream;
  stream.fail_launch = 700;
  fake = &stream;
  const CudaDriver driver{&FakeLaunch, &FakeAttribute, nullptr};
  OnStream launch(&driver, &stream);
  ffi::Error e = launch.Run([](Workers) { return ffi::Error::Success(); }, {});
  Check(e.failure() && e.message().find("700") != std::string::npos,
        "a failed cuLaunchHostFunc is an error: " + e.message());
  OnStream no_driver(nullptr, &stream);
  Check(no_driver.Run([](Workers) { return ffi::Error::Success(); }, {})
            .failure(),
        "no driver is an error");
}

void TestHostPoolResultsDoNotDependOnWorkers() {
  std::vector<double> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = 1.0 / (1.0 + i);
  auto total = [&](int64_t helpers) {
    HostPool pool;
    const int64_t workers = pool.Reserve(helpers);
    std::vector<double> partial(97, 0.0);
    RunChunks([&pool](auto task) { pool.Schedule(std::move(task)); }, workers,
              97, [&](int64_t c) {
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
    Check(total(helpers) == one,
          "same sum with " + std::to_string(helpers) + " workers");
  }
  HostPool pool;
  Check(pool.Reserve(3) == 3 && pool.Reserve(2) == 3,
        "Reserve never shrinks the pool");
}

}  // namespace
}  // namespace jax_superoffload

int main() {
  using namespace jax_superoffload;  // NOLINT: a test's main.
  TestDefersUntilTheStreamRuns();
  TestRefusesDevicePointers();
  TestDeferredErrorReachesTheNextLaunch();
  TestLaunchFailureIsAnError();
  TestHostPoolResultsDoNotDependOnWorkers();
  if (failures != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("stream_launch_test: all checks passed\n");
  return 0;
}
