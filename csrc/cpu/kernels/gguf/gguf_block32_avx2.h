// [NOTE] Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 dotted straight from their GGUF bytes on AVX2 and AVX-VNNI:
// the AVX-512 kernel's arithmetic (gguf_block32_avx512.h) on 256-bit registers: the same
// integers and float operations in the same order (the two widths' outputs not yet compared
// bit for bit on one machine). A step of four blocks is two halves of two blocks; each
// half's levels go in two registers whose 128-bit lane L holds block 2 h + L's weights 0-15
// (lo) and 16-31 (hi), matching the same quad-ordered activations, so two dot products
// leave each int32 lane with 8 products of one block; the four rows' registers of a half
// are added across their lanes (one register of 8 exact block sums per activation row), and
// the conversion, the scale product d * da and the fma run once per half and activation
// row. With 16 registers the kernel dots at most kBlock32Avx2Tokens activation rows per
// pass over the four rows (the caller repeats the pass); each (row, activation row) result
// takes the same operations in the same order whatever the number of rows per pass. Q5_0
// and Q5_1 add their fifth bits without mask registers: a shuffle spreads each qh byte over
// 8 bytes, AND and compare with the byte's bit, AND 16. When more passes follow over the
// same four rows, the first keeps the extracted levels and the step's scales
// (KeptLevels::kKeep, 1.1-1.3 bytes per weight, L1/L2-resident) and the others read them
// back (kLoad) instead of extracting again: the same values into the same operations, so a
// result does not depend on the pass.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../formats/gguf_types.h"
#include "../quant/quant_gemm.h"
#include "gguf_block32_avx512.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int kBlock32Avx2Tokens = 2;  // activation rows per pass (registers)

// (The step's prologue — zero-padded tail, per-row prefetch — repeats the AVX-512
// kernel's lines: one shared helper issuing the four rows' prefetches together measured
// 2-7% slower decode.)

// 16 bytes at `off` of blocks `blk` and blk + 1 from `b` in the two 128-bit lanes.
template <int kBytes>
inline __m256i load_lanes2(const uint8_t* b, int blk, int off) {
  const auto at = [&](int x) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + x * kBytes + off)); };
  return _mm256_inserti128_si256(_mm256_castsi128_si256(at(blk)), at(blk + 1), 1);
}

