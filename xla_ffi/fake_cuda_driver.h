// A CUDA driver stand-in for the stream launch tests (no GPU). Like CUDA,
// it runs every stream's operations on its own thread, later and
// asynchronously: copies, host functions, event records and waits, in
// each stream's order, one callback thread for all streams (so a host
// function that blocks holds every stream). "Device memory" is host
// memory the test marks as such. It records the order of everything it
// runs, counts allocations and checks that each call is made with the
// stream's context current; knobs make pointer queries fail, streams
// report capture, and launches or allocations fail.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_FAKE_CUDA_DRIVER_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_FAKE_CUDA_DRIVER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/stream_launch.h"

namespace jax_superoffload {

class FakeCuda {
 public:
  // At most one FakeCuda exists at a time (the driver's entry points are
  // plain functions that find it).
  FakeCuda();
  ~FakeCuda();
  FakeCuda(const FakeCuda&) = delete;
  FakeCuda& operator=(const FakeCuda&) = delete;

  // The entry points, bound to this fake.
  CudaDriver driver() const;

  // A stream of the fake's one context, as XLA's compute stream would be.
  void* NewStream(const std::string& name);
  // Marks [data, data + bytes) as device memory.
  void MarkDevice(const void* data, size_t bytes);
  // Enqueues `fn` on `stream` as a kernel would be (logged as `name`).
  void Enqueue(void* stream, const std::string& name, std::function<void()> fn);
  // Blocks until `stream` (null: every stream) has run all it holds.
  void Synchronize(void* stream = nullptr);
  // While held, the callback thread runs nothing.
  void Hold(bool held);

  // Every operation run so far, in order: "<stream>: <what>".
  std::vector<std::string> Log();
  // The log's entries that contain `part`.
  int Count(const std::string& part);

  // A copy enqueued so far (run or not): its host and device ends.
  struct CopyRecord {
    const void* host;
    uint64_t device;
    size_t bytes;
    bool to_host;
  };
  std::vector<CopyRecord> Copies();

  struct Knobs {
    int query_error = 0;         // Non-zero: every pointer query returns it.
    int fail_launch = 0;         // Non-zero: cuLaunchHostFunc returns it.
    int fail_alloc = 0;          // Non-zero: cuMemHostAlloc returns it.
    bool strict_context = true;  // Refuse calls without the context current.
    std::set<void*> capturing;   // Streams that report active capture.
  };
  struct Stats {
    int64_t allocations = 0;             // cuMemHostAlloc calls that succeeded.
    int64_t live_allocations = 0;        // Not yet freed.
    unsigned alloc_flags_seen = ~0u;     // AND of every allocation's flags.
    int64_t context_violations = 0;      // Calls without the context current.
    double longest_host_function = 0.0;  // Seconds.
    std::vector<std::string> violations;  // Which calls.
  };
  void set_knobs(const Knobs& knobs);
  Stats stats();

  // The fake's implementation of each entry point (see CudaDriver).
  int LaunchHostFunc(void* stream, void (*fn)(void*), void* data);
  int PointerGetAttribute(void* data, int attribute, uint64_t pointer);
  int CopyToHost(void* host, uint64_t device, size_t bytes, void* stream);
  int CopyToDevice(uint64_t device, const void* host, size_t bytes,
                   void* stream);
  int CopyDeviceToDevice(uint64_t destination, uint64_t source, size_t bytes,
                         void* stream);
  int HostAlloc(void** pointer, size_t bytes, unsigned flags);
  int HostFree(void* pointer);
  int StreamGetCtx(void* stream, void** context);
  int CtxPushCurrent(void* context);
  int CtxPopCurrent(void** context);
  int StreamIsCapturing(void* stream, int* status);
  int StreamCreate(void** stream, unsigned flags);
  int StreamDestroy(void* stream);
  int StreamSynchronize(void* stream);
  int EventCreate(void** event, unsigned flags);
  int EventDestroy(void* event);
  int EventRecord(void* event, void* stream);
  int StreamWaitEvent(void* stream, void* event, unsigned flags);

 private:
  struct Event {
    int64_t recorded = 0;   // Records enqueued.
    int64_t completed = 0;  // Records run.
  };
  struct Op {
    std::string what;
    std::function<void()> run;
    Event* wait = nullptr;  // A wait: runs once wait->completed >= target.
    int64_t target = 0;
    Event* record = nullptr;  // A record: sets record->completed = target.
    bool host_function = false;
  };
  struct Stream {
    std::string name;
    std::deque<Op> ops;
    bool running = false;
  };

  void Loop();
  // Pushes `op` on `stream` (locked); false for an unknown stream.
  bool Push(void* stream, Op op);
  // Whether the calling thread has the context current (locked: counts a
  // violation named `call` if not). Returns the error to give, or 0.
  int CheckContext(const char* call);
  Stream* Runnable();  // Locked.

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<void*, std::unique_ptr<Stream>> streams_;
  std::vector<Stream*> order_;  // Round robin.
  size_t next_ = 0;
  std::map<void*, std::unique_ptr<Event>> events_;
  std::map<uintptr_t, size_t> device_;  // Start -> bytes.
  std::map<void*, std::unique_ptr<char[]>> pinned_;
  std::vector<std::string> log_;
  std::vector<CopyRecord> copies_;
  Knobs knobs_;
  Stats stats_;
  bool held_ = false;
  bool stop_ = false;
  int context_tag_ = 0;      // Its address is the one context.
  int created_streams_ = 0;  // By cuStreamCreate.
  std::thread thread_;
};

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_FAKE_CUDA_DRIVER_H_
