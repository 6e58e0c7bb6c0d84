// [NOTE] The BF16 format policy of the MoE driver (moe_driver.h), instantiated per ISA
// with a micro-GEMM (bf16/bf16_gemm.h). Include only from a variant translation unit
// (variants/*.cpp), after its target pragma.
//
// Weights: formats/bf16_layout.h (gate and up blocks of 16 rows interleaved, k in pairs).
// Activations: each pair's token row in the micro-kernel's element type (bf16 or fp32),
// an expert's rows contiguous; the intermediate rows likewise (act() rounded to it).
// Per expert the path follows its token count m: m <= kMaxRows streams each weight line
// once for all m tokens (decode, memory-bound); larger m runs the k-blocked GEMM, where a
// block of weight lines stays in L1 while every row tile of the expert reuses it
// (prefill, compute-bound), or the micro-kernel set's tile GEMM (AMX). The vector paths
// accumulate every output in the same order (bf16_gemm.h); AMX tiles do not match them
// bit for bit (docs/formats.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../engine/engine.h"
#include "../../engine/scratch.h"
#include "../../formats/bf16_layout.h"
#include "../moe_args.h"
#include "../moe_driver.h"
#include "../moe_plan.h"
#include "bf16_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int64_t kBf16RowChunk = 96;      // rows per epilogue chunk (multiple of 32, 6 and 4)
constexpr int64_t kBf16PadRows = 32;       // readable rows past the last pair (AMX row tiles)
constexpr int64_t kBf16PrefetchPairs = 32;  // streaming passes prefetch weight lines 2 KiB ahead
constexpr int64_t kBf16GateUpJobGroups = 4;  // prefill jobs: groups of kTileBlocks blocks (Bf16Format)
constexpr int64_t kBf16DownJobGroups = 8;

// Micro::tile<rows, blocks> for run-time rows and blocks, reading weights through `src`
// (default: the BF16 lines as stored).
template <class Micro, int M, int NB = Micro::max_blocks(M), class Src = typename Micro::Lines>
void bf16_tile_blocks(int blocks, const TileArgs<typename Micro::Act>& t, const Src& src = Src()) {
  if constexpr (NB >= 1) {
    if (blocks == NB) return Micro::template tile<M, NB>(t, src);
    bf16_tile_blocks<Micro, M, NB - 1, Src>(blocks, t, src);
  }
}

template <class Micro, int M = Micro::kMaxRows, class Src = typename Micro::Lines>
void bf16_tile_any(int rows, int blocks, const TileArgs<typename Micro::Act>& t, const Src& src = Src()) {
  if constexpr (M >= 1) {
    if (rows == M) return bf16_tile_blocks<Micro, M, Micro::max_blocks(M), Src>(blocks, t, src);
    bf16_tile_any<Micro, M - 1, Src>(rows, blocks, t, src);
  }
}

// The k block of Micro's k-blocked GEMM, in k pairs: 4 blocks x 128 pairs = 32 KiB of
// weights (L1) on AVX2; on AVX-512, 1024 pairs (256 KiB, L2) since 2026-12-02: each row
// tile starts and ends a call per k block (its accumulators loaded and stored) and the
// first streams the weights in. A C++ harness calling bf16_gemm_rows on S1's matrices (36
// token rows, weights in DRAM, Zen 5, avx512_bf16) ran 5.9-6.3 vdpbf16ps per ns with 128
// pairs, 6.6-7.0 with 512 or 1024 on one core, 4.9-6.1 against 5.5-6.4 on both cores at
// once; paired A/B in place (512 tokens, 3 rounds of 16 calls): S1 0.98, S2 0.97 of the
// time, 64 tokens 0.97-0.98. The fp32 sums go through c between k blocks in the same
// order either way: the same bits.
template <class Micro>
constexpr int64_t bf16_k_block_pairs() {
  return sizeof(typename Micro::Vec::Reg) == 64 ? 1024 : 128;
}

