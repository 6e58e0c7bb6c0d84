// [NOTE] Horizontal int32 sums of the AVX-512 in-place K-quant kernels (gguf_q4k_avx512.h,
// gguf_q6k_avx512.h): each (row, activation row) pair's 16 int32 lanes of a unit are
// added in integers (exact, in any order) into one lane of a result register, lane 4 i + j
// for row i and activation row j, so the float arithmetic after them runs on one value
// per pair and unit, as the prefill tile kernel's (gguf_kquant_tile_avx512.h) does.
// Include only from a variant translation unit, after its target pragma.
#pragma once

#include <immintrin.h>

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// Per 128-bit lane: [sum(a), sum(b), sum(c), sum(d)] over that lane's four int32.
inline __m512i gguf_lane_sums4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// r[i] holds in each 128-bit lane four partial sums (j = 0..3); lane 4 i + j of the
// result adds element j of r[i]'s four 128-bit lanes.
inline __m512i gguf_cross_sums4(__m512i r0, __m512i r1, __m512i r2, __m512i r3) {
  const __m512i t01 = _mm512_add_epi32(_mm512_shuffle_i32x4(r0, r1, 0x88), _mm512_shuffle_i32x4(r0, r1, 0xDD));
  const __m512i t23 = _mm512_add_epi32(_mm512_shuffle_i32x4(r2, r3, 0x88), _mm512_shuffle_i32x4(r2, r3, 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(t01, t23, 0x88), _mm512_shuffle_i32x4(t01, t23, 0xDD));
}

// One activation row (decode): lane i of the result = the sum of all 16 lanes of v[i]
// (i < 4), in one reduction instead of four.
inline __m512i gguf_row_sums4(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  const __m512i r = gguf_lane_sums4(v0, v1, v2, v3);
  const __m512i h = _mm512_add_epi32(r, _mm512_shuffle_i32x4(r, r, 0x4E));
  return _mm512_add_epi32(h, _mm512_shuffle_i32x4(h, h, 0xB1));
}

// The lane of pair (row i, activation row j) in the kernels' result registers: 4 i + j,
// or i when M == 1 (gguf_row_sums4). Lanes of no pair hold finite values never stored.
// Per-lane factors: x[i] of the pair's row, y[j] of its activation row.
// (From registers: a vector load of four scalars just stored would miss store forwarding.)
template <int M>
inline __m512 gguf_row_factor(const float (&x)[4]) {
  const __m512 v = _mm512_castps128_ps512(_mm_setr_ps(x[0], x[1], x[2], x[3]));
  if constexpr (M == 1) return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3), v);
  else return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), v);
}

template <int M>
inline __m512 gguf_act_factor(const float (&y)[4]) {
  if constexpr (M == 1) return _mm512_set1_ps(y[0]);
  else return _mm512_broadcast_f32x4(_mm_setr_ps(y[0], y[1], y[2], y[3]));
}

// out[4 j + i] = the pair's lane of v, for i < 4, j < M.
template <int M>
inline void gguf_store_pairs(__m512 v, float* out) {
  alignas(64) float result[16];
  _mm512_store_ps(result, v);
  for (int j = 0; j < M; ++j)
    for (int i = 0; i < 4; ++i) out[4 * j + i] = result[M == 1 ? i : 4 * i + j];
}

}  // namespace
}  // namespace kt::cpu
