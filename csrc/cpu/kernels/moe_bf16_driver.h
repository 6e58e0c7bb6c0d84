// [NOTE] The BF16 MoE forward, written once and instantiated per ISA with a micro-GEMM
// (bf16/micro_gemm.h). Include only from a variant translation unit (variants/*.cpp),
// after its target pragma.
//
// For every token t: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
// e = ids[t, j], slots with e = -1 skipped. Four phases, each a parallel_for on the
// Engine:
//   1. activations: x converted to the micro-kernel's element type, one row per
//                   (token, slot) pair in expert order (an expert's rows contiguous).
//   2. gate+up:     jobs (expert, 4 interleaved gate/up blocks); SiLU(gate) * up in fp32,
//                   stored per (token, slot) pair.
//   3. down:        jobs (expert, 4 blocks of 16 hidden rows); fp32 per pair.
//   4. combine:     out[t] = sum_j w[t, j] * down_out[pair(t, j)], cast to the output type.
// Jobs of phases 2 and 3 read equal weight bytes. Per expert the path follows its token
// count m: m <= kMaxRows streams each weight line once for all m tokens (decode,
// memory-bound); larger m runs the k-blocked GEMM, where a block of weight lines stays
// in L1 while every row tile of the expert reuses it (prefill, compute-bound).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../engine/engine.h"
#include "../engine/scratch.h"
#include "../formats/bf16_layout.h"
#include "../isa/scalar_convert.h"
#include "../isa/vec_math.h"
#include "bf16/micro_gemm.h"
#include "moe_args.h"
#include "moe_driver_common.h"
#include "moe_plan.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int64_t kKBlockPairs = 128;  // GEMM k block: 4 blocks x 128 pairs = 32 KiB of weights
constexpr int64_t kRowChunk = 96;      // rows per epilogue chunk (multiple of 32, 6 and 4)
constexpr int64_t kPadRows = 32;       // readable rows past the last pair (AMX row tiles)
constexpr int64_t kDecodePrefetch = 32;  // decode: prefetch weight lines 2 KiB ahead

template <class Micro, int M, int NB = Micro::max_blocks(M)>
void tile_blocks(int blocks, const TileArgs<typename Micro::Act>& t) {
  if constexpr (NB >= 1) {
    if (blocks == NB) return Micro::template tile<M, NB>(t);
    tile_blocks<Micro, M, NB - 1>(blocks, t);
  }
}

template <class Micro, int M = Micro::kMaxRows>
void tile_any(int rows, int blocks, const TileArgs<typename Micro::Act>& t) {
  if constexpr (M >= 1) {
    if (rows == M) return tile_blocks<Micro, M>(blocks, t);
    tile_any<Micro, M - 1>(rows, blocks, t);
  }
}

// The k-blocked vector GEMM: c[m][16 b0, 16 b1) (+)= a[m] x blocks [b0, b1) over k-pairs
// [p_begin, p_end), for m < rows. A block of weight lines (kKBlockPairs) stays in L1 while
// every row tile reuses it. `accumulate` adds to c from the first k block on.
template <class Micro>
void vector_gemm(const typename Micro::Act* a, int64_t lda, int64_t rows, const uint16_t* w,
                 int64_t block_stride, int64_t p_begin, int64_t p_end, int b0, int b1, float* c,
                 int64_t ldc, bool accumulate) {
  using Act = typename Micro::Act;
  const Act* row_at[Micro::kMaxRows];
  for (int64_t p0 = p_begin; p0 < p_end; p0 += kKBlockPairs) {
    const int64_t block_pairs = std::min(kKBlockPairs, p_end - p0);
    for (int64_t m0 = 0; m0 < rows; m0 += Micro::kMaxRows) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(Micro::kMaxRows, rows - m0));
      for (int m = 0; m < tile_rows; ++m) row_at[m] = a + (m0 + m) * lda + 2 * p0;
      for (int b = b0; b < b1; b += Micro::max_blocks(tile_rows))
        tile_any<Micro>(tile_rows, std::min(Micro::max_blocks(tile_rows), b1 - b),
                        {row_at, w + b * block_stride + p0 * 32, block_stride, block_pairs,
                         c + m0 * ldc + b * 16, ldc, accumulate || p0 > p_begin, 0});
    }
  }
}

