// [NOTE] BF16 micro-GEMM for AVX2 + FMA: a 64-byte weight line is two 8-lane loads,
// each widened in registers into fp32 vectors for k and k + 1; fp32 activations.
// Every output lane accumulates k = 2p then k = 2p + 1 into one register, for any tile
// shape, so a row's result does not depend on how many rows share the tile (batch
// invariance). Decode (1-2 rows) would then be bound by the FMA latency of one chain per
// block: it takes more blocks per tile instead (max_blocks): 8 accumulators in every
// shape (1 x 4, 2 x 2, 4 x 1 blocks) + the widened weights + 2 broadcasts of 16.
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx2.h"
#include "bf16_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// The BF16 format's weight source: line p of a block as two 8-row halves, each widened
// to fp32 for k (even) and k + 1 (odd). A source whose widened blocks would not fit in
// registers next to the accumulators sets kWidenInTurn: tiles of several blocks then
// widen each block just before its fmas (the same fmas in the same order per lane).
struct Bf16LinesAvx2 {
  // The tile widens all its blocks before the fmas (decode issues their loads together:
  // widening one block at a time measured 1-3% slower BF16 decode, Zen 3, 2026-11-26).
  static constexpr bool kWidenInTurn = false;
  static constexpr bool kSplitLanes = false;
  static constexpr bool kOutlined = false;  // see Bf16GemmAvx2::tile
  void widen(const uint16_t* block, int /*b*/, int64_t p, __m256 (&even)[2], __m256 (&odd)[2]) const {
    const __m256i high_mask = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int h = 0; h < 2; ++h) {
      const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + p * 32 + h * 16));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(line, high_mask));
    }
  }
  NextTile next;
  void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const { maybe_prefetch(block, p, ahead, next); }
};

// A block's two accumulators between the split order of a source with kSplitLanes (even
// rows 0, 2, ..., 14 | odd rows 1, 3, ..., 15: fp8_decode_avx2.h) and row order (rows
// 0-7 | 8-15), at the tile's stores and loads.
inline __attribute__((always_inline)) void split_lanes_to_rows(__m256 (&v)[2]) {
  const __m256 low = _mm256_unpacklo_ps(v[0], v[1]), high = _mm256_unpackhi_ps(v[0], v[1]);  // 0-3 | 8-11, 4-7 | 12-15
  v[0] = _mm256_permute2f128_ps(low, high, 0x20);
  v[1] = _mm256_permute2f128_ps(low, high, 0x31);
}
inline __attribute__((always_inline)) void rows_to_split_lanes(__m256 (&v)[2]) {
  const __m256 low = _mm256_permute2f128_ps(v[0], v[1], 0x20), high = _mm256_permute2f128_ps(v[0], v[1], 0x31);
  v[0] = _mm256_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0));
  v[1] = _mm256_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1));
}

struct Bf16GemmAvx2 {
  using Vec = VecAvx2;
  using Act = float;
  using Lines = Bf16LinesAvx2;  // tile's default weight source (FP8 decodes instead)
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxBlocks = 4;
  // Blocks a tile of `rows` rows may hold (8 accumulators).
  static constexpr int max_blocks(int rows) { return rows <= 1 ? 4 : rows == 2 ? 2 : 1; }

  // A source with kOutlined runs the tile as a function of its own, on copies of its
  // arguments: inlined into the FP8 decode loops (fp8_format.h), GCC kept the 8
  // accumulators in registers but also stored them to the stack on every k-pair, and
  // reloaded loop bounds from it (87 instructions per pair, 13 on the stack, against 77
  // and none). Paired on Zen 3 (2026-12-02, 2 rounds of 16 calls): S1 FP8 1 and 8 tokens
  // 0.93 and 0.93 of the time (S2 0.90, 0.93), MXFP8 0.86 and 0.85 (S2 0.88, 0.88);
  // FP8_PERCHANNEL's inlined tile had no such stores (0.99). Not for the prefill sources:
  // all tiles outlined took 512-token S1 FP8 to 1.25x (FP8_PERCHANNEL 1.21x, MXFP8 1.5x).
  template <int M, int NB, class Src = Lines>
  static void tile(const TileArgs<Act>& t, const Src& src = Src()) {
    if constexpr (Src::kOutlined)
      outlined_tile<M, NB, Src>(t, src);
    else
      tile_body<M, NB, Src>(t, src);
  }

