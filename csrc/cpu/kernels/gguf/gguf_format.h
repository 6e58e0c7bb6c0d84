// [NOTE] The GGUF format policy of the MoE driver (moe_driver.h): weights used in place,
// as GGUF stores them (row-major [E, rows, K] blocks, a ggml type per matrix),
// instantiated per ISA with a set of integer operations and, on amx, a tile unit.
// Include only from a variant translation unit (variants/*.cpp), after its target pragma.
//   tokens:        each token quantized once per distinct activation format gate and up
//                  need (8-bit blocks of 32 or 256; gguf_act.h); fp32 for float types.
//   gate + up:     jobs (expert, up to 1024 rows): the rows are dotted with every token
//                  routed to the expert (gguf_rows.h) into fp32 gate and up rows [P, Ip];
//                  act() is written over the gate rows (the intermediate). The types
//                  gguf_types.h's gguf_in_place names (every quantized type on AVX-512;
//                  all but Q5_0 and Q5_1 on AVX2 / AVX-VNNI) are read
//                  from their bytes for any number of tokens (each unit of 4 rows extracted
//                  once per 4 tokens, 2 for AVX2's block-32 types); on AVX-512, the rows
//                  of an expert with kKquantTileMinPairs or more tokens are repacked once
//                  and dotted on an integer tile instead (same bits: K-quants
//                  gguf_kquant_tile_avx512.h, block-32 types gguf_block32_tile_avx512.h);
//                  the float types are decoded once per job and
//                  dotted with every token.
//   intermediate:  zero past I, quantized for down's format.
//   down:          jobs (expert, up to 256 hidden rows), same micro-kernels.
// With a tile unit (Tile = GgufAmx, amx variant), calls of a layer with a float-type
// matrix (F32 / F16 / BF16) averaging kGgufTileMinPairs or more tokens per expert
// (prefill) decode each job's rows to bf16 once and multiply them on AMX tiles
// (gguf_amx.h) instead: the token rows and intermediate rows are packed per expert as
// bf16 B chunks and no activation is quantized. That path rounds activations to bf16, so
// on amx such a prefill call does not match a decode call bit for bit (docs/formats.md);
// every other path is batch-invariant. Layers of quantized types only keep the integer
// tiles above: on a 2-core Xeon with AMX (2026-11-28, in one process, the two paths
// alternating call by call) the bf16 AMX tiles took 1.06-1.83x their time at 512 tokens
// (S1 Q4_0 1.52x, Q4_1 1.68x, Q5_K 1.69x, Q8_0 1.40x, Q4_K 1.06x, Q6_K 1.10x, Q3_K 1.83x,
// MXFP4 1.65x; S2 1.07-1.32x) and 1.8-2.3x at 128 tokens (S1 Q4_0, Q4_K, Q6_K), while F16 /
// BF16 layers ran 2.7x / 2.4x faster on them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../engine/engine.h"
#include "../../engine/scratch.h"
#include "../../formats/gguf_types.h"
#include "../moe_args.h"
#include "../moe_driver.h"
#include "../moe_plan.h"
#include "gguf_act.h"
#include "gguf_rows.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// The Tile parameter of variants without a tile unit.
struct GgufNoTile {
  static constexpr bool kEnabled = false;
  static constexpr int64_t kChunk = 0;
};

template <class Ops, class Tile = GgufNoTile>
class GgufFormat {
 public:
  using Vec = typename Ops::Vec;
  using Inter = float;
  static constexpr bool kScaled = false;
  // The variant has the AVX-512 in-place kernels (one register per 64-byte line; AVX2
  // has its block-32 kernel: gguf_types.h's gguf_in_place). They serve their types for every number of
  // tokens, so a matrix's activation format follows its type and the variant, never the call.
  static constexpr bool kInPlace = Ops::kRegsPerLine == 1;

