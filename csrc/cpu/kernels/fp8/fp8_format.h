// [NOTE] The FP8 format policy of the MoE driver (moe_driver.h) for fp8, fp8_perchannel
// and mxfp8 (formats/fp8_layout.h), instantiated per ISA with Ops (fp8_decode_*.h): the
// ISA's BF16 micro-kernel, the FP8 weight sources for it, and the mxfp8 exponent
// preparation. Include only
// from a variant translation unit, after its target pragma.
//
// Weights stay e4m3 in memory and are decoded exactly (to bf16 w / 256, in registers) on
// the way into the BF16 micro-kernels; activations are the micro-kernel's (bf16 or fp32).
// The scales follow kt-kernel's math where it is exact:
//   fp8:            y = sum_g s[g] * (256 * sum_{k in g} x w / 256): the fp32 partial of each
//                   128-k group times its scale, accumulated in fp32 (a group flush, done
//                   by the micro-kernel as it stores the group's sums: TileArgs::group_scales);
//   fp8_perchannel: y = s * (256 * sum_k x w / 256), once after all of k;
//   mxfp8:          the power-of-two scale is added to the decoded weight's exponent
//                   (exact in bf16), so the k loop is the BF16 format's (no flush per 32 k);
//                   a row with a NaN code or scale gets NaN from its addend at the end.
// Each code line is decoded once per call (gate and up: per chunk of kBf16RowChunk tokens),
// in registers, by the first row tile of its k block, which streams the codes from memory;
// the other row tiles (prefill) read the BF16 lines it stored. Every row tile adds the same
// values in the same order, so a token's result does not depend on the others (batch
// invariance).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../../engine/engine.h"
#include "../../engine/scratch.h"
#include "../../formats/fp8_layout.h"
#include "../../isa/prefetch.h"
#include "../bf16/bf16_format.h"
#include "../moe_args.h"
#include "../moe_driver.h"
#include "../moe_plan.h"
#include "fp8_kblock.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr float kFp8DecodeScale = 256.0f;  // the decoders give w / 256

// Ops whose fp8 and fp8_perchannel sources give w / Ops::kSplitUnit in split lanes
// (Ops::SplitLines, Ops::SplitReader: fp8_decode_avx2.h).
template <class Ops, class = void>
struct HasSplitLines : std::false_type {};
template <class Ops>
struct HasSplitLines<Ops, std::void_t<typename Ops::SplitReader>> : std::true_type {};

// fp8_perchannel: c[m][16 b + n] = s_b[n] * unit * c[m][16 b + n], the unit on the scale
// or on the sum as unit_on_scale (bf16_gemm.h) says: no intermediate overflows where the
// result does not.
template <class V>
void fp8_scale_rows(int64_t rows, int blocks, const float* const* scales, float* c, int64_t ldc, float unit) {
  constexpr int W = V::kWidth;
  const typename V::Reg decode = V::set1(unit);
  const bool on_scale = unit_on_scale(unit);
  for (int64_t m = 0; m < rows; ++m)
    for (int b = 0; b < blocks; ++b)
      for (int v = 0; v < 16; v += W) {
        float* out = c + m * ldc + b * 16 + v;
        const typename V::Reg s = V::load(scales[b] + v);
        V::store(out, on_scale ? V::mul(V::mul(s, decode), V::load(out)) : V::mul(s, V::mul(V::load(out), decode)));
      }
}

// mxfp8: c[m][16 b + n] += addend_b[n] (0, or NaN for a row with a NaN code or scale).
template <class V>
void fp8_add_rows(int64_t rows, int blocks, const float* const* addends, float* c, int64_t ldc) {
  constexpr int W = V::kWidth;
  for (int64_t m = 0; m < rows; ++m)
    for (int b = 0; b < blocks; ++b)
      for (int v = 0; v < 16; v += W) {
        float* out = c + m * ldc + b * 16 + v;
        V::store(out, V::add(V::load(out), V::load(addends[b] + v)));
      }
}

