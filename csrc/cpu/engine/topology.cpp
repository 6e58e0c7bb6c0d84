#include "topology.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kt::cpu {
namespace {

// Parses a kernel CPU list such as "0-3,8,10-11".
std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream stream(text);
  std::string range;
  while (std::getline(stream, range, ',')) {
    if (range.empty() || range == "\n") continue;
    const auto dash = range.find('-');
    try {
      const int first = std::stoi(range.substr(0, dash));
      const int last = dash == std::string::npos ? first : std::stoi(range.substr(dash + 1));
      for (int cpu = first; cpu <= last; ++cpu) cpus.push_back(cpu);
    } catch (const std::exception&) {
      return {};
    }
  }
  return cpus;
}

std::string read_first_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

std::vector<int> allowed_cpus() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &mask)) cpus.push_back(cpu);
  return cpus;
}

// The (package, core) pair that identifies cpu's physical core; SMT siblings share it.
std::pair<std::string, std::string> core_identity(int cpu) {
  const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  return {read_first_line(base + "physical_package_id"), read_first_line(base + "core_id")};
}

void fill_physical_cpus(NumaNode& node) {
  std::set<std::pair<std::string, std::string>> seen;
  for (int cpu : node.cpus)
    if (seen.insert(core_identity(cpu)).second) node.physical_cpus.push_back(cpu);
}

}  // namespace

int Topology::num_physical_cores() const {
  int count = 0;
  for (const auto& node : nodes) count += static_cast<int>(node.physical_cpus.size());
  return count;
}

const NumaNode* Topology::find(int id) const {
  for (const auto& node : nodes)
    if (node.id == id) return &node;
  return nullptr;
}

std::string Topology::ids() const {
  std::string text;
  for (const auto& node : nodes) text += (text.empty() ? "" : ", ") + std::to_string(node.id);
  return text;
}

Topology read_topology() {
  const std::vector<int> allowed = allowed_cpus();
  const std::set<int> allowed_set(allowed.begin(), allowed.end());
  Topology topology;
  const std::vector<int> node_ids =
      parse_cpu_list(read_first_line("/sys/devices/system/node/online"));
  for (int id : node_ids) {
    NumaNode node;
    node.id = id;
    for (int cpu : parse_cpu_list(
             read_first_line("/sys/devices/system/node/node" + std::to_string(id) + "/cpulist")))
      if (allowed_set.count(cpu)) node.cpus.push_back(cpu);
    if (!node.cpus.empty()) topology.nodes.push_back(std::move(node));
  }
  if (topology.nodes.empty()) {
    NumaNode node;
    node.cpus = allowed.empty() ? std::vector<int>{0} : allowed;
    topology.nodes.push_back(std::move(node));
  }
  for (auto& node : topology.nodes) fill_physical_cpus(node);
  return topology;
}

Topology simulate_nodes(const Topology& real, int count) {
  std::vector<int> cores;
  for (const auto& node : real.nodes) cores.insert(cores.end(), node.physical_cpus.begin(), node.physical_cpus.end());
  const int64_t M = static_cast<int64_t>(cores.size());
  if (count < 1 || count > M)
    throw std::invalid_argument("KT_OPS_NUMA_SIMULATE=" + std::to_string(count) + " asks for " +
                                std::to_string(count) + " simulated NUMA nodes, but the process may run on " +
                                std::to_string(M) + " physical cores (each node needs at least one)");
  Topology simulated;
  simulated.simulated = true;
  std::map<std::pair<std::string, std::string>, size_t> node_of_core;
  for (int i = 0; i < count; ++i) {
    NumaNode node;
    node.id = i;
    for (int64_t c = i * M / count; c < (i + 1) * M / count; ++c) {
      node.physical_cpus.push_back(cores[c]);
      node.cpus.push_back(cores[c]);
      node_of_core[core_identity(cores[c])] = static_cast<size_t>(i);
    }
    simulated.nodes.push_back(std::move(node));
  }
  for (const auto& node : real.nodes)
    for (int cpu : node.cpus) {
      if (std::find(cores.begin(), cores.end(), cpu) != cores.end()) continue;
      const auto it = node_of_core.find(core_identity(cpu));
      simulated.nodes[it != node_of_core.end() ? it->second : 0].cpus.push_back(cpu);
    }
  for (auto& node : simulated.nodes) std::sort(node.cpus.begin(), node.cpus.end());
  return simulated;
}

}  // namespace kt::cpu
