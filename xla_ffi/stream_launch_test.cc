// OnStream against a fake CUDA driver (no GPU): work runs when the "stream"
// reaches it, not when the handler returns; state in device memory is
// refused before anything is enqueued, other device buffers are staged
// through pinned memory in stream order; a step's failure reaches the next
// launch; and the process's host pool runs chunked work to the same result
// with any number of workers.

#include "xla_ffi/stream_launch.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "xla_ffi/ffi_support.h"
#include "xla_ffi/host_pool.h"
#include "xla_ffi/launch.h"

namespace jax_superoffload {
namespace {

int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// A stream that holds its operations (host functions and copies) until
// Drain(), and a set of buffers it reports as device memory.
struct FakeStream {
  std::vector<std::function<void()>> queued;
  std::vector<const void*> device;
  int fail_launch = 0;
  int allocations = 0;
};
FakeStream* fake = nullptr;

int FakeLaunch(void* stream, void (*fn)(void*), void* data) {
  if (stream != fake) return 999;
  if (fake->fail_launch != 0) return fake->fail_launch;
  fake->queued.push_back([fn, data] { fn(data); });
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

int FakeToHost(void* host, uint64_t device, size_t bytes, void* stream) {
  if (stream != fake) return 999;
  fake->queued.push_back(
      [=] { std::memcpy(host, reinterpret_cast<const void*>(device), bytes); });
  return 0;
}

int FakeToDevice(uint64_t device, const void* host, size_t bytes,
                 void* stream) {
  if (stream != fake) return 999;
  fake->queued.push_back(
      [=] { std::memcpy(reinterpret_cast<void*>(device), host, bytes); });
  return 0;
}

int FakeAlloc(void** pointer, size_t bytes, unsigned) {
  ++fake->allocations;
  *pointer = std::malloc(bytes);  // Leaked, as the launch keeps its blocks.
  return *pointer == nullptr ? 2 : 0;
}

const CudaDriver kFake{&FakeLaunch,   &FakeAttribute, &FakeToHost,
                       &FakeToDevice, &FakeAlloc,     nullptr};

void Drain() {
  auto queued = std::move(fake->queued);
  fake->queued.clear();
  for (auto& op : queued) op();
}

// A step over `in` (read) and `out` (written): out = 2 * in, summed.
struct Doubling {
  const float* in;
  float* out;
  float* sum;
  int64_t n;
};

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

ffi::Error Launch(OnStream& launch, Doubling& d) {
  using Role = Touched::Role;
  std::vector<Touched> touched = {Touch(d.in, 4 * d.n, Role::kInput),
                                  Touch(d.out, 4 * d.n, Role::kOutput),
                                  Touch(d.sum, 4, Role::kOutput)};
  JSO_RETURN_IF_ERROR(launch.Place(touched));
  return launch.Run(DoublingWork(d));
}

void TestDefersUntilTheStreamRuns() {
  FakeStream stream;
  fake = &stream;
  OnStream launch(&kFake, &stream);
  std::vector<float> in(1000, 1.0f), out(1000, 0.0f);
  float sum = 0.0f;
  Doubling d{in.data(), out.data(), &sum, 1000};
  ffi::Error e = Launch(launch, d);
  Check(e.success(), "launch succeeds: " + e.message());
  Check(stream.allocations == 0, "host buffers are not staged");
  Check(sum == 0.0f && out[0] == 0.0f,
        "nothing runs before the stream reaches it");
  Drain();
  Check(sum == 1000.0f && out[999] == 2.0f,
        "the work ran on the stream: " + std::to_string(sum));
}

void TestDeviceBuffersAreStagedInStreamOrder() {
  FakeStream stream;
  fake = &stream;
  OnStream launch(&kFake, &stream);
  std::vector<float> in(1000), out(1000, 0.0f);
  for (int i = 0; i < 1000; ++i) in[i] = static_cast<float>(i);
  float sum = 0.0f;
  stream.device = {in.data(), out.data(), &sum};
  Doubling d{in.data(), out.data(), &sum, 1000};
  ffi::Error e = Launch(launch, d);
  Check(e.success(), "staged launch succeeds: " + e.message());
  Check(stream.allocations == 1, "one pinned block");
  Check(d.in != in.data() && d.out != out.data() && d.sum != &sum,
        "the step reads and writes stand-ins");
  Check(
      stream.queued.size() == 1 + 1 + 2,
      "copy in, step, copy out twice: " + std::to_string(stream.queued.size()));
  in[0] = 7.0f;  // Written (on the stream) before the copy in runs.
  Drain();
  Check(out[0] == 14.0f && out[999] == 1998.0f,
        "results copied back: " + std::to_string(out[0]));
  Check(sum == 499507.0f, "sum copied back: " + std::to_string(sum));
  OnStream again(&kFake, &stream);
  Doubling d2{in.data(), out.data(), &sum, 1000};
  Check(Launch(again, d2).success(), "a second launch");
  Check(stream.allocations == 1, "the stream's block is reused");
  Drain();
}

void TestRefusesStateInDeviceMemory() {
  FakeStream stream;
  fake = &stream;
  OnStream launch(&kFake, &stream);
  float host = 0.0f, on_device = 0.0f;
  float* state = &on_device;
  stream.device.push_back(&on_device);
  const float* input = &host;
  std::vector<Touched> touched = {Touch(input, 4, Touched::Role::kInput),
                                  Touch(state, 4, Touched::Role::kState)};
  ffi::Error e = launch.Place(touched);
  Check(e.failure(), "device state is refused");
  Check(e.message().find("buffer 1") != std::string::npos &&
            e.message().find("optimizer state in device memory") !=
                std::string::npos,
        "the error names the buffer: " + e.message());
  Check(stream.queued.empty(), "nothing was enqueued");
}

void TestDeferredErrorReachesTheNextLaunch() {
  FakeStream stream;
  fake = &stream;
  std::vector<Touched> none;
  OnStream first(&kFake, &stream);
  Check(first.Place(none).success(), "place");
  ffi::Error e = first.Run(
      [](Workers) { return InvalidArgument("row must be 0 or 1, got 7"); });
  Check(e.success(), "the failing work is only enqueued");
  Drain();
  OnStream second(&kFake, &stream);
  e = second.Place(none);
  Check(e.failure() && e.message().find("got 7") != std::string::npos,
        "the next launch reports the earlier failure: " + e.message());
  Check(TakeDeferredError().success(), "and clears it");
  OnStream third(&kFake, &stream);
  Check(third.Place(none).success(), "a later launch places again");
  Check(third.Run([](Workers) { return ffi::Error::Success(); }).success(),
        "and runs");
  Drain();
}

void TestLaunchFailureIsAnError() {
  FakeStream stream;
  stream.fail_launch = 700;
  fake = &stream;
  std::vector<Touched> none;
  OnStream launch(&kFake, &stream);
  Check(launch.Place(none).success(), "place");
  ffi::Error e = launch.Run([](Workers) { return ffi::Error::Success(); });
  Check(e.failure() && e.message().find("700") != std::string::npos,
        "a failed cuLaunchHostFunc is an error: " + e.message());
  OnStream no_driver(nullptr, &stream);
  Check(no_driver.Place(none).failure(), "no driver is an error");
  OnStream unplaced(&kFake, &stream);
  Check(unplaced.Run([](Workers) { return ffi::Error::Success(); }).failure(),
        "Run without Place is an error");
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
  TestDeviceBuffersAreStagedInStreamOrder();
  TestRefusesStateInDeviceMemory();
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
