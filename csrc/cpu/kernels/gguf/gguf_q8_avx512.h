// [NOTE] Q8_0, Q4_0 and Q5_0 dotted straight from their GGUF bytes on AVX-512 (no
// decoded copy), four rows in lockstep: per pair of blocks, one 64-byte register of
// levels in weight order, converted and scaled per lane by the block's d times the
// activation block's scale. Q8_0's levels are made offset binary for vpdpbusd, whose
// start value -128 * sum(a) per lane cancels the offset exactly (gguf_act.h's bias4);
// Q4_0's nibbles (q - 8) start from -8 * sum(a) = bias4 / 16, Q5_0's levels (q - 16,
// the fifth bits of a block's qh OR-ed in as a 32-bit byte mask) from bias4 / 8.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../../formats/gguf_types.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// out[4 * j + i] = dot(row i of kType (Q8_0, Q4_0, Q5_0), activation row j) for i < 4,
// j < M over a row of k values (blocks past k are skipped, the activation is zero
// there), each pair of blocks of the 4 rows extracted once and dotted with the M
// activation rows. Row j: aq[j] levels [kp], scale4[j] per-4 activation scales, bias4[j]
// -128 * level sum per 4. Each (row, activation row) result takes the same operations in
// the same order whatever M (gguf_q4k_dot_rows4); prefetch as there.
template <class Ops, GgmlType kType, int M>
void gguf_block32_dot_rows4(const uint8_t* const* rows, int64_t k, const int8_t* const* aq,
                            const float* const* scale4, const int32_t* const* bias4, bool prefetch, float* out) {
  constexpr bool kNibbles = kType != GgmlType::kQ8_0;
  constexpr int kBytes = kType == GgmlType::kQ4_0 ? 18 : kType == GgmlType::kQ5_0 ? 22 : 34;
  constexpr int kQs = kType == GgmlType::kQ5_0 ? 6 : 2;  // offset of the levels in a block
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m512i halves = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  __m512 acc[M][4];
#pragma GCC unroll 4
  for (int j = 0; j < M; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_ps();
  const int64_t blocks = k / 32;
  for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
    const bool pair = b0 + 1 < blocks;
    __m512i a[M], start[M];
    __m512 sa[M];
#pragma GCC unroll 4
    for (int j = 0; j < M; ++j) {
      a[j] = _mm512_loadu_si512(aq[j] + 32 * b0);
      sa[j] = _mm512_loadu_ps(scale4[j] + 8 * b0);
      const __m512i bias = _mm512_loadu_si512(bias4[j] + 8 * b0);
      start[j] = kType == GgmlType::kQ4_0   ? _mm512_srai_epi32(bias, 4)
                 : kType == GgmlType::kQ5_0 ? _mm512_srai_epi32(bias, 3)
                 : (Ops::kInt8Bias != 0 ? bias : _mm512_setzero_si512());
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + kBytes * b0;
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(b + kGgufPrefetchBytes), _MM_HINT_T0);
        if (kBytes * 2 > 64) _mm_prefetch(reinterpret_cast<const char*>(b + kGgufPrefetchBytes + 64), _MM_HINT_T0);
      }
      int16_t h0, h1 = 0;
      std::memcpy(&h0, b, 2);
      if (pair) std::memcpy(&h1, b + kBytes, 2);
      // the blocks' d in lanes 0-7 / 8-15 (one conversion of the broadcast halves)
      const __m512 d =
          _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(h0)), _mm_set1_epi16(h1), 1));
      __m512i w;  // the two blocks' levels in weight order (Q8_0: offset binary)
      if constexpr (kNibbles) {  // nibbles: low = weight j, high = j + 16
        __m256i v = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQs)));
        if (pair)
          v = _mm256_inserti128_si256(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kBytes + kQs)), 1);
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        w = _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), halves, _mm512_castsi256_si512(hi));
        if constexpr (kType == GgmlType::kQ5_0) {  // bit j of qh: + 16 to weight j
          uint32_t qh0, qh1 = 0;
          std::memcpy(&qh0, b + 2, 4);
          if (pair) std::memcpy(&qh1, b + kBytes + 2, 4);
          w = _mm512_or_si512(w, _mm512_maskz_mov_epi8((static_cast<uint64_t>(qh1) << 32) | qh0, _mm512_set1_epi8(16)));
        }
      } else {
        w = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)));
        if (pair) w = _mm512_inserti64x4(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36)), 1);
        w = _mm512_xor_si512(w, flip);
      }
#pragma GCC unroll 4
      for (int j = 0; j < M; ++j) {
        const __m512i p = kNibbles ? Ops::dot(start[j], w, a[j]) : Ops::dot_int8(start[j], w, a[j]);
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, sa[j]), acc[j][i]);
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
