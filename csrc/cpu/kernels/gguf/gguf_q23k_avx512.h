// [NOTE] Q2_K and Q3_K dotted straight from their GGUF bytes on AVX-512 (no decoded
// copy): the low-bit types of the large models' small GGUF files. Both hold 256 two-bit
// levels as qs[64]: weight 128n + 32j + l is bits 2j..2j+1 of qs[32n + l]; Q3_K adds a
// third bit, bit 4n + j of hmask[l]. So a 64-byte register of levels in natural order
// (weights 64r .. 64r + 63, r = 2n + j / 2) is the 32 qs bytes of half n repeated in both
// 256-bit halves, shifted right per 16-bit word by 2j (the halves: j = 2(r % 2) and
// + 1), masked with 3, plus 4 under vptestmb against the halves' hmask bits. The
// activations are Q6_K's (natural order, int16 level sums of 16). Each lane's group of 16
// weights has its scale: Q2_K 4-bit (and a 4-bit minimum), Q3_K 6-bit minus 32; the
// int16 pair sums (vpmaddubsw, |.| <= 2 * 7 * 128) are multiplied by it (vpermw,
// vpdpwssd) into one int32 per lane. Q3_K's -4 offset is 4 * sum_g scale_g * (level sum
// of g), subtracted in integers; Q2_K's minimums sum_g min_g * (level sum of g) are
// subtracted in floats (dmin * da). Each (row, activation row) pair's lanes are added in
// integers (gguf_int_sums_avx512.h), so one float multiply-add by d * da per pair and unit
// remains (Q2_K: and one by dmin * da), as the prefill tile kernel
// (gguf_kquant_tile_avx512.h) computes it, bit for bit.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../../formats/gguf_types.h"
#include "gguf_decode.h"
#include "gguf_int_sums_avx512.h"
#include "gguf_q6k_avx512.h"  // its activation format and group16_scale_select

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// Q2_K / Q3_K super-block geometry and its 16 int16 scales (and Q2_K's minimums).
template <GgmlType kType>
struct Q23k {
  static constexpr bool kThree = kType == GgmlType::kQ3_K;
  static constexpr int64_t kBytes = kThree ? 110 : 84;
  static constexpr int64_t kQs = kThree ? 32 : 16;  // offset of qs[64]
  static float d(const uint8_t* b) { return gguf_f16(b + (kThree ? 108 : 80)); }
  static float dmin(const uint8_t* b) { return kThree ? 0.0f : gguf_f16(b + 82); }
  // int16 scale[g] (Q3_K: 6 bits - 32) and minimum[g] (Q2_K; zero for Q3_K) of the 16
  // groups of 16 weights, unpacked in registers (as ggml's decoders read them).
  static void scales(const uint8_t* b, __m256i& scale, __m256i& minimum) {
    const __m128i nibble = _mm_set1_epi8(0x0f);
    if constexpr (kThree) {
      const uint8_t* s = b + 96;
      // low 4 bits: s[g] & 15 for g < 8, s[g - 8] >> 4 for g >= 8
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
      const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(x, nibble), _mm_and_si128(_mm_srli_epi16(x, 4), nibble));
      // high 2 bits: bits 2 (g / 4) of s[8 + g % 4]
      int32_t tail;
      std::memcpy(&tail, s + 8, 4);
      const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(tail), _mm_setr_epi32(0, 2, 4, 6)),
                                         _mm_set1_epi8(3));
      const __m128i six = _mm_or_si128(low, _mm_slli_epi16(high, 4));  // 0..63, no carry across bytes
      scale = _mm256_sub_epi16(_mm256_cvtepu8_epi16(six), _mm256_set1_epi16(32));
      minimum = _mm256_setzero_si256();
    } else {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      scale = _mm256_cvtepu8_epi16(_mm_and_si128(x, nibble));
      minimum = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(x, 4), nibble));
    }
  }
};

