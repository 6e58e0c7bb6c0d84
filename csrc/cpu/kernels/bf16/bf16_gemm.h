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
};

// Brings line p of `stream` (if any) to L2.
inline void maybe_stream(const uint16_t* stream, int64_t p) {
  if (stream != nullptr) _mm_prefetch(reinterpret_cast<const char*>(stream + p * 32), _MM_HINT_T1);
}

// Prefetches the weight line `ahead` k-pairs after line p of a block, if asked to.
inline void maybe_prefetch(const uint16_t* block, int64_t p, int64_t ahead) {
  if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(block + (p + ahead) * 32), _MM_HINT_T0);
}

// Accumulators of a tile whose blocks are one vector each (16-lane ISAs): start from c
// (accumulate) or zero, and the final store.
template <class V, int M, int NB, typename Act>
void load_accumulators(typename V::Reg (&acc)[M][NB], const TileArgs<Act>& t) {
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = t.accumulate ? V::load(t.c + m * t.ldc + b * 16) : V::zero();
}

template <class V, int M, int NB, typename Act>
void store_accumulators(const typename V::Reg (&acc)[M][NB], const TileArgs<Act>& t) {
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
