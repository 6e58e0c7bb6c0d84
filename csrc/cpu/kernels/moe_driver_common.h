// [NOTE] Row-level pieces of the MoE driver (moe_driver.h) and its format policies:
// activation conversion, output stores, the (expert, block) job list and the final
// weighted combine. Include only from a variant translation unit, after its target
// pragma (the code is compiled for that ISA).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "moe_args.h"
#include "moe_plan.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int kTileBlocks = 4;        // output blocks (64 columns) per job
constexpr int64_t kRowsPerJob = 16;   // convert / combine rows per job

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up16(int64_t v) { return ceil_div(v, 16) * 16; }

template <class V>
void store_act(uint16_t* p, typename V::Reg v) { V::store_bf16(p, v); }
template <class V>
void store_act(float* p, typename V::Reg v) { V::store(p, v); }

// row[n, n + W) as a register, lanes at or past `limit` zero (training rows, moe_args.h).
template <class V>
typename V::Reg load_columns(const float* row, int64_t n, int64_t limit) {
  constexpr int W = V::kWidth;
  if (n + W <= limit) return V::load(row + n);
  float lanes[W] = {};
  for (int64_t i = n; i < limit; ++i) lanes[i - n] = row[i];
  return V::load(lanes);
}

// row[n, min(n + W, limit)) = the first lanes of v.
template <class V>
void store_columns(float* row, int64_t n, int64_t limit, typename V::Reg v) {
  constexpr int W = V::kWidth;
  if (n + W <= limit) return V::store(row + n, v);
  float lanes[W];
  V::store(lanes, v);
  for (int64_t i = n; i < limit; ++i) row[i] = lanes[i - n];
}

// dst[0, cols) = src[0, n) converted, zero past n.
template <class V, typename Act>
void convert_row(const void* src, ElementType type, int64_t n, Act* dst, int64_t cols) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  float tail[W];
  for (; i + W <= n; i += W) {
    typename V::Reg v;
    switch (type) {
      case ElementType::kF32: v = V::load(static_cast<const float*>(src) + i); break;
      case ElementType::kBf16: v = V::load_bf16(static_cast<const uint16_t*>(src) + i); break;
      default: v = V::load_f16(static_cast<const uint16_t*>(src) + i); break;
    }
    store_act<V>(dst + i, v);
  }
  if (i == cols) return;
  for (int j = 0; j < W; ++j) {
    const int64_t k = i + j;
    float value = 0.0f;
    if (k < n) {
      switch (type) {
        case ElementType::kF32: value = static_cast<const float*>(src)[k]; break;
        case ElementType::kBf16: value = bf16_to_float(static_cast<const uint16_t*>(src)[k]); break;
        default: value = f16_to_float(static_cast<const uint16_t*>(src)[k]); break;
      }
    }
    tail[j] = value;
  }
  Act converted[W];
  store_act<V>(converted, V::load(tail));
  std::copy(converted, converted + std::min<int64_t>(W, cols - i), dst + i);
  std::fill(dst + std::min(cols, i + W), dst + cols, Act{});
}

// out[0, n) = v (first n lanes), in the output element type.
template <class V>
void store_output(void* out, ElementType type, int64_t offset, int64_t n, typename V::Reg v) {
  constexpr int W = V::kWidth;
  if (n == W) {
    switch (type) {
      case ElementType::kF32: return V::store(static_cast<float*>(out) + offset, v);
      case ElementType::kBf16: return V::store_bf16(static_cast<uint16_t*>(out) + offset, v);
      default: return V::store_f16(static_cast<uint16_t*>(out) + offset, v);
    }
  }
  float lanes[W];
  uint16_t halves[W];
  V::store(lanes, v);
  switch (type) {
    case ElementType::kF32:
      std::copy(lanes, lanes + n, static_cast<float*>(out) + offset);
      return;
    case ElementType::kBf16: V::store_bf16(halves, v); break;
    default: V::store_f16(halves, v); break;
  }
  std::copy(halves, halves + n, static_cast<uint16_t*>(out) + offset);
}

// out[p] = tokens[pair_token[p]] in the kernel's activation type, for every pair p (rows
// of `cols` fp32 / Act values): the float formats' pair rows (phase 1).
template <class V, typename Act>
void convert_pair_rows(Engine& engine, const MoePlan& plan, const float* tokens, int64_t cols, Act* out) {
  const int64_t P = plan.num_pairs;
  engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
    for (int64_t p = job * kRowsPerJob; p < std::min(P, (job + 1) * kRowsPerJob); ++p)
      convert_row<V>(tokens + plan.pair_token[p] * cols, ElementType::kF32, cols, out + p * cols, cols);
  });
}

float weight_at(const void* weights, ElementType type, int64_t index) {
  switch (type) {
    case ElementType::kF32: return static_cast<const float*>(weights)[index];
    case ElementType::kBf16: return bf16_to_float(static_cast<const uint16_t*>(weights)[index]);
    default: return f16_to_float(static_cast<const uint16_t*>(weights)[index]);
  }
}

// Blocks per job of a streaming (decode) pass over `blocks` blocks of 16 rows: at least 4
// jobs per thread, a multiple of `multiple` in [least, most]. Each job streams its blocks
// from memory, and its first blocks start cold: longer jobs read faster.
inline int64_t streaming_job_blocks(int64_t blocks, int threads, int64_t least, int64_t most, int64_t multiple) {
  const int64_t per_job = blocks / (4 * std::max(threads, 1)) / multiple * multiple;
  return std::clamp<int64_t>(per_job, least, most);
}

struct ExpertTile {
  int32_t expert;
  int32_t first_block;
};

// (expert, first block) jobs covering `blocks` blocks of every active expert, step_of(expert)
// blocks per job.
template <class StepOf>
void build_tiles(const std::vector<int32_t>& experts, int64_t blocks, std::vector<ExpertTile>& tiles,
                 StepOf step_of) {
  tiles.clear();
  for (int32_t expert : experts) {
    const int64_t step = step_of(expert);
    for (int64_t b = 0; b < blocks; b += step)
      tiles.push_back({expert, static_cast<int32_t>(b)});
  }
}

// out[t] = sum_j w[t, j] * pair_scale[p] * down_out[p] over the slots' pairs p (phase 4);
// pair_scale == nullptr means 1. down_out rows are `out_cols` floats.
template <class V>
void combine_outputs(const MoeArgs& args, const MoePlan& plan, const float* weights,
                     const float* pair_scale, const float* down_out, int64_t out_cols) {
  constexpr int W = V::kWidth;
  const int64_t T = args.tokens, K = args.top_k, H = args.layout.shape.hidden_size;
  Engine::instance().parallel_for(ceil_div(T, kRowsPerJob), [&](int64_t job) {
    for (int64_t t = job * kRowsPerJob; t < std::min(T, (job + 1) * kRowsPerJob); ++t) {
      for (int64_t h = 0; h < H; h += W) {
        typename V::Reg acc = V::zero();
        for (int64_t j = 0; j < K; ++j) {
          const int32_t pair = plan.slot_pair[t * K + j];
          if (pair < 0) continue;
          const float w = weights[t * K + j] * (pair_scale != nullptr ? pair_scale[pair] : 1.0f);
          acc = V::fma(V::set1(w), V::load(down_out + pair * out_cols + h), acc);
        }
        store_output<V>(args.output, args.output_type, t * H + h, std::min<int64_t>(W, H - h), acc);
      }
    }
  });
}

}  // namespace
}  // namespace kt::cpu
