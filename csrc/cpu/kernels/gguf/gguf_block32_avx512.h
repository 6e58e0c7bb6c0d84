// [NOTE] The block-32 types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) dotted straight from their
// GGUF bytes on AVX-512 (no decoded copy), four rows in lockstep, four blocks (128
// weights) per step. The step's levels go in two 64-byte registers whose 128-bit lane L
// holds block L's weights 0-15 (lo) and 16-31 (hi); the activation is stored in the same
// "quad" order (gguf_act.h), so two dot products into one int32 register leave each lane
// with 8 products of one block, and the conversion, the block scale d times the
// activation block's scale and the fma run once per 128 weights and (row, token) instead
// of once per 64 (the two-block kernel before was bound by those float operations:
// Q4_0 at 512 tokens 0.76-0.79x the time now). Q8_0's levels are made offset binary for
// vpdpbusd, whose start value (-128 * the lane's level sum, bias8) cancels the offset
// exactly; Q4_0's nibbles (q - 8) start from -8 * sum = bias8 / 16, Q5_0's levels
// (q - 16, the fifth bits of a block's qh added under byte masks) from bias8 / 8, and so
// do MXFP4's (its nibbles looked up by vpshufb as the levels v + 16 of the doubled e2m1
// values v, gguf_decode.h; d the block's half scale from its exponent byte). Q4_1's
// and Q5_1's levels (d * q + m) start from 0; their minimums take one more fma per 128
// weights, m times the activation's scaled level sums (min_sums8). A row's last step,
// when its block count is not a multiple of 4, reads a zero-padded copy of the
// remaining blocks (d = 0; the activation is zero there).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../formats/gguf_types.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// Bytes per block of the block-32 in-place types, and where the levels start in one.
template <GgmlType kType>
constexpr int kBlock32Bytes = kType == GgmlType::kQ4_0   ? 18
                              : kType == GgmlType::kQ4_1 ? 20
                              : kType == GgmlType::kQ5_0 ? 22
                              : kType == GgmlType::kQ5_1 ? 24
                              : kType == GgmlType::kMxfp4 ? mxfp4::kBlockBytes
                                                         : 34;
template <GgmlType kType>
constexpr int kBlock32Levels = kType == GgmlType::kQ4_1   ? 4
                               : kType == GgmlType::kQ5_0 ? 6
                               : kType == GgmlType::kQ5_1 ? 8
                               : kType == GgmlType::kMxfp4 ? 1
                                                          : 2;

// 16 bytes at `off` of each of the 4 blocks from `b` in the 4 128-bit lanes.
template <int kBytes>
inline __m512i load_lanes4(const uint8_t* b, int off) {
  const auto at = [&](int blk) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + blk * kBytes + off)); };
  __m512i v = _mm512_castsi128_si512(at(0));
  v = _mm512_inserti32x4(v, at(1), 1);
  v = _mm512_inserti32x4(v, at(2), 2);
  return _mm512_inserti32x4(v, at(3), 3);
}

// The 4 blocks' d (and m, the f16 after it: Q4_1, Q5_1), each in the 4 lanes of its
// block's 128-bit lane: the halves packed in a general register, one conversion, one
// permute per vector (4 insertions of 16-bit words and their unpacking cost 3-4x more
// vector operations per row and step).
template <int kBytes, bool kMin>
inline void block_scales4(const uint8_t* b, __m512* d, __m512* m) {
  const auto at = [&](int blk) {
    uint32_t v;
    std::memcpy(&v, b + blk * kBytes, 4);
    return static_cast<uint64_t>(kMin ? v : v & 0xffff);
  };
  if constexpr (kMin) {  // (d, m) of block i in lanes 2i, 2i + 1
    const __m128i halves = _mm_set_epi64x(static_cast<int64_t>(at(2) | at(3) << 32), static_cast<int64_t>(at(0) | at(1) << 32));
    const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(halves));
    *d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), dm);
    *m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), dm);
  } else {  // d of block i in lane i
    const __m128i halves = _mm_cvtsi64_si128(static_cast<int64_t>(at(0) | at(1) << 16 | at(2) << 32 | at(3) << 48));
    const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(halves));
    *d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), d4);
  }
}