// out[4 * j + i] = dot(row i, activation row j) for i < 4, j < M, kType Q2_K or Q3_K: the
// contract of gguf_q6k_dot_rows4 (gguf_q6k_avx512.h), whose activation format this uses.
// Per (row, activation row) and unit, exact int32 sums, then in fp32, unit after unit:
//   Q3_K: acc = fma(float(S_u - 4 O_u), d * da, acc), O_u = sum_g scale_g * levelsum_g
//   Q2_K: acc = fma(float(S_u), d * da, acc), accm = fma(float(M_u), dmin * da, accm),
//         result acc - accm, M_u = sum_g min_g * levelsum_g
// so a result depends on its row and activation row only.
template <class Ops, GgmlType kType, int M>
void gguf_q23k_dot_rows4(const uint8_t* const* rows, const int8_t* const* aq, const float* const* scale4,
                         const int16_t* const* level_sums, int64_t units, bool prefetch, float* out) {
  static_assert(M >= 1 && M <= 4);
  using T = Q23k<kType>;
  const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  // Register r's halves hold j = 2 (r % 2) and + 1: shift by 2j per 16-bit word.
  const __m512i shift[2] = {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                            _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
  // Q3_K: register r's halves take hmask bits 4n + j (n = r / 2).
  __m512i high_bit[4];
  for (int r = 0; r < 4; ++r) {
    const int n = r / 2, j = 2 * (r % 2);
    high_bit[r] = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (4 * n + j))),
                                     _mm256_set1_epi8(static_cast<char>(1 << (4 * n + j + 1))), 1);
  }
  const __m512i select[4] = {group16_scale_select(0), group16_scale_select(1), group16_scale_select(2),
                             group16_scale_select(3)};
  // Pair (row i, activation row j) at its lane (gguf_int_sums_avx512.h).
  __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    float da[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d[4], dmin[4];
#pragma GCC unroll 4
    for (int j = 0; j < M; ++j) da[j] = scale4[j][u * 64];
    __m512i lane_sums[4], min_sums[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + u * T::kBytes;
      if (prefetch) gguf_prefetch_ahead(b, T::kBytes);
      __m256i scales, minimums;
      T::scales(b, scales, minimums);
      const __m512i sc = _mm512_castsi256_si512(scales);  // lanes 16-31 never selected
      __m512i v[4], hmask = _mm512_setzero_si512();
      if constexpr (T::kThree) hmask = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      for (int r = 0; r < 4; ++r) {
        const __m512i qs = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + T::kQs + 32 * (r / 2))));
        v[r] = _mm512_and_si512(_mm512_srlv_epi16(qs, shift[r % 2]), three);
        if constexpr (T::kThree)
          v[r] = _mm512_mask_add_epi8(v[r], _mm512_test_epi8_mask(hmask, high_bit[r]), v[r], four);
      }
      const __m512i s0 = _mm512_permutexvar_epi16(select[0], sc), s1 = _mm512_permutexvar_epi16(select[1], sc),
                    s2 = _mm512_permutexvar_epi16(select[2], sc), s3 = _mm512_permutexvar_epi16(select[3], sc);
      d[i] = T::d(b);
      dmin[i] = T::dmin(b);
      __m512i t[4], m[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        t[j] = m[j] = _mm512_setzero_si512();
        if (j >= M) continue;
        const int8_t* a = aq[j] + u * 256;
        __m512i x = Ops::dot16(_mm512_setzero_si512(), _mm512_maddubs_epi16(v[0], _mm512_loadu_si512(a)), s0);
        x = Ops::dot16(x, _mm512_maddubs_epi16(v[1], _mm512_loadu_si512(a + 64)), s1);
        x = Ops::dot16(x, _mm512_maddubs_epi16(v[2], _mm512_loadu_si512(a + 128)), s2);
        x = Ops::dot16(x, _mm512_maddubs_epi16(v[3], _mm512_loadu_si512(a + 192)), s3);
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(level_sums[j] + u * 16));
        if constexpr (T::kThree) {
          const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scales, sums), 2);  // 4 * scale_g * sum_g
          t[j] = _mm512_sub_epi32(x, _mm512_zextsi256_si512(offset));
        } else {
          t[j] = x;
          m[j] = _mm512_zextsi256_si512(_mm256_madd_epi16(minimums, sums));
        }
      }
      // M == 1: the rows' registers, else their partial sums per 128-bit lane
      lane_sums[i] = M == 1 ? t[0] : gguf_lane_sums4(t[0], t[1], t[2], t[3]);
      if constexpr (!T::kThree) min_sums[i] = M == 1 ? m[0] : gguf_lane_sums4(m[0], m[1], m[2], m[3]);
    }
    const __m512 da_lanes = gguf_act_factor<M>(da);
    auto pair_sums = [](const __m512i (&v)[4]) {
      return M == 1 ? gguf_row_sums4(v[0], v[1], v[2], v[3]) : gguf_cross_sums4(v[0], v[1], v[2], v[3]);
    };
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(lane_sums)), _mm512_mul_ps(gguf_row_factor<M>(d), da_lanes), acc);
    if constexpr (!T::kThree)
      accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sums(min_sums)), _mm512_mul_ps(gguf_row_factor<M>(dmin), da_lanes),
                             accm);
  }
  gguf_store_pairs<M>(T::kThree ? acc : _mm512_sub_ps(acc, accm), out);
}

}  // namespace
}  // namespace kt::cpu
