// [NOTE] Engine: what every kernel's parallel_for runs on.
// With a ThreadTeam installed (the extension installs torch's intra-op threads,
// thread_team.h) a parallel_for is one parallel region of that team: each of its threads
// takes job indices from one atomic counter. Without one, the Engine's own pools:
// threads = the calling thread + helpers; the caller always works as thread 0 and sleeps
// (never spins) once its share is done and the wait grows long, so N threads on N cores
// never oversubscribe; helpers are grouped into one WorkerPool per NUMA node, pinned to
// physical cores first. Either way the result of a job does not depend on which thread
// runs it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "function_ref.h"
#include "thread_team.h"
#include "topology.h"
#include "worker_pool.h"

namespace kt::cpu {

class Engine {
 public:
  // The engine, created on first use with KT_OPS_NUM_THREADS threads (default: the
  // physical cores the process may run on).
  static Engine& instance();

  int num_threads() const;
  // Own pools: one per NUMA node with helpers; with a team: 0.
  int num_pools();
  // With a team: its thread count (e.g. torch.set_num_threads). Own pools: rebuilds them
  // with n >= 1 threads; waits for a running parallel_for.
  void set_num_threads(int n);

  // Runs every later parallel_for on `team` (which must outlive the Engine) and drops the
  // own pools; KT_OPS_NUM_THREADS, when set, becomes the team's thread count. nullptr: back
  // to the own pools. Called once at module load, before any kernel runs.
  void use_team(ThreadTeam* team);
  // The team's name, or "kt_ops (own pinned pools)".
  std::string thread_source() const;

  // Calls fn(i) for every i in [0, n) on all threads and returns when all are done.
  // A nested call runs inline on its thread. Own pools: concurrent callers are
  // serialised; a team: each caller gets its own region (OpenMP: its own threads).
  void parallel_for(int64_t n, FunctionRef<void(int64_t)> fn);

 private:
  Engine();
  void build_pools(int num_threads);
  // fork() child: only the forking thread survives, so the helpers are gone and the
  // mutex may be held by a thread that no longer exists. Drops both (the pools leak:
  // their threads cannot be joined) and rebuilds the pools on the next parallel_for.
  // With a team, the child also leaves it: its threads are gone too (GNU OpenMP would
  // hang), so the child runs own pools with the team's thread count at fork time.
  void forget_threads_after_fork();
  void remember_threads_before_fork();

  void parallel_for_team(ThreadTeam* team, int64_t n, FunctionRef<void(int64_t)> fn);

  Topology topology_;
  std::atomic<ThreadTeam*> team_{nullptr};
  int64_t spin_ns_;
  int num_threads_ = 1;
  int threads_at_fork_ = 1;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<WorkerPool>> pools_;
  Job job_;
  bool rebuild_pools_ = false;
};

}  // namespace kt::cpu
