// Bookkeeping of kt::moe_forward's CUDA key that the Python module exposes (host
// compiler, no CUDA headers): how many host-call argument structs captured CUDA graphs
// own right now. Each captured call's struct belongs to its graph (a CUDA user object)
// and is freed when the graph and its executable instances are destroyed.
#pragma once

#include <cstdint>

namespace kt::cuda {

int64_t captured_host_calls();

}  // namespace kt::cuda
