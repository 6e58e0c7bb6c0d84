// [NOTE] BF16 micro-GEMM for AVX-512F without BF16 instructions: each 64-byte weight
// line is widened in registers (low halves shifted up, high halves masked) into two
// fp32 vectors for k and k + 1, then two FMAs with fp32 activations. Up to 4 rows x 4
// blocks: 16 accumulators + 8 widened weights + 2 broadcasts of 32 registers.
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx512.h"
#include "bf16_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// A 64-byte bf16 line widened to fp32 for k (even) and k + 1 (odd): low halves shifted
// up, high halves masked.
inline void widen_bf16_line(__m512i line, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(line, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// The BF16 format's weight source: line p of a block, widened.
struct Bf16LinesAvx512 {
  void widen(const uint16_t* block, int /*b*/, int64_t p, __m512& even, __m512& odd) const {
    widen_bf16_line(_mm512_loadu_si512(block + p * 32), even, odd);
  }
  NextTile next;
  void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const { maybe_prefetch(block, p, ahead, next); }
};

struct Bf16GemmAvx512 {
  using Vec = VecAvx512;
  using Act = float;
  using Lines = Bf16LinesAvx512;  // tile's default weight source (FP8 decodes instead)
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxBlocks = 4;
  static constexpr int max_blocks(int) { return kMaxBlocks; }

  template <int M, int NB, class Src = Lines>
  static void tile(const TileArgs<Act>& t, const Src& src = Src()) {
    __m512 acc[M][NB];
    load_accumulators<Vec>(acc, t);
    for (int64_t p = 0; p < t.pairs; ++p) {
      __m512 even[NB], odd[NB];
      for (int b = 0; b < NB; ++b) {
        src.widen(t.w + b * t.block_stride, b, p, even[b], odd[b]);
        src.prefetch(t.w + b * t.block_stride, p, t.prefetch);
      }
      maybe_stream(t.stream, p);
      for (int m = 0; m < M; ++m) {
        const __m512 x0 = _mm512_set1_ps(t.a[m][2 * p]);
        const __m512 x1 = _mm512_set1_ps(t.a[m][2 * p + 1]);
        for (int b = 0; b < NB; ++b) {
          acc[m][b] = _mm512_fmadd_ps(even[b], x0, acc[m][b]);
          acc[m][b] = _mm512_fmadd_ps(odd[b], x1, acc[m][b]);
        }
      }
    }
    store_accumulators<Vec>(acc, t);
  }
};

}  // namespace
}  // namespace kt::cpu
