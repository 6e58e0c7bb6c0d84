// [NOTE] The GGUF MoE forward (format gguf): weights used in place, as GGUF stores them
// (row-major [E, rows, K] blocks, a ggml type per matrix), written once and
// instantiated per ISA with a set of integer operations. Phases:
//   1. activations: each token to fp32, then quantized once per distinct activation
//                   format gate and up need (8-bit blocks of 32 or 256; gguf_act.h).
//   2. gate+up:     jobs (expert, 64 rows): kGgufRows rows at a time are decoded
//                   (gguf_decode.h) and dotted with every token routed to the expert
//                   (gguf_dot.h); SiLU(gate) * up per pair.
//   2b.             each pair's intermediate row quantized for down's format.
//   3. down:        jobs (expert, 64 hidden rows), same micro-kernels.
//   4. combine:     out[t] = sum_j w[t, j] * down_out[pair].
// A row group is decoded once and reused for all of the expert's tokens. On the AVX-512
// variants, Q4_K, Q6_K, Q8_0, Q4_0 and Q5_0 rows are read in place instead, whatever the
// number of tokens (gguf_q4k_avx512.h, gguf_q6k_avx512.h, gguf_q8_avx512.h: each unit
// of 4 rows extracted once per block of kGgufDirectTokens tokens), and such a matrix's
// activation format is the in-place kernel's. Either way a (row, token) result takes the
// same operations whatever the other tokens of the call: a token's output depends only on
// its own input, experts and weights (batch invariance). With a tile
// unit (Tile = GgufAmx, amx variant) calls averaging kGgufTileMinPairs or more tokens
// per expert (prefill) decode each job's rows to bf16 once and multiply them on AMX
// tiles (gguf_amx.h) instead: phase 1 packs each expert's token rows as bf16 B chunks,
// 2b packs the intermediate rows likewise, and no activation is quantized.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "../engine/engine.h"
#include "../engine/scratch.h"
#include "../formats/gguf_types.h"
#include "../isa/vec_math.h"
#include "gguf/gguf_act.h"
#include "gguf/gguf_decode.h"
#include "gguf/gguf_dot.h"
#include "gguf/gguf_q4k_avx512.h"
#include "gguf/gguf_q6k_avx512.h"
#include "gguf/gguf_q8_avx512.h"
#include "moe_args.h"
#include "moe_driver_common.h"
#include "moe_plan.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int kGgufRows = 4;             // weight rows decoded and dotted together
constexpr int64_t kGgufJobRows = 64;      // rows per job of the tile path (kTileBlocks blocks of 16)
// Rows per job of the row (decode) paths: up to 256, 16-aligned, at least 4 jobs per
// thread over `rows` (active experts x rows per expert). Each job's four row streams
// start cold, so longer jobs stream faster: 1-token S1 Q4_K 1130-1150 us with 64-row
// jobs, 1000-1030 with 192-256 (Q8_0 1790-1850 -> 1580-1640).
inline int64_t streaming_job_rows(int64_t rows, int threads) {
  const int64_t per_job = rows / (4 * std::max(threads, 1)) / 16 * 16;
  return std::clamp<int64_t>(per_job, kGgufJobRows, 256);
}

constexpr int kGgufQ4kActs = 257;  // activation format code of Q4_K's direct path
constexpr int kGgufQ6kActs = 258;  // of Q6_K's: 256-value blocks with int16 sums of 16
constexpr int kGgufDirectTokens = 4;  // activation rows per pass of the in-place kernels (registers)
// Average tokens per active expert from which a tile unit runs the call (tests mirror it).
constexpr int64_t kGgufTileMinPairs = 8;

// The Tile parameter of variants without a tile unit.
struct GgufNoTile {
  static constexpr bool kEnabled = false;
};

constexpr int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// One matrix (gate, up or down) of every expert in the blob.
struct GgufMatrix {
  const uint8_t* first_expert;
  uint64_t expert_bytes;
  uint64_t row_bytes;
  GgmlType type;
  bool is_float;
  GgufDecodeRowFn decode;  // quantized types
  bool direct;             // dotted from its bytes (gguf_direct_rows), not decoded: Q4_K, Q6_K, Q8_0, Q4_0
                           // and Q5_0 where the variant has the in-place kernels (AVX-512)
  int64_t k, kp;  // row length and its padded length (multiple of 256)

