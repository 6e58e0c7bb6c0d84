// [NOTE] Memory on one NUMA node, for the packed blob of a part that runs there
// (moe_parts.h). An anonymous mapping whose policy prefers the node (mbind with
// MPOL_PREFERRED through the raw syscall: no libnuma), filled by the node's own threads
// (Engine::run_on_nodes), so its pages are also first touched there: that places them
// where mbind is refused (containers whose seccomp profile blocks it) or the kernel has
// no NUMA support. Preferred, not bound: a full node spills to the others instead of
// failing the allocation. Simulated nodes (KT_OPS_NUMA_SIMULATE) have no memory of their
// own: the copy is made by the node's threads and not bound.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kt::cpu {

struct NodeMemory {
  uint8_t* data = nullptr;
  size_t bytes = 0;     // as asked
  size_t mapped = 0;    // the mapping's length (pages)
  bool bound = false;   // mbind accepted the node preference
};

// A copy of src[0, bytes) in memory of node `node` (an id of the engine's topology).
// Throws std::invalid_argument for an unknown node, std::bad_alloc when the mapping fails.
// Free it with free_node_memory.
NodeMemory copy_to_node(const uint8_t* src, size_t bytes, int node);
void free_node_memory(const NodeMemory& memory);

}  // namespace kt::cpu