// Micro-kernel sets with a whole-GEMM tile path (AMX) provide tile_gemm.
template <class Micro, class = void>
struct HasTileGemm : std::false_type {};
template <class Micro>
struct HasTileGemm<Micro, std::void_t<decltype(&Micro::tile_gemm)>> : std::true_type {};

// c[m][0, 16 * blocks) = a[m] x blocks of w over `pairs` k-pairs, for m < rows; row m
// of a starts at a + m * lda. Rows up to the next multiple of kPadRows after `rows` must
// be readable (tiles may compute them; their results are discarded).
template <class Micro>
void gemm_rows(const typename Micro::Act* a, int64_t lda, int64_t rows, const uint16_t* w,
               int64_t block_stride, int64_t pairs, int blocks, float* c, int64_t ldc) {
  using Act = typename Micro::Act;
  if (rows <= Micro::kMaxRows) {  // decode: each weight line read once, all k at once
    const Act* row_at[Micro::kMaxRows];
    for (int m = 0; m < rows; ++m) row_at[m] = a + m * lda;
    const int max_blocks = Micro::max_blocks(static_cast<int>(rows));
    for (int b0 = 0; b0 < blocks; b0 += max_blocks)
      tile_any<Micro>(static_cast<int>(rows), std::min(max_blocks, blocks - b0),
                      {row_at, w + b0 * block_stride, block_stride, pairs, c + b0 * 16, ldc, false,
                       kDecodePrefetch});
    return;
  }
  TileCoverage done{0, 0};
  if constexpr (HasTileGemm<Micro>::value)
    done = Micro::tile_gemm(a, lda, rows, w, block_stride, pairs, blocks, c, ldc);
  if (done.pairs < pairs && done.blocks > 0)  // k tail of the tiled blocks
    vector_gemm<Micro>(a, lda, rows, w, block_stride, done.pairs, pairs, 0, done.blocks, c, ldc, true);
  if (done.blocks < blocks)  // blocks no tile covered: everything
    vector_gemm<Micro>(a, lda, rows, w, block_stride, 0, pairs, done.blocks, blocks, c, ldc, false);
}

// One packed weight matrix (gate_up or down) of every expert in the blob.
struct PackedMatrix {
  const uint8_t* first_expert;
  uint64_t expert_bytes;
  size_t block_bytes;
  int64_t blocks;  // 16-row blocks per expert
  int64_t pairs;   // k-pairs per block

  const uint16_t* block(int64_t expert, int64_t first_block) const {
    return reinterpret_cast<const uint16_t*>(first_expert + expert * expert_bytes +
                                             first_block * block_bytes);
  }
  int64_t block_stride() const { return static_cast<int64_t>(block_bytes / sizeof(uint16_t)); }
  // Blocks in the job tile starting at first_block (kTileBlocks, fewer at the end).
  int tile_blocks(int64_t first_block) const {
    return static_cast<int>(std::min<int64_t>(kTileBlocks, blocks - first_block));
  }
};

