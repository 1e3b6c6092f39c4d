// What the stream launches (stream_launch.h) keep per CUDA context: the
// side stream, the worker thread, the staging slots, the launches not yet
// joined and each compute stream's sticky error. Internal to the launches
// and their test.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_STREAM_CONTEXT_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_STREAM_CONTEXT_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/launch.h"
#include "xla_ffi/stream_launch.h"

namespace jax_superoffload {
namespace stream_internal {

std::string DriverError(const CudaDriver& driver, const char* what, int code);
ffi::Error DriverFailure(const CudaDriver& driver, const char* what, int code);

// An error unless `stream` is outside stream capture.
ffi::Error RefuseCapture(const CudaDriver& driver, void* stream);

// Whether buffer `index` at `data` is device memory: only "not registered
// with the driver" (CUDA_ERROR_INVALID_VALUE) means plain host memory; any
// other failed query is an error.
ffi::Error OnDevice(const CudaDriver& driver, const void* data, size_t index,
                    bool* device);

inline constexpr size_t kStagingAlignment = 256;

inline size_t Aligned(size_t bytes) {
  return (bytes + kStagingAlignment - 1) / kStagingAlignment *
         kStagingAlignment;
}

// `context` current on this thread for the object's lifetime.
class CurrentContext {
 public:
  CurrentContext(const CudaDriver& driver, void* context);
  ~CurrentContext();
  CurrentContext(const CurrentContext&) = delete;
  CurrentContext& operator=(const CurrentContext&) = delete;
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  const CudaDriver& driver_;
  std::string error_;
};

// One pinned staging block; held by one launch at a time.
struct Slot {
  void* data = nullptr;
  size_t bytes = 0;
  bool busy = false;
};

struct Context;

// A started launch, from its start until a join has waited for it.
struct Pending {
  Context* context = nullptr;
  void* stream = nullptr;  // The compute stream it was started from.
  Work work;
  std::vector<OnStream::Copy> out;
  // Device to staging only if the step asks (Workers::Fetch), when it runs.
  std::vector<OnStream::Copy> on_demand;
  // Of those, the stand-ins copied back, to the window the step fetched
  // (`window`, -1 until it fetches), after a step that succeeded.
  std::vector<OnStream::Copy> on_demand_back;
  int64_t window = -1;
  int slot = -1;
  void* done = nullptr;  // Recorded on the side stream when handled.
  // Recorded on the side stream after the copies to staging; the compute
  // stream waits for it (not for the step), so XLA may reuse what was
  // copied as soon as the start call is behind it. Not where the start
  // holds its inputs (BucketAttrs::hold_inputs): XLA keeps them until the
  // join, which waits for `done`, after the copies.
  void* copied = nullptr;
  bool hold_inputs = false;
  bool reached = false;        // The side stream ran its host function.
  bool handled = false;        // The worker ran (or skipped) it.
  bool done_recorded = false;  // `done` was recorded.
};

struct StreamRecord {
  std::vector<std::shared_ptr<Pending>> launches;  // Not yet joined.
  std::string error;  // The first failure not yet reported (sticky).
};

struct Context {
  Context(const CudaDriver* driver, void* cuda_context)
      : driver(driver), cuda_context(cuda_context) {}
  ~Context();

  // Makes the side stream and the ready event (the context is current).
  ffi::Error Create();
  // Waits for slot (launch number % 2) to be free and takes it, grown to
  // `bytes` if it is smaller; its index and address into `slot`, `base`.
  ffi::Error Acquire(size_t bytes, int* slot, void** base);
  void Release(int slot);
  // Makes the side stream wait for `stream`, enqueues the copies `in` and
  // the launch's host function there, and registers the launch.
  ffi::Error Enqueue(void* stream, const std::vector<OnStream::Copy>& in,
                     const std::shared_ptr<Pending>& pending);
  // StreamLaunches::Join for this context's `stream` (context current).
  ffi::Error Join(void* stream);
  // Copies a running launch's on-demand inputs, each `window` of its size
  // on (Workers::Fetch), to staging on the fetch stream and waits for them
  // (the worker, context current). The launch's side stream has run its
  // host function, so what the compute stream wrote before the start is
  // there; the join keeps those buffers alive.
  ffi::Error Fetch(const std::vector<OnStream::Copy>& copies, int64_t window);
  // Waits up to `limit` for the launches in flight, stops the worker and
  // frees what the context made. False (and nothing freed) where launches
  // were still in flight.
  bool Shutdown(std::chrono::milliseconds limit);
  int64_t allocations();
  int64_t fetched();

  const CudaDriver* const driver;
  void* const cuda_context;
  void* side = nullptr;   // The side stream.
  void* fetch = nullptr;  // On-demand inputs' copies (the worker's).
  void* ready = nullptr;  // Recorded on a compute stream by each start.
  std::mutex mutex;
  std::condition_variable changed;
  // Guarded by mutex:
  std::deque<std::shared_ptr<Pending>> queue;  // Not yet handled, in order.
  std::map<void*, StreamRecord> streams;       // By compute stream.
  std::vector<void*> free_events;
  std::vector<void*> events;  // All made, to destroy.
  Slot slots[2];
  int64_t next_launch = 0;
  int64_t staging_allocations = 0;
  int64_t fetched_inputs = 0;
  bool stop = false;
  std::thread worker;
};

void StartWorker(Context* context);

}  // namespace stream_internal
}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_STREAM_CONTEXT_H_