// The k-blocked vector GEMM: c[m][16 b0, 16 b1) (+)= a[m] x blocks [b0, b1) over k-pairs
// [p_begin, p_end), for m < rows, in groups of kTileBlocks blocks: a group's block of
// weight lines (bf16_k_block_pairs) stays in cache while every row tile reuses it.
// `accumulate` adds to c from the first k block on.
template <class Micro>
void bf16_vector_gemm(const typename Micro::Act* a, int64_t lda, int64_t rows, const uint16_t* w,
                 int64_t block_stride, int64_t p_begin, int64_t p_end, int b0, int b1, float* c,
                 int64_t ldc, bool accumulate) {
  using Act = typename Micro::Act;
  const Act* row_at[Micro::kMaxRows];
  for (int g0 = b0; g0 < b1; g0 += static_cast<int>(kTileBlocks)) {
    const int g1 = std::min(b1, g0 + static_cast<int>(kTileBlocks));
    for (int64_t p0 = p_begin; p0 < p_end; p0 += bf16_k_block_pairs<Micro>()) {
      const int64_t block_pairs = std::min(bf16_k_block_pairs<Micro>(), p_end - p0);
      // What the row tiles bring to L2 while this k block runs: the group's next k block,
      // or after its last one the next group's first (prefill jobs of several groups, so
      // only a job's first k block starts cold: 512-token BF16 0.89-0.95 of the time, FP8
      // 0.87-0.95, on Zen 5).
      const bool last = p0 + block_pairs >= p_end;
      const uint16_t* next = !last ? w + g0 * block_stride + (p0 + block_pairs) * 32
                             : g1 < b1 ? w + g1 * block_stride + p_begin * 32
                                       : nullptr;
      const int next_blocks = !last ? g1 - g0 : std::min(b1, g1 + static_cast<int>(kTileBlocks)) - g1;
      for (int64_t m0 = 0, j = 0; m0 < rows; m0 += Micro::kMaxRows, ++j) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(Micro::kMaxRows, rows - m0));
        for (int m = 0; m < tile_rows; ++m) row_at[m] = a + (m0 + m) * lda + 2 * p0;
        // The first row tile of a k block streams its weights from memory (prefetching as
        // decode does: 512-token BF16 0.90-0.93 of the time); later row tiles hit L1.
        const int64_t prefetch = m0 == 0 ? kBf16PrefetchPairs : 0;
        // Row tile j brings block j of `next` to L2, one line per step.
        const uint16_t* stream = next != nullptr && j < next_blocks && g1 - g0 <= Micro::max_blocks(tile_rows)
                                     ? next + j * block_stride
                                     : nullptr;
        for (int b = g0; b < g1; b += Micro::max_blocks(tile_rows))
          bf16_tile_any<Micro>(tile_rows, std::min(Micro::max_blocks(tile_rows), g1 - b),
                               {row_at, w + b * block_stride + p0 * 32, block_stride, block_pairs,
                                c + m0 * ldc + b * 16, ldc, accumulate || p0 > p_begin, prefetch, stream});
      }
    }
  }
}

// Micro-kernel sets with a whole-GEMM tile path (AMX) provide tile_gemm.
template <class Micro, class = void>
struct HasBf16TileGemm : std::false_type {};
template <class Micro>
struct HasBf16TileGemm<Micro, std::void_t<decltype(&Micro::tile_gemm)>> : std::true_type {};

// c[m][0, 16 * blocks) = a[m] x blocks of w over `pairs` k-pairs, for m < rows; row m
// of a starts at a + m * lda. Rows up to the next multiple of kBf16PadRows after `rows` must
// be readable (tiles may compute them; their results are discarded).
template <class Micro>
void bf16_gemm_rows(const typename Micro::Act* a, int64_t lda, int64_t rows, const uint16_t* w,
               int64_t block_stride, int64_t pairs, int blocks, float* c, int64_t ldc) {
  using Act = typename Micro::Act;
  if (rows <= Micro::kMaxRows) {  // decode: each weight line read once, all k at once
    const Act* row_at[Micro::kMaxRows];
    for (int m = 0; m < rows; ++m) row_at[m] = a + m * lda;
    const int max_blocks = Micro::max_blocks(static_cast<int>(rows));
    for (int b0 = 0; b0 < blocks; b0 += max_blocks) {
      const int nb = std::min(max_blocks, blocks - b0);
      // Past a block's last line, prefetch the next tile's (when it has as many blocks).
      typename Micro::Lines lines;
      if (blocks - b0 - nb >= nb) lines.next = NextTile{pairs, nb * block_stride * 2 - pairs * 64};
      bf16_tile_any<Micro>(static_cast<int>(rows), nb,
                           {row_at, w + b0 * block_stride, block_stride, pairs, c + b0 * 16, ldc, false,
                            kBf16PrefetchPairs},
                           lines);
    }
    return;
  }
  TileCoverage done{0, 0};
  if constexpr (HasBf16TileGemm<Micro>::value)
    done = Micro::tile_gemm(a, lda, rows, w, block_stride, pairs, blocks, c, ldc);
  if (done.pairs < pairs && done.blocks > 0)  // k tail of the tiled blocks
    bf16_vector_gemm<Micro>(a, lda, rows, w, block_stride, done.pairs, pairs, 0, done.blocks, c, ldc, true);
  if (done.blocks < blocks)  // blocks no tile covered: everything
    bf16_vector_gemm<Micro>(a, lda, rows, w, block_stride, 0, pairs, done.blocks, blocks, c, ldc, false);
}

