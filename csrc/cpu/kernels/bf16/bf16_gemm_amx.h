// [NOTE] BF16 GEMM on AMX tiles (tdpbf16ps) for experts with more tokens than one
// vector micro-tile. The packed layout is already AMX's B layout: 16 consecutive
// 64-byte lines of a block (16 k-pairs x 16 columns x 2) are one B tile, loaded with a
// 64-byte stride. A tiles are 16 rows x 32 bf16 of the expert's activation rows.
// Tiles: C0..C3 = tmm0..3 (32 rows x 32 columns, fp32), A = tmm4..5, B = tmm6..7 (passes of
// up to 16 rows: C0, C1, and tmm2..3 as the B tiles of a second k step).
// What tiles do not cover — the decode path, a k tail of fewer than 16 pairs, an odd
// last block — the driver runs with the AVX512_BF16 micro-kernel this struct inherits.
// The tile configuration is loaded on every call (other AMX users on the thread, such
// as oneDNN, change it) and released after (so the OS need not save tile state).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "bf16_gemm_avx512_bf16.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12 does not treat ldtilecfg as reading its operand and dropped the stores of a
// config filled in a loop (all-zero rows: tilezero then faults with SIGILL). The empty
// asm with a memory clobber makes the stores visible before the load.
inline void load_tile_config(const AmxTileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Eight tiles of 16 rows x 64 bytes (bf16: 16 x 32 values; fp32 C: 16 x 16).
inline void load_full_tile_config() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  load_tile_config(config);
}

struct Bf16GemmAmx : Bf16GemmAvx512Bf16 {
  static constexpr int64_t kTilePairs = 16;  // k-pairs per A/B tile (64 bytes per row)

  // c[m][0, 16 * blocks_done) = a[m] x blocks of w over k-pairs [0, pairs_done) for
  // m < rows, where row m of a is at a + m * lda (bf16) and rows up to round_up(rows, 32)
  // are readable. Returns what it covered; the caller does the rest.
  static TileCoverage tile_gemm(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* w,
                                int64_t block_stride, int64_t pairs, int blocks, float* c,
                                int64_t ldc) {
    const TileCoverage done{pairs / kTilePairs * kTilePairs, blocks / 2 * 2};
    if (done.pairs == 0 || done.blocks == 0) return {0, 0};
    load_full_tile_config();
    for (int64_t m0 = 0; m0 < rows; m0 += 32) {
      const int64_t tile_rows = std::min<int64_t>(32, rows - m0);
      for (int b0 = 0; b0 < done.blocks; b0 += 2) {
        // The next pass's weights, fetched during this one's last steps (the first row
        // tile streams them from DRAM; later row tiles find them in cache).
        const bool next_pass = m0 == 0 && b0 + 2 < done.blocks;
        tile_pass(a + m0 * lda, lda, tile_rows, w + b0 * block_stride, block_stride, done.pairs,
                  next_pass ? w + (b0 + 2) * block_stride : nullptr, c + m0 * ldc + b0 * 16, ldc);
      }
    }
    _tile_release();
    return done;
  }

 private:
  // The B tiles kPrefetchTiles k-steps ahead: weights stream from DRAM once per
  // expert, and a tile load that misses stalls the matrix unit.
  static constexpr int64_t kPrefetchTiles = 8;
  // Past the end of this pass it continues into `next` (the next pass's first block
  // pair, block_stride apart), if any.
  static void prefetch_b_tiles(const uint16_t* w, const uint16_t* next, int64_t block_stride,
                               int64_t p, int64_t tile_pairs) {
    int64_t ahead = p + kPrefetchTiles * kTilePairs;
    if (ahead >= tile_pairs) {
      if (next == nullptr) return;
      w = next;
      ahead -= tile_pairs;
    }
    for (int line = 0; line < kTilePairs; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (ahead + line) * 32), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + block_stride + (ahead + line) * 32), _MM_HINT_T1);
    }
  }

  // 32 (or 16) rows x 2 blocks over tile_pairs k-pairs, stored to c[0, tile_rows).
  // A pass of up to 16 rows leaves C2 and C3 free and loads the next k step's tiles into
  // them (B) and A5 before the first step's multiplies, so its loads need not wait for
  // those multiplies to release their tiles. Same products, same order: bit-identical.
  // Paired against one step per iteration (scripts/ab_pair.py, run-time switch, 8 calls x
  // 2 rounds; Intel Xeon VM with AMX, family 6 model 167, 2026-12-06): in a slow phase of
  // that VM (S1 BF16 512 tokens 117-149 ms) S1 BF16 128 / 512 tokens 0.85x / 0.73x the
  // time, S2 0.95x / 0.92x, S1 FP8 0.95x / 0.87x; in a fast one (65-85 ms) 0.96-1.01x,
  // FP8 and MXFP8 0.97-1.02x. Running 17-32 rows as two such passes instead took 1.14x /
  // 1.19x (S1 / S2 BF16, 512 tokens).
  static void tile_pass(const uint16_t* a, int64_t lda, int64_t tile_rows, const uint16_t* w,
                        int64_t block_stride, int64_t tile_pairs, const uint16_t* next, float* c,
                        int64_t ldc) {
    const uint16_t* a1 = a + 16 * lda;
    const uint16_t* w1 = w + block_stride;
    const int64_t a_stride = lda * sizeof(uint16_t);
    const bool two_row_tiles = tile_rows > 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int64_t p0 = 0;
    if (!two_row_tiles)  // C2, C3 unused: two k steps per iteration, the second into A5, B2, B3
      for (; p0 + 2 * kTilePairs <= tile_pairs; p0 += 2 * kTilePairs) {
        const int64_t p = p0, q = p0 + kTilePairs;
        prefetch_b_tiles(w, next, block_stride, p, tile_pairs);
        prefetch_b_tiles(w, next, block_stride, q, tile_pairs);
        _tile_loadd(4, a + 2 * p, a_stride);
        _tile_loadd(6, w + p * 32, 64);
        _tile_loadd(7, w1 + p * 32, 64);
        _tile_loadd(5, a + 2 * q, a_stride);
        _tile_loadd(2, w + q * 32, 64);
        _tile_loadd(3, w1 + q * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(0, 5, 2);
        _tile_dpbf16ps(1, 5, 3);
      }
    for (int64_t p = p0; p < tile_pairs; p += kTilePairs) {
      prefetch_b_tiles(w, next, block_stride, p, tile_pairs);
      _tile_loadd(4, a + 2 * p, a_stride);
      _tile_loadd(6, w + p * 32, 64);
      _tile_loadd(7, w1 + p * 32, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two_row_tiles) {  // rows 16..31
        _tile_loadd(5, a1 + 2 * p, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    alignas(64) float out[32 * 32];  // [32 rows][2 blocks x 16]
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    if (two_row_tiles) {
      _tile_stored(2, out + 16 * 32, 128);
      _tile_stored(3, out + 16 * 32 + 16, 128);
    }
    for (int64_t m = 0; m < tile_rows; ++m) std::memcpy(c + m * ldc, out + m * 32, 32 * sizeof(float));
  }
};

}  // namespace
}  // namespace kt::cpu
