// [NOTE] Integer operations for QuantGemm (quant_gemm.h) and the GGUF dots (gguf_dot.h)
// with AVX-VNNI: the AVX2 operations (int_ops_avx2.h) with the VEX-encoded 256-bit
// vpdpbusd as the dot product (Alder Lake and later Intel Cores, Zen 5), which
// multiplies 32 unsigned weight bytes by the broadcast signed activation bytes and adds
// each lane's 4 products to an int32 lane in one instruction, where AVX2 needs vpmaddubsw,
// vpmaddwd and vpaddd. Weights are the unsigned operand (int4 levels 0..15, int8 offset
// binary q + 128); the driver removes the offset with the activation sums (kInt8Bias), so
// every integer sum equals the avx2 variant's exactly and the results are bit-identical.
// Without the int16 intermediate fewer registers are busy per dot: the k-blocked GEMM
// tile takes six token rows for INT8 (12 registers of sums; the fp32 accumulators stay in
// L1, quant_gemm.h) and three for INT4, which also holds both nibble halves of a line;
// decode streams up to four (AVX2: two and two). Paired A/B on Zen 5 (avx_vnni): INT8
// tiles of six against three (24 calls) 512-token S1/S2 0.80/0.79 of the time, 64 tokens
// 0.92 (INT4 at six 1.04: spills); before that (when accumulators lived in registers,
// 40 calls), INT4 tiles of three against four 1.18-1.21x and INT8 1.09x faster;
// streaming four tokens rather than blocking them runs 64-token layers 1.06-1.12x faster.
#pragma once

#include <immintrin.h>

#include "int_ops_avx2.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

struct IntOpsAvxVnni : IntOpsAvx2 {
  static constexpr int kMaxRows = 6;      // int8: 12 registers of sums, accumulators in L1
  static constexpr int kMaxRowsInt4 = 3;  // int4 also holds both nibble halves
  static constexpr int kDecodeRows = 4;
  static constexpr int32_t kInt8Bias = 128;
  // int4 (and GGUF's nibble types): two vpdpbusd per line, not the base's widening pair
  // sum, which this struct had inherited. Paired A/B on Zen 5 forced to avx_vnni
  // (2026-11-26): 512-token S1 AMXINT4 0.75 of the time, Q4_0 0.97; 1 token 0.95-1.02.
  static constexpr bool kDotInt4 = false;

  static IReg dot(IReg acc, IReg w, IReg a) {
    return KT_VNNI_INLINE_ASM ? asm_dpbusd(acc, w, a) : _mm256_dpbusd_avx_epi32(acc, w, a);
  }
  static IReg dot_int8(IReg acc, IReg w, IReg a) { return dot(acc, w, a); }
};

}  // namespace
}  // namespace kt::cpu