// The power of two f that brings the largest finite magnitude of x[0, n) (fp32) into
// [2^32, 2^33): the activation normalization of Ops::SplitLines, whose weights are
// w * 2^-120 (fp8_decode_avx2.h). Products and sums then stay normal fp32 numbers for any
// activation scale, and scaling by f and back is exact. 1 for a row of zeros, infinities
// or NaNs only; within [2^-126, 2^127] otherwise.
template <class V>
float fp8_row_normalizer(const float* x, int64_t n) {
  const AbsMax top = abs_max<V>(x, n);
  float largest = top.value;
  if (!top.finite) {
    largest = 0.0f;  // the finite lanes' maximum, read again without the infinities
    for (int64_t i = 0; i < n; ++i)
      if (std::isfinite(x[i])) largest = std::max(largest, std::fabs(x[i]));
  }
  if (!(largest > 0.0f)) return 1.0f;
  int exponent = 0;
  std::frexp(largest, &exponent);  // largest in [2^(exponent - 1), 2^exponent)
  return std::ldexp(1.0f, std::clamp(33 - exponent, -126, 127));
}

// out[0, n) = factor * x[0, n) (fp32; out may be x).
template <class V>
void fp8_scale_row(const float* x, int64_t n, float factor, float* out) {
  constexpr int W = V::kWidth;
  const typename V::Reg f = V::set1(factor);
  for (int64_t i = 0; i < n; i += W) V::store(out + i, V::mul(f, V::load(x + i)));
}

// Prefill's BF16 lines of a k block, [kTileBlocks][kFp8PrefillKBlockPairs][32] (256 KiB),
// one buffer per thread for the three formats, in whole 64-byte lines (a std::vector's
// 16-byte alignment split every line store and load across two); see thread_buffer.
inline uint16_t* fp8_line_buffer() {
  constexpr size_t kBytes = kTileBlocks * kFp8PrefillKBlockPairs * 32 * sizeof(uint16_t);
  return reinterpret_cast<uint16_t*>(thread_buffer(ThreadBuffer::kFp8Lines, kBytes));
}

// One packed FP8 matrix (gate_up or down) of every expert.
struct Fp8Matrix {
  const uint8_t* first_expert;
  uint64_t expert_bytes;
  fp8_layout::MatrixDims dims;

  const uint8_t* block(int64_t expert, int64_t first_block) const {
    return first_expert + expert * expert_bytes + first_block * dims.block_bytes();
  }
};

template <class Ops, PackedFormat F>
class Fp8Format {
 public:
  using Micro = typename Ops::Micro;
  using Vec = typename Micro::Vec;
  using Act = typename Micro::Act;
  using Inter = Act;
  static constexpr bool kMx = F == PackedFormat::kMxfp8;
  static constexpr bool kGroupFlush = F == PackedFormat::kFp8;
  // fp8 and fp8_perchannel through Ops::SplitLines (w * 2^-120) where the ISA has them;
  // their activation rows are normalized per row by a power of two (exact), whose inverse
  // the skeleton applies as the pair's gate/up and down scale (kScaled).
  static constexpr bool kSplit = HasSplitLines<Ops>::value && !kMx;
  static constexpr bool kScaled = kSplit;
  // mxfp8 decode through Ops::MxSplitLines (w * 2^-120 * 2^(e - 7): the weight itself, no
  // normalization) where the ISA has split lines and the k block's exponents allow it.
  static constexpr bool kMxSplit = HasSplitLines<Ops>::value && kMx;
  static constexpr int64_t kScaleRowBytes = kMx ? 16 : 64;  // one group's scales of a block's rows
  // Decode's k block (fp8_kblock.h): fp8's tiles end at every 128-k group anyway.
  static constexpr int64_t kDecodeKBlock = kGroupFlush ? kFp8KBlockPairs : kFp8PrefillKBlockPairs;
  // Prefill on AMX tiles (Ops::Tiles, fp8_amx.h) where the micro-kernel set has a tile GEMM.
  static constexpr bool kTiles = HasBf16TileGemm<Micro>::value;

  Fp8Format(const MoeArgs& args, const MoePlan& plan, int threads)
      : plan_(plan),
        dims_(args.layout.shape),
        tokens_(args.tokens),
        act_cols_(dims_.gate_up.padded_k),
        inter_cols_(dims_.down.padded_k),
        gate_up_{args.packed + args.layout.gate_up_offset, args.layout.gate_up_expert_bytes, dims_.gate_up},
        down_{args.packed + args.layout.down_offset, args.layout.down_expert_bytes, dims_.down},
        jobs_(plan, dims_.gate_up.blocks, dims_.down.blocks, threads) {}

  int64_t token_cols() const { return act_cols_; }

