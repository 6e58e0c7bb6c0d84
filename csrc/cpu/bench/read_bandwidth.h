// The machine's read bandwidth, measured the way the decode kernels read weights:
// every Engine thread streams its own contiguous share of one large buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kt::cpu {

// Seconds taken by each of `repeats` full passes over data[0, bytes).
std::vector<double> time_read_passes(const uint8_t* data, size_t bytes, int repeats);

}  // namespace kt::cpu
