// [NOTE] Activations for the GGUF kernels, quantized once per row (token or pair):
// 8-bit blocks matching the weight type's block, as ggml pairs Q8_0 (32) with the
// 32-weight types and Q8_K (256) with the K-quants. Per block: scale = max|x| / 127,
// q = round-to-nearest-even(x * 127 / max|x|). Stored for the dot micro-kernel as
// q[kp], scale per 4 values (kp / 4 floats) and scale * sum(q) per 16 values
// (kp / 16 floats; the weights' minimums multiply these), and -128 * sum(q) per 4
// values (int32; the vpdpbusd kernels start Q8_0's offset-binary dot products there,
// so the offset cancels exactly in integers). The K-quants' formats (q4k_order,
// sums_of_16) keep one scale per 256-value block, at its first per-4 entry, and int16
// level sums instead. kp is a multiple of 256 and
// the row is zero past its length. Float weight types use the fp32 row unquantized. A
// block holding a NaN or an infinity gets scale NaN, so the row's results are NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../../isa/vec_math.h"
#include "../quant/activation_quant.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// Rows of activations in one matrix's format; row r at q + r * kp etc.
struct GgufActs {
  int64_t kp = 0;
  int block = 0;             // 32 or 256; 0: fp32 rows (float weight types)
  int8_t* q = nullptr;       // [rows, kp]
  float* scale = nullptr;    // [rows, kp / 4]
  float* sum16 = nullptr;    // [rows, kp / 16]
  int32_t* bias4 = nullptr;  // [rows, kp / 4]
  // Q4_K and Q5_K on AVX-512 (gguf_q4k_avx512.h): each 256-value unit in kGgufQ4kOrder, and
  // level_sums [rows, kp / 16]: per unit 8 zeros then the level sum of each 32 values.
  // Q6_K on AVX-512 (gguf_q6k_avx512.h): natural order, level_sums [rows, kp / 16] the
  // level sum of each 16 values.
  bool q4k_order = false;
  bool sums_of_16 = false;
  // The block-32 types read in place (gguf_block32_avx512.h, gguf_block32_avx2.h): quad order. Each 128 values (4
  // blocks) as values 0-15 of the 4 blocks, then values 16-31 of the 4 blocks; per int32
  // lane of that layout (8 values: 4 + the 4 sixteen positions later), scale[] the
  // block's scale and bias4[] -128 * their level sum (kp / 8 each, at the start of the
  // row's kp / 4 entries). Per block b, each value 4 times (int32 lanes 4 b .. 4 b + 3,
  // kp / 8 per row): bias4[kp / 8 + 4 b + l] -128 * the block's level sum (the prefill
  // tile, gguf_block32_tile_avx512.h), and block_min_sums[4 b + l] the block's scale times
  // that sum (Q4_1's and Q5_1's minimums in every block-32 kernel, which add whole blocks).
  bool quad32 = false;
  float* block_min_sums = nullptr;  // quad32: [rows, kp / 4], the first kp / 8 used (rows kp bytes apart, as q's)
  int16_t* level_sums = nullptr;
  const float* f = nullptr;  // block 0: [rows, kp] fp32
};