  void carve(ScratchLayout& carve) {
    // With AMX tiles, kBf16PadRows rows follow the last pair for row tiles that run past it.
    const int64_t rows = plan_.num_pairs + (kTiles ? kBf16PadRows : 0);
    acts_at_ = carve.add<Act>(rows * act_cols_);     // pair rows   : [P (+ pad), Hk]
    inter_at_ = carve.add<Act>(rows * inter_cols_);  // intermediate: [P (+ pad), Ik]
    if constexpr (kScaled) {
      token_scale_at_ = carve.add<float>(2 * tokens_);        // (factor, inverse) per token
      inter_scale_at_ = carve.add<float>(plan_.num_pairs);  // inverse per pair
    }
  }

  void bind(uint8_t* scratch) {
    acts_ = reinterpret_cast<Act*>(scratch + acts_at_);
    inter_ = reinterpret_cast<Act*>(scratch + inter_at_);
    if constexpr (kScaled) {
      token_scale_ = reinterpret_cast<float*>(scratch + token_scale_at_);
      inter_scale_ = reinterpret_cast<float*>(scratch + inter_scale_at_);
    }
    // gate/up write intermediate columns [0, I16); down reads [0, Ik): zero the rest.
    for (int64_t p = 0; p < plan_.num_pairs; ++p)
      std::fill(inter_ + p * inter_cols_ + dims_.intermediate16, inter_ + (p + 1) * inter_cols_, Act{});
    if constexpr (kTiles) {  // only row tiles read past the last pair
      const int64_t P = plan_.num_pairs;
      std::fill(acts_ + P * act_cols_, acts_ + (P + kBf16PadRows) * act_cols_, Act{});
      std::fill(inter_ + P * inter_cols_, inter_ + (P + kBf16PadRows) * inter_cols_, Act{});
    }
  }

  void prepare_token(int64_t t, const float* x) {
    if constexpr (kScaled) {
      const float factor = fp8_row_normalizer<Vec>(x, act_cols_);
      token_scale_[2 * t] = factor;
      token_scale_[2 * t + 1] = 1.0f / factor;
    }
  }

  // Each pair's token row in the micro-kernel's element type (kScaled: times the token's
  // normalizing factor).
  void prepare_pairs(Engine& engine, const float* tokens) {
    if constexpr (kScaled) {
      const int64_t P = plan_.num_pairs;
      engine.parallel_for(ceil_div(P, kRowsPerJob), [&](int64_t job) {
        for (int64_t p = job * kRowsPerJob; p < std::min(P, (job + 1) * kRowsPerJob); ++p) {
          const int64_t t = plan_.pair_token[p];
          fp8_scale_row<Vec>(tokens + t * act_cols_, act_cols_, token_scale_[2 * t], acts_ + p * act_cols_);
        }
      });
    } else {
      convert_pair_rows<Vec>(engine, plan_, tokens, act_cols_, acts_);
    }
  }

  // Jobs as the BF16 format's (Bf16Jobs).
  int64_t gate_up_job_rows(int64_t e) const { return jobs_.gate_up_rows(e); }
  int64_t down_job_rows(int64_t e) const { return jobs_.down_rows(e); }
  int64_t chunk_pairs() const { return kBf16RowChunk; }

  GateUpTile gate_up(int64_t e, int64_t n0, int64_t n1, int64_t p0, int64_t p1) const {
    constexpr int64_t ldc = kBf16GateUpJobGroups * kTileBlocks * 16;
    float* c = reinterpret_cast<float*>(thread_buffer(ThreadBuffer::kGateUpTile, kBf16RowChunk * ldc * sizeof(float)));
    gemm_rows(acts_ + p0 * act_cols_, act_cols_, p1 - p0, dims_.gate_up, gate_up_.block(e, 2 * n0 / 16),
              static_cast<int>(2 * (n1 - n0) / 16), c, ldc);
    return {c, c + 16, ldc, 32};
  }

  float gate_up_scale(int64_t p) const { return token_scale_[2 * plan_.pair_token[p] + 1]; }
  Inter* intermediate_row(int64_t p) const { return inter_ + p * inter_cols_; }

