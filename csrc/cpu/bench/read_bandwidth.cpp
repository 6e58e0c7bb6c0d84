#include "read_bandwidth.h"

#include <cstring>

#include "../engine/engine.h"

namespace kt::cpu {
namespace {

// Sums 8 independent 64-bit lanes per 64-byte line; the compiler vectorises it and the
// result is kept live so the loads are not removed.
uint64_t sum_lines(const uint8_t* data, size_t bytes) {
  uint64_t lanes[8] = {};
  for (size_t offset = 0; offset + 64 <= bytes; offset += 64) {
    uint64_t line[8];
    std::memcpy(line, data + offset, sizeof(line));
    for (int i = 0; i < 8; ++i) lanes[i] += line[i];
  }
  uint64_t total = 0;
  for (uint64_t lane : lanes) total += lane;
  return total;
}

}  // namespace

std::vector<double> time_read_passes(const uint8_t* data, size_t bytes, int repeats) {
  Engine& engine = Engine::instance();
  const int64_t shares = engine.num_threads();
  const size_t share_bytes = bytes / shares / 64 * 64;
  std::vector<double> seconds;
  std::vector<uint64_t> sink(shares);
  for (int r = 0; r < repeats; ++r) {
    const int64_t start = now_ns();
    engine.parallel_for(shares, [&](int64_t share) {
      sink[share] += sum_lines(data + share * share_bytes, share_bytes);
    });
    seconds.push_back(static_cast<double>(now_ns() - start) * 1e-9);
  }
  volatile uint64_t keep = 0;
  for (uint64_t value : sink) keep = keep + value;
  return seconds;
}

}  // namespace kt::cpu
