// [NOTE] NodePool: the Engine's own threads on one NUMA node (pool_plan.h says which).
// Its first thread is either the caller (on the first node) or a pinned leader, a
// one-thread WorkerPool of its own, so that the leader can be handed a node's parts
// (Engine::run_on_nodes) while the node's other threads, the helpers, wait for the
// parallel_for calls the leader makes inside them. A machine-wide parallel_for starts
// the leader and the helpers alike.
#pragma once

#include <cstdint>
#include <memory>

#include "function_ref.h"
#include "pool_plan.h"
#include "worker_pool.h"

namespace kt::cpu {

class NodePool {
 public:
  NodePool(const NodePlan& plan, int64_t spin_ns);
  NodePool(const NodePool&) = delete;
  NodePool& operator=(const NodePool&) = delete;

  const NodePlan& plan() const { return plan_; }
  int node() const { return plan_.node; }
  // Threads that run this node's work: the caller or the leader, plus the helpers.
  int num_threads() const { return plan_.num_threads(); }
  bool has_leader() const { return leader_ != nullptr; }

  // Machine-wide jobs: the own threads (leader and helpers) and starting them on `job`
  // (whose unfinished_helpers the caller has set to include them).
  uint32_t num_own_threads() const;
  void start(Job* job);

  // A parallel_for on this node's threads only, called on its first thread (the caller,
  // or the leader inside a part it leads); returns when every index has run and
  // rethrows the first exception.
  void parallel_for(int64_t n, FunctionRef<void(int64_t)> fn);

  // Has the leader call (*fn)(0) and returns at once; wait_for_leader() returns when it
  // has (rethrowing its exception). Only with a leader; `fn` must outlive the wait.
  void start_leader(const FunctionRef<void(int64_t)>* fn);
  void wait_for_leader();

 private:
  const NodePlan plan_;
  const int64_t spin_ns_;
  std::unique_ptr<WorkerPool> leader_;   // none where the caller leads
  std::unique_ptr<WorkerPool> helpers_;  // none where the node has no other thread
  Job leader_job_;  // the leader's share of a run_on_nodes
  Job job_;         // a parallel_for inside a part
};

}  // namespace kt::cpu
