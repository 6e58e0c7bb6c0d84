// An 8 x 8 transpose of 32-bit words for the AVX2 "dequantize rows" paths of the
// block layouts (bf16_layout.h, int_layout.h), where line l of a 16-row block holds 4
// bytes of each row: loading 8 lines' words of 8 rows and transposing gives each row 8
// consecutive lines' words. Compiled for AVX2 by target attribute (the formats directory
// is built for baseline x86-64); call it only from functions with that target, after
// checking the CPU has AVX2.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kt::cpu {

// out[i] lane l = the 32-bit word of row i in line l, for the lines at lines + l * stride
// (l < 8) whose words of rows 0..7 are 8 consecutive words (row i at 4 i).
__attribute__((target("avx2"))) inline void load_transposed_8x8(const uint8_t* lines, size_t stride,
                                                                 __m256i out[8]) {
  __m256i r[8], t[8];
  for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + l * stride));
  for (int q = 0; q < 8; q += 2) {
    t[q] = _mm256_unpacklo_epi32(r[q], r[q + 1]);
    t[q + 1] = _mm256_unpackhi_epi32(r[q], r[q + 1]);
  }
  for (int q = 0; q < 8; q += 4) {
    r[q] = _mm256_unpacklo_epi64(t[q], t[q + 2]);
    r[q + 1] = _mm256_unpackhi_epi64(t[q], t[q + 2]);
    r[q + 2] = _mm256_unpacklo_epi64(t[q + 1], t[q + 3]);
    r[q + 3] = _mm256_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  // r[i] (i < 4): row i of lines 0-3 in the low half, row i + 4 in the high half; r[i + 4]
  // the same for lines 4-7.
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
    out[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
  }
}

// The same for 16-bit elements, 16 x 16: out[i] element l = the 16-bit element of row i in
// line l, for the 16 lines at lines + l * stride whose elements of rows 0..15 are 16
// consecutive elements (the e4m3 formats' k-pair lines, fp8_layout.h).
__attribute__((target("avx2"))) inline void load_transposed_16x16_epi16(const uint8_t* lines, size_t stride,
                                                                         __m256i out[16]) {
  __m256i r[16], a[16], b[16], c[2][8];
  for (int l = 0; l < 16; ++l) r[l] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + l * stride));
  for (int q = 0; q < 16; q += 2) {  // a[q]: rows 0-3 (lane 0; 8-11 in lane 1) of lines q, q + 1; a[q + 1]: rows 4-7
    a[q] = _mm256_unpacklo_epi16(r[q], r[q + 1]);
    a[q + 1] = _mm256_unpackhi_epi16(r[q], r[q + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // b[g + j]: rows 2 j and 2 j + 1 of lines g .. g + 3
    b[g] = _mm256_unpacklo_epi32(a[g], a[g + 2]);
    b[g + 1] = _mm256_unpackhi_epi32(a[g], a[g + 2]);
    b[g + 2] = _mm256_unpacklo_epi32(a[g + 1], a[g + 3]);
    b[g + 3] = _mm256_unpackhi_epi32(a[g + 1], a[g + 3]);
  }
  for (int h = 0; h < 2; ++h)  // c[h][i]: row i (lane 0; i + 8 in lane 1) of lines 8 h .. 8 h + 7
    for (int j = 0; j < 4; ++j) {
      c[h][2 * j] = _mm256_unpacklo_epi64(b[8 * h + j], b[8 * h + 4 + j]);
      c[h][2 * j + 1] = _mm256_unpackhi_epi64(b[8 * h + j], b[8 * h + 4 + j]);
    }
  for (int i = 0; i < 8; ++i) {
    out[i] = _mm256_permute2x128_si256(c[0][i], c[1][i], 0x20);
    out[i + 8] = _mm256_permute2x128_si256(c[0][i], c[1][i], 0x31);
  }
}

}  // namespace kt::cpu
