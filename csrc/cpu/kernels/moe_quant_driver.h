// [NOTE] The INT8 / INT4 MoE forward, written once and instantiated per ISA with a set
// of integer operations (quant/micro_quant.h) and, on AMX CPUs, a tile GEMM. Include
// only from a variant translation unit (variants/*.cpp), after its target pragma.
//
// Same four phases as the BF16 driver (moe_bf16_driver.h), with activations quantized:
//   1. activations:  each token's row quantized once to int8 (per-token scale, sums per
//                    32 k), then copied to one row per (token, slot) pair in expert order.
//   2. gate+up:      jobs (expert, 4 interleaved gate/up blocks), int32 dot products
//                    scaled to fp32 per group; SiLU(gate) * up in fp32 per pair.
//   2b. requantize:  each pair's intermediate row to int8 (per-pair scale).
//   3. down:         jobs (expert, 4 blocks of 16 hidden rows); fp32 per pair.
//   4. combine:      out[t] = sum_j w[t, j] * scale[pair] * down_out[pair].
// Per expert: m <= kMaxRows tokens streams each weight line once (decode); more runs a
// k-blocked GEMM (or the tile GEMM of the micro-kernel set, if any).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../engine/engine.h"
#include "../engine/scratch.h"
#include "../formats/int_layout.h"
#include "../isa/vec_math.h"
#include "moe_args.h"
#include "moe_driver_common.h"
#include "moe_plan.h"
#include "quant/activation_quant.h"
#include "quant/micro_quant.h"
#include "tile_coverage.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int64_t kQuantKBlock = 512;     // GEMM k block (a multiple of every int4 group)
static_assert(kQuantKBlock % kInt8FlushK == 0, "k blocks must end on INT8 flush boundaries");
constexpr int64_t kQuantRowChunk = 96;    // rows per gate/up epilogue chunk
constexpr int64_t kQuantPadRows = 32;     // readable rows past the last pair (tile GEMMs)
constexpr int64_t kQuantPrefetchLines = 32;  // decode: prefetch 2 KiB ahead

// One packed int8/int4 matrix (gate_up or down) of every expert in the blob.
struct QuantMatrix {
  const uint8_t* first_expert;
  uint64_t expert_bytes;
  int_layout::MatrixDims dims;

  const uint8_t* block(int64_t expert, int64_t first_block) const {
    return first_expert + expert * expert_bytes + first_block * dims.block_bytes();
  }
  int tile_blocks(int64_t first_block) const {
    return static_cast<int>(std::min<int64_t>(kTileBlocks, dims.blocks - first_block));
  }
};

template <class Micro, int M, int NB = Micro::kMaxBlocks>
void quant_tile_blocks(int blocks, const QuantTileArgs& t) {
  if constexpr (NB >= 1) {
    if (blocks == NB) return Micro::template tile<M, NB>(t);
    quant_tile_blocks<Micro, M, NB - 1>(blocks, t);
  }
}

template <class Micro, int M = Micro::kMaxRows>
void quant_tile_any(int rows, int blocks, const QuantTileArgs& t) {
  if constexpr (M >= 1) {
    if (rows == M) return quant_tile_blocks<Micro, M>(blocks, t);
    quant_tile_any<Micro, M - 1>(rows, blocks, t);
  }
}

// Arguments for blocks starting at `block` over k in [k0, k0 + k).
template <class Micro>
QuantTileArgs quant_args(const int_layout::MatrixDims& dims, const uint8_t* block, int64_t k0,
                         int64_t k, float* c, int64_t ldc, bool accumulate, int64_t prefetch) {
  const bool int4 = Micro::kInt4;
  const int64_t first_group = int4 ? k0 / dims.group : 0;
  const uint8_t* scales = block + dims.scales_offset() + first_group * int_layout::kLineBytes;
  const uint8_t* minimums = block + dims.minimums_offset() + first_group * int_layout::kLineBytes;
  return {nullptr,
          nullptr,
          block + (k0 / Micro::kKPerLine) * static_cast<int64_t>(int_layout::kLineBytes),
          reinterpret_cast<const float*>(scales),
          dims.minimums ? reinterpret_cast<const float*>(minimums) : nullptr,
          static_cast<int64_t>(dims.block_bytes()),
          k,
          int4 ? dims.group : kInt8FlushK,
          c,
          ldc,
          accumulate,
          prefetch};
}

