// [NOTE] Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 dotted straight from their GGUF bytes on AVX2 and AVX-VNNI:
// the AVX-512 kernel's arithmetic (gguf_block32_avx512.h) on 256-bit registers. A step
// of four blocks is two halves of two blocks; each half's levels go in two registers
// whose 128-bit lane L holds block L's weights 0-15 (lo) and 16-31 (hi), matching the
// same quad-ordered activations, so two dot products leave each int32 lane with 8
// products of one block and the conversion, the scale product and the fma run once per
// 64 weights and (row, token). With 16 registers the kernel dots at most
// kBlock32Avx2Tokens activation rows per pass over the four rows (the caller repeats
// the pass); each (row, activation row) result takes the same operations in the same
// order whatever the number of rows per pass. Q5_0 and Q5_1 add their fifth bits without
// mask registers: a shuffle spreads each qh byte over 8 bytes, AND and compare with the
// byte's bit, AND 16. When more passes follow over the same four rows, the first keeps
// the extracted levels and spread scales (KeptLevels::kKeep, 1.5-2 bytes per weight,
// L1/L2-resident) and the others read them back (kLoad) instead of extracting again: the
// same values into the same operations, so a result does not depend on the pass.
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

// A pass's extracted step of one row, kept for the next passes over the same rows
// (KeptLevels::kLoad): the levels (lo, hi per half) and the blocks' d (and m) spread
// per half, as the kernel holds them.
template <GgmlType kType>
constexpr int kBlock32CacheStep = (kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1) ? 256 : 192;

