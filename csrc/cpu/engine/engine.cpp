#include "engine.h"

#include <pthread.h>

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

namespace kt::cpu {
namespace {

thread_local bool inside_parallel_region = false;

int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 1)
    throw std::invalid_argument(std::string(name) + " must be a positive integer, got '" + text +
                                "'");
  return value;
}

}  // namespace

Engine& Engine::instance() {
  static Engine engine;
  return engine;
}

Engine::Engine()
    : topology_(read_topology()), spin_ns_(env_int("KT_OPS_SPIN_US", 200) * 1000) {
  build_pools(static_cast<int>(env_int("KT_OPS_NUM_THREADS", topology_.num_physical_cores())));
  pthread_atfork(nullptr, nullptr, [] { instance().forget_threads_after_fork(); });
}

void Engine::forget_threads_after_fork() {
  new (&mutex_) std::mutex();
  for (auto& pool : pools_) static_cast<void>(pool.release());
  pools_.clear();
  rebuild_pools_ = true;
}

int Engine::num_threads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return num_threads_;
}

int Engine::num_pools() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(pools_.size());
}

void Engine::set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mutex_);
  if (n != num_threads_ || rebuild_pools_) build_pools(n);
  rebuild_pools_ = false;
}

// Thread 0 is the caller (not pinned; it keeps the first physical core free for
// itself). Helpers take the next physical cores node by node, then SMT siblings;
// helpers beyond the CPU count are left unpinned.
void Engine::build_pools(int num_threads) {
  pools_.clear();
  std::vector<std::vector<int>> pinned(topology_.nodes.size());
  std::vector<std::pair<size_t, int>> order;  // (node index, cpu)
  for (size_t node = 0; node < topology_.nodes.size(); ++node)
    for (int cpu : topology_.nodes[node].physical_cpus) order.emplace_back(node, cpu);
  for (size_t node = 0; node < topology_.nodes.size(); ++node)
    for (int cpu : topology_.nodes[node].cpus) {
      bool physical = false;
      for (int p : topology_.nodes[node].physical_cpus) physical |= p == cpu;
      if (!physical) order.emplace_back(node, cpu);
    }
  for (int thread = 1; thread < num_threads; ++thread) {
    if (static_cast<size_t>(thread) < order.size())
      pinned[order[thread].first].push_back(order[thread].second);
    else
      pinned[0].push_back(-1);
  }
  for (const auto& cpus : pinned)
    if (!cpus.empty()) pools_.push_back(std::make_unique<WorkerPool>(cpus, spin_ns_));
  num_threads_ = num_threads;
}

void Engine::parallel_for(int64_t n, FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (inside_parallel_region || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (rebuild_pools_) {
    rebuild_pools_ = false;
    build_pools(num_threads_);
  }
  inside_parallel_region = true;
  job_.count = n;
  job_.fn = &fn;
  job_.next.store(0, std::memory_order_relaxed);
  job_.error = nullptr;
  job_.caller_sleeping.store(false, std::memory_order_relaxed);
  uint32_t helpers = 0;
  for (const auto& pool : pools_) helpers += static_cast<uint32_t>(pool->num_helpers());
  job_.unfinished_helpers.store(helpers, std::memory_order_seq_cst);
  for (const auto& pool : pools_) pool->start(&job_);
  job_.work();
  // Helpers still running work on other cores: spin briefly, then sleep.
  const int64_t deadline = now_ns() + spin_ns_;
  for (uint32_t spins = 1; job_.unfinished_helpers.load(std::memory_order_acquire) != 0; ++spins) {
    cpu_relax();
    if (spins % 64 != 0 || now_ns() < deadline) continue;
    job_.caller_sleeping.store(true, std::memory_order_seq_cst);
    const uint32_t left = job_.unfinished_helpers.load(std::memory_order_seq_cst);
    if (left != 0) futex_wait(&job_.unfinished_helpers, left);
  }
  inside_parallel_region = false;
  if (job_.error) std::rethrow_exception(job_.error);
}

}  // namespace kt::cpu
