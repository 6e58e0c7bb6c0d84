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

}  // namespace
}  // namespace kt::cpu
