// [NOTE] Integer operations for MicroQuant (micro_quant.h) with AVX512_VNNI: vpdpbusd
// multiplies 64 unsigned weight bytes by the broadcast signed activation bytes and adds
// each lane's 4 products to an int32 lane in one instruction. Weights are the unsigned
// operand (int4 levels 0..15, int8 offset binary q + 128); the driver removes the
// offset with the activation sums (kInt8Bias).
#pragma once

#include <immintrin.h>

#include "../../isa/vec_avx512.h"
#include "micro_quant.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct IntOpsAvx512Vnni {
  using Vec = VecAvx512;
  using IReg = __m512i;
  static constexpr int kRegsPerLine = 1;
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxBlocks = 2;
  static constexpr int32_t kInt8Bias = 128;

  static IReg zero() { return _mm512_setzero_si512(); }
  static IReg load(const uint8_t* line, int) { return _mm512_loadu_si512(line); }
  static IReg broadcast4(const int8_t* a) { return _mm512_set1_epi32(load_i32(a)); }
  static IReg low_nibbles(IReg v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
  static IReg high_nibbles(IReg v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
  }
  static IReg dot(IReg acc, IReg w, IReg a) { return _mm512_dpbusd_epi32(acc, w, a); }
  static IReg dot_int8(IReg acc, IReg w, IReg a) { return _mm512_dpbusd_epi32(acc, w, a); }
  static IReg add(IReg a, IReg b) { return _mm512_add_epi32(a, b); }
  static IReg sub(IReg v, int32_t s) { return _mm512_sub_epi32(v, _mm512_set1_epi32(s)); }
  static Vec::Reg to_float(IReg v) { return _mm512_cvtepi32_ps(v); }
};

}  // namespace
}  // namespace kt::cpu
