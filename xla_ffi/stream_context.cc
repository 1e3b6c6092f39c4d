// Definitions of stream_context.h, the worker and the system driver.

#include "xla_ffi/stream_context.h"

#include <dlfcn.h>

#include <exception>
#include <utility>

namespace jax_superoffload {
namespace stream_internal {
namespace {

template <class F>
bool Lookup(void* library, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  return *out != nullptr;
}

bool LookupAll(void* library, CudaDriver* d) {
  return Lookup(library, "cuLaunchHostFunc", &d->launch_host_func) &&
         Lookup(library, "cuPointerGetAttribute", &d->pointer_get_attribute) &&
         Lookup(library, "cuMemcpyDtoHAsync_v2", &d->copy_to_host) &&
         Lookup(library, "cuMemcpyHtoDAsync_v2", &d->copy_to_device) &&
         Lookup(library, "cuMemcpyDtoDAsync_v2", &d->copy_device_to_device) &&
         Lookup(library, "cuMemHostAlloc", &d->host_alloc) &&
         Lookup(library, "cuMemFreeHost", &d->host_free) &&
         Lookup(library, "cuStreamGetCtx", &d->stream_get_ctx) &&
         Lookup(library, "cuCtxPushCurrent_v2", &d->ctx_push_current) &&
         Lookup(library, "cuCtxPopCurrent_v2", &d->ctx_pop_current) &&
         Lookup(library, "cuStreamIsCapturing", &d->stream_is_capturing) &&
         Lookup(library, "cuStreamCreate", &d->stream_create) &&
         Lookup(library, "cuStreamDestroy_v2", &d->stream_destroy) &&
         Lookup(library, "cuStreamSynchronize", &d->stream_synchronize) &&
         Lookup(library, "cuEventCreate", &d->event_create) &&
         Lookup(library, "cuEventDestroy_v2", &d->event_destroy) &&
         Lookup(library, "cuEventRecord", &d->event_record) &&
         Lookup(library, "cuStreamWaitEvent", &d->stream_wait_event);
}

// The host function: runs on the driver's callback thread, which may run
// every stream's host functions in turn and must make no CUDA call. It
// only marks the launch reached and wakes the worker: microseconds.
void HandOff(void* data) noexcept {
  auto* pending = static_cast<Pending*>(data);
  Context* context = pending->context;
  // Notified under the lock: once it is released, the launch (and, after
  // a join, the context) may be gone.
  try {
    std::lock_guard<std::mutex> lock(context->mutex);
    pending->reached = true;
    context->changed.notify_all();
  } catch (...) {
    pending->reached = true;  // The mutex failed: better late than never.
    context->changed.notify_all();
  }
}

// The step of `pending`, run by the worker: its error, empty on success.
// No exception leaves it.
std::string RunStep(Context& c, Pending& pending) {
  std::string error;
  try {
    Workers workers;
    workers.fetch = [&c, &pending](int64_t window) {
      pending.window = window;
      return c.Fetch(pending.on_demand, window);
    };
    ffi::Error result = pending.work(workers);
    if (result.failure()) error = result.message();
  } catch (const std::exception& e) {
    error = std::string("jax_superoffload: the step threw: ") + e.what();
  } catch (...) {
    error = "jax_superoffload: the step threw a non-standard exception";
  }
  pending.work = nullptr;  // Its captures are no longer needed.
  return error;
}

// A step's stand-ins back to the device, on the side stream: its results,
// and the on-demand stand-ins it writes, to the window it fetched. The
// slot's next launch fetches into it only after these copies: it took the
// slot once this launch was handled, so its host function, which its
// worker waits for, follows them on the side stream. Returns the error,
// empty on success.
std::string CopyBack(Context& c, const Pending& pending) {
  const CudaDriver& driver = *c.driver;
  std::vector<OnStream::Copy> copies = pending.out;
  if (pending.window >= 0) {
    for (OnStream::Copy copy : pending.on_demand_back) {
      copy.device += static_cast<uint64_t>(pending.window) * copy.bytes;
      copies.push_back(copy);
    }
  }
  for (const OnStream::Copy& copy : copies) {
    if (int code =
            driver.copy_to_device(copy.device, copy.host, copy.bytes, c.side)) {
      return DriverError(driver, "cuMemcpyHtoDAsync", code);
    }
  }
  return std::string();
}

// After the step: its results back to the device only if it succeeded
// (`error` empty), then the done event in every case. Returns the error.
std::string Finish(Context& c, Pending& pending, std::string error) {
  const CudaDriver& driver = *c.driver;
  if (error.empty()) error = CopyBack(c, pending);
  if (int code = driver.event_record(pending.done, c.side)) {
    if (error.empty()) error = DriverError(driver, "cuEventRecord", code);
  } else {
    pending.done_recorded = true;
  }
  return error;
}

// One launch the side stream has reached: its step unless its stream has
// failed (then nothing runs and nothing is written back), the write-back
// and the done event. Returns the launch's own error.
std::string Handle(Context& c, const CurrentContext& current, Pending& p,
                   bool failed) {
  try {
    std::string error;
    if (!current.ok()) {
      error = current.error();
    } else if (!failed) {
      error = RunStep(c, p);
    }
    error = Finish(c, p, failed ? "skipped" : std::move(error));
    return failed ? std::string() : error;
  } catch (...) {
    return "jax_superoffload: the stream worker failed (out of memory?)";
  }
}

// Handles the launches in side-stream order as the side stream reaches
// them, with the context current.
void WorkerLoop(Context* c) {
  CurrentContext current(*c->driver, c->cuda_context);
  std::unique_lock<std::mutex> lock(c->mutex);
  for (;;) {
    c->changed.wait(lock, [c] {
      return c->stop || (!c->queue.empty() && c->queue.front()->reached);
    });
    if (c->queue.empty() || !c->queue.front()->reached) return;  // Stopped.
    std::shared_ptr<Pending> p = std::move(c->queue.front());
    c->queue.pop_front();
    StreamRecord& record = c->streams[p->stream];
    const bool failed = !record.error.empty();
    lock.unlock();
    std::string error = Handle(*c, current, *p, failed);
    lock.lock();
    if (!error.empty() && record.error.empty()) record.error = error;
    p->handled = true;
    if (p->slot >= 0) c->slots[p->slot].busy = false;
    c->changed.notify_all();
  }
}

}  // namespace

std::string DriverError(const CudaDriver& driver, const char* what, int code) {
  const char* text = nullptr;
  std::string message = std::string("jax_superoffload: ") + what + " failed: ";
  if (driver.get_error_string != nullptr &&
      driver.get_error_string(code, &text) == 0 && text != nullptr) {
    return message + text + " (CUDA error " + std::to_string(code) + ")";
  }
  return message + "CUDA error " + std::to_string(code);
}

ffi::Error DriverFailure(const CudaDriver& driver, const char* what, int code) {
  return ffi::Error(ffi::ErrorCode::kInternal, DriverError(driver, what, code));
}

ffi::Error RefuseCapture(const CudaDriver& driver, void* stream) {
  int status = kCaptureStatusNone;
  if (int code = driver.stream_is_capturing(stream, &status)) {
    return DriverFailure(driver, "cuStreamIsCapturing", code);
  }
  if (status != kCaptureStatusNone) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jax_superoffload: a stream step cannot be captured into a CUDA "
        "graph (its stream is capturing): a replay would not run its host "
        "step; run it outside graph capture");
  }
  return ffi::Error::Success();
}

