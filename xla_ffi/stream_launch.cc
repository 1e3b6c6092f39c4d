// Definitions of stream_launch.h.

#include "xla_ffi/stream_launch.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace jax_superoffload {
namespace {

struct DeferredError {
  std::mutex mutex;
  std::string message;  // Guarded by mutex; empty: none.
};

// The one channel from a step run by the driver back to the program.
DeferredError& Deferred() {
  static DeferredError* deferred = new DeferredError();
  return *deferred;
}

void KeepDeferredError(const std::string& message) {
  std::fprintf(stderr,
               "jax_superoffload: a step on the GPU stream failed: %s\n",
               message.c_str());
  DeferredError& d = Deferred();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.message.empty()) d.message = message;
}

// Pinned staging memory, one block per stream. Every use of a stream's
// block is ordered on that stream (copy in, step, copy out), so each launch
// may take it from the start: the launches before it on the stream are
// done with it by the time its copies run. A block that grows is replaced
// and the old one kept (work already enqueued may still use it).
class StagingBlocks {
 public:
  // `bytes` of the stream's block (grown if needed), or null with `error`.
  void* Get(const CudaDriver& driver, void* stream, size_t bytes, int* error) {
    std::lock_guard<std::mutex> lock(mutex_);
    Block& block = blocks_[stream];
    if (block.bytes < bytes) {
      const size_t grown = std::max(bytes, 2 * block.bytes);
      void* pointer = nullptr;
      *error = driver.host_alloc(&pointer, grown, 0);
      if (*error != 0) return nullptr;
      if (block.data != nullptr) retired_.push_back(block.data);
      block = Block{pointer, grown};
    }
    return block.data;
  }

 private:
  struct Block {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<void*, Block> blocks_;  // Guarded by mutex_.
  std::vector<void*> retired_;     // Guarded by mutex_.
};

StagingBlocks& Staging() {
  static StagingBlocks* staging = new StagingBlocks();
  return *staging;
}

struct Pending {
  Work work;
};

// The host function: runs on a driver thread, which must make no CUDA
// call; the step only reads and writes host memory.
void RunPending(void* data) {
  std::unique_ptr<Pending> pending(static_cast<Pending*>(data));
  ffi::Error error = pending->work(Workers{});
  if (error.failure()) KeepDeferredError(error.message());
}

std::string DriverError(const CudaDriver& driver, const char* what, int code) {
  const char* text = nullptr;
  std::string message = std::string("jax_superoffload: ") + what + " failed: ";
  if (driver.get_error_string != nullptr &&
      driver.get_error_string(code, &text) == 0 && text != nullptr) {
    return message + text;
  }
  return message + "CUDA error " + std::to_string(code);
}

ffi::Error DriverFailure(const CudaDriver& driver, const char* what, int code) {
  return ffi::Error(ffi::ErrorCode::kInternal, DriverError(driver, what, code));
}

template <class F>
bool Lookup(void* library, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  return *out != nullptr;
}

constexpr size_t kStagingAlignment = 256;

size_t Aligned(size_t bytes) {
  return (bytes + kStagingAlignment - 1) / kStagingAlignment *
         kStagingAlignment;
}

}  // namespace

const CudaDriver* SystemCudaDriver(std::string* why) {
  static const std::pair<CudaDriver, std::string>* found = [] {
    CudaDriver d{};
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* error = dlerror();
      return new std::pair<CudaDriver, std::string>(
          d, std::string("libcuda.so.1: ") + (error ? error : "not found"));
    }
    const bool ok =
        Lookup(library, "cuLaunchHostFunc", &d.launch_host_func) &&
        Lookup(library, "cuPointerGetAttribute", &d.pointer_get_attribute) &&
        Lookup(library, "cuMemcpyDtoHAsync_v2", &d.copy_to_host) &&
        Lookup(library, "cuMemcpyHtoDAsync_v2", &d.copy_to_device) &&
        Lookup(library, "cuMemHostAlloc", &d.host_alloc);
    Lookup(library, "cuGetErrorString", &d.get_error_string);
    return new std::pair<CudaDriver, std::string>(
        d, ok ? "" : "libcuda.so.1 lacks an entry point the launch uses");
  }();
  if (!found->second.empty()) {
    if (why != nullptr) *why = found->second;
    return nullptr;
  }
  return &found->first;
}

ffi::Error TakeDeferredError() {
  DeferredError& d = Deferred();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.message.empty()) return ffi::Error::Success();
  std::string message;
  message.swap(d.message);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    "jax_superoffload: an earlier step on the GPU stream "
                    "failed: " +
                        message);
}

ffi::Error OnStream::Place(std::vector<Touched>& touched) {
  JSO_RETURN_IF_ERROR(TakeDeferredError());
  if (driver_ == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jax_superoffload: no CUDA driver for a stream step");
  }
  std::vector<size_t> staged;
  size_t total = 0;
  for (size_t i = 0; i < touched.size(); ++i) {
    const Touched& t = touched[i];
    unsigned type = 0;
    const auto pointer = reinterpret_cast<uint64_t>(t.data);
    // Memory the driver does not know (an error here) is host memory.
    if (t.data == nullptr || t.bytes <= 0 ||
        driver_->pointer_get_attribute(&type, kPointerMemoryType, pointer) !=
            0 ||
        type != kMemoryTypeDevice) {
      continue;
    }
    if (t.role == Touched::Role::kState) {
      return InvalidArgument(
          "buffer " + std::to_string(i) +
          " of a stream step is optimizer state in device memory: the "
          "state must live in pinned host memory (jax.memory.Space.Host)");
    }
    staged.push_back(i);
    total += Aligned(static_cast<size_t>(t.bytes));
  }
  if (staged.empty()) {
    placed_ = true;
    return ffi::Error::Success();
  }
  int code = 0;
  auto* block =
      static_cast<char*>(Staging().Get(*driver_, stream_, total, &code));
  if (block == nullptr) return DriverFailure(*driver_, "cuMemHostAlloc", code);
  size_t offset = 0;
  for (size_t i : staged) {
    Touched& t = touched[i];
    const size_t bytes = static_cast<size_t>(t.bytes);
    const Copy copy{block + offset, reinterpret_cast<uint64_t>(t.data), bytes};
    if (t.role != Touched::Role::kOutput) in_.push_back(copy);
    if (t.role != Touched::Role::kInput) out_.push_back(copy);
    t.retarget(block + offset);
    offset += Aligned(bytes);
  }
  placed_ = true;
  return ffi::Error::Success();
}

ffi::Error OnStream::Run(Work work) {
  if (!placed_) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jax_superoffload: a stream step ran without Place");
  }
  for (const Copy& c : in_) {
    if (int code = driver_->copy_to_host(c.host, c.device, c.bytes, stream_)) {
      return DriverFailure(*driver_, "cuMemcpyDtoHAsync", code);
    }
  }
  auto pending = std::make_unique<Pending>();
  pending->work = std::move(work);
  const int code =
      driver_->launch_host_func(stream_, &RunPending, pending.get());
  if (code != 0) return DriverFailure(*driver_, "cuLaunchHostFunc", code);
  pending.release();  // RunPending owns it now.
  for (const Copy& c : out_) {
    if (int code =
            driver_->copy_to_device(c.device, c.host, c.bytes, stream_)) {
      return DriverFailure(*driver_, "cuMemcpyHtoDAsync", code);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jax_superoffload