// out[4 * j + i] = dot(row i of kType (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4), activation row j)
// for i < 4, j < M over a row of k values, each step of the 4 rows extracted once and
// dotted with the M activation rows. Row j in quad order (gguf_act.h): aq[j] levels
// [kp], scale8[j], bias8[j] and min_sums8[j] (the activation scale times the level sum:
// Q4_1's and Q5_1's minimums multiply it) per 8 values (one int32 lane). Each (row,
// activation row) result takes the same operations in the same order whatever M
// (gguf_q4k_dot_rows4); prefetch as there.
template <class Ops, GgmlType kType, int M>
void gguf_block32_dot_rows4(const uint8_t* const* rows, int64_t k, const int8_t* const* aq,
                            const float* const* scale8, const int32_t* const* bias8,
                            const float* const* min_sums8, bool prefetch, float* out) {
  constexpr bool kNibbles = kType != GgmlType::kQ8_0;
  constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;  // d * q + m, q >= 0
  constexpr bool kFifth = kType == GgmlType::kQ5_0 || kType == GgmlType::kQ5_1;
  constexpr int kBytes = kBlock32Bytes<kType>, kQs = kBlock32Levels<kType>, kStep = 4 * kBytes;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i mxfp4_levels = _mm512_broadcast_i32x4(mxfp4_level_table());
  __m512 acc[M][4];
#pragma GCC unroll 4
  for (int j = 0; j < M; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_ps();
  const int64_t blocks = k / 32;
  alignas(64) uint8_t tail[4][kStep];  // the last step's blocks, zero-padded to 4
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    const int64_t n = std::min<int64_t>(4, blocks - b0);
    if (n < 4) {
      std::memset(tail, 0, sizeof(tail));
      for (int i = 0; i < 4; ++i) std::memcpy(tail[i], rows[i] + kBytes * b0, kBytes * n);
    }
    // (Read from L1 per row instead, the levels and scales took no spills at M = 4 but
    // ran 512-token Q4_0 and Q8_0 5-6% slower.)
    __m512i a_lo[M], a_hi[M], start[M];
    __m512 sa[M], min_sum[M];
#pragma GCC unroll 4
    for (int j = 0; j < M; ++j) {
      a_lo[j] = _mm512_loadu_si512(aq[j] + 32 * b0);
      a_hi[j] = _mm512_loadu_si512(aq[j] + 32 * b0 + 64);
      sa[j] = _mm512_loadu_ps(scale8[j] + 4 * b0);
      if constexpr (kMin) min_sum[j] = _mm512_loadu_ps(min_sums8[j] + 4 * b0);
      const __m512i bias = _mm512_loadu_si512(bias8[j] + 4 * b0);
      start[j] = kType == GgmlType::kQ4_0   ? _mm512_srai_epi32(bias, 4)
                 : kType == GgmlType::kQ5_0 || kType == GgmlType::kMxfp4 ? _mm512_srai_epi32(bias, 3)
                 : kType == GgmlType::kQ8_0 && Ops::kInt8Bias != 0 ? bias
                                                                    : _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = n < 4 ? tail[i] : rows[i] + kBytes * b0;
      if (prefetch) {
        const char* ahead = reinterpret_cast<const char*>(rows[i] + kBytes * b0 + kGgufPrefetchBytes);
        for (int line = 0; line < kStep; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        _mm_prefetch(ahead + kStep - 1, _MM_HINT_T0);
      }
      __m512 d, m;  // the blocks' scales; Q4_1 / Q5_1: their minimums
      if constexpr (kType == GgmlType::kMxfp4)
        d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                  _mm512_castps128_ps512(mxfp4_half_scales4(b, kBytes)));
      else
        block_scales4<kBytes, kMin>(b, &d, &m);
      __m512i lo, hi;  // weights 0-15 / 16-31 of block L in 128-bit lane L (Q8_0: offset binary)
      if constexpr (kNibbles) {  // nibbles: low = weight j, high = j + 16
        const __m512i v = load_lanes4<kBytes>(b, kQs);
        lo = _mm512_and_si512(v, low);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (kType == GgmlType::kMxfp4) {
          lo = _mm512_shuffle_epi8(mxfp4_levels, lo);
          hi = _mm512_shuffle_epi8(mxfp4_levels, hi);
        }
        if constexpr (kFifth) {  // bit j of qh (before the nibbles): + 16 to weight j
          uint64_t mask_lo = 0, mask_hi = 0;
          for (int blk = 0; blk < 4; ++blk) {  // bits 0-15 / 16-31 of each qh
            uint16_t half[2];
            std::memcpy(half, b + blk * kBytes + kQs - 4, 4);
            mask_lo |= static_cast<uint64_t>(half[0]) << (16 * blk);
            mask_hi |= static_cast<uint64_t>(half[1]) << (16 * blk);
          }
          const __m512i sixteen = _mm512_set1_epi8(16);
          lo = _mm512_mask_add_epi8(lo, mask_lo, lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, mask_hi, hi, sixteen);
        }
      } else {
        lo = _mm512_xor_si512(load_lanes4<kBytes>(b, kQs), flip);
        hi = _mm512_xor_si512(load_lanes4<kBytes>(b, kQs + 16), flip);
      }
#pragma GCC unroll 4
      for (int j = 0; j < M; ++j) {
        const __m512i p = kNibbles ? Ops::dot(Ops::dot(start[j], lo, a_lo[j]), hi, a_hi[j])
                                   : Ops::dot_int8(Ops::dot_int8(start[j], lo, a_lo[j]), hi, a_hi[j]);
        const __m512 scale = _mm512_mul_ps(d, sa[j]);
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[j][i]);
        if constexpr (kMin) acc[j][i] = _mm512_fmadd_ps(m, min_sum[j], acc[j][i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < M; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) out[4 * j + i] = _mm512_reduce_add_ps(acc[j][i]);
}

}  // namespace
}  // namespace kt::cpu
