// [NOTE] WorkerPool: the helper threads of one NUMA node.
// Helpers are pinned to one CPU each and wait for work by spinning for a short window
// (decode calls arrive every few hundred microseconds, and a futex wake-up costs tens
// of microseconds) and then sleeping on a futex, so an idle pool burns no CPU.
// A Job is shared by every pool the Engine starts it on: helpers take job indices from
// one atomic counter until none are left. Jobs are owned by the Engine and its node
// pools and reused, so a helper may still touch one after the caller has seen the work
// finish.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "function_ref.h"

namespace kt::cpu {

struct Job {
  // Readies the job for `count` indices of `fn` and `helpers` helper threads (the caller
  // then starts their pools).
  void reset(int64_t count, const FunctionRef<void(int64_t)>* fn, uint32_t helpers);
  // Runs job indices until the counter passes `count`; records the first exception.
  void work();
  // The caller, its own share done: waits until every helper has finished (spinning for
  // `spin_ns`, then sleeping on the futex), then rethrows the first exception of a job.
  void wait_for_helpers(int64_t spin_ns);

  int64_t count = 0;
  const FunctionRef<void(int64_t)>* fn = nullptr;
  std::atomic<int64_t> next{0};
  std::atomic<uint32_t> unfinished_helpers{0};  // futex word the caller may sleep on
  std::atomic<bool> caller_sleeping{false};
  std::mutex error_mutex;
  std::exception_ptr error;
};

class WorkerPool {
 public:
  // One helper thread per entry of `cpus`, pinned to it (-1: not pinned).
  WorkerPool(const std::vector<int>& cpus, int64_t spin_ns);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int num_helpers() const { return static_cast<int>(threads_.size()); }
  // Hands `job` to every helper; the caller must have added num_helpers() to
  // job->unfinished_helpers first.
  void start(Job* job);

 private:
  void stop_and_join();  // wakes the helpers to exit and joins them
  void helper_loop(int cpu);
  void wait_for_generation(uint32_t seen);

  const int64_t spin_ns_;
  std::atomic<uint32_t> generation_{0};  // futex word helpers sleep on
  std::atomic<int> sleepers_{0};
  std::atomic<Job*> job_{nullptr};
  std::atomic<bool> stopping_{false};
  std::vector<std::thread> threads_;
};

// Linux futex helpers on a 32-bit atomic word.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected);
void futex_wake_all(std::atomic<uint32_t>* word);

// Busy-wait hint for spin loops.
void cpu_relax();

// Monotonic nanoseconds.
int64_t now_ns();

}  // namespace kt::cpu
