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
  for (int64_t u = 0; u < units; ++u) {
    const int8_t* a = aq + u * 256;
    const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 64), a2 = _mm512_loadu_si512(a + 128),
                  a3 = _mm512_loadu_si512(a + 192);
    const __m512 sums = _mm512_loadu_ps(level_sums + u * 16);
    const float da = scale4[u * 64];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + u * 144;
      uint16_t halves[2];
      std::memcpy(halves, b, 4);
      const float d = _cvtsh_ss(halves[0]) * da, dmin = _cvtsh_ss(halves[1]) * da;
      // 8 6-bit scales, then 8 6-bit minimums (ggml's get_scale_min_k4, 32 bits at a time).
      uint32_t s[4];
      std::memcpy(s, b + 4, 12);
      constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
      s[3] = ((s[2] >> 4) & k4) | (((s[1] >> 6) & k2) << 4);
      const uint32_t mins_low = s[1] & k6;
      s[1] = (s[2] & k4) | (((s[0] >> 6) & k2) << 4);
      s[2] = mins_low;
      s[0] &= k6;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m512 factor = _mm512_insertf32x8(_mm512_set1_ps(d), _mm256_set1_ps(dmin), 1);
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), factor);
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
