#include "worker_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <exception>
#include <stdexcept>
#include <string>

namespace kt::cpu {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Job::reset(int64_t n, const FunctionRef<void(int64_t)>* function, uint32_t helpers) {
  count = n;
  fn = function;
  next.store(0, std::memory_order_relaxed);
  error = nullptr;
  caller_sleeping.store(false, std::memory_order_relaxed);
  unfinished_helpers.store(helpers, std::memory_order_seq_cst);
}

void Job::wait_for_helpers(int64_t spin_ns) {
  // Helpers still running work on other cores: spin briefly, then sleep.
  const int64_t deadline = now_ns() + spin_ns;
  for (uint32_t spins = 1; unfinished_helpers.load(std::memory_order_acquire) != 0; ++spins) {
    cpu_relax();
    if (spins % 64 != 0 || now_ns() < deadline) continue;
    caller_sleeping.store(true, std::memory_order_seq_cst);
    const uint32_t left = unfinished_helpers.load(std::memory_order_seq_cst);
    if (left != 0) futex_wait(&unfinished_helpers, left);
  }
  if (error) std::rethrow_exception(error);
}

void Job::work() {
  for (int64_t index = next.fetch_add(1, std::memory_order_relaxed); index < count;
       index = next.fetch_add(1, std::memory_order_relaxed)) {
    try {
      (*fn)(index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
}

WorkerPool::WorkerPool(const std::vector<int>& cpus, int64_t spin_ns) : spin_ns_(spin_ns) {
  threads_.reserve(cpus.size());
  try {
    for (int cpu : cpus) threads_.emplace_back([this, cpu] { helper_loop(cpu); });
  } catch (const std::exception& error) {
    // The OS refused a thread (its thread or memory limits): the started helpers must be
    // joined here, as the destructor of a half-built object does not run (a joinable
    // std::thread destroyed unjoined aborts the process).
    const size_t started = threads_.size();
    stop_and_join();
    throw std::runtime_error("kt_ops could not start helper thread " + std::to_string(started + 1) + " of " +
                             std::to_string(cpus.size()) + " (" + error.what() +
                             "): fewer threads (kt_ops.set_num_threads, KT_OPS_NUM_THREADS) or higher process limits");
  }
}

WorkerPool::~WorkerPool() { stop_and_join(); }

void WorkerPool::stop_and_join() {
  stopping_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&generation_);
  for (auto& thread : threads_) thread.join();
  threads_.clear();
}

void WorkerPool::start(Job* job) {
  job_.store(job, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
}

void WorkerPool::wait_for_generation(uint32_t seen) {
  int64_t deadline = now_ns() + spin_ns_;
  for (uint32_t spins = 1;; ++spins) {
    if (generation_.load(std::memory_order_acquire) != seen) return;
    cpu_relax();
    if (spins % 64 != 0) continue;
    if (now_ns() < deadline) {
      // Let another runnable thread of this core go first: a spinning helper must not
      // hold a core that the caller's other work needs.
      if (spins % 1024 == 0) sched_yield();
      continue;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(&generation_, seen);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    deadline = now_ns() + spin_ns_;
  }
}

void WorkerPool::helper_loop(int cpu) {
  if (cpu >= 0) {
    cpu_set_t mask;
    CPU_ZERO(&mask);
    CPU_SET(cpu, &mask);
    pthread_setaffinity_np(pthread_self(), sizeof(mask), &mask);
  }
  // Generation 0 is the pool's state at construction; reading it here instead could
  // miss a job started before this thread ran.
  uint32_t seen = 0;
  for (;;) {
    wait_for_generation(seen);
    seen = generation_.load(std::memory_order_acquire);
    if (stopping_.load(std::memory_order_acquire)) return;
    Job* job = job_.load(std::memory_order_acquire);
    job->work();
    // Decrement first, then read the flag (both seq_cst): either the caller set the
    // flag before this read and is woken, or it sees the count at zero and never sleeps.
    if (job->unfinished_helpers.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        job->caller_sleeping.load(std::memory_order_seq_cst))
      futex_wake_all(&job->unfinished_helpers);
  }
}

}  // namespace kt::cpu