// Rows per gate/up or down job of expert e, for the BF16 and FP8 formats. A group is
// kTileBlocks blocks (gate/up: 2 gate + 2 up, 32 intermediate rows; down: 4 blocks).
// Prefill (more than kMaxRows pairs): kBf16GateUpJobGroups / kBf16DownJobGroups groups,
// whose row tiles bring the next group's first k block to L2 as a group's last k block
// runs (bf16_vector_gemm), so only a job's first group starts cold; with a tile GEMM (AMX)
// one group, as its passes of 32 rows would re-read a larger job's weights from beyond L2,
// and it prefetches its next block pair itself. Decode: jobs as long as keep every thread
// busy over the call's decode experts, up to a prefill job's blocks, their tiles
// prefetching the next tile's first lines (bf16_gemm_rows; FP8: fp8_format.h), so fewer
// jobs start their weight streams cold. Bit-identical to one-group jobs; in one process,
// both ways interleaved call by call (Zen 5, 2026-11-27, 20-40 calls), BF16 against
// one-group jobs without the next-tile prefetch: S1 1 token 0.915-0.99 of the time on
// avx512_bf16 (the less, the higher the machine's bandwidth then), 0.98 on avx512 and
// avx2; 8 tokens 0.98, 64 tokens 0.93; S2 1 token 0.98.
template <class Micro>
class Bf16Jobs {
 public:
  Bf16Jobs(const MoePlan& plan, int64_t gate_up_blocks, int64_t down_blocks, int threads) : plan_(plan) {
    int64_t decode_experts = 0;
    for (int32_t e : plan.active_experts) decode_experts += !prefill(e);
    gate_up_decode_ = streaming_job_blocks(decode_experts * gate_up_blocks, threads, kTileBlocks,
                                           kBf16GateUpJobGroups * kTileBlocks, kTileBlocks);
    down_decode_ = streaming_job_blocks(decode_experts * down_blocks, threads, kTileBlocks,
                                        kBf16DownJobGroups * kTileBlocks, kTileBlocks);
  }

  int64_t gate_up_rows(int64_t e) const { return blocks(e, kBf16GateUpJobGroups, gate_up_decode_) / 2 * 16; }
  int64_t down_rows(int64_t e) const { return blocks(e, kBf16DownJobGroups, down_decode_) * 16; }

 private:
  bool prefill(int64_t e) const { return plan_.expert_begin[e + 1] - plan_.expert_begin[e] > Micro::kMaxRows; }
  int64_t blocks(int64_t e, int64_t prefill_groups, int64_t decode_blocks) const {
    if (!prefill(e)) return decode_blocks;
    return (HasBf16TileGemm<Micro>::value ? 1 : prefill_groups) * kTileBlocks;
  }

  const MoePlan& plan_;
  int64_t gate_up_decode_ = kTileBlocks, down_decode_ = kTileBlocks;  // blocks per decode job
};

// One packed weight matrix (gate_up or down) of every expert in the blob.
struct Bf16Matrix {
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
};

template <class Micro>
class Bf16Format {
 public:
  using Vec = typename Micro::Vec;
  using Act = typename Micro::Act;
  using Inter = Act;
  static constexpr bool kScaled = false;