  GgufFormat(const MoeArgs& args, const MoePlan& plan, int threads)
      : plan_(plan),
        tokens_(args.tokens),
        hidden_(args.layout.shape.hidden_size),
        intermediate_(args.layout.shape.intermediate_size),
        gate_(args.packed, args.layout, kGgufGate, intermediate_, hidden_, kInPlace),
        up_(args.packed, args.layout, kGgufUp, intermediate_, hidden_, kInPlace),
        down_(args.packed, args.layout, kGgufDown, hidden_, intermediate_, kInPlace) {
    const int64_t active = static_cast<int64_t>(plan.active_experts.size());
    if constexpr (Tile::kEnabled)
      tile_ = (gate_.is_float || up_.is_float || down_.is_float) &&
              plan.num_pairs >= kGgufTileMinPairs * active;
    gate_up_rows_ = tile_ ? kGgufJobRows : streaming_job_rows(active * intermediate_, threads);
    down_rows_ = tile_ ? kGgufJobRows : streaming_job_rows(active * hidden_, threads);
    gate_block_ = tile_ ? 0 : gate_.act_block();
    up_block_ = tile_ ? 0 : up_.act_block();
    down_block_ = tile_ ? 0 : down_.act_block();
    shared_ = gate_block_ == up_block_;
    // Tile path only (prefill, where these allocations are noise): each expert's pairs
    // in B chunks, chunk_at_[e] first. Decode calls allocate nothing here.
    if constexpr (Tile::kEnabled) {
      if (tile_) {
        chunk_at_.assign(args.layout.shape.num_experts, 0);
        for (int32_t e : plan.active_experts) {
          chunk_at_[e] = static_cast<int64_t>(chunks_.size());
          for (int64_t c = 0; c < ceil_div(plan.expert_begin[e + 1] - plan.expert_begin[e], Tile::kChunk); ++c)
            chunks_.push_back({e, static_cast<int32_t>(c)});
        }
      }
    }
  }

  int64_t token_cols() const { return gate_.kp; }

  void carve(ScratchLayout& carve) {
    const int64_t P = plan_.num_pairs, Hp = gate_.kp, Ip = down_.kp;
    carve_acts(carve, gate_block_, tokens_, Hp, gate_at_);                // tokens for gate (and up)
    carve_acts(carve, shared_ ? 0 : up_block_, tokens_, Hp, up_at_);      // tokens for up
    gate_f_at_ = carve.add<float>(P * Ip);                                // gate, then the intermediate: [P, Ip]
    up_f_at_ = carve.add<float>(P * Ip);                                  // up: [P, Ip]
    carve_acts(carve, down_block_, P, Ip, down_at_);                      // intermediate for down
    const int64_t chunk_rows = static_cast<int64_t>(chunks_.size()) * Tile::kChunk;
    b_up_at_ = carve.add<uint16_t>(chunk_rows * Hp);                      // tile path: tokens as B chunks
    b_down_at_ = carve.add<uint16_t>(chunk_rows * Ip);                    //            intermediate as B chunks
  }

  void bind(uint8_t* scratch) {
    gate_f_ = reinterpret_cast<float*>(scratch + gate_f_at_);
    up_f_ = reinterpret_cast<float*>(scratch + up_f_at_);
    b_up_ = reinterpret_cast<uint16_t*>(scratch + b_up_at_);
    b_down_ = reinterpret_cast<uint16_t*>(scratch + b_down_at_);
    gate_acts_ = bind_acts(scratch, gate_block_, gate_.kp, gate_at_);
    up_acts_ = shared_ ? gate_acts_ : bind_acts(scratch, up_block_, up_.kp, up_at_);
    down_acts_ = bind_acts(scratch, down_block_, down_.kp, down_at_);
    down_acts_.f = gate_f_;
  }

  void prepare_token(int64_t t, const float* x) {
    if (gate_block_ != 0) gguf_quantize_act_row<Vec>(x, gate_acts_, t);
    if (!shared_ && up_block_ != 0) gguf_quantize_act_row<Vec>(x, up_acts_, t);
  }