// x[0, kp) (zero past the row's length) -> row r of `acts` (block 32 or 256).
template <class V>
void gguf_quantize_act_row(const float* x, const GgufActs& acts, int64_t r) {
  constexpr int W = V::kWidth;
  const int64_t kp = acts.kp;
  int8_t* q = acts.q + r * kp;
  float* scale = acts.scale + r * (kp / 4);
  float* sum16 = acts.sum16 + r * (kp / 16);
  int32_t* bias4 = acts.bias4 + r * (kp / 4);
  // The K-quant kernels (gguf_q4k_avx512.h, gguf_q6k_avx512.h, gguf_q23k_avx512.h,
  // gguf_kquant_avx2.h, gguf_kquant_tile_avx512.h) read the levels, each block's first
  // per-4 scale and the int16 level sums only: no per-4 biases or scaled sums of 16.
  const bool kquant = acts.q4k_order || acts.sums_of_16;
  for (int64_t b0 = 0; b0 < kp; b0 += acts.block) {
    const AbsMax top = abs_max<V>(x + b0, acts.block);
    const float amax = top.value;
    // A block holding a NaN or an infinity: scale NaN, levels 0 (the row's results are NaN).
    const bool finite = top.finite;
    float d = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    if (std::isinf(inv)) {  // a block below 127 / FLT_MAX (activation_quant.h)
      d = tiny_row_levels(x + b0, acts.block, amax, q + b0);
    } else {
      const typename V::Reg vinv = V::set1(inv);
      for (int64_t i = b0; i < b0 + acts.block; i += W) V::store_int8(q + i, V::mul(V::load(x + i), vinv));
    }
    if (kquant) {
      scale[b0 / 4] = d;
      continue;
    }
    for (int64_t i = b0 / 4; i < (b0 + acts.block) / 4; ++i) {
      scale[i] = d;
      bias4[i] = -128 * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
    }
    for (int64_t s = b0 / 16; s < (b0 + acts.block) / 16 && !acts.quad32; ++s) {  // quad rows: min sums below
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * s + i];
      sum16[s] = d * static_cast<float>(sum);
    }
  }
  if (acts.sums_of_16) {
    int16_t* level_sums = acts.level_sums + r * (kp / 16);
    for (int64_t g = 0; g < kp / 16; ++g) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
      level_sums[g] = static_cast<int16_t>(sum);  // |sum| <= 16 * 128
    }
  }
  if (acts.quad32) {
    float* scale8 = scale;  // the first halves of the row's per-4 buffers; group g's
    int32_t* bias8 = bias4;  // 16 lanes land below the per-4 entries later groups read
    for (int64_t g = 0; g < kp / 128; ++g) {
      int8_t* quad = q + 128 * g;
      float s[16];
      int32_t bias[16];
      for (int blk = 0; blk < 4; ++blk)
        for (int l = 0; l < 4; ++l) {
          int32_t sum = 0;
          for (int i = 0; i < 4; ++i) sum += quad[32 * blk + 4 * l + i] + quad[32 * blk + 16 + 4 * l + i];
          s[4 * blk + l] = scale[32 * g + 8 * blk];  // the natural per-4 scales, read before written
          bias[4 * blk + l] = -128 * sum;
        }
      std::memcpy(scale8 + 16 * g, s, sizeof(s));
      std::memcpy(bias8 + 16 * g, bias, sizeof(bias));
      int8_t natural[128];
      std::memcpy(natural, quad, 128);
      for (int blk = 0; blk < 4; ++blk) {
        std::memcpy(quad + 16 * blk, natural + 32 * blk, 16);
        std::memcpy(quad + 64 + 16 * blk, natural + 32 * blk + 16, 16);
      }
    }
    // After every group's scales and biases moved down (the upper halves held per-4
    // values until then).
    float* block_min = acts.block_min_sums + r * (kp / 4);
    for (int64_t b = 0; b < kp / 32; ++b) {
      const int64_t lane = 16 * (b / 4) + 4 * (b % 4);  // the block's four lanes
      const int32_t bias = bias8[lane] + bias8[lane + 1] + bias8[lane + 2] + bias8[lane + 3];
      const float min_sum = scale8[lane] * static_cast<float>(bias / -128);
      for (int l = 0; l < 4; ++l) {
        bias8[kp / 8 + 4 * b + l] = bias;
        block_min[4 * b + l] = min_sum;
      }
    }
    return;
  }
  if (!acts.q4k_order) return;
  int16_t* level_sums = acts.level_sums + r * (kp / 16);
  for (int64_t u = 0; u < kp / 256; ++u) {
    int8_t* unit = q + 256 * u;
    for (int j = 0; j < 8; ++j) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += unit[32 * j + i];
      level_sums[16 * u + j] = 0;
      level_sums[16 * u + 8 + j] = static_cast<int16_t>(sum);  // |sum| <= 32 * 128
    }
    // kGgufQ4kOrder: values 32-63 <-> 64-95 and 160-191 <-> 192-223.
    int8_t swap[32];
    for (int half = 0; half < 256; half += 128) {
      std::memcpy(swap, unit + half + 32, 32);
      std::memcpy(unit + half + 32, unit + half + 64, 32);
      std::memcpy(unit + half + 64, swap, 32);
    }
  }
}

}  // namespace
}  // namespace kt::cpu