// out[4 * j + i] = dot(row i of kType, activation row j) for i < 4, j < M <=
// kBlock32Avx2Tokens; arguments as gguf_block32_dot_rows4, plus `cache`
// (4 * ceil(k / 128) * kBlock32CacheStep bytes) for kKeep and kLoad.
template <class Ops, GgmlType kType, int M, KeptLevels kLevels = KeptLevels::kExtract>
void gguf_block32_dot_rows4_avx2(const uint8_t* const* rows, int64_t k, const int8_t* const* aq,
                                 const float* const* scale8, const int32_t* const* bias8,
                                 const float* const* min_sums8, bool prefetch, float* out,
                                 uint8_t* cache = nullptr) {
  static_assert(M <= kBlock32Avx2Tokens);
  constexpr bool kNibbles = kType != GgmlType::kQ8_0;
  constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;  // d * q + m
  constexpr bool kFifth = kType == GgmlType::kQ5_0 || kType == GgmlType::kQ5_1;
  constexpr int kBytes = kBlock32Bytes<kType>, kQs = kBlock32Levels<kType>, kStep = 4 * kBytes;
  constexpr int kCacheStep = kBlock32CacheStep<kType>;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i mxfp4_levels = _mm256_broadcastsi128_si256(mxfp4_level_table());
  __m256 acc[M][4];
  for (int j = 0; j < M; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_setzero_ps();
  const int64_t blocks = k / 32;
  alignas(64) uint8_t tail[4][kStep];  // the last step's blocks, zero-padded to 4
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    const int64_t n = std::min<int64_t>(4, blocks - b0);
    if (kLevels != KeptLevels::kLoad && n < 4) {
      std::memset(tail, 0, sizeof(tail));
      for (int i = 0; i < 4; ++i) std::memcpy(tail[i], rows[i] + kBytes * b0, kBytes * n);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      // [lo hi] x 2 halves, d x 2, m x 2 (kKeep, kLoad)
      uint8_t* kept = kLevels == KeptLevels::kExtract ? nullptr : cache + ((b0 / 4) * 4 + i) * kCacheStep;
      const uint8_t* b = n < 4 ? tail[i] : rows[i] + kBytes * b0;
      __m256 d[2], m[2];  // the blocks' d (and m) spread per half: blocks 2h, 2h + 1
      if constexpr (kLevels == KeptLevels::kLoad) {
        for (int h = 0; h < 2; ++h) {
          d[h] = _mm256_load_ps(reinterpret_cast<const float*>(kept + 128 + 32 * h));
          if constexpr (kMin) m[h] = _mm256_load_ps(reinterpret_cast<const float*>(kept + 192 + 32 * h));
        }
      } else {
        if (prefetch) {
          const char* ahead = reinterpret_cast<const char*>(rows[i] + kBytes * b0 + kGgufPrefetchBytes);
          for (int line = 0; line < kStep; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
          _mm_prefetch(ahead + kStep - 1, _MM_HINT_T0);
        }
        const auto half = [&](int blk) {
          uint32_t v;
          std::memcpy(&v, b + blk * kBytes, 4);
          return static_cast<uint64_t>(kMin ? v : v & 0xffff);
        };
        if constexpr (kMin) {  // (d, m) of block x in lanes 2x, 2x + 1
          const __m256 dm = _mm256_cvtph_ps(_mm_set_epi64x(static_cast<int64_t>(half(2) | half(3) << 32),
                                                           static_cast<int64_t>(half(0) | half(1) << 32)));
          d[0] = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
          d[1] = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6));
          m[0] = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
          m[1] = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(5, 5, 5, 5, 7, 7, 7, 7));
        } else {
          const __m256 d4 = _mm256_castps128_ps256(
              kType == GgmlType::kMxfp4
                  ? mxfp4_half_scales4(b, kBytes)
                  : _mm_cvtph_ps(_mm_cvtsi64_si128(
                        static_cast<int64_t>(half(0) | half(1) << 16 | half(2) << 32 | half(3) << 48))));
          d[0] = _mm256_permutevar8x32_ps(d4, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
          d[1] = _mm256_permutevar8x32_ps(d4, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
        }
        if constexpr (kLevels == KeptLevels::kKeep)
          for (int h = 0; h < 2; ++h) {
            _mm256_store_ps(reinterpret_cast<float*>(kept + 128 + 32 * h), d[h]);
            if constexpr (kMin) _mm256_store_ps(reinterpret_cast<float*>(kept + 192 + 32 * h), m[h]);
          }
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;  // weights 0-15 / 16-31 of blocks 2h, 2h + 1 (Q8_0: offset binary)
        if constexpr (kLevels == KeptLevels::kLoad) {
          lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(kept + 64 * h));
          hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(kept + 64 * h + 32));
        } else {
          if constexpr (kNibbles) {
            const __m256i v = load_lanes2<kBytes>(b, 2 * h, kQs);
            lo = _mm256_and_si256(v, low);
            hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (kType == GgmlType::kMxfp4) {  // levels v + 16 (gguf_decode.h)
              lo = _mm256_shuffle_epi8(mxfp4_levels, lo);
              hi = _mm256_shuffle_epi8(mxfp4_levels, hi);
            }
            if constexpr (kFifth) {  // bit j of qh (the 4 bytes before the nibbles): + 16 to weight j
              const __m256i qh = load_lanes2<kBytes>(b, 2 * h, kQs - 4);
              lo = _mm256_or_si256(lo, fifth_bits_avx2(qh, 0));
              hi = _mm256_or_si256(hi, fifth_bits_avx2(qh, 2));
            }
          } else {
            lo = _mm256_xor_si256(load_lanes2<kBytes>(b, 2 * h, kQs), flip);
            hi = _mm256_xor_si256(load_lanes2<kBytes>(b, 2 * h, kQs + 16), flip);
          }
          if constexpr (kLevels == KeptLevels::kKeep) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(kept + 64 * h), lo);
            _mm256_store_si256(reinterpret_cast<__m256i*>(kept + 64 * h + 32), hi);
          }
        }
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
          const __m256 scale = _mm256_mul_ps(d[h], _mm256_loadu_ps(scale8[j] + 4 * b0 + 8 * h));
          acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[j][i]);
          if constexpr (kMin)
            acc[j][i] = _mm256_fmadd_ps(m[h], _mm256_loadu_ps(min_sums8[j] + 4 * b0 + 8 * h), acc[j][i]);
        }
      }
    }
  }
  for (int j = 0; j < M; ++j)
    for (int i = 0; i < 4; ++i) {
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[j][i]), _mm256_extractf128_ps(acc[j][i], 1));
      const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
      out[4 * j + i] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
}

}  // namespace
}  // namespace kt::cpu
