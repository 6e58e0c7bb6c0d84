// [NOTE] FP8 prefill on AMX tiles (amx variant only; fp8_format.h drives it). An expert
// with more rows than the vector decode tile decodes each k block of a job's blocks
// (up to kTileBlocks blocks x kFp8PrefillKBlockPairs pairs) once into BF16 lines (the
// exact w / 256 of fp8_decode_avx512.h, mxfp8's exponent included), which are AMX's B
// layout already: 16 consecutive 64-byte lines of a block (16 k-pairs x 16 columns x 2)
// are one B tile. tdpbf16ps runs passes of 32 (or 16) activation rows x 2 blocks over the
// k block, as the BF16 tiles do (bf16_gemm_amx.h); the first pass over a block pair
// decodes each tile's lines just before loading it, the later passes read them.
// Scales stay out of the bf16 weights (they would round them): fp8's 128-k groups are
// flushed from the C tiles through L1 (c (+)= s * 256 * sum per group), fp8_perchannel and
// mxfp8 flush once per k block (the per-channel scale and the NaN addends follow, as on
// the vector path). tdpbf16ps sums in its own order, so these rows match the vector path
// (decode) to ~1e-6 relative in fp32, not bit for bit: the amx exception of
// docs/formats.md "Batch invariance", as BF16's tiles.
// Tiles: C = tmm0..3 (2 row tiles x 2 blocks), A = tmm4..5, B = tmm6..7; a pass of up to
// 16 rows uses C0, C1 and loads a second k step into A5 and B2, B3 (bf16_gemm_amx.h).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../bf16/bf16_gemm_amx.h"
#include "fp8_decode_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct Fp8TilesAmx {
  static constexpr int64_t kTilePairs = 16;  // k-pairs per A/B tile
  static constexpr int64_t kAheadPairs = 64;  // code prefetch distance (2 KiB, as decode's)

  // Around a call's passes: the tile configuration (other AMX users on the thread, such
  // as oneDNN, change it) and its release (so the OS need not save tile state).
  static void begin() { load_full_tile_config(); }
  static void end() { _tile_release(); }

  // The BF16 lines of k-pairs [p0, p0 + pairs) of block b (codes at `block`, pair p at
  // byte 32 p) from weight source `src` (Fp8LinesAvx512Bf16) to out[32 p].
  template <class Src>
  static KT_FP8_INLINE void decode_lines(const Src& src, const uint16_t* block, int b, int64_t p0, int64_t pairs,
                                         uint16_t* out) {
    const char* codes = reinterpret_cast<const char*>(block);
    for (int64_t p = p0; p < p0 + pairs; p += 2) {  // one 64-byte line of codes per step
      _mm_prefetch(codes + (p + kAheadPairs) * 32, _MM_HINT_T0);
      _mm512_store_si512(out + p * 32, src.line(block, b, p));
      _mm512_store_si512(out + p * 32 + 32, src.line(block, b, p + 1));
    }
  }

  // c[m][16 b + n] (+)= a[m] x BF16 lines of blocks b < (two_blocks ? 2 : 1) over k-pairs
  // [0, pairs), for m < tile_rows <= 32 (rows up to 32 readable), in flushes of
  // flush_pairs pairs (a multiple of kTilePairs): flush j adds
  // scales[b][16 j + n] * unit * sum (or the plain sum when scales is null) to c, or
  // stores it when neither `accumulate` nor an earlier flush of this call.
  // Line p of block b is at lines + b * line_stride + 32 p; row m of a at a + m * lda.
  // decode(b, p) is called before the tiles of k-pairs [p, p + kTilePairs) of block b
  // are loaded (the first pass decodes them there, so its B tiles come from L1).
  // The caller loads the tile configuration (begin) and releases it (end).
  template <class Decode>
  static void pass(const uint16_t* a, int64_t lda, int64_t tile_rows, const uint16_t* lines, int64_t line_stride,
                   bool two_blocks, int64_t pairs, int64_t flush_pairs, const float* const* scales, float unit,
                   float* c, int64_t ldc, bool accumulate, const Decode& decode) {
    const uint16_t* a1 = a + 16 * lda;
    const uint16_t* w1 = lines + line_stride;
    const int64_t a_stride = lda * static_cast<int64_t>(sizeof(uint16_t));
    const bool two_row_tiles = tile_rows > 16;
    for (int64_t g0 = 0, j = 0; g0 < pairs; g0 += flush_pairs, ++j) {
      const int64_t g1 = std::min(pairs, g0 + flush_pairs);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      int64_t p0 = g0;
      if (!two_row_tiles)  // as Bf16GemmAmx::tile_pass: two k steps per iteration, the second into A5, B2, B3
        for (; p0 + 2 * kTilePairs <= g1; p0 += 2 * kTilePairs) {
          const int64_t p = p0, q = p0 + kTilePairs;
          decode(0, p);
          if (two_blocks) decode(1, p);
          decode(0, q);
          if (two_blocks) decode(1, q);
          _tile_loadd(4, a + 2 * p, a_stride);
          _tile_loadd(6, lines + p * 32, 64);
          if (two_blocks) _tile_loadd(7, w1 + p * 32, 64);
          _tile_loadd(5, a + 2 * q, a_stride);
          _tile_loadd(2, lines + q * 32, 64);
          if (two_blocks) _tile_loadd(3, w1 + q * 32, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_blocks) _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(0, 5, 2);
          if (two_blocks) _tile_dpbf16ps(1, 5, 3);
        }
      for (int64_t p = p0; p < g1; p += kTilePairs) {
        decode(0, p);
        if (two_blocks) decode(1, p);
        _tile_loadd(4, a + 2 * p, a_stride);
        _tile_loadd(6, lines + p * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_blocks) {
          _tile_loadd(7, w1 + p * 32, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_row_tiles) {  // rows 16..31
          _tile_loadd(5, a1 + 2 * p, a_stride);
          _tile_dpbf16ps(2, 5, 6);
          if (two_blocks) _tile_dpbf16ps(3, 5, 7);
        }
      }
      alignas(64) float sums[32 * 32];  // [32 rows][2 blocks x 16]
      _tile_stored(0, sums, 128);
      if (two_blocks) _tile_stored(1, sums + 16, 128);
      if (two_row_tiles) {
        _tile_stored(2, sums + 16 * 32, 128);
        if (two_blocks) _tile_stored(3, sums + 16 * 32 + 16, 128);
      }
      flush(sums, tile_rows, two_blocks ? 2 : 1, scales, j, unit, c, ldc, accumulate || g0 > 0);
    }
  }

 private:
  static void flush(const float* sums, int64_t rows, int blocks, const float* const* scales, int64_t j, float unit,
                    float* c, int64_t ldc, bool add) {
    const __m512 u = _mm512_set1_ps(unit);
    for (int b = 0; b < blocks; ++b) {
      const __m512 s = scales != nullptr ? _mm512_mul_ps(_mm512_loadu_ps(scales[b] + 16 * j), u) : u;
      for (int64_t m = 0; m < rows; ++m) {
        float* out = c + m * ldc + 16 * b;
        const __m512 x = _mm512_load_ps(sums + m * 32 + 16 * b);
        _mm512_storeu_ps(out, add ? _mm512_fmadd_ps(s, x, _mm512_loadu_ps(out)) : _mm512_mul_ps(s, x));
      }
    }
  }
};

// The FP8 ops of the amx variant: the avx512_bf16 ones (decode keeps its vector tiles),
// with the BF16 tile GEMM's micro-kernel set (one-group prefill jobs, Bf16Jobs) and the
// tile pass above for prefill.
struct Fp8OpsAmx : Fp8OpsAvx512<Bf16GemmAmx, Fp8LinesAvx512Bf16> {
  using Tiles = Fp8TilesAmx;
};

}  // namespace
}  // namespace kt::cpu
