// Definitions of fake_cuda_driver.h.

#include "xla_ffi/fake_cuda_driver.h"

#include <chrono>
#include <cstring>
#include <utility>

namespace jax_superoffload {
namespace {

FakeCuda* g_fake = nullptr;                 // The one live fake (test only).
thread_local std::vector<void*> t_current;  // This thread's context stack.

constexpr int kInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT
constexpr int kInvalidHandle = 400;   // CUDA_ERROR_INVALID_HANDLE
constexpr int kMemoryTypeHost = 1;    // CU_MEMORYTYPE_HOST

}  // namespace

FakeCuda::FakeCuda() {
  g_fake = this;
  thread_ = std::thread([this] { Loop(); });
}

FakeCuda::~FakeCuda() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    held_ = false;
  }
  changed_.notify_all();
  thread_.join();
  g_fake = nullptr;
}

CudaDriver FakeCuda::driver() const {
  CudaDriver d{};
  d.launch_host_func = [](void* s, void (*fn)(void*), void* data) {
    return g_fake->LaunchHostFunc(s, fn, data);
  };
  d.pointer_get_attribute = [](void* data, int attribute, uint64_t p) {
    return g_fake->PointerGetAttribute(data, attribute, p);
  };
  d.copy_to_host = [](void* host, uint64_t device, size_t bytes, void* s) {
    return g_fake->CopyToHost(host, device, bytes, s);
  };
  d.copy_to_device = [](uint64_t device, const void* host, size_t bytes,
                        void* s) {
    return g_fake->CopyToDevice(device, host, bytes, s);
  };
  d.copy_device_to_device = [](uint64_t to, uint64_t from, size_t bytes,
                               void* s) {
    return g_fake->CopyDeviceToDevice(to, from, bytes, s);
  };
  d.host_alloc = [](void** p, size_t bytes, unsigned flags) {
    return g_fake->HostAlloc(p, bytes, flags);
  };
  d.host_free = [](void* p) { return g_fake->HostFree(p); };
  d.stream_get_ctx = [](void* s, void** c) {
    return g_fake->StreamGetCtx(s, c);
  };
  d.ctx_push_current = [](void* c) { return g_fake->CtxPushCurrent(c); };
  d.ctx_pop_current = [](void** c) { return g_fake->CtxPopCurrent(c); };
  d.stream_is_capturing = [](void* s, int* status) {
    return g_fake->StreamIsCapturing(s, status);
  };
  d.stream_create = [](void** s, unsigned flags) {
    return g_fake->StreamCreate(s, flags);
  };
  d.stream_destroy = [](void* s) { return g_fake->StreamDestroy(s); };
  d.stream_synchronize = [](void* s) { return g_fake->StreamSynchronize(s); };
  d.event_create = [](void** e, unsigned flags) {
    return g_fake->EventCreate(e, flags);
  };
  d.event_destroy = [](void* e) { return g_fake->EventDestroy(e); };
  d.event_record = [](void* e, void* s) { return g_fake->EventRecord(e, s); };
  d.stream_wait_event = [](void* s, void* e, unsigned flags) {
    return g_fake->StreamWaitEvent(s, e, flags);
  };
  d.get_error_string = nullptr;
  return d;
}

void* FakeCuda::NewStream(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto stream = std::make_unique<Stream>();
  stream->name = name;
  void* handle = stream.get();
  order_.push_back(stream.get());
  streams_[handle] = std::move(stream);
  return handle;
}

void FakeCuda::MarkDevice(const void* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_[reinterpret_cast<uintptr_t>(data)] = bytes;
}

void FakeCuda::Enqueue(void* stream, const std::string& name,
                       std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  Op op;
  op.what = name;
  op.run = std::move(fn);
  Push(stream, std::move(op));
}

void FakeCuda::Synchronize(void* stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] {
    for (Stream* s : order_) {
      if ((stream == nullptr || s == stream) &&
          (!s->ops.empty() || s->running)) {
        return false;
      }
    }
    return true;
  });
}

void FakeCuda::Hold(bool held) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    held_ = held;
  }
  changed_.notify_all();
}

std::vector<std::string> FakeCuda::Log() {
  std::lock_guard<std::mutex> lock(mutex_);
  return log_;
}

