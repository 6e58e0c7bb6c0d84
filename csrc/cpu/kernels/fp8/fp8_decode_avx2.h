// [NOTE] e4m3 decoding for the AVX2 variants (fp8_format.h). AVX2 has no 16-bit permute
// for fp8_decode_avx512.h's subnormal table, so 16 codes (8 rows x 2 k of one k-pair, in
// line order) go through fp16 instead: each code to the top byte of a 16-bit lane, an
// arithmetic shift by one and a mask make it an fp16 of w / 256 (s, 0eeee, mmm0000000:
// e4m3's exponent bias 7 read with fp16's 15; e4m3 subnormals are fp16 subnormals), and
// vcvtph2ps widens it exactly. mxfp8 multiplies by 2^(e - 127) * 256 in fp32 (exact).
// The fp32 values, in line order (row, k), are split into the micro-kernel's k and k + 1
// vectors, or packed into the BF16 line (exact: every decoded value is a bf16).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../isa/vec_avx2.h"
#include "../bf16/bf16_gemm.h"
#include "../bf16/bf16_gemm_avx2.h"
#include "fp8_kblock.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// mxfp8: one group of a block as 32 floats, each row's scale twice (line order).
constexpr int64_t kMxGroupBytesAvx2 = 128;

// Codes of rows 8h..8h+7 of k-pair p (16 bytes, line order) -> fp32 w / 256 of rows
// 8h..8h+3 (lo) and 8h+4..8h+7 (hi), each as (k, k + 1) pairs; Mx: times mx[0, 16).
template <bool Mx>
KT_FP8_INLINE void fp8_decode_half_avx2(const uint8_t* codes, const float* mx, __m256& lo, __m256& hi) {
  __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  x = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1), _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
  if constexpr (Mx) {
    lo = _mm256_mul_ps(lo, _mm256_loadu_ps(mx));
    hi = _mm256_mul_ps(hi, _mm256_loadu_ps(mx + 8));
  }
}

// The FP8 weight source of the AVX2 micro-kernel (as fp8_decode_avx512.h's): Mx scales of
// pair p of block b at mx + b * kMxBlockBytes + (p / 16) * kMxGroupBytes.
template <bool Mx, bool Store>
struct Fp8LinesAvx2 {
  static constexpr int64_t kMxGroupBytes = kMxGroupBytesAvx2;
  static constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * kMxGroupBytes;
  const uint8_t* mx = nullptr;
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  KT_FP8_INLINE void widen(const uint16_t* block, int b, int64_t p, __m256 (&even)[2], __m256 (&odd)[2]) const {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(block) + p * 32;
    const float* scale = reinterpret_cast<const float*>(mx + b * kMxBlockBytes + (p >> 4) * kMxGroupBytes);
    for (int h = 0; h < 2; ++h) {
      __m256 lo, hi;  // rows 8h..8h+3 and 8h+4..8h+7, (k, k + 1) each
      fp8_decode_half_avx2<Mx>(codes + 16 * h, scale + 16 * h, lo, hi);
      // k: lanes 0, 2, 4, 6 of lo then hi; vshufps picks them per 128-bit lane (rows 0 1 4 5 |
      // 2 3 6 7), vpermpd puts the rows in order.
      even[h] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
      odd[h] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
      if constexpr (Store) {
        const __m256i words = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(lo), 16),
                                                  _mm256_srli_epi32(_mm256_castps_si256(hi), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * out_stride + p * 32 + h * 16),
                            _mm256_permute4x64_epi64(words, 0xd8));
      }
    }
  }
  KT_FP8_INLINE void prefetch(const uint16_t* block, int64_t p, int64_t ahead) const { fp8_prefetch(block, p, ahead); }
};

struct Fp8OpsAvx2 {
  using Micro = Bf16GemmAvx2;
  template <bool Mx, bool Store = false>
  using Lines = Fp8LinesAvx2<Mx, Store>;
  static constexpr int64_t kMxGroupBytes = kMxGroupBytesAvx2;

  // 16 exponent codes e (in [10, 246] or 255) -> 2^(e - 127) * 256 (255: NaN), each twice.
  static void mx_prepare(const uint8_t* codes, uint8_t* out) {
    float* scale = reinterpret_cast<float*>(out);
    for (int h = 0; h < 2; ++h) {
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * h)));
      const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(8)), 23);
      const __m256i nan = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255));
      const __m256 s = _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), nan));
      // rows 8h..8h+7 -> line order (each twice): unpack within 128-bit lanes, then order.
      const __m256 a = _mm256_unpacklo_ps(s, s), b = _mm256_unpackhi_ps(s, s);  // rows 0 0 1 1 4 4 5 5 | 2 2 3 3 6 6 7 7
      _mm256_storeu_ps(scale + 16 * h, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(scale + 16 * h + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
  }
};

}  // namespace
}  // namespace kt::cpu
