#include "engine.h"

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace kt::cpu {
namespace {

thread_local bool inside_parallel_region = false;
thread_local NodePool* current_node = nullptr;  // the node whose part this thread runs

// Sets a thread_local for one scope and restores its previous value (also on a throw).
template <typename T>
class ScopedValue {
 public:
  ScopedValue(T& variable, T value) : variable_(variable), previous_(variable) { variable_ = value; }
  ~ScopedValue() { variable_ = previous_; }
  ScopedValue(const ScopedValue&) = delete;
  ScopedValue& operator=(const ScopedValue&) = delete;

 private:
  T& variable_;
  T previous_;
};

// A positive integer up to `max` from the environment (fallback where unset). A larger value
// is refused, not truncated: an int cast of 2^32 + 2 ran 2 threads silently.
int64_t env_int(const char* name, int64_t fallback, int64_t max) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 1 || errno == ERANGE || value > max)
    throw std::invalid_argument(std::string(name) + " must be a positive integer up to " + std::to_string(max) +
                                ", got '" + text + "'");
  return value;
}

constexpr int64_t kMaxEnvCount = 1 << 16;          // simulated nodes
constexpr int64_t kMaxSpinUs = 10 * 1000 * 1000;  // 10 s

// The machine's nodes, or KT_OPS_NUMA_SIMULATE=N simulated ones.
Topology engine_topology() {
  const int64_t simulated = env_int("KT_OPS_NUMA_SIMULATE", 0, kMaxEnvCount);
  Topology real = read_topology();
  return simulated == 0 ? real : simulate_nodes(real, static_cast<int>(simulated));
}

PartRun this_thread_on(int node) {
  PartRun run;
  run.node = node;
  run.thread = static_cast<int64_t>(syscall(SYS_gettid));
  run.cpu = sched_getcpu();
  return run;
}

}  // namespace

Engine& Engine::instance() {
  static Engine engine;
  return engine;
}

// The own pools are built on first use, so a process that installs a team (the
// extension does, at load) never starts their threads unless it runs NUMA parts.
Engine::Engine()
    : topology_(engine_topology()), spin_ns_(env_int("KT_OPS_SPIN_US", 200, kMaxSpinUs) * 1000) {
  num_threads_ = static_cast<int>(env_int("KT_OPS_NUM_THREADS", topology_.num_physical_cores(), max_threads()));
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
  if (current_node != nullptr) return current_node->num_threads();
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) return team->num_threads();
  // Inside an own-pool region the caller holds mutex_ (and a helper would wait on it for
  // ever); nested regions run inline there: one thread.
  if (inside_parallel_region) return 1;
  std::lock_guard<std::mutex> lock(mutex_);
  return num_threads_;
}

int Engine::max_threads() {
  const long cpus = sysconf(_SC_NPROCESSORS_CONF);
  return static_cast<int>(std::max<long>(1024, 16 * std::max<long>(cpus, 1)));
}

void Engine::set_num_threads(int n) {
  if (n < 1 || n > max_threads())
    throw std::invalid_argument("num_threads must be 1 ... " + std::to_string(max_threads()) + " (16 per CPU), got " +
                                std::to_string(n));
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) return team->set_num_threads(n);
  std::lock_guard<std::mutex> lock(mutex_);
  const int before = num_threads_;
  num_threads_ = n;
  try {
    ensure_pools();
  } catch (...) {
    num_threads_ = before;  // the next parallel_for builds the pools of the count that worked
    throw;
  }
}

std::vector<NodePlan> Engine::pool_plans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return plan_pools(topology_, pool_threads());
}

// The own pools' thread count: the team's while one is installed (they then run NUMA
// parts only), else the engine's own.
int Engine::pool_threads() const {
  ThreadTeam* team = team_.load(std::memory_order_acquire);
  return team != nullptr ? team->num_threads() : num_threads_;
}

void Engine::ensure_pools() {
  const int wanted = pool_threads();
  if (!rebuild_pools_ && wanted == pools_threads_) return;
  rebuild_pools_ = false;
  try {
    build_pools(wanted);
  } catch (...) {  // a helper thread the OS refused: no half-built pools, and build them again next time
    pools_.clear();
    rebuild_pools_ = true;
    throw;
  }
}

void Engine::build_pools(int num_threads) {
  pools_.clear();
  for (const NodePlan& plan : plan_pools(topology_, num_threads))
    pools_.push_back(std::make_unique<NodePool>(plan, spin_ns_));
  pools_threads_ = num_threads;
}

