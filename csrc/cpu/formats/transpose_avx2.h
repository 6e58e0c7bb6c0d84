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

}  // namespace kt::cpu
