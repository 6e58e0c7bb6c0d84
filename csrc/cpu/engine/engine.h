// [NOTE] Engine: what every kernel's parallel_for runs on.
// With a ThreadTeam installed (the extension installs torch's intra-op threads,
// thread_team.h) a parallel_for is one parallel region of that team: each of its threads
// takes job indices from one atomic counter. Without one, the Engine's own pools:
// threads = the calling thread + helpers; the caller always works as thread 0 and sleeps
// (never spins) once its share is done and the wait grows long, so N threads on N cores
// never oversubscribe; the threads are grouped into one NodePool per NUMA node, pinned to
// physical cores first (pool_plan.h). Either way the result of a job does not depend on
// which thread runs it.
//
// NUMA parts (run_on_nodes): a layer split over its intermediate dimension runs its parts
// at once, each on the own pool of its node, whatever the thread source: torch's team
// has no notion of nodes and its threads are not pinned, so this is the one place the
// own pools run while a team is installed (built on first use, with the team's thread
// count; their threads sleep when idle). Inside a part, every parallel_for (and
// num_threads) is that node's.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "function_ref.h"
#include "node_pool.h"
#include "pool_plan.h"
#include "thread_team.h"
#include "topology.h"
#include "worker_pool.h"

namespace kt::cpu {

// Where one part of a run_on_nodes ran.
struct PartRun {
  int node = -1;       // the node whose threads ran it (the caller's where its own has none)
  int64_t thread = 0;  // the OS thread id (gettid) that ran it
  int cpu = -1;        // the CPU that thread was on when the part started
};

class Engine {
 public:
  // The engine, created on first use with KT_OPS_NUM_THREADS threads (default: the
  // physical cores the process may run on) and the nodes of the machine, or
  // KT_OPS_NUMA_SIMULATE=N simulated ones (topology.h).
  static Engine& instance();

  // Inside a part of run_on_nodes: that node's threads.
  int num_threads() const;
  // With a team: its thread count (e.g. torch.set_num_threads). Own pools: rebuilds them
  // with 1 <= n <= max_threads() threads; waits for a running parallel_for.
  void set_num_threads(int n);
  // The most threads set_num_threads and KT_OPS_NUM_THREADS accept: 16 per logical CPU, at
  // least 1024. torch's OpenMP pool segfaults when it cannot start the threads it is given
  // (50000 on a 2-core VM with 24 GiB), so an absurd count is refused up front.
  static int max_threads();

  // Runs every later parallel_for on `team` (which must outlive the Engine) and drops the
  // own pools; KT_OPS_NUM_THREADS, when set, becomes the team's thread count. nullptr: back
  // to the own pools. Called once at module load, before any kernel runs.
  void use_team(ThreadTeam* team);
  // The team's name, or "kt_ops (own pinned pools)".
  std::string thread_source() const;

  const Topology& topology() const { return topology_; }
  // Throws std::invalid_argument naming the node ids there are unless `id` is one.
  void require_node(int id) const;
  // The own pools, one plan per node: as built, or as the next run_on_nodes (or, without
  // a team, the next parallel_for) builds them.
  std::vector<NodePlan> pool_plans() const;

  // Calls fn(i) for every i in [0, n) on all threads and returns when all are done.
  // A nested call runs inline on its thread. Own pools: concurrent callers are
  // serialised; a team: each caller gets its own region (OpenMP: its own threads).
  void parallel_for(int64_t n, FunctionRef<void(int64_t)> fn);

  // Calls fn(p) for every part p in [0, part_nodes.size()) and returns when all are done:
  // part p on node part_nodes[p] (a node id, not a position), the parts of different nodes
  // at once, each run by its node's first thread with every parallel_for inside it on
  // that node's threads; the parts of one node run one after another in index order (a
  // node whose pool has no thread, with fewer threads than nodes, lends its parts to the
  // caller's node). On a machine with one node the parts run one after another on all
  // threads. Throws std::invalid_argument for a node id the topology does not have and
  // std::logic_error inside a parallel region or part; rethrows a part's exception
  // once every part is done. Concurrent callers are serialised.
  void run_on_nodes(const std::vector<int>& part_nodes, FunctionRef<void(int64_t)> fn);
  // Where each part of the last run_on_nodes ran (diagnostics and tests).
  std::vector<PartRun> last_parts() const;

 private:
  Engine();
  void build_pools(int num_threads);
  int pool_threads() const;
  void ensure_pools();
  void run_parts_here(NodePool* pool, const std::vector<int64_t>& parts, FunctionRef<void(int64_t)> fn);
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
  std::vector<std::unique_ptr<NodePool>> pools_;  // one per node of topology_, in its order
  int pools_threads_ = 0;                         // the thread count pools_ was built for
  Job job_;
  bool rebuild_pools_ = false;
  std::vector<PartRun> last_parts_;
};

}  // namespace kt::cpu
