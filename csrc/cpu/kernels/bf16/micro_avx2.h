// [NOTE] BF16 micro-GEMM for AVX2 + FMA: a 64-byte weight line is two 8-lane loads,
// each widened in registers into fp32 vectors for k and k + 1; fp32 activations.
// Up to 4 rows x 1 block: 8 accumulators + 4 widened weights + 2 broadcasts of 16.
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx2.h"
#include "micro_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct MicroBf16Avx2 {
  using Vec = VecAvx2;
  using Act = float;
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxBlocks = 1;

  template <int M, int NB>
  static void tile(const TileArgs<Act>& t) {
    static_assert(NB == 1, "the AVX2 micro-GEMM computes one block at a time");
    // With 1-2 rows (decode) the FMA latency, not the loads, would bound the loop: the
    // even and odd k products then go to separate accumulators (4 chains per row).
    constexpr int S = M <= 2 ? 2 : 1;
    __m256 acc[M][2][S];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) {
        acc[m][h][0] = t.accumulate ? _mm256_loadu_ps(t.c + m * t.ldc + h * 8) : _mm256_setzero_ps();
        if constexpr (S == 2) acc[m][h][S - 1] = _mm256_setzero_ps();
      }
    const __m256i high_mask = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int64_t p = 0; p < t.pairs; ++p) {
      __m256 even[2], odd[2];
      maybe_prefetch(t.w, p, t.prefetch);
      for (int h = 0; h < 2; ++h) {
        const __m256i line =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + p * 32 + h * 16));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(line, high_mask));
      }
      for (int m = 0; m < M; ++m) {
        const __m256 x0 = _mm256_broadcast_ss(t.a[m] + 2 * p);
        const __m256 x1 = _mm256_broadcast_ss(t.a[m] + 2 * p + 1);
        for (int h = 0; h < 2; ++h) {
          acc[m][h][0] = _mm256_fmadd_ps(even[h], x0, acc[m][h][0]);
          acc[m][h][S - 1] = _mm256_fmadd_ps(odd[h], x1, acc[m][h][S - 1]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) {
        __m256 sum = acc[m][h][0];
        if constexpr (S == 2) sum = _mm256_add_ps(sum, acc[m][h][S - 1]);
        _mm256_storeu_ps(t.c + m * t.ldc + h * 8, sum);
      }
  }
};

}  // namespace
}  // namespace kt::cpu
