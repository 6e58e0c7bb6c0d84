// [NOTE] Engine: the process-wide set of worker pools that every kernel runs on.
// Threads = the calling thread + helpers. The caller always works as thread 0 and
// sleeps (never spins) once its share is done and the wait grows long, so N threads
// on N cores never oversubscribe. Helpers are grouped into one WorkerPool per NUMA
// node, pinned to physical cores first.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "function_ref.h"
#include "topology.h"
#include "worker_pool.h"

namespace kt::cpu {

class Engine {
 public:
  // The engine, created on first use with KT_OPS_NUM_THREADS threads (default: the
  // physical cores the process may run on).
  static Engine& instance();

  int num_threads() const;
  int num_pools() const;
  // Rebuilds the pools with n >= 1 threads; waits for a running parallel_for.
  void set_num_threads(int n);

  // Calls fn(i) for every i in [0, n) on all threads and returns when all are done.
  // Concurrent callers are serialised; a nested call runs inline on its thread.
  void parallel_for(int64_t n, FunctionRef<void(int64_t)> fn);

 private:
  Engine();
  void build_pools(int num_threads);
  // fork() child: only the forking thread survives, so the helpers are gone and the
  // mutex may be held by a thread that no longer exists. Drops both (the pools leak:
  // their threads cannot be joined) and rebuilds the pools on the next parallel_for.
  void forget_threads_after_fork();

  Topology topology_;
  int64_t spin_ns_;
  int num_threads_ = 1;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<WorkerPool>> pools_;
  Job job_;
  bool rebuild_pools_ = false;
};

}  // namespace kt::cpu
