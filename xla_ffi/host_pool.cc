// Definitions of host_pool.h.

#include "xla_ffi/host_pool.h"

#include <algorithm>
#include <exception>
#include <utility>

namespace jax_superoffload {

HostPool& HostPool::Process() {
  // Leaked on purpose: workers may be mid-step while static destructors run.
  static HostPool* pool = new HostPool();
  return *pool;
}

HostPool::~HostPool() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    threads.swap(threads_);
  }
  ready_.notify_all();
  for (std::thread& t : threads) t.join();
}

int64_t HostPool::Reserve(int64_t workers) {
  workers = std::min(workers, kMaxWorkers);
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    while (static_cast<int64_t>(threads_.size()) < workers) {
      threads_.emplace_back([this] { Work(); });
    }
  } catch (const std::exception&) {
    // No more threads or memory: run with those there are.
  }
  return static_cast<int64_t>(threads_.size());
}

void HostPool::Schedule(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  ready_.notify_one();
}

int64_t HostPool::num_workers() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(threads_.size());
}

void HostPool::Work() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // Stopping, nothing left.
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace jax_superoffload
