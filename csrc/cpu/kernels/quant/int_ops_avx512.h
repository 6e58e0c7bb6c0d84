// [NOTE] Integer operations for QuantGemm (quant_gemm.h) on AVX-512 without VNNI
// (Skylake-SP class): vpmaddubsw (u8 x s8 -> pairs of int16) then vpmaddwd by ones
// (-> int32). int4 levels are < 16, so the int16 pair sums cannot saturate. int8
// weights (offset binary) are made signed and multiplied as |w| x sign(a, w) (the
// products keep their value and a pair sum stays <= 2 * 128 * 127 < 2^15); that dot
// carries no offset (kInt8Bias = 0).
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx512.h"
#include "quant_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct IntOpsAvx512 {
  using Vec = VecAvx512;
  using IReg = __m512i;
  static constexpr int kRegsPerLine = 1;
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxRowsInt4 = 4;
  static constexpr int kDecodeRows = 4;
  static constexpr int kMaxBlocks = 2;
  static constexpr int kMaxBlocksInt4 = 2;
  static constexpr int32_t kInt8Bias = 0;

  static IReg zero() { return _mm512_setzero_si512(); }
  static IReg load(const uint8_t* line, int) { return _mm512_loadu_si512(line); }
  static IReg broadcast4(const int8_t* a) { return _mm512_set1_epi32(load_i32(a)); }
  static IReg low_nibbles(IReg v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
  static IReg high_nibbles(IReg v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
  }
  // 16 x the high nibbles (no shift; levels up to 240: for vpdpbusd, whose u8 x s8
  // products are not summed in int16).
  static IReg high_nibbles_x16(IReg v) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xf0))); }
  static IReg shift_right4(IReg v) { return _mm512_srai_epi32(v, 4); }
  static IReg dot(IReg acc, IReg w, IReg a) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
  }
  static IReg dot_int8(IReg acc, IReg w, IReg a) {
    const IReg s = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // q
    const __mmask64 negative = _mm512_movepi8_mask(s);
    const IReg signed_a = _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a);
    return dot(acc, _mm512_abs_epi8(s), signed_a);
  }
  // int4: a line's low and high nibble products summed as int16 pairs, widened once
  // (weights < 64 and |a| <= 127: |pair| <= 2 * 63 * 127, the sum of two < 2^15: exact;
  // int4 levels < 16, MXFP4's levels + 16 < 32).
  static constexpr bool kDotInt4 = true;
  static IReg dot_int4(IReg acc, IReg lo, IReg a0, IReg hi, IReg a1) {
    const IReg pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, a0), _mm512_maddubs_epi16(hi, a1));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
  // acc + per int32 lane: a16[2l] * b16[2l] + a16[2l+1] * b16[2l+1] (int16 pairs).
  static IReg dot16(IReg acc, IReg a16, IReg b16) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a16, b16)); }
  static IReg add(IReg a, IReg b) { return _mm512_add_epi32(a, b); }
  static IReg set1(int32_t s) { return _mm512_set1_epi32(s); }
  static IReg neg_shl(IReg v, int s) { return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(v, s)); }
  static Vec::Reg to_float(IReg v) { return _mm512_cvtepi32_ps(v); }
  static IReg mul(IReg a, IReg b) { return _mm512_mullo_epi32(a, b); }
  // int4_asym with integer zero points (int_layout.h): -z = minimum / scale per lane, 0
  // where the scale is 0 (padding rows). minimum is -z * scale with z <= 16 and the scale
  // a normal number (mark_integer_zeros), so minimum x the reciprocal estimate (relative
  // error < 2^-14) lies within 16 * 2^-13 of -z and rounds to it.
  static IReg negative_zeros(Vec::Reg minimum, Vec::Reg scale) {
    const __mmask16 nonzero = _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    return _mm512_cvtps_epi32(_mm512_maskz_mul_ps(nonzero, minimum, _mm512_rcp14_ps(scale)));
  }
};

}  // namespace
}  // namespace kt::cpu
