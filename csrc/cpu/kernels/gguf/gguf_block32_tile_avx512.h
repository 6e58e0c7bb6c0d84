// [NOTE] Block-32 prefill on AVX-512 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4): an integer tile
// GEMM over rows repacked once per call, the K-quant tile's scheme
// (gguf_kquant_tile_avx512.h) for the 32-weight blocks. Each group of 16 rows becomes, per
// block, 8 lines of [16 rows][4 k] level bytes (unsigned, the values the in-place kernel
// extracts: gguf_block32_avx512.h's block32_levels4) and the rows' d (and m) as fp32. Per token
// and block, 8 vpdpbusd give the 16 rows' exact int32 sums; the levels' offset comes off in
// integers from the activation block's level sum; then one conversion and one fma per
// (16 rows, token, block), into the accumulator of the block's lane b % 4. The integers and
// the float operations are the in-place kernel's:
//   acc_{b%4} = fma(float(S_b), d_b * da_b, acc_{b%4}),  accm_{b%4} = fma(m_b, da_b * levelsum_b, accm_{b%4}),
//   result (acc0 + acc2) + (acc1 + acc3) (+ the same of accm),
// so a token's result has the same bits on either path (gguf_rows picks by the expert's
// token count; batch invariance holds). Bounds: |S_b| <= 32 * 255 * 127 < 2^31.
// Include only from a variant translation unit, after its target pragma.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../formats/gguf_types.h"
#include "gguf_act.h"
#include "gguf_block32_avx512.h"
#include "gguf_decode.h"
#include "gguf_kquant_tile_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// Tokens per pass over two repacked groups: 12 accumulators, each a chain of 8 dependent
// vpdpbusd (enough chains to hide their latency). Passes of 4 tokens needed the chains
// split in two (one chain of 8: S1 Q8_0 512 tokens 59 ms, two of 4: 55) and still took
// 1.02-1.06x the time of these at 512 tokens (paired A/B, Zen 5, 2026-11-27); 6 tokens with
// split chains (24 accumulators) 1.00-1.03x.
constexpr int kBlock32TileTokens = 6;

// One block (32 k) of a group of 16 rows, repacked (640 bytes).
struct alignas(64) Block32TileBlock {
  uint8_t levels[8][64];  // line l: weights 4 l .. 4 l + 3 of row r at bytes 4 r .. 4 r + 3
  float d[16], m[16];     // per row; m: Q4_1 / Q5_1
};