// 16 in byte j of each 128-bit lane where bit 8 * first + j of the lane's first 4 bytes
// (a block's qh) is set, else 0: the fifth bits of weights 16 * (first / 2) + j.
inline __m256i fifth_bits_avx2(__m256i qh, int first) {
  const __m256i spread = first == 0 ? _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                                       0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                    : _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,  //
                                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// Bytes a pass keeps per step (4 rows x 4 blocks) for the next passes over the same
// rows (KeptLevels::kLoad): the 4 rows' levels (lo, hi per half: 512 bytes, row i at 128 i,
// half h at 64 h), then the step's block-major scales d (2 x 8 floats; Q4_1 and Q5_1: then m).
template <GgmlType kType>
constexpr int kBlock32CacheStep = (kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1) ? 640 : 576;

// The step's scales of the 4 rows block-major, as the AVX-512 kernel holds them: d[h] lane
// 4 L + i = row i's block 2 h + L (h = 0, 1; L = 0, 1), and m likewise (Q4_1, Q5_1).
template <GgmlType kType>
inline __attribute__((always_inline)) void block32_step_scales_avx2(const uint8_t* const* b, __m256* d, __m256* m) {
  constexpr int kBytes = kBlock32Bytes<kType>;
  constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;
  // 16-bit words of rows 0-1 (r01) and 2-3 (r23), 4 blocks each -> [row 0-3 of block L] x 2.
  const auto block_major = [](__m128i r01, __m128i r23, __m256* out) {
    const __m128i lo = _mm_unpacklo_epi16(r01, r23), hi = _mm_unpackhi_epi16(r01, r23);
    out[0] = _mm256_cvtph_ps(_mm_unpacklo_epi16(lo, hi));
    out[1] = _mm256_cvtph_ps(_mm_unpackhi_epi16(lo, hi));
  };
  if constexpr (kType == GgmlType::kMxfp4) {
    __m128 r0 = mxfp4_half_scales4(b[0], kBytes), r1 = mxfp4_half_scales4(b[1], kBytes);
    __m128 r2 = mxfp4_half_scales4(b[2], kBytes), r3 = mxfp4_half_scales4(b[3], kBytes);
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  // r_L: rows 0-3 of block L
    d[0] = _mm256_set_m128(r1, r0);
    d[1] = _mm256_set_m128(r3, r2);
  } else if constexpr (kMin) {  // per row [d0 m0 d1 m1 d2 m2 d3 m3] -> [d0 d1 d2 d3 m0 m1 m2 m3]
    const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m128i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm_shuffle_epi8(block_scale_halves4<kBytes, true>(b[i]), split);
    block_major(_mm_unpacklo_epi64(r[0], r[1]), _mm_unpacklo_epi64(r[2], r[3]), d);
    block_major(_mm_unpackhi_epi64(r[0], r[1]), _mm_unpackhi_epi64(r[2], r[3]), m);
  } else {  // each 16-bit word inserted where it goes: [rows 0-3 of block 2 h, rows 0-3 of block 2 h + 1]
    // (18 vector operations per step against 4 x 10 general-register ones and 8 more to put the four
    // rows' words block-major: paired A/B on Zen 3, avx2, 2026-12-07, 1 / 8 tokens S1 Q4_0 0.93 / 0.98
    // the time, Q8_0 0.96 / 0.98, Q5_0 0.94 / 0.96; the AVX-512 kernel's balance differs, see there.)
    const auto word = [&](int i, int blk) {
      uint16_t v;
      std::memcpy(&v, b[i] + blk * kBytes, 2);
      return static_cast<int>(v);
    };
    for (int h = 0; h < 2; ++h) {
      __m128i x = _mm_cvtsi32_si128(word(0, 2 * h));
      x = _mm_insert_epi16(x, word(1, 2 * h), 1);
      x = _mm_insert_epi16(x, word(2, 2 * h), 2);
      x = _mm_insert_epi16(x, word(3, 2 * h), 3);
      x = _mm_insert_epi16(x, word(0, 2 * h + 1), 4);
      x = _mm_insert_epi16(x, word(1, 2 * h + 1), 5);
      x = _mm_insert_epi16(x, word(2, 2 * h + 1), 6);
      x = _mm_insert_epi16(x, word(3, 2 * h + 1), 7);
      d[h] = _mm256_cvtph_ps(x);
    }
  }
}

// out[4 * j + i] = dot(row i of kType, activation row j) for i < 4, j < M <=
// kBlock32Avx2Tokens; arguments as gguf_block32_dot_rows4 (block_min: Q4_1's and Q5_1's
// minimums), plus `cache` (ceil(k / 128) * kBlock32CacheStep bytes, 64-byte aligned) for
// kKeep and kLoad. The same integers and float operations as gguf_block32_dot_rows4: per
// half of a step, the 4 rows' int32 lanes are added across rows (lane 4 L +
// i: row i's block 2 h + L, exact block sums), then converted, scaled by d * da and added
// into the half's accumulator; the result is (acc0 + acc1) folded as block32_lanes_sum.
// Against the form before (per row: the lanes' partial sums converted and scaled, the
// blocks' d spread by two permutes; about 50 instructions per row and step on Q4_0, a third
// of them for the scales), paired A/B on Zen 3 (avx2, 2026-12-07), 1 / 512 tokens: Q4_0
// 0.92 / 0.89 the time, Q4_1 0.84 / 0.79, Q8_0 1.02 / 0.91, MXFP4 1.02 / 1.00 (docs/formats.md).
template <class Ops, GgmlType kType, int M, KeptLevels kLevels = KeptLevels::kExtract>
void gguf_block32_dot_rows4_avx2(const uint8_t* const* rows, int64_t k, const int8_t* const* aq,
                                 const float* const* scale8, const int32_t* const* bias8,
                                 const float* const* block_min, bool prefetch, float* out,
                                 uint8_t* cache = nullptr) {
  static_assert(M <= kBlock32Avx2Tokens);
  constexpr bool kNibbles = kType != GgmlType::kQ8_0;
  constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;  // d * q + m
  constexpr bool kFifth = kType == GgmlType::kQ5_0 || kType == GgmlType::kQ5_1;
  constexpr int kBytes = kBlock32Bytes<kType>, kQs = kBlock32Levels<kType>, kStep = 4 * kBytes;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i mxfp4_levels = _mm256_broadcastsi128_si256(mxfp4_level_table());
  __m256 acc[M][2], accm[M][2];
  for (int j = 0; j < M; ++j)
    for (int h = 0; h < 2; ++h) acc[j][h] = accm[j][h] = _mm256_setzero_ps();
  const int64_t blocks = k / 32;
  alignas(64) uint8_t tail[4][kStep];  // the last step's blocks, zero-padded to 4
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    const int64_t n = std::min<int64_t>(4, blocks - b0);
    uint8_t* kept = kLevels == KeptLevels::kExtract ? nullptr : cache + (b0 / 4) * kBlock32CacheStep<kType>;
    const uint8_t* b[4];
    if constexpr (kLevels != KeptLevels::kLoad) {
      if (n < 4) {
        std::memset(tail, 0, sizeof(tail));
        for (int i = 0; i < 4; ++i) std::memcpy(tail[i], rows[i] + kBytes * b0, kBytes * n);
      }
      for (int i = 0; i < 4; ++i) b[i] = n < 4 ? tail[i] : rows[i] + kBytes * b0;
      if (prefetch)
        for (int i = 0; i < 4; ++i) {
          const char* ahead = reinterpret_cast<const char*>(rows[i] + kBytes * b0 + kGgufPrefetchBytes);
          for (int line = 0; line < kStep; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
          _mm_prefetch(ahead + kStep - 1, _MM_HINT_T0);
        }
    }
    __m256 d[2], m[2];  // lane 4 L + i: row i's block 2 h + L
    if constexpr (kLevels == KeptLevels::kLoad) {
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm256_load_ps(reinterpret_cast<const float*>(kept + 512 + 32 * h));
        if constexpr (kMin) m[h] = _mm256_load_ps(reinterpret_cast<const float*>(kept + 576 + 32 * h));
      }
    } else {
      block32_step_scales_avx2<kType>(b, d, m);
      if constexpr (kLevels == KeptLevels::kKeep)
        for (int h = 0; h < 2; ++h) {
          _mm256_store_ps(reinterpret_cast<float*>(kept + 512 + 32 * h), d[h]);
          if constexpr (kMin) _mm256_store_ps(reinterpret_cast<float*>(kept + 576 + 32 * h), m[h]);
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // blocks 2 h, 2 h + 1
      __m256i first[M], pairs[M], sums[M];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i lo, hi;  // weights 0-15 / 16-31 of blocks 2h, 2h + 1 (Q8_0: offset binary)
        if constexpr (kLevels == KeptLevels::kLoad) {
          lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(kept + 128 * i + 64 * h));
          hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(kept + 128 * i + 64 * h + 32));
        } else {
          if constexpr (kNibbles) {
            const __m256i v = load_lanes2<kBytes>(b[i], 2 * h, kQs);
            lo = _mm256_and_si256(v, low);
            hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (kType == GgmlType::kMxfp4) {  // levels v + 16 (gguf_decode.h)
              lo = _mm256_shuffle_epi8(mxfp4_levels, lo);
              hi = _mm256_shuffle_epi8(mxfp4_levels, hi);
            }
            if constexpr (kFifth) {  // bit j of qh (the 4 bytes before the nibbles): + 16 to weight j
              const __m256i qh = load_lanes2<kBytes>(b[i], 2 * h, kQs - 4);
              lo = _mm256_or_si256(lo, fifth_bits_avx2(qh, 0));
              hi = _mm256_or_si256(hi, fifth_bits_avx2(qh, 2));
            }
          } else {
            lo = _mm256_xor_si256(load_lanes2<kBytes>(b[i], 2 * h, kQs), flip);
            hi = _mm256_xor_si256(load_lanes2<kBytes>(b[i], 2 * h, kQs + 16), flip);
          }
          if constexpr (kLevels == KeptLevels::kKeep) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(kept + 128 * i + 64 * h), lo);
            _mm256_store_si256(reinterpret_cast<__m256i*>(kept + 128 * i + 64 * h + 32), hi);
          }
        }
