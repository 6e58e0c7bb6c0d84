// [NOTE] The INT8 / INT4 format policy of the MoE driver (moe_driver.h), instantiated per
// ISA with a set of integer operations (quant/quant_gemm.h) and, on AMX CPUs, a tile
// GEMM. Include only from a variant translation unit (variants/*.cpp), after its target
// pragma.
//
// Weights: formats/int_layout.h (MXFP4: INT4 lines of e2m1 codes, quant_gemm.h). Activations are quantized: each token's row once to int8
// (per-token scale, sums per 32 k), copied to one row per pair in expert order; int32 dot
// products are scaled to fp32 per group; the token scale multiplies gate and up before
// act(); each pair's intermediate row is quantized again (per-pair scale, applied by the
// combine). Per expert: m <= kDecodeRows tokens streams each weight line once (decode); more
// runs a k-blocked GEMM (or the tile GEMM of the micro-kernel set), with the same flushes
// per output element (quant_gemm.h), so decode and prefill agree bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../engine/engine.h"
#include "../../engine/scratch.h"
#include "../../formats/int_layout.h"
#include "../../isa/cpu_model.h"
#include "../moe_args.h"
#include "../moe_driver.h"
#include "../moe_plan.h"
#include "mxfp4_span.h"
#include "../tile_coverage.h"
#include "activation_quant.h"
#include "quant_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

static_assert(kQuantKBlock % (kMxfp4SpanGroups * 32) == 0, "MXFP4 spans start on k blocks");
// The k block of Micro's k-blocked GEMM (quant_vector_gemm): INT8's is one flush
// (QuantGemm::kInt8FlushK); on AVX-512 (one register per line) INT4's is 2048 too, MXFP4
// keeps one span per k block (mxfp4_span.h). Per k block each row tile starts and ends a
// call, and the first streams the weights in: a C++ harness calling quant_gemm_rows on
// S1's matrices (36 token rows, weights in DRAM, one core, Zen 5, 2026-12-02) ran INT4
// (groups of 128) gate/up at 5.9-6.2 vpdpbusd per ns with 512-k blocks, 6.7-6.9 with 2048,
// down (K = 768) 5.5-6.0 against 6.6-6.7.
template <class Micro>
constexpr int64_t quant_k_block() {
  if constexpr (!Micro::kInt4) return Micro::kInt8FlushK;
  else if constexpr (Micro::kMxfp4 || Micro::R != 1) return kQuantKBlock;
  else return kQuantWideKBlock;
}
constexpr int64_t kQuantRowChunk = 96;    // rows per gate/up epilogue chunk
constexpr int64_t kQuantPadRows = 32;     // readable rows past the last pair (tile GEMMs)
constexpr int64_t kQuantPrefetchLines = 32;  // decode: prefetch 2 KiB ahead
constexpr int64_t kDecodeJobBlocks = 128;    // decode: blocks per job, at most
constexpr int64_t kQuantGateUpJobGroups = 4;  // prefill jobs: groups of kTileBlocks blocks
constexpr int64_t kQuantDownJobGroups = 8;

// One packed int8/int4 matrix (gate_up or down) of every expert in the blob.
struct QuantMatrix {
  const uint8_t* first_expert;
  uint64_t expert_bytes;
  int_layout::MatrixDims dims;

  const uint8_t* block(int64_t expert, int64_t first_block) const {
    return first_expert + expert * expert_bytes + first_block * dims.block_bytes();
  }
};

template <class Micro, int M, int NB = Micro::kMaxBlocks>
void quant_tile_blocks(int blocks, const QuantTileArgs& t) {
  if constexpr (NB >= 1) {
    if (blocks == NB) return Micro::template tile<M, NB>(t);
    quant_tile_blocks<Micro, M, NB - 1>(blocks, t);
  }
}

template <class Micro, int M = Micro::kMaxRows, int NB = Micro::kMaxBlocks>
void quant_tile_any(int rows, int blocks, const QuantTileArgs& t) {
  if constexpr (M >= 1) {
    if (rows == M) return quant_tile_blocks<Micro, M, NB>(blocks, t);
    quant_tile_any<Micro, M - 1, NB>(rows, blocks, t);
  }
}

