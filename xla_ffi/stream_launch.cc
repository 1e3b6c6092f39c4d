// Definitions of stream_launch.h: the start (OnStream), the worker, the join.

#include "xla_ffi/stream_launch.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <utility>

#include "xla_ffi/stream_context.h"

namespace jax_superoffload {

using stream_internal::Context;
using stream_internal::CurrentContext;
using stream_internal::DriverFailure;
using stream_internal::Pending;

OnStream::~OnStream() {
  if (slot_ >= 0) context_->Release(slot_);
}

ffi::Error OnStream::Place(std::vector<Touched>& touched) {
  const CudaDriver* driver = launches_->driver();
  if (driver == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jax_superoffload: no CUDA driver for a stream step");
  }
  JSO_RETURN_IF_ERROR(stream_internal::RefuseCapture(*driver, stream_));
  if (int code = driver->stream_get_ctx(stream_, &cuda_context_)) {
    return DriverFailure(*driver, "cuStreamGetCtx", code);
  }
  CurrentContext current(*driver, cuda_context_);
  if (!current.ok()) return ffi::Error::Internal(current.error());
  std::vector<bool> on_device(touched.size(), false);
  for (size_t i = 0; i < touched.size(); ++i) {
    const Touched& t = touched[i];
    if (t.data == nullptr || t.bytes <= 0) continue;
    bool device = false;
    JSO_RETURN_IF_ERROR(stream_internal::OnDevice(*driver, t.data, i, &device));
    if (!device) continue;
    if (t.role == Touched::Role::kState && t.bytes > kMaxStagedStateBytes) {
      return InvalidArgument(
          "buffer " + std::to_string(i) +
          " of a stream step is optimizer state in device memory (" +
          std::to_string(t.bytes) +
          " bytes): the state must live in pinned host memory "
          "(jax.memory.Space.Host)");
    }
    on_device[i] = true;
  }
  ffi::Error error = ffi::Error::Success();
  context_ = launches_->ContextOf(cuda_context_, &error);
  if (context_ == nullptr) return error;
  JSO_RETURN_IF_ERROR(Stage(touched, on_device));
  placed_ = true;
  return ffi::Error::Success();
}

// Takes a staging slot for the device buffers (`on_device`) and points the
// step at it. One buffer touched twice (a state read and written in place)
// gets one stand-in, read and written; but an output that XLA placed in an
// input's buffer (aliased to it) gets its own, so that the step never
// writes what it still reads: the input is copied in at the start, the
// output back after the step.
ffi::Error OnStream::Stage(std::vector<Touched>& touched,
                           const std::vector<bool>& on_device) {
  struct Staged {
    Copy copy;
    bool read = false, written = false, on_demand = false, returned = false;
  };
  // (Buffer, written only) -> its entry in `staged`.
  std::map<std::pair<const void*, bool>, size_t> index;
  std::vector<Staged> staged;
  auto key = [](const Touched& t) {
    return std::make_pair(t.data, t.role == Touched::Role::kOutput);
  };
  for (size_t i = 0; i < touched.size(); ++i) {
    if (!on_device[i]) continue;
    const Touched& t = touched[i];
    auto [it, fresh] = index.emplace(key(t), staged.size());
    if (fresh) {
      staged.push_back(
          Staged{{nullptr, reinterpret_cast<uint64_t>(t.data), 0}});
    }
    Staged& s = staged[it->second];
    s.copy.bytes = std::max(s.copy.bytes, static_cast<size_t>(t.bytes));
    using Role = Touched::Role;
    const bool demand =
        t.role == Role::kOnDemand || t.role == Role::kOnDemandInOut;
    s.on_demand |= demand;
    s.returned |= t.role == Role::kOnDemandInOut;
    s.read |= t.role != Role::kOutput && !demand;
    s.written |= t.role != Role::kInput && !demand;
  }
  size_t total = 0;
  for (const Staged& s : staged) {
    // Copied back to a window of its own size: the buffer must be touched
    // as that window alone.
    if (s.returned && (s.read || s.written)) {
      return InvalidArgument(
          "a buffer fetched and written back a window at a time is also "
          "read or written whole");
    }
    total += stream_internal::Aligned(s.copy.bytes);
  }
  if (total == 0) return ffi::Error::Success();
  void* base = nullptr;
  JSO_RETURN_IF_ERROR(
      context_->Acquire(std::max(total, reserve_), &slot_, &base));
  size_t offset = 0;
  for (Staged& s : staged) {
    s.copy.host = static_cast<char*>(base) + offset;
    offset += stream_internal::Aligned(s.copy.bytes);
    if (s.read) {
      in_.push_back(s.copy);
    } else if (s.on_demand) {
      on_demand_.push_back(s.copy);
    }
    if (s.written) out_.push_back(s.copy);
    if (s.returned) on_demand_back_.push_back(s.copy);
  }
  for (size_t i = 0; i < touched.size(); ++i) {
    if (on_device[i]) {
      touched[i].retarget(staged[index.at(key(touched[i]))].copy.host);
    }
  }
  return ffi::Error::Success();
}

ffi::Error OnStream::Run(Work work) {
  if (!placed_) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jax_superoffload: a stream step ran without Place");
  }
  const CudaDriver& driver = *launches_->driver();
  CurrentContext current(driver, cuda_context_);
  if (!current.ok()) return ffi::Error::Internal(current.error());
  auto pending = std::make_shared<Pending>();
  pending->context = context_;
  pending->stream = stream_;
  pending->work = std::move(work);
  pending->out = std::move(out_);
  pending->on_demand = std::move(on_demand_);
  pending->on_demand_back = std::move(on_demand_back_);
  pending->slot = slot_;
  pending->hold_inputs = hold_inputs_;
  JSO_RETURN_IF_ERROR(context_->Enqueue(stream_, in_, pending));
  slot_ = -1;  // The worker releases it.
  return ffi::Error::Success();
}

