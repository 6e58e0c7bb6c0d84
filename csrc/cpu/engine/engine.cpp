#include "engine.h"

#include <pthread.h>

#include <algorithm>
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

// The own pools are built on first use, so a process that installs a team (the
// extension does, at load) never starts their threads.
Engine::Engine()
    : topology_(read_topology()), spin_ns_(env_int("KT_OPS_SPIN_US", 200) * 1000) {
  num_threads_ = static_cast<int>(env_int("KT_OPS_NUM_THREADS", topology_.num_physical_cores()));
  rebuild_pools_ = true;
  pthread_atfork([] { instance().remember_threads_before_fork(); }, nullptr,
                 [] { instance().forget_threads_after_fork(); });
}

void Engine::use_team(ThreadTeam* team) {
  std::lock_guard<std::mutex> lock(mutex_);
  team_.store(team, std::memory_order_release);
  pools_.clear();
  rebuild_pools_ = true;
  if (team != nullptr && std::getenv("KT_OPS_NUM_THREADS") != nullptr) team->set_num_threads(num_threads_);
}

std::string Engine::thread_source() const {
  ThreadTeam* team = team_.load(std::memory_order_acquire);
  return team != nullptr ? team->name() : "kt_ops (own pinned pools)";
}

void Engine::remember_threads_before_fork() {
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) threads_at_fork_ = team->num_threads();
}

void Engine::forget_threads_after_fork() {
  new (&mutex_) std::mutex();
  // GNU OpenMP's threads are gone in the child and its next parallel region hangs (torch's
  // own ops too); the child computes on fresh own pools of the same size instead.
  if (team_.exchange(nullptr) != nullptr) num_threads_ = threads_at_fork_;
  for (auto& pool : pools_) static_cast<void>(pool.release());
  pools_.clear();
  rebuild_pools_ = true;
}

int Engine::num_threads() const {
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) return team->num_threads();
  std::lock_guard<std::mutex> lock(mutex_);
  return num_threads_;
}

int Engine::num_pools() {
  if (team_.load(std::memory_order_acquire) != nullptr) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  if (rebuild_pools_) {
    rebuild_pools_ = false;
    build_pools(num_threads_);
  }
  return static_cast<int>(pools_.size());
}

void Engine::set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) return team->set_num_threads(n);
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

void Engine::parallel_for_team(ThreadTeam* team, int64_t n, FunctionRef<void(int64_t)> fn) {
  Job job;  // one per call: concurrent callers each run their own region
  job.count = n;
  job.fn = &fn;
  team->run(static_cast<int>(std::min<int64_t>(n, team->num_threads())), [&](int) {
    const bool outer = inside_parallel_region;
    inside_parallel_region = true;
    job.work();  // catches and records the jobs' exceptions
    inside_parallel_region = outer;
  });
  if (job.error) std::rethrow_exception(job.error);
}

void Engine::parallel_for(int64_t n, FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (inside_parallel_region || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) return parallel_for_team(team, n, fn);
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