  // in_place: the variant has the in-place kernels. The choice depends on the matrix's
  // type only, never on the call's tokens.
  GgufMatrix(const uint8_t* blob, const PackedLayout& layout, int m, int64_t rows, int64_t k_, bool in_place)
      : first_expert(blob + layout.matrix_offset[m]),
        expert_bytes(layout.matrix_expert_bytes[m]),
        row_bytes(layout.matrix_expert_bytes[m] / rows),
        type(ggml_type_info(layout.shape.gguf_types[m]).type),
        is_float(ggml_type_info(layout.shape.gguf_types[m]).is_float),
        decode(gguf_decoder(type)),
        direct(in_place && (type == GgmlType::kQ4_K || type == GgmlType::kQ6_K || type == GgmlType::kQ8_0 ||
                            type == GgmlType::kQ4_0 || type == GgmlType::kQ5_0)),
        k(k_),
        kp(round_up(k_, kGgufSuper)) {}
  const uint8_t* row(int64_t expert, int64_t n) const {
    return first_expert + expert * expert_bytes + n * row_bytes;
  }
  // The activation format: 0 fp32, 32, 256, kGgufQ4kActs (256 in kGgufQ4kOrder) or
  // kGgufQ6kActs (256 with sums of 16).
  int act_block() const {
    if (is_float) return 0;
    if (direct && type == GgmlType::kQ4_K) return kGgufQ4kActs;
    if (direct && type == GgmlType::kQ6_K) return kGgufQ6kActs;
    return static_cast<int>(ggml_type_info(static_cast<uint32_t>(type)).block_elems);
  }
};

// A float-type row (F32 / F16 / BF16) as fp32, zero past k up to kp.
template <class V>
void gguf_float_row(GgmlType type, const uint8_t* row, int64_t k, int64_t kp, float* out) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  if (type == GgmlType::kF32) {
    std::memcpy(out, row, k * sizeof(float));
    i = k;
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
    const bool bf16 = type == GgmlType::kBf16;
    for (; i + W <= k; i += W) V::store(out + i, bf16 ? V::load_bf16(h + i) : V::load_f16(h + i));
    for (; i < k; ++i) {
      uint16_t bits;
      std::memcpy(&bits, h + i, 2);
      out[i] = bf16 ? bf16_to_float(bits) : f16_to_float(bits);
    }
  }
  std::fill(out + k, out + kp, 0.0f);
}

template <class Ops, int NR>
void gguf_dot_group(const GgufMatrix& m, const void* decoded, const GgufActs& acts, int64_t a, float* out) {
  using V = typename Ops::Vec;
  const int64_t units = m.kp / kGgufSuper;
  if (m.is_float) {
    const float* rows[NR];
    for (int i = 0; i < NR; ++i) rows[i] = static_cast<const float*>(decoded) + i * m.kp;
    return gguf_dot_rows_float<V, NR>(rows, acts.f + a * m.kp, m.kp, out);
  }
  const GgufDecoded* rows[NR];
  for (int i = 0; i < NR; ++i) rows[i] = static_cast<const GgufDecoded*>(decoded) + i * units;
  const int8_t* q = acts.q + a * m.kp;
  const float* s = acts.scale + a * (m.kp / 4);
  const float* sums = acts.sum16 + a * (m.kp / 16);
  const int32_t* bias4 = acts.bias4 + a * (m.kp / 4);
  if (m.type == GgmlType::kQ8_0)
    gguf_dot_rows<Ops, true, false, NR>(rows, q, s, sums, bias4, units, out);
  else if (m.act_block() == kGgufSuper)
    gguf_dot_rows<Ops, false, true, NR>(rows, q, s, sums, bias4, units, out);
  else
    gguf_dot_rows<Ops, false, false, NR>(rows, q, s, sums, bias4, units, out);
}

