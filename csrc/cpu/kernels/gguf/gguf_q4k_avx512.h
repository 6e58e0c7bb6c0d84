// [NOTE] Q4_K dotted straight from its GGUF bytes on AVX-512 (no decoded copy): the
// weight-streaming path of the most common GGUF expert type. A 64-byte load of a
// super-block's nibbles holds, in its low nibbles, weights 0-31 and 64-95 (sub-blocks
// 0 and 2) and in its high nibbles 32-63 and 96-127 (1 and 3), so the activation rows
// for such matrices are stored with each 256-value unit permuted to match
// (gguf_act.h: kGgufQ4kOrder); each int32 lane then belongs to one sub-block, and its
// scale comes from a 16-float vector [d*sc_j*da (8), dmin*m_j*da (8)] by one permute.
// The minimums use the activation's per-sub-block level sums (lanes 8-15 of a vector
// whose lanes 0-7 are zero), so both terms need no horizontal work until the row ends.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// out[i] = dot(Q4_K row i, activation row) for i < 4, the rows walked in lockstep (four
// memory streams in flight). aq: permuted levels [units * 256], scale4: per-4
// activation scales (one value per unit), level_sums: [units * 16] as described above.
template <class Ops>
void gguf_q4k_dot_rows4(const uint8_t* const* rows, const int8_t* aq, const float* scale4,
                        const float* level_sums, int64_t units, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i idx0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i idx1 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i idx2 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
  const __m512i idx3 = _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7);
  __m512 acc[4], accm[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) acc[i] = accm[i] = _mm512_setzero_ps();
  // ggml's get_scale_min_k4 on 4 rows at once: 128-bit lane i = row i's 12 scale bytes
  // (words s0 s1 s2), out words: s0 & k6 | (s2 & k4) + (s0 >> 6 & k2) << 4 | s1 & k6 |
  // (s2 >> 4 & k4) + (s1 >> 6 & k2) << 4, i.e. 8 scales then 8 minimums per row.
  const __m512i k6k4 = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
  const __m512i k2hi = _mm512_set4_epi32(0x03030303, 0, 0x03030303, 0);
  const __m512i low_shift = _mm512_set4_epi32(4, 0, 0, 0);
  for (int64_t u = 0; u < units; ++u) {
    const int8_t* a = aq + u * 256;
    const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 64), a2 = _mm512_loadu_si512(a + 128),
                  a3 = _mm512_loadu_si512(a + 192);
    const __m512 sums = _mm512_loadu_ps(level_sums + u * 16);
    const float da = scale4[u * 64];
    __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + u * 144 + 4)));
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + u * 144 + 4)), 1);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2] + u * 144 + 4)), 2);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[3] + u * 144 + 4)), 3);
    const __m512i p = _mm512_shuffle_epi32(raw, static_cast<_MM_PERM_ENUM>(0x98));  // s0 s2 s1 s2
    const __m512i q = _mm512_shuffle_epi32(raw, static_cast<_MM_PERM_ENUM>(0x50));  // s0 s0 s1 s1
    const __m512i scale_bytes = _mm512_or_si512(
        _mm512_and_si512(_mm512_srlv_epi32(p, low_shift), k6k4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 6), k2hi), 4));
    const __m128i lane[4] = {_mm512_castsi512_si128(scale_bytes), _mm512_extracti32x4_epi32(scale_bytes, 1),
                             _mm512_extracti32x4_epi32(scale_bytes, 2), _mm512_extracti32x4_epi32(scale_bytes, 3)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + u * 144;
      for (int line = 0; line < 144; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + kGgufPrefetchBytes + line), _MM_HINT_T0);
      uint16_t halves[2];
      std::memcpy(halves, b, 4);
      const float d = _cvtsh_ss(halves[0]) * da, dmin = _cvtsh_ss(halves[1]) * da;
      const __m512 factor = _mm512_insertf32x8(_mm512_set1_ps(d), _mm256_set1_ps(dmin), 1);
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane[i])), factor);
      const __m512i qa = _mm512_loadu_si512(b + 16), qb = _mm512_loadu_si512(b + 80);
      const __m512i zero = _mm512_setzero_si512();
      const __m512i p0 = Ops::dot(zero, _mm512_and_si512(qa, low), a0);
      const __m512i p1 = Ops::dot(zero, _mm512_and_si512(_mm512_srli_epi16(qa, 4), low), a1);
      const __m512i p2 = Ops::dot(zero, _mm512_and_si512(qb, low), a2);
      const __m512i p3 = Ops::dot(zero, _mm512_and_si512(_mm512_srli_epi16(qb, 4), low), a3);
      __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(idx0, f), acc[i]);
      r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(idx1, f), r);
      r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2), _mm512_permutexvar_ps(idx2, f), r);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p3), _mm512_permutexvar_ps(idx3, f), r);
      accm[i] = _mm512_fmadd_ps(f, sums, accm[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) - _mm512_reduce_add_ps(accm[i]);
}

}  // namespace
}  // namespace kt::cpu