// The block's scales of the 16 rows (lane r) from the first 4 bytes of each row's block
// (`head`, gathered): d (and m, Q4_1 / Q5_1) as f16 halves, or MXFP4's half scale from its
// exponent byte: mxfp4::half_scale_bits (mxfp4_block.h) on 16 lanes, as mxfp4_half_scales4
// computes it on 4 for the in-place kernel (2^(e - 128); subnormal below e = 2, NaN at 255).
template <GgmlType kType>
inline void block32_tile_scales(__m512i head, Block32TileBlock& t) {
  if constexpr (kType == GgmlType::kMxfp4) {
    const __m512i e = _mm512_and_si512(head, _mm512_set1_epi32(0xff));
    __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)),
                                 _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(mxfp4::kNanExponent)),
                                 _mm512_set1_epi32(0x7fc00000));
    _mm512_store_ps(t.d, _mm512_castsi512_ps(bits));
  } else {
    _mm512_store_ps(t.d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
    if constexpr (kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1)
      _mm512_store_ps(t.m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
  }
}

// The 8 level lines of one block of 16 rows, read from the rows' bytes at byte `at` (the
// block's start) by 4 x 4 int32 transposes within the 128-bit lanes. Q8_0: each register
// holds two rows' 32 level bytes (rows p and 4 + p, or 8 + p and 12 + p), so after the
// transposes one vshufi32x4 puts line w (and 4 + w) of all 16 rows together; the packed
// nibble types: four rows' 16 bytes, one per 128-bit lane (row 4 q + i in lane q of
// register i), whose transposes give the nibble words of rows 0-15 in order, split into
// levels afterwards (low nibbles: line w, high: line 4 + w). Q5_0 / Q5_1 add 16 where a
// fifth bit is set: the rows' 32-bit qh words gathered into one register (row_offsets:
// row r's bytes from row 0's), each of their bytes spread over its dword by a vpshufb, and
// per line a byte test against the line's 4 bit masks and a masked add. Per line 5 (Q8_0),
// 4 (Q4_0, Q4_1, MXFP4) or 6.5 (Q5) vector operations, against 9 and 5.5 for the in-place
// extraction of 4 blocks followed by 16 x 16 transposes.
template <GgmlType kType>
inline __attribute__((always_inline)) void block32_tile_levels(const uint8_t* const* rows, int64_t at, Block32TileBlock& t,
                                                                __m512i row_offsets) {
  constexpr int kQs = kBlock32Levels<kType>;
  constexpr bool kFifth = kType == GgmlType::kQ5_0 || kType == GgmlType::kQ5_1;
  if constexpr (kType == GgmlType::kQ8_0) {
    const auto pair = [&](int lo_row, int hi_row) {
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[lo_row] + at + kQs));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[hi_row] + at + kQs));
      return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    };
    __m512i y[4], z[4];
    transpose4x4_lanes_epi32(pair(0, 4), pair(1, 5), pair(2, 6), pair(3, 7), y);      // lanes: rows 0-3 w, 0-3 4+w, 4-7 w, 4-7 4+w
    transpose4x4_lanes_epi32(pair(8, 12), pair(9, 13), pair(10, 14), pair(11, 15), z);  // rows 8-15 alike
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int w = 0; w < 4; ++w) {
      _mm512_store_si512(t.levels[w], _mm512_xor_si512(_mm512_shuffle_i32x4(y[w], z[w], 0x88), flip));
      _mm512_store_si512(t.levels[4 + w], _mm512_xor_si512(_mm512_shuffle_i32x4(y[w], z[w], 0xDD), flip));
    }
  } else {
    const auto quad = [&](int i) {  // 128-bit lane q: row 4 q + i
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + at + kQs)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 + i] + at + kQs)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[8 + i] + at + kQs)), 2);
      return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[12 + i] + at + kQs)), 3);
    };
    __m512i y[4];
    transpose4x4_lanes_epi32(quad(0), quad(1), quad(2), quad(3), y);  // y[w] lane r: bytes 4 w .. 4 w + 3 of row r
    __m512i fifth[4];  // Q5: lane r's 4 bytes all byte c of row r's 32 fifth bits
    if constexpr (kFifth) {
      const __m512i qh = _mm512_i32gather_epi32(row_offsets, rows[0] + at + kQs - 4, 1);
      const __m512i dword_bytes = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0);
      for (int c = 0; c < 4; ++c) fifth[c] = _mm512_shuffle_epi8(qh, _mm512_add_epi8(dword_bytes, _mm512_set1_epi8(static_cast<char>(c))));
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int w = 0; w < 4; ++w) {
      __m512i lo = _mm512_and_si512(y[w], low), hi = _mm512_and_si512(_mm512_srli_epi16(y[w], 4), low);
      if constexpr (kFifth) {  // weight 4 w + i (lo) and 16 + 4 w + i (hi): bit 4 (w % 2) + i of byte w / 2 and 2 + w / 2
        const __m512i bit = _mm512_set1_epi32(static_cast<int>(w % 2 != 0 ? 0x80402010u : 0x08040201u));
        const __m512i sixteen = _mm512_set1_epi8(16);
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(fifth[w / 2], bit), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(fifth[2 + w / 2], bit), hi, sixteen);
      }
      if constexpr (kType == GgmlType::kMxfp4) {
        const __m512i table = _mm512_broadcast_i32x4(mxfp4_level_table());
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
      _mm512_store_si512(t.levels[w], lo);
      _mm512_store_si512(t.levels[4 + w], hi);
    }
  }
}