std::vector<FakeCuda::CopyRecord> FakeCuda::Copies() {
  std::lock_guard<std::mutex> lock(mutex_);
  return copies_;
}

int FakeCuda::Count(const std::string& part) {
  int n = 0;
  for (const std::string& entry : Log()) {
    if (entry.find(part) != std::string::npos) ++n;
  }
  return n;
}

void FakeCuda::set_knobs(const Knobs& knobs) {
  std::lock_guard<std::mutex> lock(mutex_);
  knobs_ = knobs;
}

FakeCuda::Stats FakeCuda::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

FakeCuda::Stream* FakeCuda::Runnable() {
  for (size_t i = 0; i < order_.size(); ++i) {
    Stream* s = order_[(next_ + i) % order_.size()];
    if (s->running || s->ops.empty()) continue;
    const Op& op = s->ops.front();
    if (op.wait != nullptr && op.wait->completed < op.target) continue;
    next_ = (next_ + i + 1) % order_.size();
    return s;
  }
  return nullptr;
}

void FakeCuda::Loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    Stream* s = nullptr;
    changed_.wait(lock, [&] {
      if (stop_) return true;
      s = held_ ? nullptr : Runnable();
      return s != nullptr;
    });
    if (s == nullptr) return;  // Stopped.
    Op op = std::move(s->ops.front());
    s->ops.pop_front();
    s->running = true;
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    if (op.run) op.run();
    const std::chrono::duration<double> took =
        std::chrono::steady_clock::now() - start;
    lock.lock();
    if (op.record != nullptr) op.record->completed = op.target;
    if (op.host_function && took.count() > stats_.longest_host_function) {
      stats_.longest_host_function = took.count();
    }
    log_.push_back(s->name + ": " + op.what);
    s->running = false;
    changed_.notify_all();
  }
}

bool FakeCuda::Push(void* stream, Op op) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) return false;
  it->second->ops.push_back(std::move(op));
  changed_.notify_all();
  return true;
}

int FakeCuda::CheckContext(const char* call) {
  if (!t_current.empty() && t_current.back() == &context_tag_) return 0;
  ++stats_.context_violations;
  stats_.violations.push_back(call);
  return knobs_.strict_context ? kInvalidContext : 0;
}

int FakeCuda::LaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuLaunchHostFunc")) return e;
  if (knobs_.fail_launch != 0) return knobs_.fail_launch;
  Op op;
  op.what = "host function";
  op.run = [fn, data] { fn(data); };
  op.host_function = true;
  return Push(stream, std::move(op)) ? 0 : kInvalidHandle;
}

int FakeCuda::PointerGetAttribute(void* data, int attribute, uint64_t p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (knobs_.query_error != 0) return knobs_.query_error;
  if (attribute != kPointerMemoryType) return kErrorInvalidValue;
  auto* out = static_cast<unsigned*>(data);
  if (pinned_.count(reinterpret_cast<void*>(p)) != 0) {
    *out = kMemoryTypeHost;
    return 0;
  }
  auto it = device_.upper_bound(static_cast<uintptr_t>(p));
  if (it != device_.begin()) {
    --it;
    if (p < it->first + it->second) {
      *out = kMemoryTypeDevice;
      return 0;
    }
  }
  return kErrorInvalidValue;  // What CUDA says of unregistered memory.
}

int FakeCuda::CopyToHost(void* host, uint64_t device, size_t bytes,
                         void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuMemcpyDtoHAsync")) return e;
  Op op;
  op.what = "copy to host " + std::to_string(bytes);
  op.run = [=] {
    std::memcpy(host, reinterpret_cast<const void*>(device), bytes);
  };
  if (!Push(stream, std::move(op))) return kInvalidHandle;
  copies_.push_back({host, device, bytes, true});
  return 0;
}

int FakeCuda::CopyToDevice(uint64_t device, const void* host, size_t bytes,
                           void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuMemcpyHtoDAsync")) return e;
  Op op;
  op.what = "copy to device " + std::to_string(bytes);
  op.run = [=] { std::memcpy(reinterpret_cast<void*>(device), host, bytes); };
  if (!Push(stream, std::move(op))) return kInvalidHandle;
  copies_.push_back({host, device, bytes, false});
  return 0;
}

