// What the process may run on: the CPUs in its affinity mask, grouped by NUMA node,
// and how many of them are distinct physical cores; or, for tests on a one-node machine,
// those CPUs split into simulated nodes (KT_OPS_NUMA_SIMULATE).
#pragma once

#include <string>
#include <vector>

namespace kt::cpu {

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;           // logical CPUs of this node the process may use
  std::vector<int> physical_cpus;  // one logical CPU per physical core, in cpus order
};

struct Topology {
  std::vector<NumaNode> nodes;  // never empty, in id order
  // Nodes made by simulate_nodes: groups of CPUs with no memory of their own.
  bool simulated = false;
  int num_physical_cores() const;
  // The node with this id, or nullptr.
  const NumaNode* find(int id) const;
  // "0, 1" (the node ids), for messages.
  std::string ids() const;
};

// Reads /sys (Linux). Falls back to one node holding the affinity mask's CPUs.
Topology read_topology();

// `real`'s physical cores dealt into `count` simulated nodes with ids 0 .. count - 1, in
// contiguous runs (node i gets cores [i M / count, (i + 1) M / count) of the M cores, in
// node order); each SMT sibling joins its core's node. Throws std::invalid_argument
// (naming KT_OPS_NUMA_SIMULATE, which is what asks for it) unless 1 <= count <= M.
Topology simulate_nodes(const Topology& real, int count);

}  // namespace kt::cpu
