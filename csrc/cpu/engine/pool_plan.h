// [NOTE] Which CPU each of the Engine's own threads is pinned to, node by node.
// Thread 0 is the caller (never pinned): it keeps the first node's first physical core
// for itself. Threads 1 .. n-1 are dealt over the nodes in turn (node 1, node 2, ...,
// node 0, node 1, ...), each taking its node's next physical core, then its SMT
// siblings; where a node has no free CPU left the thread goes to the next node that has
// one, and once every CPU is taken threads stay unpinned. So n threads on N nodes give
// each node n / N of them (the first n % N one more), as kt-kernel splits its threads
// among NUMA subpools, and a node's parts run on CPUs next to its memory.
#pragma once

#include <vector>

#include "topology.h"

namespace kt::cpu {

struct NodePlan {
  int node = 0;          // node id
  int caller_cpu = -1;   // >= 0: the caller is this node's first thread and keeps this CPU
  std::vector<int> cpus; // one own (pinned) thread per entry, -1: unpinned; the first of them
                         // leads the node's parts unless the caller does
  bool has_caller() const { return caller_cpu >= 0; }
  int num_threads() const { return static_cast<int>(has_caller()) + static_cast<int>(cpus.size()); }
};

// One plan per node of `topology`, in its order, for `num_threads` >= 1 threads.
std::vector<NodePlan> plan_pools(const Topology& topology, int num_threads);

}  // namespace kt::cpu