  void prepare_pairs(Engine& engine, const float* tokens) {
    gate_acts_.f = up_acts_.f = tokens;  // float weight types dot the fp32 token rows
    if (tile_) pack_chunks(engine, tokens, true, gate_.kp, b_up_);
  }

  int64_t gate_up_job_rows(int64_t /*expert*/) const { return gate_up_rows_; }
  int64_t down_job_rows(int64_t /*expert*/) const { return down_rows_; }
  // All of an expert's pairs at once: each row is decoded (or read) once per job.
  int64_t chunk_pairs() const { return std::numeric_limits<int32_t>::max(); }

  GateUpTile gate_up(int64_t e, int64_t n0, int64_t n1, int64_t p0, int64_t p1) const {
    const int64_t Ip = down_.kp, rows_end = std::min(n1, intermediate_);
    if constexpr (Tile::kEnabled) {
      if (tile_) {
        gguf_tile_rows<Tile, Vec>({{&gate_, n0, rows_end, gate_f_ + p0 * Ip}, {&up_, n0, rows_end, up_f_ + p0 * Ip}},
                                  e, b_up_ + chunk_at_[e] * Tile::kChunk * gate_.kp, p1 - p0, Ip);
        return {gate_f_ + p0 * Ip + n0, up_f_ + p0 * Ip + n0, Ip, 16};
      }
    }
    const int32_t* pair_token = plan_.pair_token.data();
    gguf_rows<Ops>(gate_, e, n0, rows_end, gate_acts_, pair_token, p0, p1, gate_f_, Ip);
    gguf_rows<Ops>(up_, e, n0, rows_end, up_acts_, pair_token, p0, p1, up_f_, Ip);
    return {gate_f_ + p0 * Ip + n0, up_f_ + p0 * Ip + n0, Ip, 16};
  }

  // act() overwrites the gate rows (read before written, element by element).
  Inter* intermediate_row(int64_t p) const { return gate_f_ + p * down_.kp; }

  // Zero past I (act() of rows past I wrote there), quantized for down or packed as B chunks.
  // The tile path packs all pairs' rows at once (finish_intermediate). The decode path
  // could prepare them expert by expert too, but in one region (moe_driver.h) S2 Q4_K
  // (down Q5_0) took 1.02-1.04x the time at 1 and 8 tokens on a 2-core Zen 3 (avx2,
  // scripts/ab_pair.py both ways, 2 + 3 rounds of 12 calls, 2026-12-07; S1 Q4_K 0.97-1.01),
  // cause not found: GGUF keeps the phases.
  bool intermediate_by_rows() const { return false; }
  void prepare_intermediate_rows(int64_t p0, int64_t p1) {
    const int64_t Ip = down_.kp;
    for (int64_t p = p0; p < p1; ++p) {
      std::fill(gate_f_ + p * Ip + intermediate_, gate_f_ + (p + 1) * Ip, 0.0f);
      if (down_block_ != 0) gguf_quantize_act_row<Vec>(gate_f_ + p * Ip, down_acts_, p);
    }
  }
  void finish_intermediate(Engine& engine) {
    if (tile_) pack_chunks(engine, gate_f_, false, down_.kp, b_down_);
  }

  void down(int64_t e, int64_t h0, int64_t h1, int64_t p0, int64_t p1, float* out, int64_t ldo) const {
    const int64_t rows_end = std::min(h1, hidden_);
    if constexpr (Tile::kEnabled) {
      if (tile_) {
        // gguf_tile_rows writes row n of pair p at out[(p - p0) * ldo + n].
        gguf_tile_rows<Tile, Vec>({{&down_, h0, rows_end, out - h0}}, e,
                                  b_down_ + chunk_at_[e] * Tile::kChunk * down_.kp, p1 - p0, ldo);
        return;
      }
    }
    gguf_rows<Ops>(down_, e, h0, rows_end, down_acts_, nullptr, p0, p1, out - p0 * ldo - h0, ldo);
  }

  const float* down_scales() const { return nullptr; }