 private:
  template <int M, int NB, class Src>
  __attribute__((noinline)) static void outlined_tile(const TileArgs<Act>& args, const Src& source) {
    const Act* rows[M];
    for (int m = 0; m < M; ++m) rows[m] = args.a[m];
    TileArgs<Act> t = args;
    t.a = rows;
    const Src src = source;
    tile_body<M, NB, Src>(t, src);
  }

  template <int M, int NB, class Src>
  KT_TILE_INLINE static void tile_body(const TileArgs<Act>& t, const Src& src) {
    static_assert(NB <= max_blocks(M), "the AVX2 micro-GEMM holds 8 accumulators");
    __m256 acc[M][NB][2];
    const bool from_c = t.accumulate && t.group_scales == nullptr;
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h)
          acc[m][b][h] = from_c ? _mm256_loadu_ps(t.c + m * t.ldc + b * 16 + h * 8) : _mm256_setzero_ps();
    if constexpr (Src::kSplitLanes)
      if (from_c)
        for (int m = 0; m < M; ++m)
          for (int b = 0; b < NB; ++b) rows_to_split_lanes(acc[m][b]);
    for (int64_t p = 0; p < t.pairs; ++p) {
      if constexpr (NB == 1 || !Src::kWidenInTurn) {  // widen every block, then the fmas
        __m256 even[NB][2], odd[NB][2];
        for (int b = 0; b < NB; ++b) {
          const uint16_t* block = t.w + b * t.block_stride;
          src.prefetch(block, p, t.prefetch);
          src.widen(block, b, p, even[b], odd[b]);
        }
        for (int m = 0; m < M; ++m) {
          const __m256 x0 = _mm256_broadcast_ss(t.a[m] + 2 * p);
          const __m256 x1 = _mm256_broadcast_ss(t.a[m] + 2 * p + 1);
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h)
              acc[m][b][h] = _mm256_fmadd_ps(odd[b][h], x1, _mm256_fmadd_ps(even[b][h], x0, acc[m][b][h]));
        }
      } else {  // the broadcasts, then one block at a time, widened and used at once
        __m256 x0[M], x1[M];
        for (int m = 0; m < M; ++m) {
          x0[m] = _mm256_broadcast_ss(t.a[m] + 2 * p);
          x1[m] = _mm256_broadcast_ss(t.a[m] + 2 * p + 1);
        }
        for (int b = 0; b < NB; ++b) {
          const uint16_t* block = t.w + b * t.block_stride;
          src.prefetch(block, p, t.prefetch);
          __m256 even[2], odd[2];
          src.widen(block, b, p, even, odd);
          for (int m = 0; m < M; ++m)
            for (int h = 0; h < 2; ++h)
              acc[m][b][h] = _mm256_fmadd_ps(odd[h], x1[m], _mm256_fmadd_ps(even[h], x0[m], acc[m][b][h]));
        }
      }
      maybe_stream(t.stream, p);
    }
    if constexpr (Src::kSplitLanes)
      for (int m = 0; m < M; ++m)
        for (int b = 0; b < NB; ++b) split_lanes_to_rows(acc[m][b]);
    if (t.group_scales != nullptr) {
      const __m256 unit = _mm256_set1_ps(t.group_unit);
      const bool on_scale = unit_on_scale(t.group_unit);
      for (int m = 0; m < M; ++m)
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h)
            store_group_sum<VecAvx2>(t.c + m * t.ldc + b * 16 + h * 8, acc[m][b][h], t.group_scales[b] + h * 8, unit,
                                     on_scale, t.accumulate);
      return;
    }
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(t.c + m * t.ldc + b * 16 + h * 8, acc[m][b][h]);
  }
};

}  // namespace
}  // namespace kt::cpu