  // kScaled: each pair's intermediate row normalized in place (its inverse goes to the
  // combine as the pair's down scale).
  bool intermediate_by_rows() const { return true; }
  void prepare_intermediate_rows(int64_t p0, int64_t p1) {
    if constexpr (kScaled)
      for (int64_t p = p0; p < p1; ++p) {
        Act* row = inter_ + p * inter_cols_;
        const float factor = fp8_row_normalizer<Vec>(row, inter_cols_);
        fp8_scale_row<Vec>(row, inter_cols_, factor, row);
        inter_scale_[p] = 1.0f / factor;
      }
  }
  void finish_intermediate(Engine&) {}

  void down(int64_t e, int64_t h0, int64_t h1, int64_t p0, int64_t p1, float* out, int64_t ldo) const {
    gemm_rows(inter_ + p0 * inter_cols_, inter_cols_, p1 - p0, dims_.down, down_.block(e, h0 / 16),
              static_cast<int>((h1 - h0) / 16), out, ldo);
  }

  const float* down_scales() const { return kScaled ? inter_scale_ : nullptr; }

 private:
  // c[m][0, 16 blocks) = rows of a x `blocks` blocks starting at w, in groups of
  // kTileBlocks blocks, each over k blocks of kDecodeKBlock pairs (decode) or
  // kFp8PrefillKBlockPairs (prefill). In each k block the first row tile decodes the codes
  // in registers as it streams them (prefetching 2 KiB ahead, as the BF16 decode does) and,
  // when more row tiles follow, stores the BF16 lines for them to read (fp8_line_buffer);
  // those bring the group's next k block (after its last, the next group's first) to L2.
  // With one row tile (decode, m <= kMaxRows) nothing is stored.
  static void gemm_rows(const Act* a, int64_t lda, int64_t rows, const fp8_layout::MatrixDims& dims,
                        const uint8_t* w, int blocks, float* c, int64_t ldc) {
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    if constexpr (kTiles)
      if (rows > Micro::kMaxRows) {
        Ops::Tiles::begin();
        for (int b0 = 0; b0 < blocks; b0 += kTileBlocks)
          tile_group(a, lda, rows, dims, w + b0 * block_bytes, std::min(static_cast<int>(kTileBlocks), blocks - b0),
                     c + b0 * 16, ldc);
        Ops::Tiles::end();
        return;
      }
    for (int b0 = 0; b0 < blocks; b0 += kTileBlocks) {
      const int nb = std::min(static_cast<int>(kTileBlocks), blocks - b0);
      const int next_nb = std::min(static_cast<int>(kTileBlocks), blocks - b0 - nb);
      if (rows > Micro::kMaxRows)
        group_rows<true>(a, lda, rows, dims, w + b0 * block_bytes, nb, next_nb, c + b0 * 16, ldc);
      else
        group_rows<false>(a, lda, rows, dims, w + b0 * block_bytes, nb, next_nb, c + b0 * 16, ldc);
    }
  }