// One in-place kernel call: `rows` (4 rows of m) dotted with activation rows
// act_row(p) for the M pairs p = p0 .. p0 + M - 1, out[4 * j + i] (row i, pair p0 + j).
template <class Ops, int M>
void gguf_direct_block(const GgufMatrix& m, const uint8_t* const* rows, const GgufActs& acts,
                       const int32_t* act_rows, int64_t p0, bool prefetch, float* out) {
  const int8_t* q[M];
  const float* scale4[M];
  const int32_t* bias4[M];
  const int16_t* level_sums[M];
  for (int j = 0; j < M; ++j) {
    const int64_t a = act_rows != nullptr ? act_rows[p0 + j] : p0 + j;
    q[j] = acts.q + a * m.kp;
    scale4[j] = acts.scale + a * (m.kp / 4);
    bias4[j] = acts.bias4 + a * (m.kp / 4);
    level_sums[j] = acts.level_sums + a * (m.kp / 16);
  }
  const int64_t units = m.kp / kGgufSuper;
  switch (m.type) {
    case GgmlType::kQ4_K: return gguf_q4k_dot_rows4<Ops, M>(rows, q, scale4, level_sums, units, prefetch, out);
    case GgmlType::kQ6_K: return gguf_q6k_dot_rows4<Ops, M>(rows, q, scale4, level_sums, units, prefetch, out);
    case GgmlType::kQ8_0:
      return gguf_block32_dot_rows4<Ops, GgmlType::kQ8_0, M>(rows, m.k, q, scale4, bias4, prefetch, out);
    case GgmlType::kQ4_0:
      return gguf_block32_dot_rows4<Ops, GgmlType::kQ4_0, M>(rows, m.k, q, scale4, bias4, prefetch, out);
    default: return gguf_block32_dot_rows4<Ops, GgmlType::kQ5_0, M>(rows, m.k, q, scale4, bias4, prefetch, out);
  }
}

// Q4_K / Q6_K / Q8_0 / Q4_0 / Q5_0 rows [n0, n1) dotted from their bytes (AVX-512): four rows a quarter of
// the range apart at a time, so four memory streams are in flight (1-token S1 Q4_K:
// 7.5 -> 16 GB/s), each group of four dotted with the pairs in blocks of
// kGgufDirectTokens (one extraction of the rows per block, no decoded copy).
template <class Ops>
void gguf_direct_rows(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
                      const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  const int64_t stride = (n1 - n0 + 3) / 4;
  // The kernels prefetch kGgufPrefetchBytes ahead; the first bytes of each stream are
  // requested here, all at once, instead of one stream after the other.
  for (int i = 0; i < 4; ++i) {
    const uint8_t* first = m.row(expert, std::min(n0 + i * stride, n1 - 1));
    for (int line = 0; line < kGgufPrefetchBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + line), _MM_HINT_T0);
  }
  for (int64_t j = 0; j < stride; ++j) {
    int64_t n[4];
    const uint8_t* rows[4];
    for (int i = 0; i < 4; ++i) {
      n[i] = std::min(n0 + j + i * stride, n1 - 1);  // past the end: repeat the last row
      rows[i] = m.row(expert, n[i]);
    }
    for (int64_t p = p0; p < p1; p += kGgufDirectTokens) {
      float result[4 * kGgufDirectTokens];
      const int64_t count = std::min<int64_t>(kGgufDirectTokens, p1 - p);
      const bool prefetch = p == p0;  // later blocks find the rows in the cache
      static_assert(kGgufDirectTokens == 4);
      switch (count) {
        case 4: gguf_direct_block<Ops, 4>(m, rows, acts, act_rows, p, prefetch, result); break;
        case 3: gguf_direct_block<Ops, 3>(m, rows, acts, act_rows, p, prefetch, result); break;
        case 2: gguf_direct_block<Ops, 2>(m, rows, acts, act_rows, p, prefetch, result); break;
        default: gguf_direct_block<Ops, 1>(m, rows, acts, act_rows, p, prefetch, result); break;
      }
      for (int64_t t = 0; t < count; ++t)
        for (int i = 0; i < 4; ++i) out[(p + t) * ldo + n[i]] = result[4 * t + i];
    }
  }
}

