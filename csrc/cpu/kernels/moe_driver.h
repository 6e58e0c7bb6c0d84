// [NOTE] The MoE forward, written once for every format and CPU variant. Include only
// from a variant translation unit (variants/*.cpp), after its target pragma.
//
// For every token t: out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t), up_e(x_t))),
// e = ids[t, j], slots with e = -1 skipped. The (token, slot) pairs are grouped by expert
// (moe_plan.h), so each expert's weights are read once for all of its tokens. Phases,
// each a parallel_for on the Engine:
//   1. tokens:       each token's row to fp32 once (zero past H), then the format
//                    prepares it (quantizes it, ...) and its pair rows.
//   2. gate+up:      jobs (expert, kind of rows of the intermediate dimension): the format
//                    computes gate and up for the expert's pairs in chunks; the activation
//                    (act(g, u) of the blob's GluSpec, glu.h, after the format's per-pair
//                    scale and the expert's gate/up biases) goes to the format's
//                    intermediate rows. Training (moe_args.h): gate_up_add is added
//                    to g and u first, gate_up_out receives them (slot-order rows).
//   2b.              the format prepares the intermediate rows for down (quantize, pad).
//   3. down:         jobs (expert, rows of the hidden dimension) -> fp32 [P, H16]; with
//                    biases, each row is scaled (format's down scale) and biased here.
//                    Where the format prepares rows one by one (intermediate_by_rows),
//                    2, 2b and 3 are one parallel region: an expert's down jobs wait for
//                    its own gate/up jobs only (expert_readiness.h), not for every
//                    expert's, so no thread idles at a barrier between the phases.
//   4. combine:      out[t] = sum_j w[t, j] * down_scale[p] * down_out[p], p = pair(t, j).
// A format policy (bf16/bf16_format.h, quant/quant_format.h, gguf/gguf_format.h) says how
// its weights are stored and multiplied on one CPU variant:
//
//   struct Format {
//     using Vec = ...;                       // fp32 vector ops (isa/vec_*.h)
//     using Inter = ...;                     // element of the intermediate rows
//     static constexpr bool kScaled;         // gate/up results and down results are
//                                            // scaled per pair (quantized activations;
//                                            // FP8 on AVX2: normalized ones)
//     Format(const MoeArgs&, const MoePlan&, int threads);
//     int64_t token_cols() const;            // fp32 columns of a token row (>= H)
//     int64_t intermediate_cols() const;     // columns of an intermediate row (>= I16)
//     void carve(ScratchLayout&);  void bind(uint8_t* scratch);
//     void prepare_token(int64_t t, const float* x);     // phase 1, once per token
//     void prepare_pairs(Engine&, const float* tokens);   // phase 1, pair rows
//     int64_t gate_up_job_rows(int64_t e) const;  // rows per job of expert e: multiples of 16
//     int64_t down_job_rows(int64_t e) const;
//     int64_t chunk_pairs() const;           // pairs per gate_up call
//     GateUpTile gate_up(e, n0, n1, p0, p1); // rows [n0, n1) of gate and up, pairs [p0, p1)
//     float gate_up_scale(int64_t p) const;  // kScaled only: applied before act()
//     Inter* intermediate_row(int64_t p);
//     bool intermediate_by_rows() const;     // phase 2b is prepare_intermediate_rows alone
//     void prepare_intermediate_rows(p0, p1);  // phase 2b, pairs [p0, p1)
//     void finish_intermediate(Engine&);     // phase 2b, after all rows (!intermediate_by_rows)
//     void down(e, h0, h1, p0, p1, float* out, int64_t ldo);  // out[(p - p0) ldo + h - h0]
//     const float* down_scales() const;      // [P] for the combine; nullptr: 1
//   };
//
// Batch invariance: a pair's result depends only on its token, its expert and the
// weights. Formats keep one accumulation order per output element whatever the number
// of rows per tile, the path (decode streams weights once for a few tokens, prefill
// runs a k-blocked or tile GEMM) and the job split; the skeleton computes every row the
// same way (phases 1, 2b and 4 are per row; the activation is elementwise).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../engine/engine.h"
#include "../engine/scratch.h"
#include "../isa/vec_math.h"
#include "expert_readiness.h"
#include "glu.h"
#include "moe_args.h"
#include "moe_driver_common.h"
#include "moe_plan.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// The gate and up values a format computed for a chunk of pairs: for pair row m and
// intermediate row n0 + 16 s + i (i < 16), gate[m * ld + s * segment + i] (up likewise).
struct GateUpTile {
  const float* gate;
  const float* up;
  int64_t ld;
  int64_t segment;
};