// Arguments for blocks starting at `block` over k in [k0, k0 + k).
template <class Micro>
QuantTileArgs quant_args(const int_layout::MatrixDims& dims, const uint8_t* block, int64_t k0,
                         int64_t k, float* c, int64_t ldc, bool accumulate, int64_t prefetch) {
  const bool int4 = Micro::kInt4;
  const int64_t first_group = int4 ? k0 / dims.group : 0;
  const uint8_t* scales = block + dims.scales_offset() + first_group * static_cast<int64_t>(dims.scale_row_bytes);
  const uint8_t* minimums = block + dims.minimums_offset() + first_group * int_layout::kLineBytes;
  QuantTileArgs args{nullptr,
                     nullptr,
                     block + (k0 / Micro::kKPerLine) * static_cast<int64_t>(int_layout::kLineBytes),
                     reinterpret_cast<const float*>(scales),
                     dims.minimums ? reinterpret_cast<const float*>(minimums) : nullptr,
                     static_cast<int64_t>(dims.block_bytes()),
                     k,
                     int4 ? dims.group : Micro::kInt8FlushK,
                     c,
                     ldc,
                     accumulate,
                     prefetch};
  args.integer_zeros = dims.integer_zeros;
  return args;
}

// k-blocked vector GEMM over rows [0, rows) and blocks [b0, b1), k in [k_begin, k_end), in
// groups of kTileBlocks blocks: a group's k block stays in L1 while every row tile reuses it.
// A function of its own: inlined into quant_gemm_rows beside the decode tiles, GCC's
// register allocation spilled MXFP4's 6 x 2 tile (512-token S1 MXFP4 1.01 of the old
// time instead of 0.75-0.79).
template <class Micro>
__attribute__((noinline)) void quant_vector_gemm(const QuantRows& a, int64_t rows,
                                                 const int_layout::MatrixDims& dims, const uint8_t* w,
                                                 int64_t k_begin, int64_t k_end, int b0, int b1, float* c,
                                                 int64_t ldc, bool accumulate) {
  const int8_t* row_at[Micro::kMaxRows];
  const int32_t* sums_at[Micro::kMaxRows];
  const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
  const auto line_of = [](int64_t k) { return (k / Micro::kKPerLine) * static_cast<int64_t>(int_layout::kLineBytes); };
  for (int g0 = b0; g0 < b1; g0 += kTileBlocks) {
    const int g1 = std::min(b1, g0 + kTileBlocks);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += quant_k_block<Micro>()) {
      const int64_t k = std::min(quant_k_block<Micro>(), k_end - k0);
      // Row tile j brings block j of the group's next k block (after its last, of the next
      // group's first) to L2, one line per line step, and prefill jobs hold several groups
      // (QuantFormat), so only a job's first k block starts cold (Zen 5, avx512_bf16,
      // 512 tokens, against kTileBlocks-block jobs streaming within a group and INT8 only:
      // INT8 0.90-0.92 of the time, MXFP4 0.92, INT4 0.97-0.99).
      const bool last = k0 + k >= k_end;
      const uint8_t* next = !last ? w + g0 * block_bytes + line_of(k0 + k)
                            : g1 < b1 ? w + g1 * block_bytes + line_of(k_begin)
                                      : nullptr;
      const int next_blocks = !last ? g1 - g0 : std::min(b1, g1 + kTileBlocks) - g1;
      for (int64_t m0 = 0; m0 < rows; m0 += Micro::kMaxRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(Micro::kMaxRows, rows - m0));
        for (int m = 0; m < tile_rows; ++m) {
          row_at[m] = a.levels + (m0 + m) * a.stride + k0;
          sums_at[m] = a.sums + (m0 + m) * a.sums_stride + k0 / int_layout::kKAlign;
        }
        const int64_t j = m0 / Micro::kMaxRows;
        const bool stream = next != nullptr && j < next_blocks;
        for (int b = g0; b < g1; b += Micro::kMaxBlocks) {
          // The first row tile of a k block streams its weights from memory; later ones hit L1.
          QuantTileArgs t = quant_args<Micro>(dims, w + b * block_bytes, k0, k, c + m0 * ldc + b * 16,
                                              ldc, accumulate || k0 > k_begin, m0 == 0 ? kQuantPrefetchLines : 0);
          if (stream && b == g0) t.stream = next + j * block_bytes;  // one tile per row tile
          t.a = row_at;
          t.a_sums = sums_at;
          quant_tile_any<Micro>(tile_rows, std::min(Micro::kMaxBlocks, g1 - b), t);
        }
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
  if (rows <= Micro::kDecodeRows) {  // decode: each weight line read once, all k at once
    const int8_t* row_at[Micro::kDecodeRows];
    const int32_t* sums_at[Micro::kDecodeRows];
    for (int m = 0; m < rows; ++m) {
      row_at[m] = a.levels + m * a.stride;
      sums_at[m] = a.sums + m * a.sums_stride;
    }
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    // One token streams all of the job's blocks at once (more streams in flight: 1-token
    // S1 int4 from 17.9 to 19.7 GB/s, int8 23.6 to 25.2); more rows need the registers for their sums.
    const int max_blocks = rows == 1 ? kTileBlocks : Micro::kDecodeBlocks;
    // Where the next tile's stream (below) lands in L1 itself, the tile's own lines `prefetch`
    // ahead are there already and the prefetch_ahead requests only duplicate it: CPUs whose
    // PREFETCHT1 fills L1 (AMD before Zen 4, isa/cpu_model.h) stream without them. Paired
    // A/B on a 2-core Zen 3 (avx2, scripts/ab_pair.py, a run-time switch in one build, 2
    // rounds of 12 calls, 2026-12-07; the same bits), 1 / 8 tokens: S1 AMXINT4 0.85 / 0.94
    // of the time, S1 RAWINT4 0.86 / 0.97, S1 MXFP4 0.88 / 0.93, S1 AMXINT8 0.93 / 0.95,
    // S2 GPTQ_INT4 0.87 / 0.91, S2 AWQ_INT4 0.93 / 0.96. Keeping them in a job's first tile
    // (which nothing streams) measured 0.98-1.24 / 0.96-1.04 of the time without any.
    constexpr bool kStreamNextTile = Micro::R == 2 || Micro::kInt4;
    const int64_t prefetch = kStreamNextTile && prefetch_l2_fills_l1() ? 0 : kQuantPrefetchLines;
    for (int b0 = 0; b0 < blocks; b0 += max_blocks) {
      QuantTileArgs t = quant_args<Micro>(dims, w + b0 * block_bytes, 0, K, c + b0 * 16, ldc, false, prefetch);
      t.a = row_at;
      t.a_sums = sums_at;
      const int next_blocks = std::min(max_blocks, blocks - b0 - max_blocks);  // <= 0: last tile
      if (next_blocks > 0) t.next_tile = w + (b0 + max_blocks) * block_bytes;
      // All of the job's next tile of blocks comes to L2 while this one runs: its streams start
      // warm (Zen 3, a C++ harness of S1's 1-token down jobs of 16 blocks: 24 -> 30 GB/s,
      // a plain reader of the same bytes 31). With AVX2-width registers for every kind;
      // with AVX-512's only for the 4-bit kinds. Zen 5 (avx512_bf16, paired A/B without
      // them, 30-40 calls, 2026-11-26, when AVX-512's prefetch_ahead still went to L1):
      // 1 and 8 tokens AMXINT8 0.84-0.91 of the time, AMXINT4 / GPTQ_INT4 0.88-0.96,
      // RAWINT4 / MXFP4 0.95-1.01 without them; forced to avx_vnni, AMXINT8 0.86-0.90 but
      // AMXINT4 0.93-1.10, so kept there. Zen 4 (avx512_bf16, prefetch_ahead to L2,
      // scripts/ab_pair.py with a run-time switch, 2 rounds of 12 calls, 2026-12-04), with
      // them: 1 / 8 / 64 tokens S1 AMXINT4 0.96 / 0.87 / 0.90, S1 MXFP4 0.89 / 0.90 / 0.87,
      // S2 GPTQ_INT4 0.97 / 0.93 / 0.94, S1 RAWINT4 1.01 / 0.97; but S1 AMXINT8 1.04 / 1.04
      // and S2 AMXINT8 1.00-1.45, so int8 streams its own tile alone. Zen 5 and the Intel
      // Xeons were not measured with the 4-bit kinds' streams on AVX-512.
      if (kStreamNextTile && next_blocks > 0) {
        t.stream = t.next_tile;
        t.stream_blocks = next_blocks;
        t.stream_scales = true;
      }
      if (rows == 1)
        quant_tile_blocks<Micro, 1, kTileBlocks>(std::min(max_blocks, blocks - b0), t);
      else
        quant_tile_any<Micro, Micro::kDecodeRows, Micro::kDecodeBlocks>(static_cast<int>(rows),
                                                                        std::min(max_blocks, blocks - b0), t);
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


template <class Micro>
class QuantFormat {
 public:
  using Vec = typename Micro::Vec;
  using Inter = float;
  static constexpr bool kScaled = true;

  QuantFormat(const MoeArgs& args, const MoePlan& plan, int threads)
      : plan_(plan),
        dims_(args.layout.shape),
        tokens_(args.tokens),
        act_cols_(dims_.gate_up.padded_k),
        act_sums_(act_cols_ / int_layout::kKAlign),
        inter_cols_(dims_.down.padded_k),
        inter_sums_(inter_cols_ / int_layout::kKAlign),
        gate_up_{args.packed + args.layout.gate_up_offset, args.layout.gate_up_expert_bytes, dims_.gate_up},
        down_{args.packed + args.layout.down_offset, args.layout.down_expert_bytes, dims_.down} {
    // Experts of at most kDecodeRows pairs stream their weights once (decode): longer jobs,
    // whose tiles prefetch the next ones (quant_gemm_rows), as many as keep every thread
    // busy; experts of more pairs run jobs of kQuantGateUpJobGroups / kQuantDownJobGroups
    // groups of kTileBlocks blocks (quant_vector_gemm).
    int64_t decode_experts = 0;
    for (int32_t e : plan.active_experts) decode_experts += pairs(e) <= Micro::kDecodeRows;
    gate_up_decode_blocks_ = streaming_job_blocks(decode_experts * dims_.gate_up.blocks, threads, kTileBlocks,
                                                  kDecodeJobBlocks, kTileBlocks);
    down_decode_blocks_ = streaming_job_blocks(decode_experts * dims_.down.blocks, threads, kTileBlocks,
                                               kDecodeJobBlocks, kTileBlocks);
  }

  int64_t token_cols() const { return act_cols_; }

  void carve(ScratchLayout& carve) {
    const int64_t T = tokens_, P = plan_.num_pairs, Pp = P + kQuantPadRows;
    at_[0] = carve.add<int8_t>(T * act_cols_);              // tokens (int8) : [T, Hk]
    at_[1] = carve.add<int32_t>(T * act_sums_);             // token sums    : [T, Hk/32]
    at_[2] = carve.add<float>(T);                           // token scales  : [T]
    at_[3] = carve.add<int8_t>(Pp * act_cols_);             // pair rows     : [P+pad, Hk]
    at_[4] = carve.add<int32_t>(Pp * act_sums_);            // pair sums     : [P+pad, Hk/32]
    at_[5] = carve.add<float>(P * dims_.intermediate16);    // intermediate  : [P, I16] fp32
    at_[6] = carve.add<int8_t>(Pp * inter_cols_);           //   int8        : [P+pad, Ik]
    at_[7] = carve.add<int32_t>(Pp * inter_sums_);          //   sums        : [P+pad, Ik/32]
    at_[8] = carve.add<float>(P);                           //   scales      : [P]
  }

  void bind(uint8_t* scratch) {
    token_q_ = reinterpret_cast<int8_t*>(scratch + at_[0]);
    token_sums_ = reinterpret_cast<int32_t*>(scratch + at_[1]);
    token_scale_ = reinterpret_cast<float*>(scratch + at_[2]);
    acts_ = reinterpret_cast<int8_t*>(scratch + at_[3]);
    act_sums_p_ = reinterpret_cast<int32_t*>(scratch + at_[4]);
    inter_f_ = reinterpret_cast<float*>(scratch + at_[5]);
    inter_q_ = reinterpret_cast<int8_t*>(scratch + at_[6]);
    inter_sums_p_ = reinterpret_cast<int32_t*>(scratch + at_[7]);
    inter_scale_ = reinterpret_cast<float*>(scratch + at_[8]);
    if constexpr (HasQuantTileGemm<Micro>::value) {  // only row tiles read past the last pair
      const int64_t P = plan_.num_pairs;
      std::memset(acts_ + P * act_cols_, 0, kQuantPadRows * act_cols_);
      std::memset(act_sums_p_ + P * act_sums_, 0, kQuantPadRows * act_sums_ * sizeof(int32_t));
      std::memset(inter_q_ + P * inter_cols_, 0, kQuantPadRows * inter_cols_);
      std::memset(inter_sums_p_ + P * inter_sums_, 0, kQuantPadRows * inter_sums_ * sizeof(int32_t));
    }
  }

  void prepare_token(int64_t t, const float* x) {
    token_scale_[t] = quantize_activation_row<Vec>(x, dims_.hidden, act_cols_, token_q_ + t * act_cols_,
                                                   token_sums_ + t * act_sums_);
  }

  void prepare_pairs(Engine& engine, const float*) {
    const int64_t P = plan_.num_pairs;
    engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
      for (int64_t p = job * kRowsPerJob; p < std::min(P, (job + 1) * kRowsPerJob); ++p) {
        const int64_t t = plan_.pair_token[p];
        std::memcpy(acts_ + p * act_cols_, token_q_ + t * act_cols_, act_cols_);
        std::memcpy(act_sums_p_ + p * act_sums_, token_sums_ + t * act_sums_, act_sums_ * sizeof(int32_t));
      }
    });
  }

  // Decode jobs: up to kDecodeJobBlocks blocks (above). Prefill jobs: kQuantGateUpJobGroups
  // groups of kTileBlocks blocks (2 gate + 2 up each: 32 intermediate rows), and
  // kQuantDownJobGroups of 4 down blocks; one group with a tile GEMM (AMX), whose passes
  // of 32 rows would re-read a larger job's weights from beyond L2.
  int64_t gate_up_job_rows(int64_t e) const {
    if (pairs(e) <= Micro::kDecodeRows) return gate_up_decode_blocks_ / 2 * 16;
    return prefill_groups(kQuantGateUpJobGroups) * kTileBlocks / 2 * 16;
  }
  int64_t down_job_rows(int64_t e) const {
    if (pairs(e) <= Micro::kDecodeRows) return down_decode_blocks_ * 16;
    return prefill_groups(kQuantDownJobGroups) * kTileBlocks * 16;
  }
  int64_t chunk_pairs() const { return kQuantRowChunk; }

  // Gate/up blocks 2 n0 / 16 ... are interleaved [gate 16 | up 16] per intermediate block.
  GateUpTile gate_up(int64_t e, int64_t n0, int64_t n1, int64_t p0, int64_t p1) const {
    // A chunk of pairs times a prefill job's blocks, or a decode job's rows times its blocks.
    constexpr size_t kTileFloats =
        std::max(kQuantRowChunk * kQuantGateUpJobGroups * kTileBlocks, Micro::kDecodeRows * kDecodeJobBlocks) * 16;
    float* c = reinterpret_cast<float*>(thread_buffer(ThreadBuffer::kGateUpTile, kTileFloats * sizeof(float)));
    const int64_t ldc = 2 * (n1 - n0);  // the job's gate and up blocks
    const QuantRows rows{acts_ + p0 * act_cols_, act_cols_, act_sums_p_ + p0 * act_sums_, act_sums_};
    quant_gemm_rows<Micro>(rows, p1 - p0, dims_.gate_up, gate_up_.block(e, 2 * n0 / 16),
                           static_cast<int>(2 * (n1 - n0) / 16), c, ldc);
    return {c, c + 16, ldc, 32};
  }

  float gate_up_scale(int64_t p) const { return token_scale_[plan_.pair_token[p]]; }
  Inter* intermediate_row(int64_t p) const { return inter_f_ + p * dims_.intermediate16; }

  // Each pair's intermediate row to int8 (its scale goes to the combine).
  bool intermediate_by_rows() const { return true; }
  void prepare_intermediate_rows(int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      inter_scale_[p] = quantize_activation_row<Vec>(intermediate_row(p), dims_.intermediate, inter_cols_,
                                                     inter_q_ + p * inter_cols_, inter_sums_p_ + p * inter_sums_);
  }
  void finish_intermediate(Engine&) {}

  void down(int64_t e, int64_t h0, int64_t h1, int64_t p0, int64_t p1, float* out, int64_t ldo) const {
    const QuantRows rows{inter_q_ + p0 * inter_cols_, inter_cols_, inter_sums_p_ + p0 * inter_sums_, inter_sums_};
    quant_gemm_rows<Micro>(rows, p1 - p0, dims_.down, down_.block(e, h0 / 16), static_cast<int>((h1 - h0) / 16),
                           out, ldo);
  }

  const float* down_scales() const { return inter_scale_; }

 private:
  const MoePlan& plan_;
  int_layout::Dims dims_;
  int64_t tokens_, act_cols_, act_sums_, inter_cols_, inter_sums_;
  QuantMatrix gate_up_, down_;
  int64_t gate_up_decode_blocks_ = kTileBlocks, down_decode_blocks_ = kTileBlocks;  // per decode job
  int64_t pairs(int64_t e) const { return plan_.expert_begin[e + 1] - plan_.expert_begin[e]; }
  static constexpr int64_t prefill_groups(int64_t groups) { return HasQuantTileGemm<Micro>::value ? 1 : groups; }
  size_t at_[9] = {};
  int8_t* token_q_ = nullptr;
  int32_t* token_sums_ = nullptr;
  float* token_scale_ = nullptr;
  int8_t* acts_ = nullptr;
  int32_t* act_sums_p_ = nullptr;
  float* inter_f_ = nullptr;
  int8_t* inter_q_ = nullptr;
  int32_t* inter_sums_p_ = nullptr;
  float* inter_scale_ = nullptr;
};

}  // namespace
}  // namespace kt::cpu
