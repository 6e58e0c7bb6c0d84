// [NOTE] BF16 micro-GEMM with vdpbf16ps (AVX512_BF16): one instruction multiplies a
// 64-byte weight line (16 outputs x 2 k) by a broadcast activation pair and adds both
// products into 16 fp32 accumulators. Activations are bf16. Up to 6 rows x 4 blocks:
// 24 accumulators + 4 weight registers of 32.
#pragma once

#include <immintrin.h>

#include <type_traits>

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

// A weight source may also decode pairs p and p + 1 of every block in one call (p even):
//   template <int NB, class Step>
//   void two_pairs(w, block_stride, p, prefetch, Step&& step)
// which prefetches as `prefetch` asks and calls step(p, lines) then step(p + 1, lines)
// with each pair's NB lines (FP8: one exponent test for all of them, fp8_decode_avx512.h).
// The accumulators see the same operations in the same order either way.
template <class Src, class = void>
constexpr bool kHasTwoPairs = false;
template <class Src>
constexpr bool kHasTwoPairs<Src, std::void_t<decltype(Src::kTwoPairs)>> = Src::kTwoPairs;

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
    // Pair p's lines w[NB] into every row's accumulators.
    auto step = [&](int64_t p, const __m512i(&w)[NB]) __attribute__((always_inline)) {
      maybe_stream(t.stream, p);
      for (int m = 0; m < M; ++m) {
        const __m512i x = _mm512_set1_epi32(load_pair(t.a[m] + 2 * p));
        for (int b = 0; b < NB; ++b)
          acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)w[b], (__m512bh)x);
      }
    };
    int64_t p = 0;
    if constexpr (kHasTwoPairs<Src>)
      for (; p + 2 <= t.pairs; p += 2) src.template two_pairs<NB>(t.w, t.block_stride, p, t.prefetch, step);
    for (; p < t.pairs; ++p) {
      __m512i w[NB];
      for (int b = 0; b < NB; ++b) {
        w[b] = src.line(t.w + b * t.block_stride, b, p);
        src.prefetch(t.w + b * t.block_stride, p, t.prefetch);
      }
      step(p, w);
    }
    store_accumulators<Vec>(acc, t);
  }
};

}  // namespace
}  // namespace kt::cpu
