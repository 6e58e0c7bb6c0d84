// [NOTE] Q4_K dotted straight from its GGUF bytes on AVX-512 (no decoded copy): the
// weight-streaming path of the most common GGUF expert type. A 64-byte load of a
// super-block's nibbles holds, in its low nibbles, weights 0-31 and 64-95 (sub-blocks
// 0 and 2) and in its high nibbles 32-63 and 96-127 (1 and 3), so the activation rows
// for such matrices are stored with each 256-value unit permuted to match
// (gguf_act.h: kGgufQ4kOrder); each int32 lane then belongs to one sub-block.
// The sub-block scales (6-bit) are applied in integers: vpmaddubsw gives int16 pair
// sums (|.| <= 2 * 15 * 128), which vpdpwssd (or vpmaddwd + add) multiplies by the
// lane's scale, zero-extended to int16 by one vpshufb, into int32 lanes; the lanes of
// each (row, activation row) are added in integers to one exact sum per unit, and one
// float multiply-add by d * da per row, activation row and unit follows (16 of them in
// one register). The minimums of four rows go together: their 6-bit values (int16) times
// the activation's int16 level sums of the 8 sub-blocks (vpmaddwd), one exact sum per
// unit, times dmin * da. The prefill tile kernel (gguf_kquant_tile_avx512.h) computes the
// same integers and the same float operations, so both give the same bits.
// Q5_K is the same super-block with 32 bytes of fifth bits (qh) before the nibbles: bit
// 2c of qh[l] belongs to weight 64c + l and bit 2c + 1 to 64c + 32 + l, so each 64-byte
// register of levels takes one bit per 32-byte half (vptestmb against that half's bit,
// then + 16 under the mask): levels 0-31, pair sums |.| <= 2 * 31 * 128, no saturation.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gguf_decode.h"
#include "gguf_int_sums_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// vpshufb control: int16 lanes of 128-bit lanes 0-1 take scale byte `lo`, of 2-3 `hi`.
inline __m512i q4k_scale_select(int lo, int hi) {
  const int a = static_cast<int>(0x80008000u | lo << 16 | lo), b = static_cast<int>(0x80008000u | hi << 16 | hi);
  return _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
}

