// [NOTE] Q8_0 dotted straight from its GGUF bytes on AVX-512 (no decoded copy), four
// rows in lockstep: per pair of 34-byte blocks, one 64-byte register of levels (made
// offset binary for vpdpbusd, whose start value -128 * sum(a) per lane cancels the
// offset exactly: gguf_act.h's bias4), converted and scaled per lane by the block's d
// (one permute of the unit's 8 scales) times the activation block's scale.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// out[i] = dot(Q8_0 row i, activation row) for i < 4 over kp / 256 units (a row of k
// values; blocks past k are skipped, the activation is zero there). aq: levels [kp],
// scale4: per-4 activation scales, bias4: -128 * level sum per 4.
template <class Ops>
void gguf_q8_0_dot_rows4(const uint8_t* const* rows, int64_t k, const int8_t* aq, const float* scale4,
                         const int32_t* bias4, float* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t blocks = k / 32;
  for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
    const bool pair = b0 + 1 < blocks;
    const __m512i a = _mm512_loadu_si512(aq + 32 * b0);
    const __m512 sa = _mm512_loadu_ps(scale4 + 8 * b0);
    const __m512i start = Ops::kInt8Bias != 0 ? _mm512_loadu_si512(bias4 + 8 * b0) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const uint8_t* b = rows[i] + 34 * b0;
      uint16_t h0, h1 = 0;
      std::memcpy(&h0, b, 2);
      __m512i w = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)));
      if (pair) {
        std::memcpy(&h1, b + 34, 2);
        w = _mm512_inserti64x4(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36)), 1);
      }
      const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(h0)), _mm256_set1_ps(_cvtsh_ss(h1)), 1);
      const __m512i p = Ops::dot_int8(start, _mm512_xor_si512(w, flip), a);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, sa), acc[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

}  // namespace
}  // namespace kt::cpu