// 16 rows (pointers to their first block; a group's rows past the matrix repeat its last
// row) -> `blocks` repacked blocks: per block the levels straight from the rows
// (block32_tile_levels) and the scales from the rows' first 4 bytes of the block, gathered
// (block32_tile_scales). Against the in-place kernel's extraction of 4 blocks followed by
// 16 x 16 int32 transposes, 512-token S1 Q8_0 took 0.92-0.94, Q4_0 0.95-0.96, MXFP4 0.98,
// Q4_1 0.99 of the time; Q5_0 0.88 (S1) and 0.96 (S2), Q5_1 0.93 (S2) (Intel Xeon VM,
// avx512_vnni, both ways interleaved in one process, 2026-11-28).
// The gathered scales, against each row's 4 blocks' scales collected in a general register
// and transposed by permutes: 512 tokens S1 MXFP4 0.93, S2 Q4_0 0.96, Q4_1 0.93, Q5_0
// 0.91, S1 Q8_0 1.01 of the time (paired A/B, same VM, 2026-11-28).
// Cost on Zen 5 (a C++ harness, one core, rows in L2, 2026-12-02): per 16 rows x 32 k,
// Q8_0 11.3 ns, Q4_0 10.1, Q4_1 10.4, Q5_0 14.9 (what the tile GEMM spends on 6-9 tokens
// of that block); the scales' vpgatherdd is 1.7-3.4 ns of it (without it, timing only:
// 9.6 / 7.0 / 7.8 / 11.5), and 16 scalar loads through a stack array did not gain (1.05x
// the time, a noisy A/B). At 512 tokens (S1, ~32 tokens per expert) the repack and the
// passes of fewer than 6 tokens took 46% of the kernel's samples (perf), the 6-token tile
// the rest.
template <GgmlType kType>
void block32_tile_repack(const uint8_t* const* rows, int64_t blocks, Block32TileBlock* out) {
  constexpr int kBytes = kBlock32Bytes<kType>, kStep = 4 * kBytes;
  alignas(64) int32_t offsets[kKquantTileRows];  // row r's bytes from row 0's (one matrix: int32)
  for (int r = 0; r < kKquantTileRows; ++r) offsets[r] = static_cast<int32_t>(rows[r] - rows[0]);
  const __m512i row_offsets = _mm512_load_si512(offsets);
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, blocks - b0));
    if (b0 + 4 < blocks)  // the next step of every row to L1 (the span's stream brought it to L2)
      for (int r = 0; r < kKquantTileRows; ++r)
        for (int line = 0; line < kStep + 63; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(rows[r] + kBytes * (b0 + 4) + std::min(line, kStep - 1)), _MM_HINT_T0);
    for (int blk = 0; blk < n; ++blk) {
      Block32TileBlock& t = out[b0 + blk];
      block32_tile_levels<kType>(rows, kBytes * (b0 + blk), t, row_offsets);
      block32_tile_scales<kType>(_mm512_i32gather_epi32(row_offsets, rows[0] + kBytes * (b0 + blk), 1), t);
    }
  }
}