template <class Format>
void moe_forward(const MoeArgs& args) {
  using V = typename Format::Vec;
  constexpr int W = V::kWidth;
  const int64_t E = args.layout.shape.num_experts, H = args.layout.shape.hidden_size,
                I = args.layout.shape.intermediate_size, T = args.tokens, K = args.top_k;
  const int64_t I16 = round_up16(I), H16 = round_up16(H);
  const Glu<V> glu(args.layout.shape.glu);
  const GluBiases biases(args.layout, args.packed);

  // Per calling thread, reused across calls. Bound to references so the lambdas below
  // (run on helper threads) capture the caller's objects, not their own thread_locals.
  thread_local MoePlan thread_plan;
  thread_local std::vector<ExpertTile> thread_tiles, thread_down_tiles;
  thread_local ExpertReadiness thread_readiness;
  MoePlan& plan = thread_plan;
  std::vector<ExpertTile>& tiles = thread_tiles;
  std::vector<ExpertTile>& down_tiles = thread_down_tiles;
  plan.build(args.topk_ids, args.topk_ids_int64, T, K, E);
  const int64_t P = plan.num_pairs;
  Engine& engine = Engine::instance();
  Format format(args, plan, engine.num_threads());
  const int64_t x_cols = format.token_cols();

  ScratchLayout carve;
  const size_t x_at = carve.add<float>(T * x_cols);         // 1. tokens   : [T, x_cols] fp32
  const size_t down_at = carve.add<float>(P * H16);         // 3. down_out : [P, H16] fp32
  const size_t weights_at = carve.add<float>(T * K);        // 4. weights  : [T, K] fp32
  format.carve(carve);                                      //    the format's own buffers
  const ScratchLease lease(carve.bytes());  // given back at the end if it is huge
  uint8_t* scratch = lease.data();
  float* x = reinterpret_cast<float*>(scratch + x_at);
  float* down_out = reinterpret_cast<float*>(scratch + down_at);
  float* weights = reinterpret_cast<float*>(scratch + weights_at);
  format.bind(scratch);
  for (int64_t s = 0; s < T * K; ++s) weights[s] = weight_at(args.topk_weights, args.weights_type, s);

  // 1. Tokens.
  const size_t in_bytes = args.hidden_type == ElementType::kF32 ? 4 : 2;
  engine.parallel_for(ceil_div(T, kRowsPerJob), [&](int64_t job) {
    for (int64_t t = job * kRowsPerJob; t < std::min(T, (job + 1) * kRowsPerJob); ++t) {
      convert_row<V>(static_cast<const uint8_t*>(args.hidden) + t * H * in_bytes, args.hidden_type, H,
                     x + t * x_cols, x_cols);
      format.prepare_token(t, x + t * x_cols);
    }
  });
  format.prepare_pairs(engine, x);

  // 2. gate + up, then the activation into the intermediate rows; 2b. those rows prepared
  // for down; 3. down.
  const int64_t chunk = format.chunk_pairs();
  const bool train = args.gate_up_add != nullptr || args.gate_up_out != nullptr;
  build_tiles(plan.active_experts, ceil_div(I16, 16), tiles, [&](int32_t e) { return format.gate_up_job_rows(e) / 16; });
  build_tiles(plan.active_experts, ceil_div(H16, 16), down_tiles,
              [&](int32_t e) { return format.down_job_rows(e) / 16; });
  auto gate_up_job = [&](int64_t job) {
    const int64_t e = tiles[job].expert;
    const int64_t n0 = tiles[job].first_block * int64_t{16}, n1 = std::min(I16, n0 + format.gate_up_job_rows(e));
    const int64_t begin = plan.expert_begin[e], end = plan.expert_begin[e + 1];
    for (int64_t p0 = begin; p0 < end; p0 += chunk) {
      const int64_t p1 = std::min(end, p0 + chunk);
      const GateUpTile c = format.gate_up(e, n0, n1, p0, p1);
      const float* gate_bias = biases.gate != nullptr ? biases.gate + e * I16 + n0 : nullptr;
      const float* up_bias = biases.up != nullptr ? biases.up + e * I16 + n0 : nullptr;
      for (int64_t p = p0; p < p1; ++p) {
        const float* g = c.gate + (p - p0) * c.ld;
        const float* u = c.up + (p - p0) * c.ld;
        typename Format::Inter* out = format.intermediate_row(p) + n0;
        typename V::Reg scale = V::set1(1.0f);
        if constexpr (Format::kScaled) scale = V::set1(format.gate_up_scale(p));
        // Training: this pair's slot row of gate_up_add / gate_up_out (moe_args.h).
        const int64_t slot_row = train ? plan.pair_slot[p] * 2 * I : 0;
        const float* add = args.gate_up_add != nullptr ? args.gate_up_add + slot_row : nullptr;
        float* save = args.gate_up_out != nullptr ? args.gate_up_out + slot_row : nullptr;
        for (int64_t s = 0; s < (n1 - n0) / 16; ++s)
          for (int v = 0; v < 16; v += W) {
            typename V::Reg gv = V::load(g + s * c.segment + v), uv = V::load(u + s * c.segment + v);
            if constexpr (Format::kScaled) {
              gv = V::mul(scale, gv);
              uv = V::mul(scale, uv);
            }
            if (gate_bias != nullptr) {
              gv = V::add(gv, V::load(gate_bias + s * 16 + v));
              uv = V::add(uv, V::load(up_bias + s * 16 + v));
            }
            const int64_t n = n0 + s * 16 + v;  // intermediate row of lane 0; rows >= I are padding
            if (add != nullptr) {
              gv = V::add(gv, load_columns<V>(add, n, I));
              uv = V::add(uv, load_columns<V>(add + I, n, I));
            }
            if (save != nullptr) {
              store_columns<V>(save, n, I, gv);
              store_columns<V>(save + I, n, I, uv);
            }
            store_act<V>(out + s * 16 + v, glu.apply(gv, uv));
          }
      }
    }
  };
  auto down_job = [&](int64_t job) {
    const int64_t e = down_tiles[job].expert;
    const int64_t h0 = down_tiles[job].first_block * int64_t{16}, h1 = std::min(H16, h0 + format.down_job_rows(e));
    const int64_t p0 = plan.expert_begin[e], p1 = plan.expert_begin[e + 1];
    format.down(e, h0, h1, p0, p1, down_out + p0 * H16 + h0, H16);
    if (biases.down == nullptr) return;
    const float* scales = format.down_scales();  // out = scale * out + bias, per pair row
    const float* bias = biases.down + e * H16;
    for (int64_t p = p0; p < p1; ++p) {
      const typename V::Reg scale = V::set1(scales != nullptr ? scales[p] : 1.0f);
      float* row = down_out + p * H16;
      for (int64_t h = h0; h < h1; h += W) V::store(row + h, V::fma(scale, V::load(row + h), V::load(bias + h)));
    }
  };
  const int64_t gate_up_jobs = static_cast<int64_t>(tiles.size()), down_jobs = static_cast<int64_t>(down_tiles.size());
  if (format.intermediate_by_rows()) {
    // One parallel region for all three: the gate/up jobs come first, in job order, and a
    // down job of expert e waits only for e's gate/up jobs (the thread that finishes the
    // last of them prepares e's rows), not for every expert's: no barrier between the
    // phases, whose tails left a thread idle (rows are computed as before: the same bits).
    ExpertReadiness& ready = thread_readiness;
    ready.reset(E);
    for (const ExpertTile& tile : tiles) ready.add_job(tile.expert);
    engine.parallel_for(gate_up_jobs + down_jobs, [&](int64_t job) {
      if (job < gate_up_jobs) {
        const int64_t e = tiles[job].expert;
        ready.finish_one(e, [&] { gate_up_job(job); },
                         [&] { format.prepare_intermediate_rows(plan.expert_begin[e], plan.expert_begin[e + 1]); });
      } else {
        ready.wait(down_tiles[job - gate_up_jobs].expert);
        down_job(job - gate_up_jobs);
      }
    });
  } else {
    engine.parallel_for(gate_up_jobs, gate_up_job);
    engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
      format.prepare_intermediate_rows(job * kRowsPerJob, std::min(P, (job + 1) * kRowsPerJob));
    });
    format.finish_intermediate(engine);
    engine.parallel_for(down_jobs, down_job);
  }

  // 4. combine (the down scales already applied where biases were added).
  combine_outputs<V>(args, plan, weights, biases.down != nullptr ? nullptr : format.down_scales(), down_out, H16);
}

}  // namespace
}  // namespace kt::cpu