// k-blocked vector GEMM over rows [0, rows) and blocks [b0, b1), k in [k_begin, k_end).
template <class Micro>
void quant_vector_gemm(const QuantRows& a, int64_t rows, const int_layout::MatrixDims& dims,
                       const uint8_t* w, int64_t k_begin, int64_t k_end, int b0, int b1, float* c,
                       int64_t ldc, bool accumulate) {
  const int8_t* row_at[Micro::kMaxRows];
  const int32_t* sums_at[Micro::kMaxRows];
  const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kQuantKBlock) {
    const int64_t k = std::min(kQuantKBlock, k_end - k0);
    for (int64_t m0 = 0; m0 < rows; m0 += Micro::kMaxRows) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(Micro::kMaxRows, rows - m0));
      for (int m = 0; m < tile_rows; ++m) {
        row_at[m] = a.levels + (m0 + m) * a.stride + k0;
        sums_at[m] = a.sums + (m0 + m) * a.sums_stride + k0 / int_layout::kKAlign;
      }
      for (int b = b0; b < b1; b += Micro::kMaxBlocks) {
        QuantTileArgs t = quant_args<Micro>(dims, w + b * block_bytes, k0, k, c + m0 * ldc + b * 16,
                                            ldc, accumulate || k0 > k_begin, 0);
        t.a = row_at;
        t.a_sums = sums_at;
        quant_tile_any<Micro>(tile_rows, std::min(Micro::kMaxBlocks, b1 - b), t);
      }
    }
  }
}

template <class Micro, class = void>
struct HasQuantTileGemm : std::false_type {};
template <class Micro>
struct HasQuantTileGemm<Micro, std::void_t<decltype(&Micro::tile_gemm)>> : std::true_type {};

// c[m][0, 16 * blocks) = rows of a x `blocks` blocks starting at w, over all of k.
// Rows up to the next multiple of kQuantPadRows after `rows` must be readable.
template <class Micro>
void quant_gemm_rows(const QuantRows& a, int64_t rows, const int_layout::MatrixDims& dims,
                     const uint8_t* w, int blocks, float* c, int64_t ldc) {
  const int64_t K = dims.padded_k;
  if (rows <= Micro::kMaxRows) {  // decode: each weight line read once, all k at once
    const int8_t* row_at[Micro::kMaxRows];
    const int32_t* sums_at[Micro::kMaxRows];
    for (int m = 0; m < rows; ++m) {
      row_at[m] = a.levels + m * a.stride;
      sums_at[m] = a.sums + m * a.sums_stride;
    }
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    // One token streams all of the job's blocks at once (more streams in flight: 1-token
    // S1 int4 from 17.9 to 19.7 GB/s, int8 23.6 to 25.2); more rows need the registers for their sums.
    const int max_blocks = rows == 1 ? kTileBlocks : Micro::kMaxBlocks;
    for (int b0 = 0; b0 < blocks; b0 += max_blocks) {
      QuantTileArgs t = quant_args<Micro>(dims, w + b0 * block_bytes, 0, K, c + b0 * 16, ldc, false,
                                          kQuantPrefetchLines);
      t.a = row_at;
      t.a_sums = sums_at;
      if (rows == 1)
        quant_tile_blocks<Micro, 1, kTileBlocks>(std::min(max_blocks, blocks - b0), t);
      else
        quant_tile_any<Micro>(static_cast<int>(rows), std::min(max_blocks, blocks - b0), t);
    }
    return;
  }
  TileCoverage done{0, 0};
  if constexpr (HasQuantTileGemm<Micro>::value) done = Micro::tile_gemm(a, rows, dims, w, blocks, c, ldc);
  if (done.pairs < K && done.blocks > 0)  // k tail of the tiled blocks ("pairs" = k here)
    quant_vector_gemm<Micro>(a, rows, dims, w, done.pairs, K, 0, done.blocks, c, ldc, true);
  if (done.blocks < blocks)
    quant_vector_gemm<Micro>(a, rows, dims, w, 0, K, done.blocks, blocks, c, ldc, false);
}

// Quantizes `rows` fp32 rows (n valid columns of `x_cols`) into int8 rows of `cols`
// columns, 16 rows per job.
template <class V>
void quantize_rows(int64_t rows, const float* x, int64_t x_cols, int64_t n, int8_t* q, int64_t cols,
                   int32_t* sums, float* scales) {
  Engine::instance().parallel_for(ceil_div(rows, kRowsPerJob), [&](int64_t job) {
    for (int64_t r = job * kRowsPerJob; r < std::min(rows, (job + 1) * kRowsPerJob); ++r)
      scales[r] = quantize_activation_row<V>(x + r * x_cols, n, cols, q + r * cols,
                                             sums + r * (cols / int_layout::kKAlign));
  });
}