// G repacked groups (group g's blocks at w + g * blocks; rows r < rows[g]) dotted with T
// activation rows: out[j] + 16 g + r = dot(row r of group g, activation row j). Token j
// is one pointer, aq[j] its levels (quad order); its other arrays (GgufActs: rows kp bytes
// apart, as the levels') sit at fixed byte offsets from it: the block scales at scale_off,
// the block biases (-128 * level sum) at bias_off, the minimum sums (Q4_1, Q5_1) at
// min_off, each 16 bytes per block. With a pointer per token and array the tile's 18-24
// pointers spilled to vector registers, one move back per broadcast (19 per block and 96
// vpdpbusd): one pointer each, 512-token S1 Q8_0 0.94-0.99, Q4_0 0.89, MXFP4 0.94, Q5_0 /
// Q5_1 0.95-0.97, Q4_1 0.99-1.01 of the time (Intel Xeon VM, avx512_vnni, both ways
// interleaved in one process, 2026-11-28). Per 4-k
// line, G weight loads and T broadcasts feed G * T vpdpbusd; the fp32 accumulators (4 block
// lanes x G x T registers) live in L1. The minimums' products (Q4_1, Q5_1) are summed after
// the dots, lane by lane in registers (the same order within each lane, so the same bits):
// 512-token S2 Q4_1 0.93-0.94, Q5_1 0.93 of the time of accumulating them in L1 beside the
// dots (0.94 on avx512; Intel Xeon VM, interleaved in one process, 2026-11-28).
template <class Ops, GgmlType kType, int G, int T>
void block32_tile_gemm(const Block32TileBlock* w, int64_t blocks, const int8_t* const* aq_in, intptr_t scale_off,
                       intptr_t bias_off, intptr_t min_off, float* const* out, const int* rows, const char* stream,
                       int64_t stream_lines) {
  constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;
  // `stream_lines` lines from `stream` to L2, spread over the blocks.
  const int64_t per_step = (stream_lines + blocks - 1) / blocks;
  int64_t streamed = 0;
  const int8_t* aq[T];  // a local copy: the compiler keeps them in general registers
  for (int j = 0; j < T; ++j) aq[j] = aq_in[j];
  alignas(64) float acc[4][G][T][16], accm[kMin ? 4 : 1][G][T][16];
  for (int l = 0; l < 4; ++l)
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < T; ++j) _mm512_store_ps(acc[l][g][j], _mm512_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    for (const int64_t end = std::min(stream_lines, streamed + per_step); streamed < end; ++streamed)
      _mm_prefetch(stream + streamed * 64, _MM_HINT_T1);
    const int64_t at = 128 * (b / 4) + 16 * (b % 4);  // the block's values 0-15 (quad order); 16-31 at + 64
    const intptr_t s_at = scale_off + 16 * b, b_at = bias_off + 16 * b;
    // The chain starts at the levels' offset times the activation block's level sum (taken
    // off in integers); with 8 or fewer accumulators, lines 0-3 and 4-7 run as two chains.
    constexpr bool kSplit = G * T <= 8;
    __m512i v[G][T], v_hi[G][T];
    for (int j = 0; j < T; ++j) {
      int32_t bias;
      std::memcpy(&bias, aq[j] + b_at, 4);
      const __m512i offset = block32_offset<Ops, kType>(_mm512_set1_epi32(bias));
      for (int g = 0; g < G; ++g) {
        v[g][j] = kSplit ? _mm512_setzero_si512() : offset;
        if constexpr (kSplit) v_hi[g][j] = offset;
      }
    }
    const Block32TileBlock* wb = w + b;
#pragma GCC unroll 8
    for (int line = 0; line < 8; ++line) {
      __m512i a[T];
      for (int j = 0; j < T; ++j) {
        int32_t word;
        std::memcpy(&word, aq[j] + at + (line < 4 ? 4 * line : 64 + 4 * (line - 4)), 4);
        a[j] = _mm512_set1_epi32(word);
      }
      for (int g = 0; g < G; ++g) {
        const __m512i levels = _mm512_load_si512(wb[g * blocks].levels[line]);
        for (int j = 0; j < T; ++j) {
          __m512i& sum = kSplit && line >= 4 ? v_hi[g][j] : v[g][j];
          sum = kType == GgmlType::kQ8_0 ? Ops::dot_int8(sum, levels, a[j]) : Ops::dot(sum, levels, a[j]);
        }
      }
    }
    if constexpr (kSplit)
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < T; ++j) v[g][j] = _mm512_add_epi32(v[g][j], v_hi[g][j]);
    const int lane = static_cast<int>(b % 4);
    for (int j = 0; j < T; ++j) {
      float da_s;
      std::memcpy(&da_s, aq[j] + s_at, 4);
      const __m512 da = _mm512_set1_ps(da_s);
      for (int g = 0; g < G; ++g) {
        const Block32TileBlock& t = wb[g * blocks];
        _mm512_store_ps(acc[lane][g][j], _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[g][j]), _mm512_mul_ps(_mm512_load_ps(t.d), da),
                                                         _mm512_load_ps(acc[lane][g][j])));
      }
    }
  }
  if constexpr (kMin)  // accm_{lane} = sum over its blocks, in order, of m_b * (da_b * levelsum_b)
    for (int lane = 0; lane < 4; ++lane) {
      __m512 f[G][T];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < T; ++j) f[g][j] = _mm512_setzero_ps();
      for (int64_t b = lane; b < blocks; b += 4)
        for (int j = 0; j < T; ++j) {
          float min_s;
          std::memcpy(&min_s, aq[j] + min_off + 16 * b, 4);
          for (int g = 0; g < G; ++g)
            f[g][j] = _mm512_fmadd_ps(_mm512_load_ps(w[b + g * blocks].m), _mm512_set1_ps(min_s), f[g][j]);
        }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < T; ++j) _mm512_store_ps(accm[lane][g][j], f[g][j]);
    }
  for (int g = 0; g < G; ++g) {
    const __mmask16 valid = static_cast<__mmask16>((1u << rows[g]) - 1);
    for (int j = 0; j < T; ++j) {
      const auto lanes = [&](float (*a)[G][T][16]) {
        return _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(a[0][g][j]), _mm512_load_ps(a[2][g][j])),
                             _mm512_add_ps(_mm512_load_ps(a[1][g][j]), _mm512_load_ps(a[3][g][j])));
      };
      __m512 result = lanes(acc);
      if constexpr (kMin) result = _mm512_add_ps(result, lanes(accm));
      _mm512_mask_storeu_ps(out[j] + 16 * g, valid, result);
    }
  }
}