void Engine::parallel_for_team(ThreadTeam* team, int64_t n, FunctionRef<void(int64_t)> fn) {
  Job job;  // one per call: concurrent callers each run their own region
  job.count = n;
  job.fn = &fn;
  team->run(static_cast<int>(std::min<int64_t>(n, team->num_threads())), [&](int) {
    const ScopedValue<bool> region(inside_parallel_region, true);
    job.work();  // catches and records the jobs' exceptions
  });
  if (job.error) std::rethrow_exception(job.error);
}

void Engine::parallel_for(int64_t n, FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (inside_parallel_region || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Every thread of an own pool runs its jobs inside the region, helpers too, so a nested
  // parallel_for (the backward's dequantization) runs inline: on a helper it locked
  // mutex_, which the region's caller holds, and waited for ever.
  auto in_region = [&fn](int64_t i) {
    const ScopedValue<bool> region(inside_parallel_region, true);
    fn(i);
  };
  const FunctionRef<void(int64_t)> job_fn(in_region);
  if (NodePool* node = current_node) {
    const ScopedValue<bool> region(inside_parallel_region, true);
    return node->parallel_for(n, job_fn);
  }
  if (ThreadTeam* team = team_.load(std::memory_order_acquire)) return parallel_for_team(team, n, fn);
  std::lock_guard<std::mutex> lock(mutex_);
  ensure_pools();
  const ScopedValue<bool> region(inside_parallel_region, true);
  uint32_t helpers = 0;
  for (const auto& pool : pools_) helpers += pool->num_own_threads();
  job_.reset(n, &job_fn, helpers);
  for (const auto& pool : pools_) pool->start(&job_);
  job_.work();
  job_.wait_for_helpers(spin_ns_);
}

void Engine::require_node(int id) const {
  if (topology_.find(id) == nullptr)
    throw std::invalid_argument("NUMA node " + std::to_string(id) + " does not exist; this process has " +
                                (topology_.simulated ? "simulated (KT_OPS_NUMA_SIMULATE) node ids " : "node ids ") +
                                topology_.ids());
}

void Engine::run_parts_here(NodePool* pool, const std::vector<int64_t>& parts, FunctionRef<void(int64_t)> fn) {
  const ScopedValue<NodePool*> node(current_node, pool);
  for (int64_t part : parts) {
    last_parts_[part] = this_thread_on(pool->node());
    fn(part);
  }
}

void Engine::run_on_nodes(const std::vector<int>& part_nodes, FunctionRef<void(int64_t)> fn) {
  if (inside_parallel_region || current_node != nullptr)
    throw std::logic_error("Engine::run_on_nodes called inside a parallel region or a part");
  for (int id : part_nodes) require_node(id);
  const int64_t P = static_cast<int64_t>(part_nodes.size());
  if (topology_.nodes.size() == 1) {  // nothing to split: all threads, part after part
    std::vector<PartRun> runs(P);
    for (int64_t p = 0; p < P; ++p) {
      runs[p] = this_thread_on(part_nodes[p]);
      fn(p);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    last_parts_ = std::move(runs);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  last_parts_.assign(P, PartRun{});
  ensure_pools();
  // parts[k]: the parts pools_[k] runs; a node whose pool has no thread lends them to
  // the caller's (pools_[0]).
  std::vector<std::vector<int64_t>> parts(pools_.size());
  for (int64_t p = 0; p < P; ++p) {
    size_t k = 0;
    while (pools_[k]->node() != part_nodes[p]) ++k;
    if (pools_[k]->num_threads() == 0) k = 0;
    parts[k].push_back(p);
  }
  auto leader_task = [&](size_t k) {
    return [this, &parts, &fn, k](int64_t) { run_parts_here(pools_[k].get(), parts[k], fn); };
  };
  using LeaderTask = decltype(leader_task(0));
  std::vector<LeaderTask> tasks;
  std::vector<FunctionRef<void(int64_t)>> calls;
  tasks.reserve(pools_.size());
  calls.reserve(pools_.size());
  for (size_t k = 0; k < pools_.size(); ++k) tasks.push_back(leader_task(k));
  for (size_t k = 0; k < pools_.size(); ++k) calls.emplace_back(tasks[k]);
  std::vector<size_t> started;
  for (size_t k = 1; k < pools_.size(); ++k)
    if (!parts[k].empty()) {
      pools_[k]->start_leader(&calls[k]);
      started.push_back(k);
    }
  std::exception_ptr error;
  try {
    if (!parts[0].empty()) run_parts_here(pools_[0].get(), parts[0], fn);
  } catch (...) {
    error = std::current_exception();
  }
  for (size_t k : started) {
    try {
      pools_[k]->wait_for_leader();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

std::vector<PartRun> Engine::last_parts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_parts_;
}

}  // namespace kt::cpu
