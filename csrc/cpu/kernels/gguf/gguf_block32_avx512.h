// [NOTE] The block-32 types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) dotted straight from their
// GGUF bytes on AVX-512 (no decoded copy), four rows in lockstep, four blocks (128
// weights) per step. The step's levels go in two 64-byte registers whose 128-bit lane L
// holds block L's weights 0-15 (lo) and 16-31 (hi); the activation is stored in the same
// "quad" order (gguf_act.h), so two dot products into one int32 register leave each lane
// with 8 products of one block. The four rows' registers are then added across their
// lanes (gguf_lane_sums4): one register per activation row holds the 16 exact block sums
// (lane 4 L + i: row i, block L), and the conversion, the scale product d * da and the fma
// run once per step and activation row, into accumulators that keep block b in lane b %
// 4. The prefill tile (gguf_block32_tile_avx512.h) computes the same integers and float
// operations, so a token gets the same bits from either path. Q8_0's levels are made
// offset binary for vpdpbusd; the offset comes off in integers with the activation
// block's level sum (-128 * sum; Q4_0's nibbles q - 8: -8 * sum, Q5_0's levels q - 16
// (the fifth bits of a block's qh added under byte masks) and MXFP4's (its nibbles looked
// up by vpshufb as the levels v + 16 of the doubled e2m1 values v, gguf_decode.h; d the
// block's half scale from its exponent byte): -16 * sum). Q4_1's and Q5_1's levels (d * q
// + m) carry no offset; their minimums take one more fma per step, m times the
// activation block's scaled level sum, into a second accumulator. A row's last step, when
// its block count is not a multiple of 4, reads a zero-padded copy of the remaining
// blocks (d = 0; the activation is zero there: those lanes add 0).
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

// The 4 blocks' scales of one row: the halves of d (non-minimum types: lanes 0-3 of a
// 16-bit vector) or of (d, m) (Q4_1, Q5_1: d of block i in half 2 i, m in 2 i + 1), gathered
// in a general register (4 insertions of 16-bit words cost 3-4x more vector operations).
template <int kBytes, bool kMin>
inline __m128i block_scale_halves4(const uint8_t* b) {
  const auto at = [&](int blk) {
    uint32_t v;
    std::memcpy(&v, b + blk * kBytes, 4);
    return static_cast<uint64_t>(kMin ? v : v & 0xffff);
  };
  if constexpr (kMin) return _mm_set_epi64x(static_cast<int64_t>(at(2) | at(3) << 32), static_cast<int64_t>(at(0) | at(1) << 32));
  return _mm_cvtsi64_si128(static_cast<int64_t>(at(0) | at(1) << 16 | at(2) << 32 | at(3) << 48));
}