  // gemm_rows for one group of `blocks` <= kTileBlocks blocks at w; `next_blocks` blocks
  // of the next group follow it.
  // Store: more rows than one tile (prefill), whose first row tile stores the BF16 lines.
  template <bool Store>
  static void group_rows(const Act* a, int64_t lda, int64_t rows, const fp8_layout::MatrixDims& dims,
                         const uint8_t* w, int blocks, int next_blocks, float* c, int64_t ldc) {
    const int64_t pairs = dims.padded_k / 2, group_pairs = dims.group / 2;
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    constexpr int64_t kKBlock = Store ? kFp8PrefillKBlockPairs : kDecodeKBlock;
    constexpr int64_t kLineStride = kKBlock * 32;  // the k block's BF16 lines: [blocks][kKBlock][32]
    uint16_t* const lines = Store ? fp8_line_buffer() : nullptr;
    const Act* row_at[Micro::kMaxRows];
    constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * Ops::kMxGroupBytes;
    alignas(64) uint8_t mx[kTileBlocks * kMxBlockBytes];          // mxfp8: the k block's exponents
    if constexpr (!Store && (kMx || kGroupFlush)) {  // this group's scale rows and the next group's
      prefetch_scale_rows(w, blocks, dims);
      prefetch_scale_rows(w + blocks * block_bytes, next_blocks, dims);
    }
    const float* scales[kTileBlocks];
    auto scales_of = [&](const uint8_t* first, int nb, int64_t g) {
      for (int b = 0; b < nb; ++b)
        scales[b] = reinterpret_cast<const float*>(first + b * block_bytes + dims.scales_offset()) + g * 16;
      return scales;
    };
    for (int64_t q0 = 0; q0 < pairs; q0 += kKBlock) {
      const int64_t q1 = std::min(pairs, q0 + kKBlock);
      // The codes the later row tiles bring to L2: this group's next k block, or the next
      // group's first.
      const uint8_t* next = q1 < pairs ? w + q1 * 32 : next_blocks > 0 ? w + blocks * block_bytes : nullptr;
      const int streamed = q1 < pairs ? blocks : next_blocks;
      // Decode, the last k block: prefetches past a block's last code go to the same
      // block of the next group (when it has as many blocks), whose streams then start
      // warm, as the INT8/INT4 decode tiles do (QuantTileArgs::next_tile). Bit-identical;
      // in one process, both ways interleaved call by call (Zen 5, avx512_bf16,
      // 2026-11-27, 30-40 calls): S1 1 and 8 tokens FP8 0.98-0.99 of the time, MXFP8
      // 0.97-0.985; S2 1 token FP8 1.00, MXFP8 0.97.
      const bool wrap = !Store && q1 == pairs && next_blocks >= blocks;
      auto next_tile = [&](int64_t g0) {
        return wrap ? NextTile{pairs - g0, blocks * block_bytes - pairs * 32} : NextTile{};
      };
      for (int64_t m0 = 0; m0 < rows; m0 += Micro::kMaxRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(Micro::kMaxRows, rows - m0));
        const bool first = m0 == 0;
        const int max_blocks = Micro::max_blocks(tile_rows);
        const int64_t step = kGroupFlush ? group_pairs : kKBlock;  // fp8 flushes per group
        for (int b0 = 0; b0 < blocks; b0 += max_blocks) {
          const int nb = std::min(max_blocks, blocks - b0);
          const uint8_t* codes = w + b0 * block_bytes;
          uint16_t* decoded = Store ? lines + b0 * kLineStride : nullptr;
          for (int64_t g0 = q0; g0 < q1; g0 += step) {
            const int64_t g1 = std::min(q1, g0 + step);
            for (int m = 0; m < tile_rows; ++m) row_at[m] = a + (m0 + m) * lda + 2 * g0;
            float* out = c + m0 * ldc + b0 * 16;
            const bool accumulate = g0 > 0;
            // fp8: the tile's group sums are scaled into c as it stores them (TileArgs).
            const float* const* group_scales = kGroupFlush ? scales_of(codes, nb, g0 / group_pairs) : nullptr;
            if (first) {
              const TileArgs<Act> t{row_at, reinterpret_cast<const uint16_t*>(codes + g0 * 32),
                                    block_bytes / 2,
                                    g1 - g0,
                                    out,
                                    ldc,
                                    accumulate,
                                    kBf16PrefetchPairs,
                                    nullptr,
                                    group_scales,
                                    decode_unit()};
              bool mx_split = false;
              if constexpr (kMx) mx_split = prepare_mx<!Store>(codes, nb, dims, g0, g1, mx);
              if constexpr (kSplit)
                bf16_tile_any<Micro>(tile_rows, nb, t,
                                     typename Ops::template SplitLines<Store>{
                                         Store ? decoded + (g0 - q0) * 32 : nullptr, kLineStride, next_tile(g0)});
              else if constexpr (Store)
                bf16_tile_any<Micro>(tile_rows, nb, t,
                                     typename Ops::template Lines<kMx, true>{mx, decoded + (g0 - q0) * 32, kLineStride});
              else if (mx_split) {
                if constexpr (kMxSplit)
                  bf16_tile_any<Micro>(tile_rows, nb, t, typename Ops::MxSplitLines{mx, next_tile(g0)});
              } else {
                bf16_tile_any<Micro>(tile_rows, nb, t,
                                     typename Ops::template Lines<kMx, false>{mx, nullptr, 0, next_tile(g0)});
              }
            } else {
              // Row tile j + 1 brings block j of `next` to L2, a line per step, for the
              // decoding tile (as the BF16 GEMM streams its next k block).
              const int64_t j = m0 / Micro::kMaxRows - 1;
              const uint16_t* stream =
                  b0 == 0 && j < streamed && next != nullptr
                      ? reinterpret_cast<const uint16_t*>(next + j * block_bytes + (g0 - q0) * 64)
                      : nullptr;
              const TileArgs<Act> t{row_at, decoded + (g0 - q0) * 32, kLineStride, g1 - g0, out, ldc, accumulate, 0,
                                    stream, group_scales, decode_unit()};
              if constexpr (kSplit)
                bf16_tile_any<Micro>(tile_rows, nb, t, typename Ops::SplitReader{});
              else
                bf16_tile_any<Micro>(tile_rows, nb, t);
            }
          }
        }
      }
    }
    finish_rows(rows, dims, w, blocks, c, ldc, decode_unit());
  }

  // mxfp8: the exponents of pairs [q0, q1) of `blocks` blocks at w into mx (per block
  // kMxGroupsPerKBlock groups of Ops::kMxGroupBytes), for Ops::MxSplitLines when Split
  // and it takes every code (true), else for Ops::Lines<true, ...> (false).
  template <bool Split>
  static bool prepare_mx(const uint8_t* w, int blocks, const fp8_layout::MatrixDims& dims, int64_t q0, int64_t q1,
                         uint8_t* mx) {
    constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * Ops::kMxGroupBytes;
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes()), group_pairs = dims.group / 2;
    const int64_t g0 = q0 / group_pairs, g1 = (q1 + group_pairs - 1) / group_pairs;
    if constexpr (Split && kMxSplit) {
      bool fits = true;
      for (int b = 0; b < blocks; ++b)
        for (int64_t g = g0; g < g1; ++g)
          fits &= Ops::mx_prepare_split(w + b * block_bytes + dims.scales_offset() + g * 16,
                                        mx + b * kMxBlockBytes + (g - g0) * Ops::kMxGroupBytes);
      if (fits) return true;
    }
    for (int b = 0; b < blocks; ++b)
      for (int64_t g = g0; g < g1; ++g)
        Ops::mx_prepare(w + b * block_bytes + dims.scales_offset() + g * 16,
                        mx + b * kMxBlockBytes + (g - g0) * Ops::kMxGroupBytes);
    return false;
  }

  // What the vector kernels' decoded weights are to be multiplied by.
  static constexpr float decode_unit() {
    if constexpr (kSplit) return Ops::kSplitUnit;
    return kFp8DecodeScale;
  }

  // After all of k: fp8_perchannel's scales, mxfp8's NaN addends (rows holding a NaN code
  // or scale: the kernels cannot decode one).
  static void finish_rows(int64_t rows, const fp8_layout::MatrixDims& dims, const uint8_t* w, int blocks, float* c,
                          int64_t ldc, float unit) {
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    if constexpr (F == PackedFormat::kFp8PerChannel) {
      const float* scales[kTileBlocks];
      for (int b = 0; b < blocks; ++b) scales[b] = reinterpret_cast<const float*>(w + b * block_bytes + dims.scales_offset());
      fp8_scale_rows<Vec>(rows, blocks, scales, c, ldc, unit);
    }
    if constexpr (kMx) {
      const float* addends[kTileBlocks];
      for (int b = 0; b < blocks; ++b) addends[b] = reinterpret_cast<const float*>(w + b * block_bytes + dims.addend_offset());
      fp8_add_rows<Vec>(rows, blocks, addends, c, ldc);
    }
  }

  // Prefill on AMX tiles (fp8_amx.h): gemm_rows for one group of `blocks` <= kTileBlocks
  // blocks at w. Per k block of kFp8PrefillKBlockPairs pairs, the first 32-row pass over
  // each block pair decodes its codes into BF16 lines (fp8_line_buffer), 16 pairs just
  // before the B tile loads that read them, the later passes read them from L2; fp8
  // flushes per 128-k group with its scales, the others per k block.
  static void tile_group(const Act* a, int64_t lda, int64_t rows, const fp8_layout::MatrixDims& dims, const uint8_t* w,
                         int blocks, float* c, int64_t ldc) {
    const int64_t pairs = dims.padded_k / 2, group_pairs = dims.group / 2;
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    constexpr int64_t kLineStride = kFp8PrefillKBlockPairs * 32;  // [blocks][kKBlock][32]
    constexpr int64_t kMxBlockBytes = kMxGroupsPerKBlock * Ops::kMxGroupBytes;
    uint16_t* const lines = fp8_line_buffer();
    alignas(64) uint8_t mx[kTileBlocks * kMxBlockBytes];  // mxfp8: the k block's exponents
    for (int64_t q0 = 0; q0 < pairs; q0 += kFp8PrefillKBlockPairs) {
      const int64_t q1 = std::min(pairs, q0 + kFp8PrefillKBlockPairs);
      if constexpr (kMx) prepare_mx<false>(w, blocks, dims, q0, q1, mx);
      const typename Ops::template Lines<kMx, false> src{mx, nullptr, 0};
      for (int64_t m0 = 0; m0 < rows; m0 += kBf16PadRows)
        for (int b0 = 0; b0 < blocks; b0 += 2) {
          // The first pass decodes block b0 + t's lines of pairs [p, p + 16) of this k block.
          auto decode = [&](int t, int64_t p) {
            if (m0 == 0)
              Ops::Tiles::decode_lines(src, reinterpret_cast<const uint16_t*>(w + (b0 + t) * block_bytes + q0 * 32),
                                       b0 + t, p, Ops::Tiles::kTilePairs, lines + (b0 + t) * kLineStride);
          };
          const float* scales[2] = {nullptr, nullptr};
          if constexpr (kGroupFlush)
            for (int t = 0; t < 2 && b0 + t < blocks; ++t)
              scales[t] = reinterpret_cast<const float*>(w + (b0 + t) * block_bytes + dims.scales_offset()) +
                          q0 / group_pairs * 16;
          Ops::Tiles::pass(a + m0 * lda + 2 * q0, lda, std::min<int64_t>(kBf16PadRows, rows - m0),
                           lines + b0 * kLineStride, kLineStride, b0 + 1 < blocks, q1 - q0,
                           kGroupFlush ? group_pairs : q1 - q0, kGroupFlush ? scales : nullptr,
                           kGroupFlush ? kFp8DecodeScale : 1.0f, c + m0 * ldc + b0 * 16, ldc, q0 > 0, decode);
        }
    }
    finish_rows(rows, dims, w, blocks, c, ldc, kFp8DecodeScale);
  }

  // Decode: asks L2 for all the scale rows (fp8's block scales, mxfp8's exponents) of
  // `blocks` blocks at w (1 KiB a block at K 2048), as group_rows<false> starts a group of
  // blocks, for that group and the next. Without it each k block's rows were read where
  // the k block starts (mxfp8's prepare_mx) or a group ends (fp8), and missed there: in a
  // profile of 1-token S1 MXFP8 (perf, Zen 3, avx2, 2026-12-06) 30% of the decode's samples
  // sat in group_rows, 70% of those on the first use of the exponent load (14% after). Paired
  // against the build without it (scripts/ab_pair.py ... --calls 16 --rounds 2, same VM, a
  // run-time switch removed before commit), 1 / 8 tokens: S1 MXFP8 0.86 / 0.88 of the time
  // (rounds 0.85-0.86, 0.87-0.90), S2 MXFP8 0.90 / 0.93, S1 FP8 0.98 / 0.98. Only in the
  // decode instance. The per-k-block prefetch it replaces
  // (`_mm_prefetch` of the next k block's rows) compiled to nothing with GCC 12.2, and as
  // assembly measured 0.91-1.05 on a 2-core Zen 4 (avx512_bf16, 2026-12-05); in the
  // prefill instance, inlined or called, even never run, it had changed the code enough to
  // take 512-token S1 fp8 to 1.19x the time.
  static void prefetch_scale_rows(const uint8_t* w, int blocks, const fp8_layout::MatrixDims& dims) {
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    const int64_t bytes = dims.groups * kScaleRowBytes;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* at = w + b * block_bytes + dims.scales_offset();
      for (int64_t line = 0; line < bytes; line += 64) prefetch_l2(at + line);
    }
  }

  const MoePlan& plan_;
  fp8_layout::Dims dims_;
  int64_t tokens_, act_cols_, inter_cols_;
  Fp8Matrix gate_up_, down_;
  size_t acts_at_ = 0, inter_at_ = 0, token_scale_at_ = 0, inter_scale_at_ = 0;
  Act* acts_ = nullptr;
  Act* inter_ = nullptr;
  float* token_scale_ = nullptr;  // kScaled: [T][2] normalizing factor, its inverse
  float* inter_scale_ = nullptr;  // kScaled: [P] inverse of the intermediate row's factor
  Bf16Jobs<Micro> jobs_;
};

}  // namespace
}  // namespace kt::cpu