// out[4 * j + i] = dot(Q4_K row i, activation row j) for i < 4, j < M: the rows walked in
// lockstep (four memory streams in flight), each unit's nibbles and scales extracted once
// and dotted with the M activation rows. Row j: aq[j] permuted levels [units * 256],
// scale4[j] per-4 activation scales (one value per unit), level_sums[j] [units * 16]
// int16, per unit 8 zeros then the level sum of each sub-block (gguf_act.h).
// The arithmetic (gguf_kquant_tile_avx512.h computes the same): per (row, activation
// row) and unit u, two exact int32 sums, S_u = sum_sub scale_sub * sum_{k in sub} q a and
// M_u = sum_sub min_sub * levelsum_sub, then in fp32, unit after unit,
//   acc = fma(float(S_u), d_u * da_u, acc),  accm = fma(float(M_u), dmin_u * da_u, accm),
// and the result acc - accm. A result therefore depends on its row and activation row
// only (not on M, the lanes or the kernel that ran it): batch invariance, and the tile
// path of prefill gives the same bits. prefetch: request the rows' bytes
// kGgufPrefetchBytes ahead (the first pass over a row group; later token blocks find
// them in the cache). kFive: Q5_K rows (176 bytes per super-block) instead of Q4_K (144).
template <class Ops, int M, bool kFive = false>
void gguf_q4k_dot_rows4(const uint8_t* const* rows, const int8_t* const* aq, const float* const* scale4,
                        const int16_t* const* level_sums, int64_t units, bool prefetch, float* out) {
  static_assert(M >= 1 && M <= 4);
  constexpr int64_t kBytes = kFive ? 176 : 144;  // per super-block
  constexpr int64_t kQs = kFive ? 48 : 16;       // offset of the nibbles
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i sixteen = _mm512_set1_epi8(16);
  // Q5_K: the qh bit of each 32-byte half of levels register r (weights 0-31 | 64-95,
  // 32-63 | 96-127, 128-159 | 192-223, 160-191 | 224-255).
  const __m512i fifth_bit[4] = {
      _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(4), 1),
      _mm512_inserti64x4(_mm512_set1_epi8(2), _mm256_set1_epi8(8), 1),
      _mm512_inserti64x4(_mm512_set1_epi8(16), _mm256_set1_epi8(64), 1),
      _mm512_inserti64x4(_mm512_set1_epi8(32), _mm256_set1_epi8(static_cast<char>(128)), 1)};
  // Chunk c's int32 lanes 0-7 / 8-15 belong to sub-blocks (0, 2), (1, 3), (4, 6), (5, 7).
  const __m512i select[4] = {q4k_scale_select(0, 2), q4k_scale_select(1, 3), q4k_scale_select(4, 6),
                             q4k_scale_select(5, 7)};
  // Halves of word 0 (d, dmin) of each row's 128-bit lane, gathered into the low lane.
  const __m512i first_words = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  // Each pair's lane (gguf_int_sums_avx512.h): its row i's d (dw lane 2 i) and dmin (2 i + 1).
  const __m512i d_of_lane = M == 1 ? _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i dmin_of_lane = _mm512_add_epi32(d_of_lane, _mm512_set1_epi32(1));
  // Pair (row i, activation row j) at its lane; acc - accm at the end.
  __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
  // ggml's get_scale_min_k4 on 4 rows at once: 128-bit lane i = row i's 16 header bytes
  // (words d|dmin, s0, s1, s2), out words: s0 & k6 | (s2 & k4) + (s0 >> 6 & k2) << 4 |
  // s1 & k6 | (s2 >> 4 & k4) + (s1 >> 6 & k2) << 4, i.e. 8 scales then 8 minimums.
  const __m512i k6k4 = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
  const __m512i k2hi = _mm512_set4_epi32(0x03030303, 0, 0x03030303, 0);
  const __m512i low_shift = _mm512_set4_epi32(4, 0, 0, 0);
  for (int64_t u = 0; u < units; ++u) {
    __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + u * kBytes)));
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + u * kBytes)), 1);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2] + u * kBytes)), 2);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[3] + u * kBytes)), 3);
    // [d0 dmin0 d1 dmin1 d2 dmin2 d3 dmin3]
    const __m512 dw =
        _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(first_words, raw))));
    const __m512i p = _mm512_shuffle_epi32(raw, static_cast<_MM_PERM_ENUM>(0xED));  // s0 s2 s1 s2
    const __m512i q = _mm512_shuffle_epi32(raw, static_cast<_MM_PERM_ENUM>(0xA5));  // s0 s0 s1 s1
    const __m512i scale_bytes = _mm512_or_si512(
        _mm512_and_si512(_mm512_srlv_epi32(p, low_shift), k6k4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 6), k2hi), 4));
    // int16 [8 scales, 8 minimums] of rows 0-1 (2-3)
    const __m512i sm01 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(scale_bytes));
    const __m512i sm23 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(scale_bytes, 1));
    // Minimums: [8 scales, 8 minimums] times [0 x 8, level sums]; per activation row j,
    // 128-bit lane i holds row i's four partial sums of M_u.
    __m512i mins[4];
    float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if (j >= M) {
        mins[j] = _mm512_setzero_si512();
        continue;
      }
      da[j] = scale4[j][u * 64];
      const __m512i sums =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(level_sums[j] + u * 16)));
      mins[j] = _mm512_shuffle_i32x4(_mm512_madd_epi16(sm01, sums), _mm512_madd_epi16(sm23, sums), 0xDD);
    }
    __m512i lane_sums[4];  // M == 1: row i's t, else per 128-bit lane L its partial sums over L of each j
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + u * kBytes;
      if (prefetch) gguf_prefetch_ahead(b, kBytes);
      const __m512i own = _mm512_shuffle_i32x4(scale_bytes, scale_bytes, 0x55 * i);  // row i's lane x 4
      const __m512i qa = _mm512_loadu_si512(b + kQs), qb = _mm512_loadu_si512(b + kQs + 64);
      __m512i l0 = _mm512_and_si512(qa, low), l1 = _mm512_and_si512(_mm512_srli_epi16(qa, 4), low);
      __m512i l2 = _mm512_and_si512(qb, low), l3 = _mm512_and_si512(_mm512_srli_epi16(qb, 4), low);
      if constexpr (kFive) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
        l0 = _mm512_mask_add_epi8(l0, _mm512_test_epi8_mask(qh, fifth_bit[0]), l0, sixteen);
        l1 = _mm512_mask_add_epi8(l1, _mm512_test_epi8_mask(qh, fifth_bit[1]), l1, sixteen);
        l2 = _mm512_mask_add_epi8(l2, _mm512_test_epi8_mask(qh, fifth_bit[2]), l2, sixteen);
        l3 = _mm512_mask_add_epi8(l3, _mm512_test_epi8_mask(qh, fifth_bit[3]), l3, sixteen);
      }
      const __m512i s0 = _mm512_shuffle_epi8(own, select[0]), s1 = _mm512_shuffle_epi8(own, select[1]);
      const __m512i s2 = _mm512_shuffle_epi8(own, select[2]), s3 = _mm512_shuffle_epi8(own, select[3]);
      __m512i t[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        if (j >= M) {
          t[j] = _mm512_setzero_si512();
          continue;
        }
        const int8_t* a = aq[j] + u * 256;
        __m512i v = Ops::dot16(_mm512_setzero_si512(), _mm512_maddubs_epi16(l0, _mm512_loadu_si512(a)), s0);
        v = Ops::dot16(v, _mm512_maddubs_epi16(l1, _mm512_loadu_si512(a + 64)), s1);
        v = Ops::dot16(v, _mm512_maddubs_epi16(l2, _mm512_loadu_si512(a + 128)), s2);
        t[j] = Ops::dot16(v, _mm512_maddubs_epi16(l3, _mm512_loadu_si512(a + 192)), s3);
      }
      lane_sums[i] = M == 1 ? t[0] : gguf_lane_sums4(t[0], t[1], t[2], t[3]);
    }
    // S_u and M_u of each pair at its lane, exact.
    __m512i s_u, m_u;
    if constexpr (M == 1) {
      s_u = gguf_row_sums4(lane_sums[0], lane_sums[1], lane_sums[2], lane_sums[3]);
      // 128-bit lane i of mins[0]: row i's partial sums -> every lane of it their sum, then lane 4 L + i.
      __m512i x = _mm512_add_epi32(mins[0], _mm512_shuffle_epi32(mins[0], static_cast<_MM_PERM_ENUM>(0x4E)));
      x = _mm512_add_epi32(x, _mm512_shuffle_epi32(x, static_cast<_MM_PERM_ENUM>(0xB1)));
      m_u = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), x);
    } else {
      s_u = gguf_cross_sums4(lane_sums[0], lane_sums[1], lane_sums[2], lane_sums[3]);
      m_u = gguf_lane_sums4(mins[0], mins[1], mins[2], mins[3]);
    }
    const __m512 da_lanes = gguf_act_factor<M>(da);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_u), _mm512_mul_ps(_mm512_permutexvar_ps(d_of_lane, dw), da_lanes), acc);
    accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m_u), _mm512_mul_ps(_mm512_permutexvar_ps(dmin_of_lane, dw), da_lanes),
                           accm);
  }
  gguf_store_pairs<M>(_mm512_sub_ps(acc, accm), out);
}

}  // namespace
}  // namespace kt::cpu
