// [NOTE] 16-lane fp32 vector operations for the AVX-512 variants (avx512, avx512_vnni, avx512_bf16,
// amx). Include only from a translation unit compiled for AVX-512F/BW/VL/DQ + F16C
// (see kernels/variants/). Generic algorithms (moe_driver.h) are written against this
// interface and its AVX2 twin (vec_avx2.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct VecAvx512 {
  using Reg = __m512;
  static constexpr int kWidth = 16;

  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float value) { return _mm512_set1_ps(value); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
  static Reg min(Reg a, Reg b) { return _mm512_min_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }

  static Reg load_bf16(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  // Round to nearest even; NaN stays NaN.
  static void store_bf16(uint16_t* p, Reg v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  static Reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, Reg v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static Reg abs(Reg x) { return _mm512_abs_ps(x); }
  static float reduce_max(Reg x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(Reg x) { return _mm512_reduce_add_ps(x); }
  // Rounds to nearest even and saturates to [-128, 127].
  static void store_int8(int8_t* p, Reg v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }

  static Reg round_nearest(Reg x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // 2^n for integral n in [-126, 127].
  static Reg pow2(Reg n) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};

}  // namespace
}  // namespace kt::cpu
