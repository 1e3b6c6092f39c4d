// One pool of host threads per process for the Grace Adam handlers.
//
// XLA:CPU hands a handler its intra-op pool; the CUDA plugin's host compute
// hands it a one-thread pool, and a handler ordered on a GPU stream (see
// stream_launch.h) gets none. Those steps share this pool instead of
// starting threads of their own on every call, so several devices' steps
// in one process never run more workers than the pool has.

#ifndef JAX_SUPEROFFLOAD_XLA_FFI_HOST_POOL_H_
#define JAX_SUPEROFFLOAD_XLA_FFI_HOST_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace jax_superoffload {

class HostPool {
 public:
  // The process's pool, made on first use with no worker; `Reserve` adds
  // them. Never destroyed: a step may still run on it while the process
  // exits.
  static HostPool& Process();

  HostPool() = default;
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;
  ~HostPool();

  // Starts workers until there are `workers` (never more than kMaxWorkers);
  // returns how many there are. A thread that cannot be started is left
  // out: callers take chunks too, so fewer workers only run slower.
  int64_t Reserve(int64_t workers);

  // Runs `task` on a worker. Tasks must not block on other tasks.
  void Schedule(std::function<void()> task);

  int64_t num_workers();

  static constexpr int64_t kMaxWorkers = 4095;

 private:
  void Work();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;  // Guarded by mutex_.
  std::vector<std::thread> threads_;         // Guarded by mutex_.
  bool stopping_ = false;                    // Guarded by mutex_.
};

}  // namespace jax_superoffload

#endif  // JAX_SUPEROFFLOAD_XLA_FFI_HOST_POOL_H_
