// [NOTE] Q6_K dotted straight from its GGUF bytes on AVX-512 (no decoded copy): the down
// matrix of Q4_K_M files. A super-block (210 bytes) holds 256 six-bit levels as ql[128]
// (low nibbles), qh[64] (2-bit high parts), 16 int8 scales (one per 16 weights) and d.
// Per half (128 weights), the 64-byte load of ql holds weights 0-63 in its low nibbles
// and 64-127 in its high nibbles, in order; the half's 32 qh bytes, repeated in both
// 256-bit halves and shifted per 16-bit word ([4, 2] left, [0, 2] right) then masked with
// 0x30, give each byte its bits 4-5. So the activations need no permutation. Levels
// 0..63 times int8 activations (vpmaddubsw, pairs <= 2 * 63 * 128) times the int16
// scale of each lane's group (vpermw, vpdpwssd) sum into one int32 per lane; the -32
// offset is 32 * sum_g scale_g * (level sum of group g) (vpmaddwd), subtracted in
// integers; the lanes of each (row, activation row) are added in integers
// (gguf_int_sums_avx512.h), so one float multiply-add by d * da per row, activation row
// and unit remains: acc = fma(float(T_u), d * da, acc), as the prefill tile kernel
// (gguf_kquant_tile_avx512.h) computes it, bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gguf_decode.h"
#include "gguf_int_sums_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// vpermw indices for the K-quants with 16 groups of 16 weights (Q6_K, Q2_K, Q3_K): the
// int16 lanes of 128-bit lane q of register c (weights 64c .. 64c + 63) take group
// 4c + q's scale.
inline __m512i group16_scale_select(int c) {
  int pair[4];
  for (int q = 0; q < 4; ++q) pair[q] = (4 * c + q) * 0x10001;
  return _mm512_setr_epi32(pair[0], pair[0], pair[0], pair[0], pair[1], pair[1], pair[1], pair[1], pair[2], pair[2],
                           pair[2], pair[2], pair[3], pair[3], pair[3], pair[3]);
}

// out[4 * j + i] = dot(Q6_K row i, activation row j) for i < 4, j < M: the rows walked in
// lockstep (four memory streams in flight), each unit's levels and scales extracted once
// and dotted with the M activation rows. Row j: aq[j] levels [units * 256], scale4[j]
// per-4 activation scales (one value per unit), level_sums[j] [units * 16] int16, the
// level sum of each 16 values. Per (row, activation row) and unit, the exact int32
// T_u = sum_g scale_g * sum_{k in g} (q - 32) a, then acc = fma(float(T_u), d * da, acc),
// unit after unit: a result depends on its row and activation row only (not on M or the
// kernel that ran it); prefetch as gguf_q4k_dot_rows4's.
template <class Ops, int M>
void gguf_q6k_dot_rows4(const uint8_t* const* rows, const int8_t* const* aq, const float* const* scale4,
                        const int16_t* const* level_sums, int64_t units, bool prefetch, float* out) {
  static_assert(M >= 1 && M <= 4);
  const __m512i low = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i select[4] = {group16_scale_select(0), group16_scale_select(1), group16_scale_select(2),
                             group16_scale_select(3)};
  __m512 acc = _mm512_setzero_ps();  // pair (row i, activation row j) at its lane (gguf_int_sums_avx512.h)
  for (int64_t u = 0; u < units; ++u) {
    float da[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4];
#pragma GCC unroll 4
    for (int j = 0; j < M; ++j) da[j] = scale4[j][u * 64];
    __m512i lane_sums[4];  // M == 1: the rows' sums, else their partial sums per 128-bit lane
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + u * 210;
      if (prefetch) gguf_prefetch_ahead(b, 210);  // lines 0, 64, 128, 192
      const __m512i ql0 = _mm512_loadu_si512(b), ql1 = _mm512_loadu_si512(b + 64), qh = _mm512_loadu_si512(b + 128);
      const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      const __m512i sc = _mm512_castsi256_si512(scales);  // lanes 16-31 never selected
      const __m512i h0 = _mm512_shuffle_i64x2(qh, qh, 0x44), h1 = _mm512_shuffle_i64x2(qh, qh, 0xEE);
      auto levels = [&](__m512i ql, __m512i h, bool high) {
        const __m512i nibbles = high ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), low) : _mm512_and_si512(ql, low);
        const __m512i top = high ? _mm512_srlv_epi16(h, right) : _mm512_sllv_epi16(h, left);
        return _mm512_or_si512(nibbles, _mm512_and_si512(top, bits45));
      };
      const __m512i v0 = levels(ql0, h0, false), v1 = levels(ql0, h0, true), v2 = levels(ql1, h1, false),
                    v3 = levels(ql1, h1, true);
      const __m512i s0 = _mm512_permutexvar_epi16(select[0], sc), s1 = _mm512_permutexvar_epi16(select[1], sc),
                    s2 = _mm512_permutexvar_epi16(select[2], sc), s3 = _mm512_permutexvar_epi16(select[3], sc);
      d[i] = gguf_f16(b + 208);
      __m512i t[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        if (j >= M) {
          t[j] = _mm512_setzero_si512();
          continue;
        }
        const int8_t* a = aq[j] + u * 256;
        __m512i v = Ops::dot16(_mm512_setzero_si512(), _mm512_maddubs_epi16(v0, _mm512_loadu_si512(a)), s0);
        v = Ops::dot16(v, _mm512_maddubs_epi16(v1, _mm512_loadu_si512(a + 64)), s1);
        v = Ops::dot16(v, _mm512_maddubs_epi16(v2, _mm512_loadu_si512(a + 128)), s2);
        v = Ops::dot16(v, _mm512_maddubs_epi16(v3, _mm512_loadu_si512(a + 192)), s3);
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(level_sums[j] + u * 16));
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scales, sums), 5);  // 32 * scale_g * sum_g
        t[j] = _mm512_sub_epi32(v, _mm512_zextsi256_si512(offset));
      }
      lane_sums[i] = M == 1 ? t[0] : gguf_lane_sums4(t[0], t[1], t[2], t[3]);
    }
    const __m512i t_u = M == 1 ? gguf_row_sums4(lane_sums[0], lane_sums[1], lane_sums[2], lane_sums[3])
                               : gguf_cross_sums4(lane_sums[0], lane_sums[1], lane_sums[2], lane_sums[3]);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t_u), _mm512_mul_ps(gguf_row_factor<M>(d), gguf_act_factor<M>(da)), acc);
  }
  gguf_store_pairs<M>(acc, out);
}

}  // namespace
}  // namespace kt::cpu