ffi::Error OnDevice(const CudaDriver& driver, const void* data, size_t index,
                    bool* device) {
  unsigned type = 0;
  const int code = driver.pointer_get_attribute(
      &type, kPointerMemoryType, reinterpret_cast<uint64_t>(data));
  if (code == kErrorInvalidValue) {  // Not registered: plain host memory.
    *device = false;
    return ffi::Error::Success();
  }
  if (code != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "buffer " + std::to_string(index) +
                          " of a stream step: " +
                          DriverError(driver, "cuPointerGetAttribute", code));
  }
  *device = type == kMemoryTypeDevice;
  return ffi::Error::Success();
}

CurrentContext::CurrentContext(const CudaDriver& driver, void* context)
    : driver_(driver) {
  if (int code = driver.ctx_push_current(context)) {
    error_ = DriverError(driver, "cuCtxPushCurrent", code);
  }
}

CurrentContext::~CurrentContext() {
  void* popped = nullptr;
  if (ok()) driver_.ctx_pop_current(&popped);
}

void StartWorker(Context* context) {
  context->worker = std::thread(WorkerLoop, context);
}

Context::~Context() {
  if (worker.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    changed.notify_all();
    worker.join();
  }
}

ffi::Error Context::Create() {
  if (int code = driver->stream_create(&side, kStreamNonBlocking)) {
    return DriverFailure(*driver, "cuStreamCreate", code);
  }
  if (int code = driver->stream_create(&fetch, kStreamNonBlocking)) {
    driver->stream_destroy(side);
    return DriverFailure(*driver, "cuStreamCreate", code);
  }
  if (int code = driver->event_create(&ready, kEventDisableTiming)) {
    driver->stream_destroy(fetch);
    driver->stream_destroy(side);
    return DriverFailure(*driver, "cuEventCreate", code);
  }
  return ffi::Error::Success();
}