// out[p * ldo + n] = dot(row n of `expert`, activation row act_row(p)) for rows [n0, n1)
// and pairs [p0, p1); act_rows == nullptr means activation row p.
template <class Ops>
void gguf_rows(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
               const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  using V = typename Ops::Vec;
  if constexpr (Ops::kRegsPerLine == 1) {
    if (m.direct) return gguf_direct_rows<Ops>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
  }
  const int64_t units = m.kp / kGgufSuper;
  thread_local std::vector<GgufDecoded> decoded_units;
  thread_local std::vector<float> decoded_floats;
  void* decoded;
  if (m.is_float) {
    decoded_floats.resize(kGgufRows * m.kp);
    decoded = decoded_floats.data();
  } else {
    decoded_units.resize(kGgufRows * units);
    decoded = decoded_units.data();
  }
  // Groups of kGgufRows rows a quarter of the range apart: four memory streams.
  const int64_t stride = (n1 - n0 + kGgufRows - 1) / kGgufRows;
  for (int64_t j = 0; j < stride; ++j) {
    int64_t n[kGgufRows];
    int nr = 0;
    for (int i = 0; i < kGgufRows; ++i)
      if (n0 + j + i * stride < n1) n[nr++] = n0 + j + i * stride;
    for (int i = 0; i < nr; ++i) {
      const uint8_t* row = m.row(expert, n[i]);
      if (m.is_float)
        gguf_float_row<V>(m.type, row, m.k, m.kp, decoded_floats.data() + i * m.kp);
      else
        m.decode(row, m.k, decoded_units.data() + i * units);
    }
    float result[kGgufRows];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t a = act_rows != nullptr ? act_rows[p] : p;
      switch (nr) {
        case 4: gguf_dot_group<Ops, 4>(m, decoded, acts, a, result); break;
        case 3: gguf_dot_group<Ops, 3>(m, decoded, acts, a, result); break;
        case 2: gguf_dot_group<Ops, 2>(m, decoded, acts, a, result); break;
        default: gguf_dot_group<Ops, 1>(m, decoded, acts, a, result); break;
      }
      for (int i = 0; i < nr; ++i) out[p * ldo + n[i]] = result[i];
    }
  }
}

// Rows [n0, n1) of `expert` as bf16 [round_up(n1 - n0, 16)][kp], rows past n1 zero (Tile::gemm's A).
template <class Tile, class V>
void gguf_rows_bf16(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, uint16_t* out) {
  thread_local std::vector<GgufDecoded> decoded;
  thread_local std::vector<float> floats;
  const int64_t units = m.kp / kGgufSuper, rows = n1 - n0, stride = (rows + 3) / 4;
  // Four rows a quarter of the range apart at a time: four memory streams.
  for (int64_t r = 0; r < 4 * stride; ++r) {
    const int64_t n = n0 + r / 4 + (r % 4) * stride;
    if (n >= n1) continue;
    uint16_t* row = out + (n - n0) * m.kp;
    if (Tile::row_to_bf16(m.type, m.row(expert, n), m.k, m.kp, row)) continue;
    if (m.is_float) {
      floats.resize(m.kp);
      gguf_float_row<V>(m.type, m.row(expert, n), m.k, m.kp, floats.data());
      Tile::floats_to_bf16(floats.data(), m.kp, row);
    } else {
      decoded.resize(units);
      m.decode(m.row(expert, n), m.k, decoded.data());
      for (int64_t u = 0; u < units; ++u)
        Tile::unit_to_bf16(decoded[u], m.type == GgmlType::kQ8_0, row + u * kGgufSuper);
    }
  }
  std::fill(out + (n1 - n0) * m.kp, out + round_up(n1 - n0, 16) * m.kp, uint16_t{0});
}

// Rows [n0, n1) of one matrix for the tile path, written to out[p * ldo + n].
struct GgufTileRows {
  const GgufMatrix* m;
  int64_t n0, n1;
  float* out;
};

