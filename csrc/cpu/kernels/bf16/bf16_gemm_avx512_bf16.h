// [NOTE] BF16 micro-GEMM with vdpbf16ps (AVX512_BF16): one instruction multiplies a
// 64-byte weight line (16 outputs x 2 k) by a broadcast activation pair and adds both
// products into 16 fp32 accumulators. Activations are bf16. Up to 6 rows x 4 blocks:
// 24 accumulators + 4 weight registers of 32.
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx512.h"
#include "bf16_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// The BF16 format's weight source: line p of a block, as stored.
struct Bf16LinesAvx512Bf16 {
  __m512i line(const uint16_t* block, int /*b*/, int64_t p) const { return _mm512_loadu_si512(block + p * 32); }
  NextTile next;
  void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const { maybe_prefetch(block, p, ahead, next); }
};

struct Bf16GemmAvx512Bf16 {
  using Vec = VecAvx512;
  using Act = uint16_t;
  using Lines = Bf16LinesAvx512Bf16;  // tile's default weight source (FP8 decodes instead)
  static constexpr int kMaxRows = 6;
  static constexpr int kMaxBlocks = 4;
  static constexpr int max_blocks(int) { return kMaxBlocks; }

  template <int M, int NB, class Src = Lines>
  static void tile(const TileArgs<Act>& t, const Src& src = Src()) {
    __m512 acc[M][NB];
    load_accumulators<Vec>(acc, t);
    for (int64_t p = 0; p < t.pairs; ++p) {
      __m512i w[NB];
      for (int b = 0; b < NB; ++b) {
        w[b] = src.line(t.w + b * t.block_stride, b, p);
        src.prefetch(t.w + b * t.block_stride, p, t.prefetch);
      }
      maybe_stream(t.stream, p);
      for (int m = 0; m < M; ++m) {
        const __m512i x = _mm512_set1_epi32(load_pair(t.a[m] + 2 * p));
        for (int b = 0; b < NB; ++b)
          acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)w[b], (__m512bh)x);
      }
    }
    store_accumulators<Vec>(acc, t);
  }
};

}  // namespace
}  // namespace kt::cpu