ffi::Error Context::Fetch(const std::vector<OnStream::Copy>& copies,
                          int64_t window) {
  for (const OnStream::Copy& c : copies) {
    const uint64_t from = c.device + static_cast<uint64_t>(window) * c.bytes;
    if (int code = driver->copy_to_host(c.host, from, c.bytes, fetch)) {
      driver->stream_synchronize(fetch);  // Nothing in flight on failure.
      return DriverFailure(*driver, "cuMemcpyDtoHAsync", code);
    }
  }
  if (int code = driver->stream_synchronize(fetch)) {
    return DriverFailure(*driver, "cuStreamSynchronize", code);
  }
  std::lock_guard<std::mutex> lock(mutex);
  fetched_inputs += static_cast<int64_t>(copies.size());
  return ffi::Error::Success();
}

ffi::Error Context::Acquire(size_t bytes, int* slot, void** base) {
  int k = 0;
  {
    std::unique_lock<std::mutex> lock(mutex);
    k = static_cast<int>(next_launch++ % 2);
    changed.wait(lock, [&] { return !slots[k].busy; });
    slots[k].busy = true;
  }
  Slot& s = slots[k];  // Ours alone until released.
  if (s.bytes < bytes) {
    if (s.data != nullptr) {
      // Earlier launches' copies may still use it.
      if (int code = driver->stream_synchronize(side)) {
        Release(k);
        return DriverFailure(*driver, "cuStreamSynchronize", code);
      }
      driver->host_free(s.data);
      s = Slot{nullptr, 0, true};
    }
    void* data = nullptr;
    const int code = driver->host_alloc(&data, bytes, kHostAllocPortable);
    {
      std::lock_guard<std::mutex> lock(mutex);
      ++staging_allocations;
    }
    if (code != 0) {
      Release(k);
      return DriverFailure(*driver, "cuMemHostAlloc", code);
    }
    s.data = data;
    s.bytes = bytes;
  }
  *slot = k;
  *base = s.data;
  return ffi::Error::Success();
}

void Context::Release(int slot) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    slots[slot].busy = false;
  }
  changed.notify_all();
}