template <class Ops, GgmlType kType, int G>
void block32_tile_pass(int count, const Block32TileBlock* w, int64_t blocks, const int8_t* const* aq,
                       intptr_t scale_off, intptr_t bias_off, intptr_t min_off, float* const* out, const int* rows,
                       const char* stream, int64_t stream_lines) {
  static_assert(kBlock32TileTokens == 6);
  switch (count) {
    case 6: return block32_tile_gemm<Ops, kType, G, 6>(w, blocks, aq, scale_off, bias_off, min_off, out, rows, stream, stream_lines);
    case 5: return block32_tile_gemm<Ops, kType, G, 5>(w, blocks, aq, scale_off, bias_off, min_off, out, rows, stream, stream_lines);
    case 4: return block32_tile_gemm<Ops, kType, G, 4>(w, blocks, aq, scale_off, bias_off, min_off, out, rows, stream, stream_lines);
    case 3: return block32_tile_gemm<Ops, kType, G, 3>(w, blocks, aq, scale_off, bias_off, min_off, out, rows, stream, stream_lines);
    case 2: return block32_tile_gemm<Ops, kType, G, 2>(w, blocks, aq, scale_off, bias_off, min_off, out, rows, stream, stream_lines);
    default: return block32_tile_gemm<Ops, kType, G, 1>(w, blocks, aq, scale_off, bias_off, min_off, out, rows, stream, stream_lines);
  }
}

// out[p * ldo + n] = dot(row n of `expert`, activation row act_row(p)) for rows [n0, n1)
// and pairs [p0, p1) of a block-32 matrix (activations in kGgufQuad32Acts' format):
// kKquantTileGroups groups of 16 rows repacked at a time, then dotted with the pairs
// kBlock32TileTokens at a time.
template <class Ops, GgmlType kType, class Matrix>
void block32_tile_rows(const Matrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
                       const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  const int64_t blocks = m.k / 32;
  thread_local std::vector<Block32TileBlock> packed;
  packed.resize(static_cast<size_t>(kKquantTileGroups * blocks));
  const auto repack = [&](int g, const uint8_t* const* row_at) {
    block32_tile_repack<kType>(row_at, blocks, packed.data() + g * blocks);
  };
  // Byte offsets from a token's levels to its block scales, biases and minimum sums
  // (GgufActs: every array's rows are kp bytes apart, all carved from one scratch buffer).
  const intptr_t q0 = reinterpret_cast<intptr_t>(acts.q);
  const intptr_t scale_off = reinterpret_cast<intptr_t>(acts.scale) - q0;
  const intptr_t bias_off = reinterpret_cast<intptr_t>(acts.bias4 + m.kp / 8) - q0;
  const intptr_t min_off = reinterpret_cast<intptr_t>(acts.block_min_sums) - q0;
  const auto pass = [&](int groups, int count, const int64_t* a, float* const* outs, const int* rows,
                        const char* stream, int64_t stream_lines) {
    const int8_t* aq[kBlock32TileTokens];
    for (int j = 0; j < count; ++j) aq[j] = acts.q + a[j] * m.kp;
    static_assert(kKquantTileGroups == 2);
    if (groups == 2)
      block32_tile_pass<Ops, kType, 2>(count, packed.data(), blocks, aq, scale_off, bias_off, min_off, outs, rows,
                                       stream, stream_lines);
    else
      block32_tile_pass<Ops, kType, 1>(count, packed.data(), blocks, aq, scale_off, bias_off, min_off, outs, rows,
                                       stream, stream_lines);
  };
  repacked_tile_spans<kBlock32TileTokens>(m, expert, n0, n1, act_rows, p0, p1, out, ldo, repack, pass);
}

}  // namespace
}  // namespace kt::cpu