#pragma GCC unroll 2
        for (int j = 0; j < M; ++j) {
          const int64_t at = 32 * b0 + 32 * h;  // quad order: this half's lo bytes, hi 64 later
          const __m256i a_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq[j] + at));
          const __m256i a_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq[j] + at + 64));
          const __m256i bias = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias8[j] + 4 * b0 + 8 * h));
          const __m256i start = kType == GgmlType::kQ4_0                      ? _mm256_srai_epi32(bias, 4)
                                : kType == GgmlType::kMxfp4 || kType == GgmlType::kQ5_0 ? _mm256_srai_epi32(bias, 3)
                                : kType == GgmlType::kQ8_0 && Ops::kInt8Bias != 0 ? bias
                                                                                   : _mm256_setzero_si256();
          __m256i p;
          if constexpr (!kNibbles)
            p = Ops::dot_int8(Ops::dot_int8(start, lo, a_lo), hi, a_hi);
          else if constexpr (HasDotInt4<Ops>::value)  // levels < 32: exact int16 pair sums
            p = Ops::dot_int4(start, lo, a_lo, hi, a_hi);
          else
            p = Ops::dot(Ops::dot(start, lo, a_lo), hi, a_hi);
          if (i % 2 == 0) {
            first[j] = p;
          } else {  // per 128-bit lane: [row i - 1: 2 sums | row i: 2 sums] (gguf_lane_sums4)
            const __m256i two = _mm256_add_epi32(_mm256_unpacklo_epi32(first[j], p), _mm256_unpackhi_epi32(first[j], p));
            if (i == 1)
              pairs[j] = two;
            else
              sums[j] = _mm256_add_epi32(_mm256_unpacklo_epi64(pairs[j], two), _mm256_unpackhi_epi64(pairs[j], two));
          }
        }
      }
#pragma GCC unroll 2
      for (int j = 0; j < M; ++j) {
        const __m256 scale = _mm256_mul_ps(d[h], _mm256_loadu_ps(scale8[j] + 4 * b0 + 8 * h));
        acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), scale, acc[j][h]);
        if constexpr (kMin)
          accm[j][h] = _mm256_fmadd_ps(m[h], _mm256_loadu_ps(block_min[j] + 4 * b0 + 8 * h), accm[j][h]);
      }
    }
  }
  // (acc0 + acc2) + (acc1 + acc3) over the block lanes, as block32_lanes_sum.
  const auto lanes_sum = [](const __m256* a) {
    const __m256 t = _mm256_add_ps(a[0], a[1]);
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  };
  for (int j = 0; j < M; ++j) {
    __m128 r = lanes_sum(acc[j]);
    if constexpr (kMin) r = _mm_add_ps(r, lanes_sum(accm[j]));
    _mm_storeu_ps(out + 4 * j, r);
  }
}

}  // namespace
}  // namespace kt::cpu