ffi::Error Context::Enqueue(void* stream, const std::vector<OnStream::Copy>& in,
                            const std::shared_ptr<Pending>& p) {
  std::lock_guard<std::mutex> lock(mutex);
  while (free_events.size() < 2) {
    void* event = nullptr;
    if (int code = driver->event_create(&event, kEventDisableTiming)) {
      return DriverFailure(*driver, "cuEventCreate", code);
    }
    events.push_back(event);
    free_events.push_back(event);
  }
  p->done = free_events.back();
  free_events.pop_back();
  p->copied = free_events.back();
  free_events.pop_back();
  auto fail = [&](const char* what, int code) {
    free_events.push_back(p->done);
    free_events.push_back(p->copied);
    return DriverFailure(*driver, what, code);
  };
  if (int code = driver->event_record(ready, stream)) {
    return fail("cuEventRecord", code);
  }
  if (int code = driver->stream_wait_event(side, ready, 0)) {
    return fail("cuStreamWaitEvent", code);
  }
  for (const OnStream::Copy& c : in) {
    if (int code = driver->copy_to_host(c.host, c.device, c.bytes, side)) {
      return fail("cuMemcpyDtoHAsync", code);
    }
  }
  // XLA takes the start call's operands as read when the call returns and
  // may reuse their buffers in stream order: the compute stream goes on
  // only once they are in staging (the step itself it does not wait for),
  // unless XLA keeps them alive until the join (hold_inputs).
  if (!p->hold_inputs) {
    if (int code = driver->event_record(p->copied, side)) {
      return fail("cuEventRecord", code);
    }
    if (int code = driver->stream_wait_event(stream, p->copied, 0)) {
      return fail("cuStreamWaitEvent", code);
    }
  }
  std::vector<std::shared_ptr<Pending>>& launches = streams[stream].launches;
  queue.push_back(p);
  launches.push_back(p);
  if (int code = driver->launch_host_func(side, &HandOff, p.get())) {
    queue.pop_back();
    launches.pop_back();
    return fail("cuLaunchHostFunc", code);
  }
  return ffi::Error::Success();
}

ffi::Error Context::Join(void* stream) {
  std::vector<std::shared_ptr<Pending>> launches;
  std::string error;
  {
    std::unique_lock<std::mutex> lock(mutex);
    auto it = streams.find(stream);
    if (it == streams.end()) return ffi::Error::Success();
    std::vector<std::shared_ptr<Pending>>& started = it->second.launches;
    changed.wait(lock, [&] {
      for (const auto& p : started) {
        if (!p->handled) return false;
      }
      return true;
    });
    launches.swap(started);
    error.swap(it->second.error);
  }
  for (const auto& p : launches) {
    if (!p->done_recorded) continue;
    if (int code = driver->stream_wait_event(stream, p->done, 0)) {
      if (error.empty())
        error = DriverError(*driver, "cuStreamWaitEvent", code);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& p : launches) {
      free_events.push_back(p->done);
      free_events.push_back(p->copied);
    }
  }
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

bool Context::Shutdown(std::chrono::milliseconds limit) {
  bool drained = false;
  {
    std::unique_lock<std::mutex> lock(mutex);
    // A system-clock deadline: a steady-clock wait compiles to
    // pthread_cond_clockwait (glibc 2.30), which the wheels' glibc 2.27
    // floor lacks (.ci/check_symbol_versions.py refuses it).
    const auto deadline = std::chrono::system_clock::now() + limit;
    drained =
        changed.wait_until(lock, deadline, [this] { return queue.empty(); });
    stop = true;
  }
  changed.notify_all();
  if (worker.joinable()) worker.join();
  if (!drained) return false;
  CurrentContext current(*driver, cuda_context);
  if (!current.ok()) return true;  // The context, and its memory, are gone.
  driver->stream_synchronize(side);
  for (Slot& s : slots) {
    if (s.data != nullptr) driver->host_free(s.data);
    s = Slot{};
  }
  for (void* event : events) driver->event_destroy(event);
  driver->event_destroy(ready);
  driver->stream_destroy(fetch);
  driver->stream_destroy(side);
  return true;
}

int64_t Context::allocations() {
  std::lock_guard<std::mutex> lock(mutex);
  return staging_allocations;
}

int64_t Context::fetched() {
  std::lock_guard<std::mutex> lock(mutex);
  return fetched_inputs;
}

}  // namespace stream_internal

const CudaDriver* SystemCudaDriver(std::string* why) {
  static const std::pair<CudaDriver, std::string>* found = [] {
    CudaDriver d{};
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* error = dlerror();
      return new std::pair<CudaDriver, std::string>(
          d, std::string("libcuda.so.1: ") + (error ? error : "not found"));
    }
    const bool ok = stream_internal::LookupAll(library, &d);
    stream_internal::Lookup(library, "cuGetErrorString", &d.get_error_string);
    return new std::pair<CudaDriver, std::string>(
        d, ok ? "" : "libcuda.so.1 lacks an entry point the launch uses");
  }();
  if (!found->second.empty()) {
    if (why != nullptr) *why = found->second;
    return nullptr;
  }
  return &found->first;
}

}  // namespace jax_superoffload