template <class Micro>
void moe_forward_bf16(const MoeArgs& args) {
  using Act = typename Micro::Act;
  using V = typename Micro::Vec;
  constexpr int W = V::kWidth;
  const PackedLayout& layout = args.layout;
  const int64_t E = layout.shape.num_experts;
  const bf16_layout::Dims dims(layout.shape.hidden_size, layout.shape.intermediate_size);
  const int64_t H = dims.hidden, T = args.tokens, K = args.top_k;
  const int64_t act_cols = 2 * dims.hidden_pairs, inter_cols = dims.intermediate16,
                out_cols = dims.hidden16;

  // Per calling thread, reused across calls. Bound to references so the lambdas below
  // (run on helper threads) capture the caller's objects, not their own thread_locals.
  thread_local MoePlan thread_plan;
  thread_local std::vector<ExpertTile> thread_tiles;
  MoePlan& plan = thread_plan;
  std::vector<ExpertTile>& tiles = thread_tiles;
  plan.build(args.topk_ids, args.topk_ids_int64, T, K, E);
  const int64_t P = plan.num_pairs;

  ScratchLayout carve;
  // Rows are (token, slot) pairs grouped by expert, so an expert's rows are contiguous;
  // kPadRows rows follow the last pair for row tiles (AMX) that run past it.
  const size_t acts_at = carve.add<Act>((P + kPadRows) * act_cols);    // 1. activations : [P, H2]
  const size_t inter_at = carve.add<Act>((P + kPadRows) * inter_cols); // 2. intermediate: [P, I16]
  const size_t down_at = carve.add<float>(P * out_cols);               // 3. down_out    : [P, H16]
  const size_t weights_at = carve.add<float>(T * K);                   // 4. weights     : [T, K]
  uint8_t* scratch = thread_scratch(carve.bytes());
  Act* acts = reinterpret_cast<Act*>(scratch + acts_at);
  Act* inter = reinterpret_cast<Act*>(scratch + inter_at);
  float* down_out = reinterpret_cast<float*>(scratch + down_at);
  float* weights = reinterpret_cast<float*>(scratch + weights_at);
  for (int64_t s = 0; s < T * K; ++s) weights[s] = weight_at(args.topk_weights, args.weights_type, s);
  if constexpr (HasTileGemm<Micro>::value) {  // only row tiles read past the last pair
    std::memset(acts + P * act_cols, 0, kPadRows * act_cols * sizeof(Act));
    std::memset(inter + P * inter_cols, 0, kPadRows * inter_cols * sizeof(Act));
  }

  Engine& engine = Engine::instance();
  const size_t in_bytes = args.hidden_type == ElementType::kF32 ? 4 : 2;
  engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
    for (int64_t p = job * kRowsPerJob; p < std::min(P, (job + 1) * kRowsPerJob); ++p)
      convert_row<V>(static_cast<const uint8_t*>(args.hidden) + plan.pair_token[p] * H * in_bytes,
                     args.hidden_type, H, acts + p * act_cols, act_cols);
  });

  const PackedMatrix gate_up{args.packed + layout.gate_up_offset, layout.gate_up_expert_bytes,
                             dims.gate_up_block_bytes(), dims.gate_up_blocks, dims.hidden_pairs};
  const PackedMatrix down{args.packed + layout.down_offset, layout.down_expert_bytes,
                          dims.down_block_bytes(), dims.down_blocks, dims.down_pairs};

  build_tiles(plan.active_experts, gate_up.blocks, tiles);
  engine.parallel_for(static_cast<int64_t>(tiles.size()), [&](int64_t job) {
    const ExpertTile tile = tiles[job];
    const int blocks = gate_up.tile_blocks(tile.first_block);
    const uint16_t* w = gate_up.block(tile.expert, tile.first_block);
    alignas(64) float c[kRowChunk * kTileBlocks * 16];
    constexpr int64_t ldc = kTileBlocks * 16;
    const int64_t begin = plan.expert_begin[tile.expert], end = plan.expert_begin[tile.expert + 1];
    for (int64_t p0 = begin; p0 < end; p0 += kRowChunk) {
      const int64_t chunk = std::min(kRowChunk, end - p0);
      gemm_rows<Micro>(acts + p0 * act_cols, act_cols, chunk, w, gate_up.block_stride(),
                       gate_up.pairs, blocks, c, ldc);
      // Row layout [gate 16 | up 16] per intermediate block -> silu(gate) * up.
      for (int64_t m = 0; m < chunk; ++m) {
        Act* out = inter + (p0 + m) * inter_cols + (tile.first_block / 2) * 16;
        for (int pair = 0; pair < blocks / 2; ++pair)
          for (int v = 0; v < 16; v += W)
            store_act<V>(out + pair * 16 + v,
                         vec_silu_mul<V>(V::load(c + m * ldc + pair * 32 + v),
                                         V::load(c + m * ldc + pair * 32 + 16 + v)));
      }
    }
  });

  build_tiles(plan.active_experts, down.blocks, tiles);
  engine.parallel_for(static_cast<int64_t>(tiles.size()), [&](int64_t job) {
    const ExpertTile tile = tiles[job];
    const int64_t begin = plan.expert_begin[tile.expert], end = plan.expert_begin[tile.expert + 1];
    gemm_rows<Micro>(inter + begin * inter_cols, inter_cols, end - begin,
                     down.block(tile.expert, tile.first_block), down.block_stride(), down.pairs,
                     down.tile_blocks(tile.first_block),
                     down_out + begin * out_cols + tile.first_block * 16, out_cols);
  });

  combine_outputs<V>(args, plan, weights, nullptr, down_out, out_cols);
}

}  // namespace
}  // namespace kt::cpu
