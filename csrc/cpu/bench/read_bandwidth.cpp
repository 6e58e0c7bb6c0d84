#include "read_bandwidth.h"

#include <immintrin.h>

#include "../engine/engine.h"
#include "../isa/cpu_variant.h"

namespace kt::cpu {
namespace {

// Four independent accumulators of the widest loads the CPU has: narrower loads or a
// single dependency chain measure the core, not the memory (SSE2 loads read ~half
// the bandwidth that AVX-512 loads do on the machine this was written on).
__attribute__((target("avx512f"))) float sum_avx512(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

__attribute__((target("avx2"))) float sum_avx2(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}

}  // namespace

std::vector<double> time_read_passes(const uint8_t* data, size_t bytes, int repeats) {
  Engine& engine = Engine::instance();
  // The machine's limit, whatever variant the kernels are forced to.
  const bool avx512 = missing_features(CpuVariant::kAvx512).empty();
  const int64_t shares = engine.num_threads();
  const size_t share_floats = bytes / shares / 256 * 64;  // whole 256-byte steps
  const float* floats = reinterpret_cast<const float*>(data);
  std::vector<double> seconds;
  std::vector<float> sink(shares);
  for (int r = 0; r < repeats; ++r) {
    const int64_t start = now_ns();
    engine.parallel_for(shares, [&](int64_t share) {
      const float* p = floats + share * share_floats;
      sink[share] += avx512 ? sum_avx512(p, share_floats) : sum_avx2(p, share_floats);
    });
    seconds.push_back(static_cast<double>(now_ns() - start) * 1e-9);
  }
  volatile float keep = 0;
  for (float value : sink) keep = keep + value;
  return seconds;
}

}  // namespace kt::cpu
