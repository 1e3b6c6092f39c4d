// Definitions of stream_launch.h.

#include "xla_ffi/stream_launch.h"

#include <dlfcn.h>

#include <cstdio>
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
  std::fprintf(stderr, "jax_superoffload: a step on the GPU stream failed: %s\n",
               message.c_str());
  DeferredError& d = Deferred();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.message.empty()) d.message = message;
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

std::string DriverError(const CudaDriver& driver, int code) {
  const char* text = nullptr;
  if (driver.get_error_string != nullptr &&
      driver.get_error_string(code, &text) == 0 && text != nullptr) {
    return text;
  }
  return "CUDA error " + std::to_string(code);
}

template <class F>
bool Lookup(void* library, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  return *out != nullptr;
}

}  // namespace

const CudaDriver* SystemCudaDriver(std::string* why) {
  static const std::pair<CudaDriver, std::string>* found = [] {
    CudaDriver driver{};
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* error = dlerror();
      return new std::pair<CudaDriver, std::string>(
          driver, std::string("libcuda.so.1: ") + (error ? error : "not found"));
    }
    bool ok = Lookup(library, "cuLaunchHostFunc", &driver.launch_host_func) &&
              Lookup(library, "cuPointerGetAttribute",
                     &driver.pointer_get_attribute);
    Lookup(library, "cuGetErrorString", &driver.get_error_string);
    return new std::pair<CudaDriver, std::string>(
        driver, ok ? "" : "libcuda.so.1 lacks cuLaunchHostFunc");
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
                    "failed: " + message);
}

ffi::Error OnStream::Run(Work work, const std::vector<const void*>& touched) {
  if (ffi::Error error = TakeDeferredError(); error.failure()) return error;
  if (driver_ == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jax_superoffload: no CUDA driver for a stream step");
  }
  for (size_t i = 0; i < touched.size(); ++i) {
    unsigned type = 0;
    const auto pointer = reinterpret_cast<uint64_t>(touched[i]);
    // Memory the driver does not know (an error here) is host memory.
    if (touched[i] != nullptr &&
        driver_->pointer_get_attribute(&type, kPointerMemoryType, pointer) ==
            0 &&
        type == kMemoryTypeDevice) {
      return InvalidArgument(
          "buffer " + std::to_string(i) +
          " of a stream step is in device memory: its operands must be in "
          "pinned host memory (jax.memory.Space.Host)");
    }
  }
  auto pending = std::make_unique<Pending>();
  pending->work = std::move(work);
  const int code =
      driver_->launch_host_func(stream_, &RunPending, pending.get());
  if (code != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jax_superoffload: cuLaunchHostFunc failed: " +
                          DriverError(*driver_, code));
  }
  pending.release();  // RunPending owns it now.
  return ffi::Error::Success();
}

}  // namespace jax_superoffload
