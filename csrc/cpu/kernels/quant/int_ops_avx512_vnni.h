// [NOTE] Integer operations for QuantGemm (quant_gemm.h) with AVX512_VNNI: the AVX-512
// operations (int_ops_avx512.h) with vpdpbusd as the dot product. It multiplies 64
// unsigned weight bytes by the broadcast signed activation bytes and adds each lane's
// 4 products to an int32 lane in one instruction. Weights are the unsigned operand
// (int4 levels 0..15, int8 offset binary q + 128); the driver removes the offset with
// the activation sums (kInt8Bias).
#pragma once

#include <immintrin.h>

#include "int_ops_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct IntOpsAvx512Vnni : IntOpsAvx512 {
  static constexpr int32_t kInt8Bias = 128;

  static IReg dot(IReg acc, IReg w, IReg a) { return _mm512_dpbusd_epi32(acc, w, a); }
  static IReg dot_int8(IReg acc, IReg w, IReg a) { return _mm512_dpbusd_epi32(acc, w, a); }
  static IReg dot16(IReg acc, IReg a16, IReg b16) { return _mm512_dpwssd_epi32(acc, a16, b16); }
};

}  // namespace
}  // namespace kt::cpu
