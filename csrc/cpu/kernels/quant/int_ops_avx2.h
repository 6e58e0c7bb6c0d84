// [NOTE] Integer operations for QuantGemm (quant_gemm.h) on AVX2: vpmaddubsw (u8 x s8
// -> pairs of int16) then vpmaddwd by ones (-> int32), two 32-byte registers per
// 64-byte line (outputs 0-7, 8-15). int8 weights are multiplied as |w| x sign(a, w)
// (vpsignb), so no int16 pair sum saturates and the dot carries no offset.
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx2.h"
#include "quant_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct IntOpsAvx2 {
  using Vec = VecAvx2;
  using IReg = __m256i;
  static constexpr int kRegsPerLine = 2;
  static constexpr int kMaxRows = 2;
  static constexpr int kMaxRowsInt4 = 2;
  static constexpr int kDecodeRows = 2;
  static constexpr int kMaxBlocks = 1;
  static constexpr int kMaxBlocksInt4 = 1;
  static constexpr int32_t kInt8Bias = 0;

  static IReg zero() { return _mm256_setzero_si256(); }
  static IReg load(const uint8_t* line, int r) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * r));
  }
  static IReg broadcast4(const int8_t* a) { return _mm256_set1_epi32(load_i32(a)); }
  static IReg low_nibbles(IReg v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
  static IReg high_nibbles(IReg v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
  }
  // 16 x the high nibbles (no shift; levels up to 240: for vpdpbusd, whose u8 x s8
  // products are not summed in int16).
  static IReg high_nibbles_x16(IReg v) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(0xf0))); }
  static IReg shift_right4(IReg v) { return _mm256_srai_epi32(v, 4); }
  static IReg dot(IReg acc, IReg w, IReg a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
  }
  static IReg dot_int8(IReg acc, IReg w, IReg a) {
    const IReg s = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // q
    return dot(acc, _mm256_abs_epi8(s), _mm256_sign_epi8(a, s));
  }
  static IReg add(IReg a, IReg b) { return _mm256_add_epi32(a, b); }
  // int4: a line's low and high nibble products summed as int16 pairs, widened once
  // (weights < 64 and |a| <= 127: |pair| <= 2 * 63 * 127, the sum of two < 2^15: exact;
  // int4 levels < 16, MXFP4's levels + 16 < 32).
  static constexpr bool kDotInt4 = true;
  static IReg dot_int4(IReg acc, IReg lo, IReg a0, IReg hi, IReg a1) {
    const IReg pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a0), _mm256_maddubs_epi16(hi, a1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static IReg set1(int32_t s) { return _mm256_set1_epi32(s); }
  static IReg neg_shl(IReg v, int s) { return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(v, s)); }
  static Vec::Reg to_float(IReg v) { return _mm256_cvtepi32_ps(v); }
  static IReg mul(IReg a, IReg b) { return _mm256_mullo_epi32(a, b); }
  // int4_asym with integer zero points (int_layout.h): -z = minimum / scale per lane, 0
  // where the scale is 0 (padding rows). minimum is -z * scale with z <= 16 and the scale
  // a normal number (mark_integer_zeros), so minimum x the reciprocal estimate (relative
  // error <= 1.5 * 2^-12) lies within 0.01 of -z and rounds to it.
  static IReg negative_zeros(Vec::Reg minimum, Vec::Reg scale) {
    const __m256 nonzero = _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    return _mm256_cvtps_epi32(_mm256_and_ps(_mm256_mul_ps(minimum, _mm256_rcp_ps(scale)), nonzero));
  }
};

}  // namespace
}  // namespace kt::cpu