StreamLaunches::StreamLaunches(const CudaDriver* driver) : driver_(driver) {}

StreamLaunches::~StreamLaunches() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [cuda_context, context] : contexts_) {
    if (!context->Shutdown(std::chrono::seconds(10))) {
      // Launches still in flight may yet touch it: leave it be.
      context.release();
    }
  }
}

StreamLaunches& StreamLaunches::Process() {
  static StreamLaunches launches(SystemCudaDriver(nullptr));
  return launches;
}

Context* StreamLaunches::FindContext(void* cuda_context) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = contexts_.find(cuda_context);
  return it == contexts_.end() ? nullptr : it->second.get();
}

Context* StreamLaunches::ContextOf(void* cuda_context, ffi::Error* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::unique_ptr<Context>& context = contexts_[cuda_context];
  if (context == nullptr) {
    auto made = std::make_unique<Context>(driver_, cuda_context);
    *error = made->Create();
    if (error->failure()) {
      contexts_.erase(cuda_context);
      return nullptr;
    }
    stream_internal::StartWorker(made.get());
    context = std::move(made);
  }
  return context.get();
}

int64_t StreamLaunches::fetched_inputs() const {
  return SumOverContexts(&Context::fetched);
}

int64_t StreamLaunches::staging_allocations() const {
  return SumOverContexts(&Context::allocations);
}

int64_t StreamLaunches::SumOverContexts(int64_t (Context::*count)()) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const auto& [cuda_context, context] : contexts_) {
    total += (context.get()->*count)();
  }
  return total;
}

ffi::Error StreamLaunches::Join(void* stream) {
  if (driver_ == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jax_superoffload: no CUDA driver for a stream join");
  }
  JSO_RETURN_IF_ERROR(stream_internal::RefuseCapture(*driver_, stream));
  void* cuda_context = nullptr;
  if (int code = driver_->stream_get_ctx(stream, &cuda_context)) {
    return DriverFailure(*driver_, "cuStreamGetCtx", code);
  }
  CurrentContext current(*driver_, cuda_context);
  if (!current.ok()) return ffi::Error::Internal(current.error());
  if (Context* context = FindContext(cuda_context)) {
    return context->Join(stream);
  }
  return ffi::Error::Success();
}

ffi::Error StreamLaunches::CopyToDevice(void* stream,
                                        const std::vector<ToDevice>& copies) {
  if (driver_ == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jax_superoffload: no CUDA driver for a copy to device");
  }
  void* cuda_context = nullptr;
  if (int code = driver_->stream_get_ctx(stream, &cuda_context)) {
    return DriverFailure(*driver_, "cuStreamGetCtx", code);
  }
  CurrentContext current(*driver_, cuda_context);
  if (!current.ok()) return ffi::Error::Internal(current.error());
  std::vector<bool> from_device(copies.size(), false);
  for (size_t i = 0; i < copies.size(); ++i) {
    bool to_device = false, source_on_device = false;
    JSO_RETURN_IF_ERROR(
        stream_internal::OnDevice(*driver_, copies[i].device, i, &to_device));
    JSO_RETURN_IF_ERROR(stream_internal::OnDevice(*driver_, copies[i].source, i,
                                                  &source_on_device));
    if (!to_device) {
      return InvalidArgument("copy " + std::to_string(i) +
                             " to the device must write device memory; it "
                             "goes from " +
                             (source_on_device ? "device" : "host") +
                             " to host memory");
    }
    from_device[i] = source_on_device;
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    const ToDevice& c = copies[i];
    if (c.bytes == 0) continue;
    const uint64_t to = reinterpret_cast<uint64_t>(c.device);
    if (from_device[i]) {
      if (int code = driver_->copy_device_to_device(
              to, reinterpret_cast<uint64_t>(c.source), c.bytes, stream)) {
        return DriverFailure(*driver_, "cuMemcpyDtoDAsync", code);
      }
    } else if (int code =
                   driver_->copy_to_device(to, c.source, c.bytes, stream)) {
      return DriverFailure(*driver_, "cuMemcpyHtoDAsync", code);
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckJoin(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() < rets.size()) {
    return InvalidArgument("a stream join has " + std::to_string(args.size()) +
                           " operands and " + std::to_string(rets.size()) +
                           " results: it needs an operand per result");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (arg.has_error() || ret.has_error() ||
        arg->untyped_data() != (*ret)->untyped_data() ||
        arg->size_bytes() != (*ret)->size_bytes()) {
      return InvalidArgument("result " + std::to_string(i) +
                             " of a stream join must alias operand " +
                             std::to_string(i) + " (input_output_aliases)");
    }
  }
  return ffi::Error::Success();
}

ffi::Error ToDeviceCopies(ffi::RemainingArgs args, ffi::RemainingRets rets,
                          std::vector<StreamLaunches::ToDevice>* copies) {
  if (args.size() != rets.size()) {
    return InvalidArgument("a copy to device has " +
                           std::to_string(args.size()) + " operands and " +
                           std::to_string(rets.size()) +
                           " results: it needs a result per operand");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (arg.has_error() || ret.has_error() ||
        arg->size_bytes() != (*ret)->size_bytes()) {
      return InvalidArgument("result " + std::to_string(i) +
                             " of a copy to device must have operand " +
                             std::to_string(i) + "'s size");
    }
    copies->push_back(
        {(*ret)->untyped_data(), arg->untyped_data(), arg->size_bytes()});
  }
  return ffi::Error::Success();
}

}  // namespace jax_superoffload
