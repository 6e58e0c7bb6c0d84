// [NOTE] Integer operations for QuantGemm (quant_gemm.h) with AVX512_VNNI: the AVX-512
// operations (int_ops_avx512.h) with vpdpbusd as the dot product. It multiplies 64
// unsigned weight bytes by the broadcast signed activation bytes and adds each lane's
// 4 products to an int32 lane in one instruction. Weights are the unsigned operand
// (int4 levels 0..15, int8 offset binary q + 128); the driver removes the offset with
// the activation sums (kInt8Bias).
// The GEMM tile is 6 token rows x 4 blocks (INT4 prefill: 6 x 2, below): per 64-byte line 4 weight loads and 6
// broadcasts feed 24 vpdpbusd, whose int32 sums fill 24 registers (the fp32 accumulators
// stay in the L1-resident output tile, quant_gemm.h). Against tiles of 4 x 2, paired A/B
// on Zen 5 (avx512_bf16, 30 calls): 512-token S1/S2 INT8 0.83/0.86 of the time, INT4
// 0.83/0.89; 64 tokens 0.76-1.04; decode unchanged.
#pragma once

#include <immintrin.h>

#include "int_ops_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct IntOpsAvx512Vnni : IntOpsAvx512 {
  static constexpr int32_t kInt8Bias = 128;
  static constexpr int kMaxRows = 6;
  static constexpr int kMaxRowsInt4 = 6;
  static constexpr int kMaxBlocks = 4;
  // INT4 prefill tiles of 6 rows x 2 blocks hold their 12 fp32 accumulators in registers
  // beside the 12 of sums (quant_gemm.h): groups of 32 flush every 4 lines, and the 6 x 4
  // tile's accumulators in L1 cost a load and a store per register and group. Paired A/B
  // of the commit that made this and the flush changes of quant_gemm.h, against 6 x 4
  // (scripts/ab_pair.py, Zen 5, avx512_bf16, 2026-11-27, 12 calls): 512-token S1 RAWINT4
  // 0.74, MXFP4 0.79, AMXINT4 (groups of 128) 0.91, S2 GPTQ_INT4 0.86 of the time; 64
  // tokens 0.97-1.04. Decode tiles stay 4 blocks wide (QuantGemm::kDecodeBlocks).
  static constexpr int kMaxBlocksInt4 = 2;
  // int4: two vpdpbusd per line (low and high nibbles), not the base's widening pair sum
  // (2 vpmaddubsw + vpaddw + vpmaddwd + vpaddd), which this struct had inherited. Paired A/B
  // (scripts/ab_pair.py, Zen 5, 2026-11-26): 512-token S1 AMXINT4 / RAWINT4 / MXFP4 and
  // S2 GPTQ_INT4 0.67-0.71 of the time; 1 and 8 tokens 0.98-1.07 (memory-bound). Same sums.
  static constexpr bool kDotInt4 = false;

  static IReg dot(IReg acc, IReg w, IReg a) {
    return KT_VNNI_INLINE_ASM ? asm_dpbusd(acc, w, a) : _mm512_dpbusd_epi32(acc, w, a);
  }
  static IReg dot_int8(IReg acc, IReg w, IReg a) { return dot(acc, w, a); }
  static IReg dot16(IReg acc, IReg a16, IReg b16) {
    return KT_VNNI_INLINE_ASM ? asm_dpwssd(acc, a16, b16) : _mm512_dpwssd_epi32(acc, a16, b16);
  }
};

}  // namespace
}  // namespace kt::cpu
