// What the process may run on: the CPUs in its affinity mask, grouped by NUMA node,
// and how many of them are distinct physical cores.
#pragma once

#include <vector>

namespace kt::cpu {

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;           // logical CPUs of this node the process may use
  std::vector<int> physical_cpus;  // one logical CPU per physical core, in cpus order
};

struct Topology {
  std::vector<NumaNode> nodes;  // never empty
  int num_physical_cores() const;
};

// Reads /sys (Linux). Falls back to one node holding the affinity mask's CPUs.
Topology read_topology();

}  // namespace kt::cpu