// The tile path of one job: each range's rows decoded to bf16, then multiplied with the
// expert's `pairs` B chunks `b`. (Prefetching the next range during a multiply measured
// no gain: S1 512 tokens Q4_K 75-78 ms either way.)
template <class Tile, class V>
void gguf_tile_rows(std::initializer_list<GgufTileRows> ranges, int64_t expert, const uint16_t* b, int64_t pairs,
                    int64_t ldo) {
  thread_local std::vector<uint16_t> w;
  for (const GgufTileRows& r : ranges) {
    w.resize(kGgufJobRows * r.m->kp);
    gguf_rows_bf16<Tile, V>(*r.m, expert, r.n0, r.n1, w.data());
    Tile::gemm(w.data(), r.n1 - r.n0, r.m->kp, b, pairs, r.out + r.n0, ldo);
  }
}

template <class Ops, class Tile = GgufNoTile>
void moe_forward_gguf(const MoeArgs& args) {
  using V = typename Ops::Vec;
  constexpr int W = V::kWidth;
  const PackedLayout& layout = args.layout;
  const int64_t E = layout.shape.num_experts, H = layout.shape.hidden_size,
                I = layout.shape.intermediate_size;
  const int64_t T = args.tokens, K = args.top_k;
  // The in-place kernels (AVX-512) serve their types for every number of tokens, so
  // each matrix's activation format is fixed by its type, not by the call.
  constexpr bool in_place = Ops::kRegsPerLine == 1;
  GgufMatrix gate(args.packed, layout, kGgufGate, I, H, in_place), up(args.packed, layout, kGgufUp, I, H, in_place),
      down(args.packed, layout, kGgufDown, H, I, in_place);
  const int64_t Hp = gate.kp, Ip = down.kp, H16 = round_up(H, 16);

  thread_local MoePlan thread_plan;
  thread_local std::vector<ExpertTile> thread_tiles;
  MoePlan& plan = thread_plan;
  std::vector<ExpertTile>& tiles = thread_tiles;
  plan.build(args.topk_ids, args.topk_ids_int64, T, K, E);
  const int64_t P = plan.num_pairs;
  bool tile = false;
  if constexpr (Tile::kEnabled)
    tile = P >= kGgufTileMinPairs * static_cast<int64_t>(plan.active_experts.size());
  // Tile path: each expert's rows in B chunks of Tile::kChunk pairs, chunk_at[e] first.
  thread_local std::vector<int64_t> thread_chunk_at;
  thread_local std::vector<ExpertTile> thread_chunks;  // (expert, chunk within it)
  std::vector<int64_t>& chunk_at = thread_chunk_at;
  std::vector<ExpertTile>& chunks = thread_chunks;
  int64_t chunk_pairs = 0;  // pairs per chunk
  chunks.clear();
  if constexpr (Tile::kEnabled) {
    chunk_pairs = Tile::kChunk;
    chunk_at.assign(E, 0);
    for (int32_t e : plan.active_experts) {
      if (!tile) break;
      chunk_at[e] = static_cast<int64_t>(chunks.size());
      for (int64_t c = 0; c < ceil_div(plan.expert_begin[e + 1] - plan.expert_begin[e], chunk_pairs); ++c)
        chunks.push_back({e, static_cast<int32_t>(c)});
    }
  }
  const int64_t chunk_count = static_cast<int64_t>(chunks.size());

  // Activation formats: gate's, up's (shared when equal), down's; none on the tile path.
  const int gate_block = tile ? 0 : gate.act_block(), up_block = tile ? 0 : up.act_block(),
            down_block = tile ? 0 : down.act_block();
  const bool shared = gate_block == up_block;
  ScratchLayout carve;
  const size_t x_at = carve.add<float>(T * Hp);
  auto carve_acts = [&](int block, int64_t rows, int64_t kp, size_t at[5]) {
    const int64_t n = block == 0 ? 0 : rows;
    at[0] = carve.add<int8_t>(n * kp);
    at[1] = carve.add<float>(n * kp / 4);
    at[2] = carve.add<float>(n * kp / 16);
    at[3] = carve.add<int32_t>(n * kp / 4);
    at[4] = carve.add<int16_t>(block == kGgufQ4kActs || block == kGgufQ6kActs ? n * kp / 16 : 0);
  };
  size_t gate_at[5], up_at[5], down_at[5];
  carve_acts(gate_block, T, Hp, gate_at);
  carve_acts(shared ? 0 : up_block, T, Hp, up_at);
  const size_t gate_f_at = carve.add<float>(P * Ip);  // gate, then the intermediate
  const size_t up_f_at = carve.add<float>(P * Ip);
  carve_acts(down_block, P, Ip, down_at);
  const size_t out_at = carve.add<float>(P * H16);
  const size_t weights_at = carve.add<float>(T * K);
  const size_t b_up_at = carve.add<uint16_t>(chunk_count * chunk_pairs * Hp);  // tokens, gate/up's B
  const size_t b_down_at = carve.add<uint16_t>(chunk_count * chunk_pairs * Ip);  // intermediate, down's B
  uint8_t* scratch = thread_scratch(carve.bytes());
  auto acts_at = [&](int block, int64_t kp, const size_t at[5], const float* f) {
    GgufActs acts;
    acts.kp = kp;
    acts.block = block == kGgufQ4kActs || block == kGgufQ6kActs ? kGgufSuper : block;
    acts.q4k_order = block == kGgufQ4kActs;
    acts.sums_of_16 = block == kGgufQ6kActs;
    acts.level_sums = reinterpret_cast<int16_t*>(scratch + at[4]);
    acts.q = reinterpret_cast<int8_t*>(scratch + at[0]);
    acts.scale = reinterpret_cast<float*>(scratch + at[1]);
    acts.sum16 = reinterpret_cast<float*>(scratch + at[2]);
    acts.bias4 = reinterpret_cast<int32_t*>(scratch + at[3]);
    acts.f = f;
    return acts;
  };
  float* x = reinterpret_cast<float*>(scratch + x_at);
  float* gate_f = reinterpret_cast<float*>(scratch + gate_f_at);
  float* up_f = reinterpret_cast<float*>(scratch + up_f_at);
  float* down_out = reinterpret_cast<float*>(scratch + out_at);
  float* weights = reinterpret_cast<float*>(scratch + weights_at);
  uint16_t* b_up = reinterpret_cast<uint16_t*>(scratch + b_up_at);
  uint16_t* b_down = reinterpret_cast<uint16_t*>(scratch + b_down_at);
  const GgufActs gate_acts = acts_at(gate_block, Hp, gate_at, x);
  const GgufActs up_acts = shared ? gate_acts : acts_at(up_block, Hp, up_at, x);
  const GgufActs down_acts = acts_at(down_block, Ip, down_at, gate_f);
  for (int64_t s = 0; s < T * K; ++s) weights[s] = weight_at(args.topk_weights, args.weights_type, s);

  // 1. Tokens: fp32 (zero-padded to Hp), quantized for gate and up.
  Engine& engine = Engine::instance();
  const size_t in_bytes = args.hidden_type == ElementType::kF32 ? 4 : 2;
  engine.parallel_for(ceil_div(T, kRowsPerJob), [&](int64_t job) {
    for (int64_t t = job * kRowsPerJob; t < std::min(T, (job + 1) * kRowsPerJob); ++t) {
      convert_row<V>(static_cast<const uint8_t*>(args.hidden) + t * H * in_bytes, args.hidden_type, H,
                     x + t * Hp, Hp);
      if (gate_block != 0) gguf_quantize_act_row<V>(x + t * Hp, gate_acts, t);
      if (!shared && up_block != 0) gguf_quantize_act_row<V>(x + t * Hp, up_acts, t);
    }
  });

  // Tile path: row r(p) of `rows` (stride kp, fp32) -> B chunks for every pair p.
  const int32_t* pair_token = plan.pair_token.data();
  auto pack_chunks = [&](const float* rows, bool by_token, int64_t kp, uint16_t* b) {
    if constexpr (Tile::kEnabled)
      engine.parallel_for(chunk_count, [&](int64_t job) {
        const ExpertTile c = chunks[job];
        const int64_t p0 = plan.expert_begin[c.expert] + c.first_block * chunk_pairs;
        const int64_t n = std::min(chunk_pairs, plan.expert_begin[c.expert + 1] - p0);
        uint16_t* chunk = b + job * chunk_pairs * kp;
        if (n < chunk_pairs) std::fill(chunk, chunk + chunk_pairs * kp, uint16_t{0});
        for (int64_t i = 0; i < n; ++i)
          Tile::pack_column(rows + (by_token ? pair_token[p0 + i] : p0 + i) * kp, kp, chunk, i);
      });
  };
  if (tile) pack_chunks(x, true, Hp, b_up);

  // 2. gate / up rows for every pair of the expert, then SiLU(gate) * up into gate_f.
  const int64_t active = static_cast<int64_t>(plan.active_experts.size());
  const int64_t gate_rows = tile ? kGgufJobRows : streaming_job_rows(active * I, engine.num_threads());
  build_tiles(plan.active_experts, ceil_div(I, 16), tiles, gate_rows / 16);
  engine.parallel_for(static_cast<int64_t>(tiles.size()), [&](int64_t job) {
    const ExpertTile tile_job = tiles[job];
    const int64_t e = tile_job.expert;
    const int64_t n0 = tile_job.first_block * int64_t{16}, n1 = std::min(I, n0 + gate_rows);
    const int64_t p0 = plan.expert_begin[e], p1 = plan.expert_begin[e + 1];
    if constexpr (Tile::kEnabled) {
      if (tile) {
        gguf_tile_rows<Tile, V>({{&gate, n0, n1, gate_f + p0 * Ip}, {&up, n0, n1, up_f + p0 * Ip}}, e,
                                b_up + chunk_at[e] * chunk_pairs * Hp, p1 - p0, Ip);
      }
    }
    if (!tile) {
      gguf_rows<Ops>(gate, e, n0, n1, gate_acts, pair_token, p0, p1, gate_f, Ip);
      gguf_rows<Ops>(up, e, n0, n1, up_acts, pair_token, p0, p1, up_f, Ip);
    }
    for (int64_t p = p0; p < p1; ++p) {
      float* g = gate_f + p * Ip;
      const float* u = up_f + p * Ip;
      int64_t n = n0;
      for (; n + W <= n1; n += W) V::store(g + n, vec_silu_mul<V>(V::load(g + n), V::load(u + n)));
      if (n < n1) {
        float gt[W] = {}, ut[W] = {};
        std::copy(g + n, g + n1, gt);
        std::copy(u + n, u + n1, ut);
        V::store(gt, vec_silu_mul<V>(V::load(gt), V::load(ut)));
        std::copy(gt, gt + (n1 - n), g + n);
      }
    }
  });

  // 2b. Intermediate rows: zero past I, quantized for down.
  engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
    for (int64_t p = job * kRowsPerJob; p < std::min(P, (job + 1) * kRowsPerJob); ++p) {
      std::fill(gate_f + p * Ip + I, gate_f + (p + 1) * Ip, 0.0f);
      if (down_block != 0) gguf_quantize_act_row<V>(gate_f + p * Ip, down_acts, p);
    }
  });
  if (tile) pack_chunks(gate_f, false, Ip, b_down);

  // 3. down.
  const int64_t down_rows = tile ? kGgufJobRows : streaming_job_rows(active * H, engine.num_threads());
  build_tiles(plan.active_experts, ceil_div(H, 16), tiles, down_rows / 16);
  engine.parallel_for(static_cast<int64_t>(tiles.size()), [&](int64_t job) {
    const int64_t e = tiles[job].expert;
    const int64_t h0 = tiles[job].first_block * int64_t{16}, h1 = std::min(H, h0 + down_rows);
    const int64_t p0 = plan.expert_begin[e], p1 = plan.expert_begin[e + 1];
    if constexpr (Tile::kEnabled) {
      if (tile) {
        gguf_tile_rows<Tile, V>({{&down, h0, h1, down_out + p0 * H16}}, e, b_down + chunk_at[e] * chunk_pairs * Ip,
                                p1 - p0, H16);
      }
    }
    if (!tile) gguf_rows<Ops>(down, e, h0, h1, down_acts, nullptr, p0, p1, down_out, H16);
  });

  // 4. combine.
  combine_outputs<V>(args, plan, weights, nullptr, down_out, H16);
}

}  // namespace
}  // namespace kt::cpu