template <class Micro>
void moe_forward_quant(const MoeArgs& args) {
  using V = typename Micro::Vec;
  constexpr int W = V::kWidth;
  const PackedLayout& layout = args.layout;
  const int64_t E = layout.shape.num_experts;
  const int_layout::Dims dims(layout.shape);
  const int64_t H = dims.hidden, T = args.tokens, K = args.top_k;
  const int64_t act_cols = dims.gate_up.padded_k, act_sums = act_cols / int_layout::kKAlign;
  const int64_t inter_cols = dims.down.padded_k, inter_sums = inter_cols / int_layout::kKAlign;
  const int64_t inter_f_cols = dims.intermediate16, out_cols = dims.hidden16;

  // Per calling thread, reused across calls (see moe_bf16_driver.h).
  thread_local MoePlan thread_plan;
  thread_local std::vector<ExpertTile> thread_tiles;
  MoePlan& plan = thread_plan;
  std::vector<ExpertTile>& tiles = thread_tiles;
  plan.build(args.topk_ids, args.topk_ids_int64, T, K, E);
  const int64_t P = plan.num_pairs, Pp = P + kQuantPadRows;

  ScratchLayout carve;
  const size_t x_at = carve.add<float>(T * act_cols);                 // 1. tokens (fp32)   : [T, Hk]
  const size_t token_q_at = carve.add<int8_t>(T * act_cols);          //    tokens (int8)   : [T, Hk]
  const size_t token_sums_at = carve.add<int32_t>(T * act_sums);      //    token sums      : [T, Hk/32]
  const size_t token_scale_at = carve.add<float>(T);                  //    token scales    : [T]
  const size_t acts_at = carve.add<int8_t>(Pp * act_cols);            //    pair rows       : [P+pad, Hk]
  const size_t act_sums_at = carve.add<int32_t>(Pp * act_sums);       //    pair sums       : [P+pad, Hk/32]
  const size_t inter_f_at = carve.add<float>(P * inter_f_cols);       // 2. intermediate    : [P, I16]
  const size_t inter_q_at = carve.add<int8_t>(Pp * inter_cols);       //    int8            : [P+pad, Ik]
  const size_t inter_sums_at = carve.add<int32_t>(Pp * inter_sums);   //    sums            : [P+pad, Ik/32]
  const size_t inter_scale_at = carve.add<float>(P);                  //    scales          : [P]
  const size_t down_at = carve.add<float>(P * out_cols);              // 3. down_out        : [P, H16]
  const size_t weights_at = carve.add<float>(T * K);                  // 4. weights         : [T, K]
  uint8_t* scratch = thread_scratch(carve.bytes());
  auto at = [&](size_t offset) { return scratch + offset; };
  float* x = reinterpret_cast<float*>(at(x_at));
  int8_t* token_q = reinterpret_cast<int8_t*>(at(token_q_at));
  int32_t* token_sums = reinterpret_cast<int32_t*>(at(token_sums_at));
  float* token_scale = reinterpret_cast<float*>(at(token_scale_at));
  int8_t* acts = reinterpret_cast<int8_t*>(at(acts_at));
  int32_t* act_sum = reinterpret_cast<int32_t*>(at(act_sums_at));
  float* inter_f = reinterpret_cast<float*>(at(inter_f_at));
  int8_t* inter_q = reinterpret_cast<int8_t*>(at(inter_q_at));
  int32_t* inter_sum = reinterpret_cast<int32_t*>(at(inter_sums_at));
  float* inter_scale = reinterpret_cast<float*>(at(inter_scale_at));
  float* down_out = reinterpret_cast<float*>(at(down_at));
  float* weights = reinterpret_cast<float*>(at(weights_at));
  for (int64_t s = 0; s < T * K; ++s) weights[s] = weight_at(args.topk_weights, args.weights_type, s);
  if constexpr (HasQuantTileGemm<Micro>::value) {  // only row tiles read past the last pair
    std::memset(acts + P * act_cols, 0, kQuantPadRows * act_cols);
    std::memset(act_sum + P * act_sums, 0, kQuantPadRows * act_sums * sizeof(int32_t));
    std::memset(inter_q + P * inter_cols, 0, kQuantPadRows * inter_cols);
    std::memset(inter_sum + P * inter_sums, 0, kQuantPadRows * inter_sums * sizeof(int32_t));
  }

  // 1. Each token once: convert to fp32, quantize; then one row per pair.
  Engine& engine = Engine::instance();
  const size_t in_bytes = args.hidden_type == ElementType::kF32 ? 4 : 2;
  engine.parallel_for(ceil_div(T, kRowsPerJob), [&](int64_t job) {
    for (int64_t t = job * kRowsPerJob; t < std::min(T, (job + 1) * kRowsPerJob); ++t) {
      convert_row<V>(static_cast<const uint8_t*>(args.hidden) + t * H * in_bytes, args.hidden_type,
                     H, x + t * act_cols, act_cols);
      token_scale[t] = quantize_activation_row<V>(x + t * act_cols, H, act_cols, token_q + t * act_cols,
                                                  token_sums + t * act_sums);
    }
  });
  engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
    for (int64_t p = job * kRowsPerJob; p < std::min(P, (job + 1) * kRowsPerJob); ++p) {
      const int64_t t = plan.pair_token[p];
      std::memcpy(acts + p * act_cols, token_q + t * act_cols, act_cols);
      std::memcpy(act_sum + p * act_sums, token_sums + t * act_sums, act_sums * sizeof(int32_t));
    }
  });

  const QuantMatrix gate_up{args.packed + layout.gate_up_offset, layout.gate_up_expert_bytes, dims.gate_up};
  const QuantMatrix down{args.packed + layout.down_offset, layout.down_expert_bytes, dims.down};

  // 2. gate/up and the SiLU epilogue (token scale applied here).
  build_tiles(plan.active_experts, dims.gate_up.blocks, tiles);
  engine.parallel_for(static_cast<int64_t>(tiles.size()), [&](int64_t job) {
    const ExpertTile tile = tiles[job];
    const int blocks = gate_up.tile_blocks(tile.first_block);
    const uint8_t* w = gate_up.block(tile.expert, tile.first_block);
    alignas(64) float c[kQuantRowChunk * kTileBlocks * 16];
    constexpr int64_t ldc = kTileBlocks * 16;
    const int64_t begin = plan.expert_begin[tile.expert], end = plan.expert_begin[tile.expert + 1];
    for (int64_t p0 = begin; p0 < end; p0 += kQuantRowChunk) {
      const int64_t chunk = std::min(kQuantRowChunk, end - p0);
      const QuantRows rows{acts + p0 * act_cols, act_cols, act_sum + p0 * act_sums, act_sums};
      quant_gemm_rows<Micro>(rows, chunk, dims.gate_up, w, blocks, c, ldc);
      for (int64_t m = 0; m < chunk; ++m) {
        const typename V::Reg scale = V::set1(token_scale[plan.pair_token[p0 + m]]);
        float* out = inter_f + (p0 + m) * inter_f_cols + (tile.first_block / 2) * 16;
        for (int pair = 0; pair < blocks / 2; ++pair)
          for (int v = 0; v < 16; v += W)
            V::store(out + pair * 16 + v,
                     vec_silu_mul<V>(V::mul(scale, V::load(c + m * ldc + pair * 32 + v)),
                                     V::mul(scale, V::load(c + m * ldc + pair * 32 + 16 + v))));
      }
    }
  });

  // 2b. The intermediate rows to int8 (their scales go to the combine).
  quantize_rows<V>(P, inter_f, inter_f_cols, dims.intermediate, inter_q, inter_cols, inter_sum,
                   inter_scale);

  // 3. down.
  build_tiles(plan.active_experts, dims.down.blocks, tiles);
  engine.parallel_for(static_cast<int64_t>(tiles.size()), [&](int64_t job) {
    const ExpertTile tile = tiles[job];
    const int64_t begin = plan.expert_begin[tile.expert], end = plan.expert_begin[tile.expert + 1];
    const QuantRows rows{inter_q + begin * inter_cols, inter_cols, inter_sum + begin * inter_sums,
                         inter_sums};
    quant_gemm_rows<Micro>(rows, end - begin, dims.down, down.block(tile.expert, tile.first_block),
                           down.tile_blocks(tile.first_block),
                           down_out + begin * out_cols + tile.first_block * 16, out_cols);
  });

  // 4. combine.
  combine_outputs<V>(args, plan, weights, inter_scale, down_out, out_cols);
}

}  // namespace
}  // namespace kt::cpu