// The levels of the 4 blocks from `b` (kType): weights 0-15 (lo) and 16-31 (hi) of block L
// in 128-bit lane L, unsigned (Q8_0 offset binary: q + 128; MXFP4 the doubled e2m1 values
// + 16; Q4_0, Q4_1 the nibbles; Q5_0, Q5_1 the nibbles + 16 * the fifth bit).
// (Always inlined: as a call, Q5_0's took 1-token S1 1.23-1.31x the time, lo and hi in memory.)
template <GgmlType kType>
inline __attribute__((always_inline)) void block32_levels4(const uint8_t* b, __m512i* lo, __m512i* hi) {
  constexpr int kBytes = kBlock32Bytes<kType>, kQs = kBlock32Levels<kType>;
  constexpr bool kFifth = kType == GgmlType::kQ5_0 || kType == GgmlType::kQ5_1;
  if constexpr (kType == GgmlType::kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    *lo = _mm512_xor_si512(load_lanes4<kBytes>(b, kQs), flip);
    *hi = _mm512_xor_si512(load_lanes4<kBytes>(b, kQs + 16), flip);
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i v = load_lanes4<kBytes>(b, kQs);  // nibbles: low = weight j, high = j + 16
  *lo = _mm512_and_si512(v, low);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (kType == GgmlType::kMxfp4) {
    const __m512i table = _mm512_broadcast_i32x4(mxfp4_level_table());
    *lo = _mm512_shuffle_epi8(table, *lo);
    *hi = _mm512_shuffle_epi8(table, *hi);
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
    *lo = _mm512_mask_add_epi8(*lo, mask_lo, *lo, sixteen);
    *hi = _mm512_mask_add_epi8(*hi, mask_hi, *hi, sixteen);
  }
}

// The start of an exact integer sum, from -128 * the activation's level sum (of a lane's 8
// values in place, of a block on the tile): the levels' offset (Q8_0 on vpdpbusd: 128,
// Q4_0: 8, Q5_0 and MXFP4: 16) times the level sum, cancelled in integers; 0 for Q4_1,
// Q5_1 and Q8_0 without VNNI (sign trick, no offset).
template <class Ops, GgmlType kType>
inline __m512i block32_offset(__m512i bias) {
  if constexpr (kType == GgmlType::kQ4_0) return _mm512_srai_epi32(bias, 4);
  if constexpr (kType == GgmlType::kQ5_0 || kType == GgmlType::kMxfp4) return _mm512_srai_epi32(bias, 3);
  if constexpr (kType == GgmlType::kQ8_0 && Ops::kInt8Bias != 0) return bias;
  return _mm512_setzero_si512();
}

// The result of a (row, activation row) pair from its four block-lane accumulators
// (blocks b with b % 4 = 0, 1, 2, 3): (a0 + a2) + (a1 + a3), the tile kernel's order.
inline __m128 block32_lanes_sum(__m512 acc) {
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(acc, 0), _mm512_extractf32x8_ps(acc, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[4 * j + i] = dot(row i of kType (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4), activation row j)
// for i < 4, j < M over a row of k values, each step (4 blocks) of the 4 rows extracted once
// and dotted with the M activation rows. Row j in quad order (gguf_act.h): aq[j] levels
// [kp], scale8[j] the blocks' scales, bias8[j] -128 * the level sum of each int32 lane's 8
// values (the dot products start at the levels' offset times it), and block_min[j] each
// block's scale times its level sum, 4 lanes per block (Q4_1's and Q5_1's minimums).
// The arithmetic (gguf_block32_tile_avx512.h computes the same): per (row, activation row)
// and block b, the exact int32 S_b = sum q a (levels' offset removed), then in fp32, in
// block order within each of 4 accumulators (block b in accumulator b % 4),
//   acc = fma(float(S_b), d_b * da_b, acc),  accm = fma(m_b, da_b * levelsum_b, accm)  (Q4_1, Q5_1),
// and the result (acc0 + acc2) + (acc1 + acc3) (+ the same of accm). The four rows' int32
// lanes of a step are added across rows (gguf_lane_sums4: lane 4 L + i = row i's block L),
// so the float operations run on one register per activation row and step. A result depends on its row and activation row only. prefetch:
// request the rows' bytes kGgufPrefetchBytes ahead (the first pass over a row group).
// Cost on Zen 5 (a C++ harness, one core, rows in L2, 2026-12-02), Q8_0 per step: ~4.8 ns
// to extract the 4 rows plus ~1.8 ns per activation row (M = 1: 77-83 GB/s of weights,
// M = 4: 42-44; Q4_0 55 and 25); from DRAM 31-37 GB/s at M = 1, 22-28 at M = 4. M = 5
// still fits the registers (one pass of 5 took 0.75-0.86x the time of 4 + 1: not taken,
// only experts with exactly 5 pairs would gain); M >= 6 spills (M = 8: 9-12 GB/s).
// Extracting the 4 rows first and then looping over the activation rows kept M = 8 in
// registers but ran M = 1 to 4 at 0.7x this order's rate.
template <class Ops, GgmlType kType, int M>
void gguf_block32_dot_rows4(const uint8_t* const* rows, int64_t k, const int8_t* const* aq,
                            const float* const* scale8, const int32_t* const* bias8,
                            const float* const* block_min, bool prefetch, float* out) {
  constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;  // d * q + m, q >= 0
  constexpr int kBytes = kBlock32Bytes<kType>, kStep = 4 * kBytes;
  // Lane 4 L + i <- lane 4 i + L (row-major 4 x 4 -> block-major).
  const __m512i block_major = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  // (d, m) halves of rows 0-1 | 2-3 as floats, lane 8 (i % 2) + 2 L (+ 1: m) -> lane 4 L + i.
  const __m512i d_of_lane = _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30);
  const __m512i m_of_lane = _mm512_add_epi32(d_of_lane, _mm512_set1_epi32(1));
  __m512 acc[M], accm[M];
#pragma GCC unroll 4
  for (int j = 0; j < M; ++j) acc[j] = accm[j] = _mm512_setzero_ps();
  const int64_t blocks = k / 32;
  alignas(64) uint8_t tail[4][kStep];  // the last step's blocks, zero-padded to 4
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    const int64_t n = std::min<int64_t>(4, blocks - b0);
    if (n < 4) {
      std::memset(tail, 0, sizeof(tail));
      for (int i = 0; i < 4; ++i) std::memcpy(tail[i], rows[i] + kBytes * b0, kBytes * n);
    }
    __m512i a_lo[M], a_hi[M], start[M];
#pragma GCC unroll 4
    for (int j = 0; j < M; ++j) {
      a_lo[j] = _mm512_loadu_si512(aq[j] + 32 * b0);
      a_hi[j] = _mm512_loadu_si512(aq[j] + 32 * b0 + 64);
      // Each row's lanes start at the offset's share of their 8 values: summed over a
      // block's 4 lanes, the offset times the block's level sum (exact integers).
      start[j] = block32_offset<Ops, kType>(_mm512_loadu_si512(bias8[j] + 4 * b0));
    }
    __m512i pairs[M], sums[M];  // rows 0-1, then 2-3, added across rows per 128-bit lane
    __m512i first[M];
    __m128i halves[4];
    __m128 mx[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = n < 4 ? tail[i] : rows[i] + kBytes * b0;
      if (prefetch) {
        const char* ahead = reinterpret_cast<const char*>(rows[i] + kBytes * b0 + kGgufPrefetchBytes);
        for (int line = 0; line < kStep; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        _mm_prefetch(ahead + kStep - 1, _MM_HINT_T0);
      }
      if constexpr (kType == GgmlType::kMxfp4)
        mx[i] = mxfp4_half_scales4(b, kBytes);
      else
        halves[i] = block_scale_halves4<kBytes, kMin>(b);
      __m512i lo, hi;
      block32_levels4<kType>(b, &lo, &hi);
#pragma GCC unroll 4
      for (int j = 0; j < M; ++j) {
        const __m512i p = kType == GgmlType::kQ8_0 ? Ops::dot_int8(Ops::dot_int8(start[j], lo, a_lo[j]), hi, a_hi[j])
                                                   : Ops::dot(Ops::dot(start[j], lo, a_lo[j]), hi, a_hi[j]);
        if (i % 2 == 0) {
          first[j] = p;
        } else {  // per 128-bit lane: [row i - 1: 2 sums | row i: 2 sums] (gguf_lane_sums4)
          const __m512i two = _mm512_add_epi32(_mm512_unpacklo_epi32(first[j], p), _mm512_unpackhi_epi32(first[j], p));
          if (i == 1)
            pairs[j] = two;
          else
            sums[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[j], two), _mm512_unpackhi_epi64(pairs[j], two));
        }
      }
    }
    __m512 d, m;  // lane 4 L + i: row i's block L
    if constexpr (kType == GgmlType::kMxfp4) {
      const __m512 rows4 = _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm256_set_m128(mx[1], mx[0])), _mm256_set_m128(mx[3], mx[2]), 1);
      d = _mm512_permutexvar_ps(block_major, rows4);
    } else if constexpr (kMin) {
      const __m512 f01 = _mm512_cvtph_ps(_mm256_set_m128i(halves[1], halves[0]));
      const __m512 f23 = _mm512_cvtph_ps(_mm256_set_m128i(halves[3], halves[2]));
      d = _mm512_permutex2var_ps(f01, d_of_lane, f23);
      m = _mm512_permutex2var_ps(f01, m_of_lane, f23);
    } else {
      const __m256i h = _mm256_set_epi64x(_mm_cvtsi128_si64(halves[3]), _mm_cvtsi128_si64(halves[2]),
                                          _mm_cvtsi128_si64(halves[1]), _mm_cvtsi128_si64(halves[0]));
      d = _mm512_permutexvar_ps(block_major, _mm512_cvtph_ps(h));
    }
#pragma GCC unroll 4
    for (int j = 0; j < M; ++j) {
      const __m512i s = sums[j];
      const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(scale8[j] + 4 * b0));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[j]);
      if constexpr (kMin) accm[j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(block_min[j] + 4 * b0), accm[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < M; ++j) {
    __m128 r = block32_lanes_sum(acc[j]);
    if constexpr (kMin) r = _mm_add_ps(r, block32_lanes_sum(accm[j]));
    _mm_storeu_ps(out + 4 * j, r);
  }
}

}  // namespace
}  // namespace kt::cpu
