// [NOTE] GGUF prefill on AMX tiles (amx variant only): the weights are the A operand,
// the tokens the B operand, so decoded weight rows need no re-layout.
//   - A job decodes its (up to) 64 weight rows once into bf16, row-major [64][kp]; an A
//     tile is 16 of those rows x 32 values, loaded with the row length as stride.
//   - Each expert's activation rows (tokens, or intermediate rows for down) are packed
//     once per call into B chunks of 16 pairs: [kp / 2][16 pairs][2] bf16, so a B tile
//     is 16 consecutive 64-byte lines (16 k-pairs x 16 pairs x 2).
//   - C tiles are [16 rows][16 pairs] fp32, written out transposed (out[pair][row]).
// Tiles: C = tmm0..3 (2 row tiles x 2 pair chunks), A = tmm4..5, B = tmm6..7.
// Weights and activations are rounded to bf16, products accumulated in fp32 (error
// ~3e-3 relative, below the 8-bit activation blocks of the vector path).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../bf16/bf16_gemm_amx.h"
#include "../../formats/gguf_types.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct GgufAmx {
  static constexpr bool kEnabled = true;
  static constexpr int64_t kChunk = 16;  // pairs per B chunk (tile columns)

  // 256 decoded weights -> bf16: scale[e / 4] * q[e] - minimum[e / 16]; Q8_0's levels
  // are offset binary (q + 128) with no minimum.
  static void unit_to_bf16(const GgufDecoded& d, bool offset_binary, uint16_t* out) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i offset = _mm512_set1_epi32(offset_binary ? 128 : 0);
    __m512 v[2];
    for (int g = 0; g < 16; ++g) {
      const __m512i q = _mm512_sub_epi32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d.q + 16 * g))), offset);
      const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(d.scale + 4 * g)));
      v[g & 1] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), s, _mm512_set1_ps(d.minimum[g]));
      if (g & 1)
        _mm512_storeu_si512(out + 16 * (g - 1), (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    }
  }

  // A Q4_K / Q8_0 row straight from its bytes to bf16 [kp] (zero past k); false for
  // other types (the caller decodes them through gguf_decode.h and unit_to_bf16).
  static bool row_to_bf16(GgmlType type, const uint8_t* row, int64_t k, int64_t kp, uint16_t* out) {
    if (type == GgmlType::kQ4_K) {
      for (int64_t u = 0; u < k / 256; ++u) q4k_unit_to_bf16(row + u * 144, out + u * 256);
    } else if (type == GgmlType::kQ8_0) {
      for (int64_t b = 0; b < k / 32; ++b) q8_0_block_to_bf16(row + b * 34, out + b * 32);
    } else {
      return false;
    }
    std::fill(out + k, out + kp, uint16_t{0});
    return true;
  }

  // fp32 [kp] -> bf16 [kp] (kp a multiple of 32).
  static void floats_to_bf16(const float* x, int64_t kp, uint16_t* out) {
    for (int64_t i = 0; i < kp; i += 32)
      _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
  }

  // Activation row x (fp32 [kp]) -> column `col` of B chunk `chunk` ([kp / 2][16][2] bf16).
  static void pack_column(const float* x, int64_t kp, uint16_t* chunk, int64_t col) {
    const __m512i lines = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(16));
    int32_t* base = reinterpret_cast<int32_t*>(chunk) + col;  // 32-bit lane = one bf16 pair
    for (int64_t i = 0; i < kp; i += 32) {
      const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
      _mm512_i32scatter_epi32(base + (i / 2) * 16, lines, pairs, 4);
    }
  }

  // One Q4_K super-block (144 bytes) -> 256 bf16. Per pair of sub-blocks a 32-entry
  // bf16 table (d*sc*q - dmin*m for q < 16, the first sub-block's then the second's)
  // and one vpermw per 32 weights: the low nibbles index entries 0-15, the high ones
  // (| 16) entries 16-31.
  static void q4k_unit_to_bf16(const uint8_t* b, uint16_t* out) {
    uint16_t halves[2];
    std::memcpy(halves, b, 4);
    // get_scale_min_k4 (see gguf_q4k_avx512.h): 8 scales then 8 minimums.
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i p = _mm_shuffle_epi32(raw, 0x98), q = _mm_shuffle_epi32(raw, 0x50);
    const __m128i bytes = _mm_or_si128(
        _mm_and_si128(_mm_srlv_epi32(p, _mm_setr_epi32(0, 0, 0, 4)), _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
        _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(q, 6), _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4));
    const __m512 factor = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(halves[0])), _mm256_set1_ps(_cvtsh_ss(halves[1])), 1);
    alignas(64) float sm[16];
    _mm512_store_ps(sm, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), factor));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m512i high_entries = _mm512_set1_epi16(16);
    for (int j = 0; j < 4; ++j) {
      const __m512 first = _mm512_fmsub_ps(iota, _mm512_set1_ps(sm[2 * j]), _mm512_set1_ps(sm[8 + 2 * j]));
      const __m512 second = _mm512_fmsub_ps(iota, _mm512_set1_ps(sm[2 * j + 1]), _mm512_set1_ps(sm[9 + 2 * j]));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(second, first);
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j));
      const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(qs, low));
      const __m512i hi = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(qs, 4), low)), high_entries);
      _mm512_storeu_si512(out + 64 * j, _mm512_permutexvar_epi16(lo, table));
      _mm512_storeu_si512(out + 64 * j + 32, _mm512_permutexvar_epi16(hi, table));
    }
  }

  // One Q8_0 block (34 bytes) -> 32 bf16: d * q.
  static void q8_0_block_to_bf16(const uint8_t* b, uint16_t* out) {
    uint16_t half;
    std::memcpy(&half, b, 2);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(half));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }

  // out[p * ldo + n] = sum_k w[n][k] * b(p)[k] for rows n < rows and pairs p < pairs,
  // where w is bf16 [round_up(rows, 16)][kp] row-major and b the pairs' B chunks
  // (chunk c at b + c * 16 * kp). kp is a multiple of 32; rows <= 64.
  static void gemm(const uint16_t* w, int64_t rows, int64_t kp, const uint16_t* b, int64_t pairs, float* out,
                   int64_t ldo) {
    load_full_tile_config();
    const int64_t row_tiles = (rows + 15) / 16, chunks = (pairs + kChunk - 1) / kChunk;
    for (int64_t r0 = 0; r0 < row_tiles; r0 += 2)
      for (int64_t c0 = 0; c0 < chunks; c0 += 2) {
        const bool two_rows = r0 + 1 < row_tiles, two_chunks = c0 + 1 < chunks;
        const uint16_t* a0 = w + r0 * 16 * kp;
        const uint16_t* b0 = b + c0 * kChunk * kp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < kp; k += 32) {
          _tile_loadd(4, a0 + k, kp * 2);
          _tile_loadd(6, b0 + k * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_chunks) {
            _tile_loadd(7, b0 + kChunk * kp + k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_rows) {
            _tile_loadd(5, a0 + 16 * kp + k, kp * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two_chunks) _tile_dpbf16ps(3, 5, 7);
          }
        }
        alignas(64) float c[4][16 * 16];  // [tile][row][pair]
        _tile_stored(0, c[0], 64);
        if (two_chunks) _tile_stored(1, c[1], 64);
        if (two_rows) _tile_stored(2, c[2], 64);
        if (two_rows && two_chunks) _tile_stored(3, c[3], 64);
        for (int t = 0; t < 4; ++t) {
          const int64_t n0 = (r0 + t / 2) * 16, p0 = (c0 + t % 2) * kChunk;
          if (n0 >= rows || p0 >= pairs) continue;
          const int64_t nn = std::min<int64_t>(16, rows - n0), np = std::min<int64_t>(kChunk, pairs - p0);
          for (int64_t p = 0; p < np; ++p)
            for (int64_t n = 0; n < nn; ++n) out[(p0 + p) * ldo + n0 + n] = c[t][n * 16 + p];
        }
      }
    _tile_release();
  }
};

}  // namespace
}  // namespace kt::cpu
