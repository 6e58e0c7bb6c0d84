// [NOTE] The BF16 micro-GEMM interface every ISA implements (bf16_gemm_avx512_bf16.h,
// bf16_gemm_avx512.h, bf16_gemm_avx2.h):
//
//   struct Micro {
//     using Vec = ...;           // fp32 vector ops (isa/vec_*.h)
//     using Act = ...;           // activation element: uint16_t (bf16 bits) or float
//     static constexpr int kMaxRows, kMaxBlocks;
//     static constexpr int max_blocks(int rows);  // blocks per tile of `rows` rows
//     template <int M, int NB> static void tile(const TileArgs<Act>&);
//     // optional, for matrix units (AMX): computes what it can of a whole GEMM
//     static TileCoverage tile_gemm(a, lda, rows, w, block_stride, pairs, blocks, c, ldc);
//   };
//
// tile<M, NB> computes, for rows m < M and output blocks b < NB (16 columns each),
//   c[m][16 b + n] (+)= sum_{p < pairs} a[m][2p] w_b[p][n][0] + a[m][2p + 1] w_b[p][n][1]
// where w_b = w + b * block_stride is a packed block (formats/bf16_layout.h). Each output
// lane must see the same operations in the same order whatever M and NB are (batch
// invariance: a token's result may not depend on the other rows of its tile).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../tile_coverage.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

template <typename Act>
struct TileArgs {
  const Act* const* a;   // [M] row pointers, each at the tile's first k-pair (2 elements)
  const uint16_t* w;     // first 64-byte line of block 0 in this k range
  int64_t block_stride;  // uint16 elements between consecutive blocks
  int64_t pairs;         // k-pairs to accumulate
  float* c;              // [M][ldc] fp32 output tile, NB * 16 columns used
  int64_t ldc;
  bool accumulate;       // add to c instead of overwriting it
  int64_t prefetch;      // k-pairs ahead to prefetch weight lines (0: none). The decode
                         // path streams weights from DRAM once: prefetching 2 KiB ahead
                         // took 1-token S1 from ~85% to ~93% of read bandwidth.
  const uint16_t* stream = nullptr;  // prefill: line p of this to L2 at step p (the next k block)
  // Set: the tile's sums end a scale group (FP8 block scales). They start from zero and
  // are stored as c[m][16 b + n] = group_scales[b][n] * (group_unit * sum), added to c
  // when `accumulate` (fma): the scaling happens in registers, with no partial-sum pass.
  const float* const* group_scales = nullptr;
  float group_unit = 1.0f;
};

// Brings line p of `stream` (if any) to L2.
inline void maybe_stream(const uint16_t* stream, int64_t p) {
  if (stream != nullptr) _mm_prefetch(reinterpret_cast<const char*>(stream + p * 32), _MM_HINT_T1);
}

// Decode: from pair `end` of a call on (past its blocks' last lines), weight prefetches
// move `wrap` bytes on, to the same block of the next tile of blocks, whose streams then
// start warm (bf16_gemm_rows; FP8's code prefetch likewise, fp8_format.h).
struct NextTile {
  int64_t end = INT64_MAX;
  int64_t wrap = 0;
};

// Prefetches the weight line `ahead` k-pairs after line p of a block (past next.end, in
// the next tile's block), if asked to: to L2, as the int decode tiles do (quant_gemm.h's
// prefetch_ahead; an L1 prefetch holds a fill buffer until its line arrives). On a 2-core
// Zen 4 (scripts/ab_pair.py, a run-time switch in one build, 2 rounds of 12 calls,
// 2026-12-04) L2 instead of L1 took 1 / 8 / 64 tokens S1 BF16 to 0.95-0.98 / 0.99 / 0.96
// of the time on avx512_bf16 and 1 / 8 tokens to 0.94 / 1.00 forced to avx2.
inline void maybe_prefetch(const uint16_t* block, int64_t p, int64_t ahead, const NextTile& next) {
  if (ahead <= 0) return;
  const int64_t q = p + ahead;
  _mm_prefetch(reinterpret_cast<const char*>(block + q * 32) + (q >= next.end ? next.wrap : 0), _MM_HINT_T1);
}

// Accumulators of a tile whose blocks are one vector each (16-lane ISAs): start from c
// (accumulate) or zero, and the final store.
// The tile prologue and epilogues are forced inline: a call passes the accumulators
// through memory (GCC outlined store_accumulators once it had the group_scales branch:
// 512-token FP8 1.03-1.05x the time).
#define KT_TILE_INLINE inline __attribute__((always_inline))

template <class V, int M, int NB, typename Act>
KT_TILE_INLINE void load_accumulators(typename V::Reg (&acc)[M][NB], const TileArgs<Act>& t) {
  const bool from_c = t.accumulate && t.group_scales == nullptr;
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = from_c ? V::load(t.c + m * t.ldc + b * 16) : V::zero();
}

// Whether a group's unit multiplies its scales (s * unit, then the sum) rather than its
// sums: AVX-512's decoders give w / 256 for activations as they are, so 256 * sum can
// overflow where s * 256 * sum does not (FP8 with activations ~1e18 came out inf), and
// s * 256 is exact for any real scale; AVX2's split lanes give w * 2^-120 of rows
// normalized to [2^32, 2^33), whose sums take 2^120 safely but a scale above 256 would
// not. Same bits either way wherever nothing overflows (the one rounding is of the same
// exact product).
KT_TILE_INLINE bool unit_on_scale(float unit) { return unit <= 256.0f; }

// One output vector of a tile that ends a scale group (TileArgs::group_scales).
template <class V>
KT_TILE_INLINE void store_group_sum(float* out, typename V::Reg sum, const float* scale, typename V::Reg unit,
                                    bool on_scale, bool accumulate) {
  const typename V::Reg s = on_scale ? V::mul(V::load(scale), unit) : V::load(scale);
  const typename V::Reg x = on_scale ? sum : V::mul(sum, unit);
  V::store(out, accumulate ? V::fma(s, x, V::load(out)) : V::mul(s, x));
}

template <class V, int M, int NB, typename Act>
KT_TILE_INLINE void store_accumulators(const typename V::Reg (&acc)[M][NB], const TileArgs<Act>& t) {
  if (t.group_scales != nullptr) {
    const typename V::Reg unit = V::set1(t.group_unit);
    const bool on_scale = unit_on_scale(t.group_unit);
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b)
        store_group_sum<V>(t.c + m * t.ldc + b * 16, acc[m][b], t.group_scales[b], unit, on_scale, t.accumulate);
    return;
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) V::store(t.c + m * t.ldc + b * 16, acc[m][b]);
}

// A bf16 pair (two consecutive activations) as one 32-bit lane value.
inline int32_t load_pair(const uint16_t* p) {
  int32_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

}  // namespace
}  // namespace kt::cpu