  Bf16Format(const MoeArgs& args, const MoePlan& plan, int threads)
      : plan_(plan),
        dims_(args.layout.shape.hidden_size, args.layout.shape.intermediate_size),
        act_cols_(2 * dims_.hidden_pairs),
        gate_up_{args.packed + args.layout.gate_up_offset, args.layout.gate_up_expert_bytes,
                 dims_.gate_up_block_bytes(), dims_.gate_up_blocks, dims_.hidden_pairs},
        down_{args.packed + args.layout.down_offset, args.layout.down_expert_bytes, dims_.down_block_bytes(),
              dims_.down_blocks, dims_.down_pairs},
        jobs_(plan, dims_.gate_up_blocks, dims_.down_blocks, threads) {}

  int64_t token_cols() const { return act_cols_; }

  void carve(ScratchLayout& carve) {
    // Rows are pairs grouped by expert; kBf16PadRows rows follow the last pair for row tiles
    // (AMX) that run past it.
    const int64_t rows = plan_.num_pairs + kBf16PadRows;
    acts_at_ = carve.add<Act>(rows * act_cols_);               // pair rows   : [P + pad, 2 Hp]
    inter_at_ = carve.add<Act>(rows * dims_.intermediate16);   // intermediate: [P + pad, I16]
  }

  void bind(uint8_t* scratch) {
    acts_ = reinterpret_cast<Act*>(scratch + acts_at_);
    inter_ = reinterpret_cast<Act*>(scratch + inter_at_);
    if constexpr (HasBf16TileGemm<Micro>::value) {  // only row tiles read past the last pair
      const int64_t P = plan_.num_pairs;
      std::memset(acts_ + P * act_cols_, 0, kBf16PadRows * act_cols_ * sizeof(Act));
      std::memset(inter_ + P * dims_.intermediate16, 0, kBf16PadRows * dims_.intermediate16 * sizeof(Act));
    }
  }

  void prepare_token(int64_t, const float*) {}

  // Each pair's token row in the micro-kernel's element type.
  void prepare_pairs(Engine& engine, const float* tokens) {
    convert_pair_rows<Vec>(engine, plan_, tokens, act_cols_, acts_);
  }

  int64_t gate_up_job_rows(int64_t e) const { return jobs_.gate_up_rows(e); }
  int64_t down_job_rows(int64_t e) const { return jobs_.down_rows(e); }
  int64_t chunk_pairs() const { return kBf16RowChunk; }

  // Gate/up blocks 2 n0 / 16 ... are interleaved [gate 16 | up 16] per intermediate block.
  GateUpTile gate_up(int64_t e, int64_t n0, int64_t n1, int64_t p0, int64_t p1) const {
    constexpr int64_t ldc = kBf16GateUpJobGroups * kTileBlocks * 16;
    float* c = reinterpret_cast<float*>(thread_buffer(ThreadBuffer::kGateUpTile, kBf16RowChunk * ldc * sizeof(float)));
    bf16_gemm_rows<Micro>(acts_ + p0 * act_cols_, act_cols_, p1 - p0, gate_up_.block(e, 2 * n0 / 16),
                     gate_up_.block_stride(), gate_up_.pairs, static_cast<int>(2 * (n1 - n0) / 16), c, ldc);
    return {c, c + 16, ldc, 32};
  }

  Inter* intermediate_row(int64_t p) const { return inter_ + p * dims_.intermediate16; }
  bool intermediate_by_rows() const { return true; }
  void prepare_intermediate_rows(int64_t, int64_t) {}
  void finish_intermediate(Engine&) {}

  void down(int64_t e, int64_t h0, int64_t h1, int64_t p0, int64_t p1, float* out, int64_t ldo) const {
    bf16_gemm_rows<Micro>(inter_ + p0 * dims_.intermediate16, dims_.intermediate16, p1 - p0, down_.block(e, h0 / 16),
                     down_.block_stride(), down_.pairs, static_cast<int>((h1 - h0) / 16), out, ldo);
  }

  const float* down_scales() const { return nullptr; }

 private:
  const MoePlan& plan_;
  bf16_layout::Dims dims_;
  int64_t act_cols_;
  Bf16Matrix gate_up_, down_;
  Bf16Jobs<Micro> jobs_;
  size_t acts_at_ = 0, inter_at_ = 0;
  Act* acts_ = nullptr;
  Act* inter_ = nullptr;
};

}  // namespace
}  // namespace kt::cpu