 private:
  // Activation buffers of one format: levels, scales per 4, scaled sums per 16, bias per
  // 4, int16 level sums (the direct Q4_K / Q6_K formats), the blocks' minimum sums (the
  // block-32 quad format); nothing for fp32 (block 0).
  static void carve_acts(ScratchLayout& carve, int block, int64_t rows, int64_t kp, size_t at[6]) {
    const int64_t n = block == 0 ? 0 : rows;
    at[0] = carve.add<int8_t>(n * kp);
    at[1] = carve.add<float>(n * kp / 4);
    at[2] = carve.add<float>(n * kp / 16);
    at[3] = carve.add<int32_t>(n * kp / 4);
    at[4] = carve.add<int16_t>(block == kGgufQ4kActs || block == kGgufQ6kActs ? n * kp / 16 : 0);
    at[5] = carve.add<float>(block == kGgufQuad32Acts ? n * kp / 4 : 0);
  }

  static GgufActs bind_acts(uint8_t* scratch, int block, int64_t kp, const size_t at[6]) {
    GgufActs acts;
    acts.kp = kp;
    acts.block = block == kGgufQ4kActs || block == kGgufQ6kActs ? kGgufSuper : block == kGgufQuad32Acts ? 32 : block;
    acts.quad32 = block == kGgufQuad32Acts;
    acts.q4k_order = block == kGgufQ4kActs;
    acts.sums_of_16 = block == kGgufQ6kActs;
    acts.level_sums = reinterpret_cast<int16_t*>(scratch + at[4]);
    acts.q = reinterpret_cast<int8_t*>(scratch + at[0]);
    acts.scale = reinterpret_cast<float*>(scratch + at[1]);
    acts.sum16 = reinterpret_cast<float*>(scratch + at[2]);
    acts.bias4 = reinterpret_cast<int32_t*>(scratch + at[3]);
    acts.block_min_sums = reinterpret_cast<float*>(scratch + at[5]);
    return acts;
  }

  // Tile path: row r(p) of `rows` (stride kp, fp32) -> each expert's B chunks, for every
  // pair p (r = its token, or p itself).
  void pack_chunks(Engine& engine, const float* rows, bool by_token, int64_t kp, uint16_t* b) const {
    if constexpr (Tile::kEnabled)
      engine.parallel_for(static_cast<int64_t>(chunks_.size()), [&](int64_t job) {
        const ExpertTile c = chunks_[job];
        const int64_t p0 = plan_.expert_begin[c.expert] + c.first_block * Tile::kChunk;
        const int64_t n = std::min(Tile::kChunk, plan_.expert_begin[c.expert + 1] - p0);
        uint16_t* chunk = b + job * Tile::kChunk * kp;
        if (n < Tile::kChunk) std::fill(chunk, chunk + Tile::kChunk * kp, uint16_t{0});
        for (int64_t i = 0; i < n; ++i)
          Tile::pack_column(rows + (by_token ? plan_.pair_token[p0 + i] : p0 + i) * kp, kp, chunk, i);
      });
  }

  const MoePlan& plan_;
  int64_t tokens_, hidden_, intermediate_;
  GgufMatrix gate_, up_, down_;
  bool tile_ = false, shared_ = false;
  int gate_block_ = 0, up_block_ = 0, down_block_ = 0;
  int64_t gate_up_rows_ = 0, down_rows_ = 0;
  // Tile path: (expert, chunk within it) per B chunk; an expert's first chunk.
  std::vector<ExpertTile> chunks_;
  std::vector<int64_t> chunk_at_;
  size_t gate_at_[6] = {}, up_at_[6] = {}, down_at_[6] = {};
  size_t gate_f_at_ = 0, up_f_at_ = 0, b_up_at_ = 0, b_down_at_ = 0;
  float* gate_f_ = nullptr;
  float* up_f_ = nullptr;
  uint16_t* b_up_ = nullptr;
  uint16_t* b_down_ = nullptr;
  GgufActs gate_acts_, up_acts_, down_acts_;
};

}  // namespace
}  // namespace kt::cpu
