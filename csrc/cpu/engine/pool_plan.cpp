#include "pool_plan.h"

#include <algorithm>
#include <cstddef>

namespace kt::cpu {

std::vector<NodePlan> plan_pools(const Topology& topology, int num_threads) {
  const size_t N = topology.nodes.size();
  std::vector<NodePlan> plans(N);
  std::vector<std::vector<int>> free_cpus(N);  // physical cores first, then SMT siblings
  for (size_t i = 0; i < N; ++i) {
    const NumaNode& node = topology.nodes[i];
    plans[i].node = node.id;
    free_cpus[i] = node.physical_cpus;
    for (int cpu : node.cpus)
      if (std::find(node.physical_cpus.begin(), node.physical_cpus.end(), cpu) == node.physical_cpus.end())
        free_cpus[i].push_back(cpu);
    std::reverse(free_cpus[i].begin(), free_cpus[i].end());  // taken from the back
  }
  plans[0].caller_cpu = free_cpus[0].back();
  free_cpus[0].pop_back();
  for (int thread = 1; thread < num_threads; ++thread) {
    const size_t home = static_cast<size_t>(thread) % N;
    size_t node = home;
    while (free_cpus[node].empty() && (node + 1) % N != home) node = (node + 1) % N;
    if (free_cpus[node].empty()) {
      plans[home].cpus.push_back(-1);
      continue;
    }
    plans[node].cpus.push_back(free_cpus[node].back());
    free_cpus[node].pop_back();
  }
  return plans;
}

}  // namespace kt::cpu