int FakeCuda::CopyDeviceToDevice(uint64_t destination, uint64_t source,
                                 size_t bytes, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuMemcpyDtoDAsync")) return e;
  Op op;
  op.what = "copy device to device " + std::to_string(bytes);
  op.run = [=] {
    std::memcpy(reinterpret_cast<void*>(destination),
                reinterpret_cast<const void*>(source), bytes);
  };
  if (!Push(stream, std::move(op))) return kInvalidHandle;
  return 0;
}

int FakeCuda::HostAlloc(void** pointer, size_t bytes, unsigned flags) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuMemHostAlloc")) return e;
  if (knobs_.fail_alloc != 0) return knobs_.fail_alloc;
  auto block = std::make_unique<char[]>(bytes);
  *pointer = block.get();
  pinned_[*pointer] = std::move(block);
  ++stats_.allocations;
  ++stats_.live_allocations;
  stats_.alloc_flags_seen &= flags;
  return 0;
}

int FakeCuda::HostFree(void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuMemFreeHost")) return e;
  if (pinned_.erase(pointer) == 0) return kErrorInvalidValue;
  --stats_.live_allocations;
  return 0;
}

int FakeCuda::StreamGetCtx(void* stream, void** context) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (streams_.count(stream) == 0) return kInvalidHandle;
  *context = &context_tag_;
  return 0;
}

int FakeCuda::CtxPushCurrent(void* context) {
  if (context != &context_tag_) return kInvalidContext;
  t_current.push_back(context);
  return 0;
}

int FakeCuda::CtxPopCurrent(void** context) {
  if (t_current.empty()) return kInvalidContext;
  *context = t_current.back();
  t_current.pop_back();
  return 0;
}

int FakeCuda::StreamIsCapturing(void* stream, int* status) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (streams_.count(stream) == 0) return kInvalidHandle;
  *status = knobs_.capturing.count(stream) != 0 ? 1 : 0;
  return 0;
}

int FakeCuda::StreamCreate(void** stream, unsigned flags) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (int e = CheckContext("cuStreamCreate")) return e;
  }
  // The first is "side", the next "side#2" and so on.
  std::string name = "side";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (++created_streams_ > 1) name += "#" + std::to_string(created_streams_);
  }
  if (flags != kStreamNonBlocking) name += " (blocking)";
  *stream = NewStream(name);
  return 0;
}

int FakeCuda::StreamDestroy(void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuStreamDestroy")) return e;
  auto it = streams_.find(stream);
  if (it == streams_.end()) return kInvalidHandle;
  it->second->name += " (destroyed)";
  return 0;  // Kept: its name stays in the log.
}

int FakeCuda::StreamSynchronize(void* stream) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (int e = CheckContext("cuStreamSynchronize")) return e;
    if (streams_.count(stream) == 0) return kInvalidHandle;
  }
  Synchronize(stream);
  return 0;
}

int FakeCuda::EventCreate(void** event, unsigned) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuEventCreate")) return e;
  auto made = std::make_unique<Event>();
  *event = made.get();
  events_[*event] = std::move(made);
  return 0;
}

int FakeCuda::EventDestroy(void* event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuEventDestroy")) return e;
  return events_.count(event) != 0 ? 0 : kInvalidHandle;  // Kept alive.
}

int FakeCuda::EventRecord(void* event, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuEventRecord")) return e;
  auto it = events_.find(event);
  if (it == events_.end()) return kInvalidHandle;
  Op op;
  op.record = it->second.get();
  op.target = ++op.record->recorded;
  op.what = "record event";
  return Push(stream, std::move(op)) ? 0 : kInvalidHandle;
}

int FakeCuda::StreamWaitEvent(void* stream, void* event, unsigned) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (int e = CheckContext("cuStreamWaitEvent")) return e;
  auto it = events_.find(event);
  if (it == events_.end()) return kInvalidHandle;
  Op op;
  op.wait = it->second.get();
  op.target = op.wait->recorded;
  op.what = "wait event";
  return Push(stream, std::move(op)) ? 0 : kInvalidHandle;
}

}  // namespace jax_superoffload
