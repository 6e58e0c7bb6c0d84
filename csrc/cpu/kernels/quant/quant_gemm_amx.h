// [NOTE] INT8 / INT4 / MXFP4 GEMM on AMX tiles for experts with more tokens than one
// vector micro-tile. Activations are int8 (signed); weights:
//   INT8:  a block's lines are AMX's B layout already (16 lines = a B tile of 64 k),
//          unsigned offset-binary bytes (tdpbsud, the bias comes off at the flush);
//   INT4 / MXFP4: lines unpacked per k step into B tile buffers (AMX reads tiles from
//          memory; nothing larger than a block's k range is ever unpacked), symmetric
//          int4 and MXFP4 as signed levels (level - bias, tdpbssd: no activation sum at
//          the flush), asymmetric int4 with integer zero points as level - z (signed, the
//          same flush: int_layout.h), other asymmetric int4 as unsigned levels (tdpbsud,
//          plus the minimum term).
// int32 sums are flushed to fp32 per group (int8: every QuantGemm::kInt8FlushK k) with QuantGemm's
// arithmetic, so the tiles give the same bits as the vector micro-kernel (decode, tails):
// batch invariance holds.
// MXFP4 runs spans of 512 k (mxfp4_span.h): one integer sum per span and tile where the
// exponents allow, group by group otherwise (mxfp4_tile_gemm).
// Groups of 32 (RAWINT4, int4 group_size 32) flush after every tdpbssd: they run
// one block at a time (block_pass_g32), its B tiles unpacked once, by the first row tile
// just before it loads them, the later row tiles reading them back; the
// fp32 accumulators of a 16-row tile in registers, four C tiles in rotation so a group's
// sums are stored and flushed two groups later, while the next tdpbssd run. Larger
// groups: passes of 32 rows x 2 blocks (tile_pass; C = tmm0..3, A = tmm4..5, B = tmm6..7).
// Experts of at most 16 rows with groups of 32 keep the 32 x 2 passes. Measured (512
// tokens RAWINT4 / MXFP4 0.62-0.78 of the previous pass's time) and what was tried and not
// kept: docs/formats.md, "AMX tiles for INT4 and MXFP4".
// An INT8 k tail (K not a multiple of 64) starts on a flush boundary and, with an odd
// last block of the larger-group passes, is left to the AVX512_VNNI micro-kernel this
// struct inherits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../../engine/scratch.h"
#include "../../isa/vec_avx512.h"
#include "../bf16/bf16_gemm_amx.h"
#include "../tile_coverage.h"
#include "int_ops_avx512_vnni.h"
#include "mxfp4_span.h"
#include "quant_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

template <QuantKind Kind>
struct QuantGemmAmx : QuantGemm<IntOpsAvx512Vnni, Kind> {
  using Base = QuantGemm<IntOpsAvx512Vnni, Kind>;
  static constexpr bool kInt4 = Base::kInt4;
  // Symmetric int4 and MXFP4 unpack level - bias into signed B tiles (tdpbssd): the same
  // int32 sums as the biased levels' less bias x the activation sum.
  static constexpr bool kSigned = Kind == QuantKind::kInt4 || Kind == QuantKind::kMxfp4;
  static constexpr int kBias = Kind == QuantKind::kMxfp4 ? int_layout::kMxfp4LevelBias : int_layout::kInt4Zero;

  static TileCoverage tile_gemm(const QuantRows& a, int64_t rows, const int_layout::MatrixDims& dims,
                                const uint8_t* w, int blocks, float* c, int64_t ldc) {
    const int64_t k_step = kInt4 ? std::min<int64_t>(dims.group, 64) : 64;
    // INT8 tiles take k in steps of 64; when K is not a multiple of 64 the tail left to
    // the vector micro-kernel starts on a flush boundary (same flushes as decode).
    const int64_t covered_k = kInt4 || dims.padded_k % 64 == 0 ? dims.padded_k
                                                                : dims.padded_k / Base::kInt8FlushK * Base::kInt8FlushK;
    // One block at a time pays off from two row tiles (at 64 tokens, experts of 5-16 rows
    // took 1.05-1.10x the time on it: a 16-row flush per group for a few rows).
    if constexpr (Kind == QuantKind::kMxfp4) return mxfp4_tile_gemm(a, rows, dims, w, blocks, c, ldc);
    const bool g32 = signed_levels(dims) && dims.group == 32 && rows > 16;
    const TileCoverage done{covered_k, g32 ? blocks : blocks / 2 * 2};
    if (done.pairs == 0 || done.blocks == 0) return {0, 0};
    configure(k_step);
    if (g32) {
      for (int b = 0; b < blocks; ++b)
        block_pass_g32(a, rows, dims, w + b * dims.block_bytes(), covered_k, c + b * 16, ldc);
    } else {
      for (int64_t m0 = 0; m0 < rows; m0 += 32)
        for (int b0 = 0; b0 < done.blocks; b0 += 2)
          tile_pass(a, m0, std::min<int64_t>(32, rows - m0), dims, w + b0 * dims.block_bytes(), k_step,
                    covered_k, c + m0 * ldc + b0 * 16, ldc);
    }
    _tile_release();
    return done;
  }

 private:
  // Whether the B tiles hold signed levels (tdpbssd): symmetric int4 and MXFP4 (level -
  // bias), int4_asym with integer zero points (level - z: MatrixDims::integer_zeros).
  static bool signed_levels(const int_layout::MatrixDims& dims) { return kSigned || dims.integer_zeros; }

  // What unpack_b adds to each level byte: -bias (signed kinds), -z of each row's lane
  // (integer zero points: group g's minimums / scales of the block at `block`), else 0.
  static __m512i level_offsets(const int_layout::MatrixDims& dims, const uint8_t* block, int64_t g) {
    if constexpr (kSigned) {
      return _mm512_set1_epi8(static_cast<char>(-kBias));
    } else if constexpr (Kind == QuantKind::kInt4Asym) {
      if (!dims.integer_zeros) return _mm512_setzero_si512();
      const __m512 minimum = _mm512_loadu_ps(
          reinterpret_cast<const float*>(block + dims.minimums_offset() + g * int_layout::kLineBytes));
      const __m512i negative_z = IntOpsAvx512::negative_zeros(
          minimum, Base::load_scales(block + dims.scales_offset() + g * Base::kScaleRowBytes, 0));
      // The low byte of each int32 lane (-z, two's complement) in all four of its bytes.
      return _mm512_shuffle_epi8(negative_z,
                                 _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c)));
    } else {
      return _mm512_setzero_si512();
    }
  }

  static void configure(int64_t k_step) {
    AmxTileConfig config;
    for (int t = 0; t < 4; ++t) {  // C: 16 rows x 16 int32
      config.rows[t] = 16;
      config.bytes_per_row[t] = 64;
    }
    for (int t = 4; t < 6; ++t) {  // A: 16 rows x k_step int8
      config.rows[t] = 16;
      config.bytes_per_row[t] = static_cast<uint16_t>(k_step);
    }
    for (int t = 6; t < 8; ++t) {  // B: k_step / 4 quad lines x 64 bytes
      config.rows[t] = static_cast<uint8_t>(k_step / 4);
      config.bytes_per_row[t] = 64;
    }
    load_tile_config(config);
  }

  // INT4: the k_step / 8 lines from `line` as k_step / 4 quad lines (low nibbles of
  // line l = quad 2l, high = quad 2l + 1); MXFP4: the codes' levels (Base::mxfp4_levels);
  // plus `offsets` (level_offsets: signed levels where it subtracts a bias or zero point).
  static void unpack_b(const uint8_t* line, int64_t k_step, uint8_t* tile, __m512i offsets) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int64_t l = 0; l < k_step / 8; ++l) {
      const __m512i v = _mm512_loadu_si512(line + l * 64);
      __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      if constexpr (Kind == QuantKind::kMxfp4) {
        lo = Base::mxfp4_levels(lo);
        hi = Base::mxfp4_levels(hi);
      }
      if constexpr (kInt4) {
        lo = _mm512_add_epi8(lo, offsets);
        hi = _mm512_add_epi8(hi, offsets);
      }
      _mm512_store_si512(tile + (2 * l) * 64, lo);
      _mm512_store_si512(tile + (2 * l + 1) * 64, hi);
    }
  }

  // One k step of a 32-row x 2-block pass: C tmm0..3 += A (a0, and a1 when two_row_tiles:
  // tmm4 / tmm5) x B (b0 / b1: tmm6 / tmm7, 64-byte rows, the A tiles' k_step / 4 quad lines).
  // tdpbssd on signed levels, else tdpbsud (unsigned offset-binary or asymmetric levels).
  // The intrinsics paste their tile numbers into asm, so the tile numbers are literals here.
  __attribute__((always_inline)) static inline void dot_step(const int8_t* a0, const int8_t* a1, int64_t stride,
                                                             const void* b0, const void* b1, bool two_row_tiles,
                                                             bool signed_dot) {
#define KT_AMX_DOT(c, a, b)  \
  do {                       \
    if (signed_dot)          \
      _tile_dpbssd(c, a, b); \
    else                     \
      _tile_dpbsud(c, a, b); \
  } while (0)
    _tile_loadd(4, a0, stride);
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    KT_AMX_DOT(0, 4, 6);
    KT_AMX_DOT(1, 4, 7);
    if (two_row_tiles) {
      _tile_loadd(5, a1, stride);
      KT_AMX_DOT(2, 5, 6);
      KT_AMX_DOT(3, 5, 7);
    }
#undef KT_AMX_DOT
  }

  // Two k steps of a pass of up to 16 rows: C tmm0..1 += A (a0: tmm4, then a0 + k_step:
  // tmm5) x B (b0 / b1: tmm6 / tmm7, then c0 / c1: tmm2 / tmm3, free in such a pass). All
  // six tiles load before the first multiply, so the second step's loads need not wait
  // for the first step's multiplies to release their tiles (bf16_gemm_amx.h). Same
  // products in the same order as two dot_steps: bit-identical. Paired against one step
  // at a time (scripts/ab_pair.py, run-time switch, 8 calls x 2 rounds; Intel Xeon VM with
  // AMX, family 6 model 167, 2026-12-06), 128 / 512 tokens: S1 AMXINT8 0.89x / 0.74x the
  // time, S1 AMXINT4 0.93x / 0.90x, S2 GPTQ_INT4 0.86x / 0.90x.
  __attribute__((always_inline)) static inline void dot_two_steps(const int8_t* a0, int64_t stride, int64_t k_step,
                                                                  const void* b0, const void* b1, const void* c0,
                                                                  const void* c1, bool signed_dot) {
    _tile_loadd(4, a0, stride);
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_loadd(5, a0 + k_step, stride);
    _tile_loadd(2, c0, 64);
    _tile_loadd(3, c1, 64);
    if (signed_dot) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(0, 5, 2);
      _tile_dpbssd(1, 5, 3);
    } else {
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 4, 7);
      _tile_dpbsud(0, 5, 2);
      _tile_dpbsud(1, 5, 3);
    }
  }

  // Groups of 32 (signed levels): all rows x one block at w -> c (see the note above).
  // Group g: C = tmm(g % 4), A = tmm4 / tmm5 and B = tmm6 / tmm7 by its parity.
  static void block_pass_g32(const QuantRows& a, int64_t rows, const int_layout::MatrixDims& dims,
                             const uint8_t* w, int64_t covered_k, float* c, int64_t ldc) {
    const int64_t groups = covered_k / 32;
    const uint8_t* scales = w + dims.scales_offset();
    uint8_t* b_buf = thread_buffer(ThreadBuffer::kTileWeights, static_cast<size_t>(groups) * 512);
    constexpr int64_t kAhead = 16;  // groups of codes and scales prefetched ahead
    alignas(64) int32_t sums[16][16];
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      const int8_t* a0 = a.levels + m0 * a.stride;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
      auto flush = [&](int64_t g) {  // acc += group g's sums x its scales
        const __m512 scale = Base::load_scales(scales + g * Base::kScaleRowBytes, 0);
#pragma GCC unroll 16
        for (int m = 0; m < 16; ++m)
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[m])), scale, acc[m]);
      };
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      // C tile of group g: tmm(g % 4); its sums are stored two groups later.
      auto drain = [&](int64_t g) {
        switch (g & 3) {
          case 0: _tile_stored(0, sums, 64); _tile_zero(0); break;
          case 1: _tile_stored(1, sums, 64); _tile_zero(1); break;
          case 2: _tile_stored(2, sums, 64); _tile_zero(2); break;
          default: _tile_stored(3, sums, 64); _tile_zero(3); break;
        }
        flush(g);
      };
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* at_g = a0 + g * 32;
        uint8_t* b_g = b_buf + g * 512;
        if (m0 == 0) {  // the first row tile unpacks each group just before its B tile load
          if (g + kAhead < groups) {
            for (int l = 0; l < 4; ++l)
              _mm_prefetch(reinterpret_cast<const char*>(w + ((g + kAhead) * 4 + l) * 64), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(scales + (g + kAhead) * Base::kScaleRowBytes), _MM_HINT_T0);
          }
          unpack_b(w + g * 4 * 64, 32, b_g, level_offsets(dims, w, g));
        }
        switch (g & 3) {
          case 0: _tile_loadd(4, at_g, a.stride); _tile_loadd(6, b_g, 64); _tile_dpbssd(0, 4, 6); break;
          case 1: _tile_loadd(5, at_g, a.stride); _tile_loadd(7, b_g, 64); _tile_dpbssd(1, 5, 7); break;
          case 2: _tile_loadd(4, at_g, a.stride); _tile_loadd(6, b_g, 64); _tile_dpbssd(2, 4, 6); break;
          default: _tile_loadd(5, at_g, a.stride); _tile_loadd(7, b_g, 64); _tile_dpbssd(3, 5, 7); break;
        }
        if (g >= 2) drain(g - 2);
      }
      for (int64_t g = std::max<int64_t>(0, groups - 2); g < groups; ++g) drain(g);
      const int64_t n = std::min<int64_t>(16, rows - m0);
      for (int64_t m = 0; m < n; ++m) _mm512_storeu_ps(c + (m0 + m) * ldc, acc[m]);
    }
  }

  // MXFP4: passes of 32 rows x 2 blocks over spans of 512 k (mxfp4_span.h), 64-k tiles.
  // A span whose rows' exponents lie within kMxfp4MaxShift of each other (every row of
  // both blocks) is one int32 sum per tile (levels shifted left by e - e_min), flushed
  // once with the smallest half-scale; any other span runs group by group (each group's
  // B tile with zeros in the other group's half of k), as the vector path adds them.
  // Each block pair's B tiles are unpacked by its first row tile into a per-thread
  // buffer (one 32 KiB slot per span) that the later row tiles read back.
  struct SpanInfo {
    alignas(64) float min_scale[2][16];  // merged: the smallest half-scale of each row
    int32_t merged;
  };
  static constexpr int64_t kSpanK = kMxfp4SpanGroups * 32;
  static constexpr int64_t kSpanSlotBytes = kMxfp4SpanGroups * 2 * 1024;  // 4 groups x 2 blocks of B tiles

  static TileCoverage mxfp4_tile_gemm(const QuantRows& a, int64_t rows, const int_layout::MatrixDims& dims,
                                      const uint8_t* w, int blocks, float* c, int64_t ldc) {
    // 64-k tiles: a k tail of 32 (an odd number of groups) goes to the vector path, from a
    // span boundary so that it adds the same partials.
    const int64_t covered_k = dims.padded_k % 64 == 0 ? dims.padded_k : dims.padded_k / kSpanK * kSpanK;
    const TileCoverage done{covered_k, blocks / 2 * 2};
    if (done.pairs == 0 || done.blocks == 0) return {0, 0};
    const int64_t spans = (covered_k + kSpanK - 1) / kSpanK;
    uint8_t* buffer = thread_buffer(ThreadBuffer::kTileWeights,
                                    static_cast<size_t>(spans) * (kSpanSlotBytes + sizeof(SpanInfo)));
    auto* info = reinterpret_cast<SpanInfo*>(buffer + spans * kSpanSlotBytes);
    configure(64);
    for (int b0 = 0; b0 < done.blocks; b0 += 2)
      for (int64_t m0 = 0; m0 < rows; m0 += 32)
        mxfp4_pass(a, m0, std::min<int64_t>(32, rows - m0), dims, w + b0 * dims.block_bytes(), covered_k, buffer,
                   info, c + m0 * ldc + b0 * 16, ldc);
    _tile_release();
    return done;
  }

  // Whether the span of `n` groups whose first scale row is at `row` merges in every row
  // of the block; if so, per group the shift of each row's levels (int32 lanes: the 4
  // bytes of a B-tile lane are one row) with the byte mask that clears what the shift
  // carries in from the byte below, and the rows' smallest half-scales.
  static bool span_shifts(const uint8_t* row, int64_t n, __m512i (&shift)[kMxfp4SpanGroups],
                          __m512i (&mask)[kMxfp4SpanGroups], float* min_scale) {
    __m256i field[kMxfp4SpanGroups];
    __m256i lo = _mm256_set1_epi16(-1), hi = _mm256_setzero_si256(), any = _mm256_setzero_si256(),
            mantissa = _mm256_setzero_si256();
    for (int64_t j = 0; j < n; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * Base::kScaleRowBytes));
      field[j] = _mm256_srli_epi16(v, 7);  // the sign (never set) makes it > 255
      lo = _mm256_min_epu16(lo, field[j]);
      hi = _mm256_max_epu16(hi, field[j]);
      any = _mm256_or_si256(any, v);
      mantissa = _mm256_or_si256(mantissa, _mm256_and_si256(v, _mm256_set1_epi16(0x7f)));
    }
    const __mmask16 zero_rows = _mm256_cmpeq_epi16_mask(any, _mm256_setzero_si256());
    const __mmask16 in_range = _mm256_cmpge_epu16_mask(lo, _mm256_set1_epi16(1)) &
                               _mm256_cmple_epu16_mask(hi, _mm256_set1_epi16(kMxfp4MaxField)) &
                               _mm256_cmple_epu16_mask(_mm256_sub_epi16(hi, lo), _mm256_set1_epi16(kMxfp4MaxShift)) &
                               _mm256_cmpeq_epi16_mask(mantissa, _mm256_setzero_si256());
    if (static_cast<__mmask16>(zero_rows | in_range) != 0xffff) return false;
    for (int64_t j = 0; j < n; ++j) {
      shift[j] = _mm512_cvtepu16_epi32(_mm256_sub_epi16(field[j], lo));
      mask[j] = _mm512_mullo_epi32(_mm512_and_si512(_mm512_sllv_epi32(_mm512_set1_epi32(0xff), shift[j]),
                                                    _mm512_set1_epi32(0xff)),
                                   _mm512_set1_epi32(0x01010101));
    }
    // A bf16 half-scale 2^(f - 127) with no mantissa has f in fp32's exponent field too.
    _mm512_store_ps(min_scale, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 23)));
    return true;
  }

  // The 8 lines at `line` (64 k: groups 2s and 2s + 1 of the span) as a B tile of signed
  // levels shifted left per row by shift[0] (first 32 k) and shift[1].
  static void unpack_shifted(const uint8_t* line, const __m512i* shift, const __m512i* mask, uint8_t* tile) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(kBias));
    for (int l = 0; l < 8; ++l) {
      const __m512i v = _mm512_loadu_si512(line + l * 64);
      __m512i lo = _mm512_sub_epi8(Base::mxfp4_levels(_mm512_and_si512(v, nibble)), bias);
      __m512i hi = _mm512_sub_epi8(Base::mxfp4_levels(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)), bias);
      lo = _mm512_and_si512(_mm512_sllv_epi32(lo, shift[l >> 2]), mask[l >> 2]);
      hi = _mm512_and_si512(_mm512_sllv_epi32(hi, shift[l >> 2]), mask[l >> 2]);
      _mm512_store_si512(tile + (2 * l) * 64, lo);
      _mm512_store_si512(tile + (2 * l + 1) * 64, hi);
    }
  }

  // Rows [m0, m0 + tile_rows) x 2 blocks at w over k in [0, covered_k) -> c (see above).
  // The first row tile decides each span, unpacks each 64-k step's B tiles just before
  // its tdpbssd and prefetches the same step of the next span.
  static void mxfp4_pass(const QuantRows& a, int64_t m0, int64_t tile_rows, const int_layout::MatrixDims& dims,
                         const uint8_t* w, int64_t covered_k, uint8_t* buffer, SpanInfo* info, float* c,
                         int64_t ldc) {
    const int8_t* a0 = a.levels + m0 * a.stride;
    const int8_t* a1 = a0 + 16 * a.stride;
    const bool two_row_tiles = tile_rows > 16;
    const bool first = m0 == 0;
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    const uint8_t* scale_rows = w + dims.scales_offset();
    alignas(64) float acc[32][32] = {};
    alignas(64) float part[32][32];
    alignas(64) int32_t sums[32][32];
    __m512i shift[2][kMxfp4SpanGroups], mask[2][kMxfp4SpanGroups];
    // One 64-k step of A at k with block 0's and block 1's B tiles at tiles, tiles + 1024.
    auto step = [&](int64_t k, const uint8_t* tiles) {
      dot_step(a0 + k, a1 + k, a.stride, tiles, tiles + 1024, two_row_tiles, true);
    };
    auto zero_c = [] {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    };
    auto store_c = [&] {
      _tile_stored(0, &sums[0][0], 128);
      _tile_stored(1, &sums[0][16], 128);
      if (two_row_tiles) {
        _tile_stored(2, &sums[16][0], 128);
        _tile_stored(3, &sums[16][16], 128);
      }
    };
    const int64_t spans = (covered_k + kSpanK - 1) / kSpanK;
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t k0 = s * kSpanK;
      const int64_t n_groups = std::min<int64_t>(kMxfp4SpanGroups, (covered_k - k0) / 32);
      const bool next_span = s + 1 < spans;
      uint8_t* slot = buffer + s * kSpanSlotBytes;
      const uint8_t* lines = w + (k0 / 8) * 64;  // block 0's lines of the span
      auto prefetch_next = [&](int64_t first_line, int n_lines) {  // block b's lines of the next span
        if (!next_span) return;
        for (int b = 0; b < 2; ++b)
          for (int l = 0; l < n_lines; ++l)
            _mm_prefetch(reinterpret_cast<const char*>(lines + b * block_bytes + (kSpanK / 8 + first_line + l) * 64),
                         _MM_HINT_T0);
      };
      if (first) {
        if (next_span)
          for (int b = 0; b < 2; ++b)
            for (int64_t l = 0; l < kMxfp4SpanGroups * Base::kScaleRowBytes / 64; ++l)
              _mm_prefetch(reinterpret_cast<const char*>(scale_rows + b * block_bytes +
                                                         (s + 1) * kMxfp4SpanGroups * Base::kScaleRowBytes + l * 64),
                           _MM_HINT_T0);
        bool merged = true;
        for (int b = 0; b < 2 && merged; ++b)
          merged = span_shifts(scale_rows + b * block_bytes + s * kMxfp4SpanGroups * Base::kScaleRowBytes, n_groups,
                               shift[b], mask[b], info[s].min_scale[b]);
        info[s].merged = merged;
      }
      zero_c();
      if (info[s].merged) {
        for (int64_t st = 0; st < n_groups / 2; ++st) {
          uint8_t* tiles = slot + st * 2048;
          if (first) {
            prefetch_next(st * 8, 8);
            for (int b = 0; b < 2; ++b)
              unpack_shifted(lines + b * block_bytes + st * 8 * 64, shift[b] + 2 * st, mask[b] + 2 * st,
                             tiles + b * 1024);
          }
          step(k0 + st * 64, tiles);
        }
        store_c();
        for (int b = 0; b < 2; ++b) {
          const __m512 scale = _mm512_load_ps(info[s].min_scale[b]);
          for (int64_t m = 0; m < tile_rows; ++m) {
            const __m512 x = _mm512_cvtepi32_ps(_mm512_load_si512(&sums[m][b * 16]));
            _mm512_store_ps(&acc[m][b * 16], _mm512_fmadd_ps(x, scale, _mm512_load_ps(&acc[m][b * 16])));
          }
        }
        continue;
      }
      for (int64_t j = 0; j < n_groups; ++j) {  // the vector path's operations, group by group
        uint8_t* tiles = slot + j * 2048;
        if (first) {  // group j's levels in its half of the 64 k, zeros in the other half
          prefetch_next(j * 4, 4);
          const int64_t half = j & 1;
          for (int b = 0; b < 2; ++b) {
            std::memset(tiles + b * 1024 + (1 - half) * 512, 0, 512);
            unpack_b(lines + b * block_bytes + j * 4 * 64, 32, tiles + b * 1024 + half * 512,
                     _mm512_set1_epi8(static_cast<char>(-kBias)));
          }
        }
        if (j > 0) zero_c();
        step(k0 + (j / 2) * 64, tiles);
        store_c();
        for (int b = 0; b < 2; ++b) {
          const __m512 scale =
              Base::load_scales(scale_rows + b * block_bytes + (s * kMxfp4SpanGroups + j) * Base::kScaleRowBytes, 0);
          for (int64_t m = 0; m < tile_rows; ++m) {
            const __m512 x = _mm512_cvtepi32_ps(_mm512_load_si512(&sums[m][b * 16]));
            __m512 v = _mm512_fmadd_ps(x, scale, j == 0 ? _mm512_setzero_ps() : _mm512_load_ps(&part[m][b * 16]));
            if (j == n_groups - 1) v = _mm512_add_ps(_mm512_load_ps(&acc[m][b * 16]), v);
            _mm512_store_ps(j == n_groups - 1 ? &acc[m][b * 16] : &part[m][b * 16], v);
          }
        }
      }
    }
    for (int64_t m = 0; m < tile_rows; ++m) std::memcpy(c + m * ldc, acc[m], 32 * sizeof(float));
  }

  // Rows [m0, m0 + tile_rows) x 2 blocks at w over k in [0, covered_k) -> c.
  static void tile_pass(const QuantRows& a, int64_t m0, int64_t tile_rows,
                        const int_layout::MatrixDims& dims, const uint8_t* w, int64_t k_step, int64_t covered_k,
                        float* c, int64_t ldc) {
    const int8_t* a0 = a.levels + m0 * a.stride;
    const int8_t* a1 = a0 + 16 * a.stride;
    const bool two_row_tiles = tile_rows > 16;
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    const int64_t group = kInt4 ? dims.group : Base::kInt8FlushK;
    alignas(64) float acc[32][32] = {};
    alignas(64) int32_t sums[32][32];
    alignas(64) uint8_t b_tiles[4][16 * 64];
    const bool signed_dot = signed_levels(dims);
    for (int64_t g0 = 0; g0 < covered_k; g0 += group) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const int64_t group_k = std::min(group, covered_k - g0);
      __m512i offsets[2];
      if constexpr (kInt4)
        for (int b = 0; b < 2; ++b) offsets[b] = level_offsets(dims, w + b * block_bytes, g0 / group);
      auto prefetch = [&](int64_t k) {
        if (m0 == 0) {  // the first row tile streams the weights from DRAM
          if constexpr (kInt4) {
            const int64_t ahead = k + 512;  // 8 lines of codes per block ahead
            if (ahead < covered_k && (ahead & 63) == 0)
              for (int b = 0; b < 2; ++b)
                for (int l = 0; l < 8; ++l)
                  _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + (ahead / 8 + l) * 64), _MM_HINT_T0);
          } else {
            for (int line = 0; line < 16; ++line) {
              _mm_prefetch(reinterpret_cast<const char*>(w + (k / 4 + 128 + line) * 64), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(w + block_bytes + (k / 4 + 128 + line) * 64), _MM_HINT_T1);
            }
          }
        }
      };
      for (int64_t k = g0; k < g0 + group_k; k += k_step) {
        prefetch(k);
        // Two steps at once (dot_two_steps) where tmm2 / tmm3, configured as C tiles (16 x 64
        // bytes), fit as B tiles: steps of 64 k (groups of 128 k and more).
        if (!two_row_tiles && k_step == 64 && k + 2 * k_step <= g0 + group_k) {
          prefetch(k + k_step);
          const int64_t q = k + k_step;
          if constexpr (kInt4) {
            unpack_b(w + (k / 8) * 64, k_step, b_tiles[0], offsets[0]);
            unpack_b(w + block_bytes + (k / 8) * 64, k_step, b_tiles[1], offsets[1]);
            unpack_b(w + (q / 8) * 64, k_step, b_tiles[2], offsets[0]);
            unpack_b(w + block_bytes + (q / 8) * 64, k_step, b_tiles[3], offsets[1]);
            dot_two_steps(a0 + k, a.stride, k_step, b_tiles[0], b_tiles[1], b_tiles[2], b_tiles[3], signed_dot);
          } else {
            dot_two_steps(a0 + k, a.stride, k_step, w + (k / 4) * 64, w + block_bytes + (k / 4) * 64,
                          w + (q / 4) * 64, w + block_bytes + (q / 4) * 64, signed_dot);
          }
          k = q;
          continue;
        }
        if constexpr (kInt4) {
          unpack_b(w + (k / 8) * 64, k_step, b_tiles[0], offsets[0]);
          unpack_b(w + block_bytes + (k / 8) * 64, k_step, b_tiles[1], offsets[1]);
          dot_step(a0 + k, a1 + k, a.stride, b_tiles[0], b_tiles[1], two_row_tiles, signed_dot);
        } else {
          dot_step(a0 + k, a1 + k, a.stride, w + (k / 4) * 64, w + block_bytes + (k / 4) * 64, two_row_tiles,
                   signed_dot);
        }
      }
      _tile_stored(0, &sums[0][0], 128);
      _tile_stored(1, &sums[0][16], 128);
      if (two_row_tiles) {
        _tile_stored(2, &sums[16][0], 128);
        _tile_stored(3, &sums[16][16], 128);
      }
      flush(a, m0, tile_rows, dims, w, g0, group_k, sums, acc);
    }
    for (int64_t m = 0; m < tile_rows; ++m) std::memcpy(c + m * ldc, acc[m], 32 * sizeof(float));
  }

  // acc += the group's sums, unbiased (unsigned kinds) and scaled (QuantGemm::flush_group's
  // arithmetic). Signed kinds read each block's scales once; the unsigned ones go row by
  // row, the row's activation sum shared by both blocks (AWQ_INT4 with the signed kinds'
  // block-major loop took 1.09-1.15x the time at 512 tokens, S1 / S2, in-process A/B).
  static void flush(const QuantRows& a, int64_t m0, int64_t tile_rows, const int_layout::MatrixDims& dims,
                    const uint8_t* w, int64_t g0, int64_t group_k, const int32_t (&sums)[32][32],
                    float (&acc)[32][32]) {
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    const int64_t g = kInt4 ? g0 / dims.group : 0;
    auto scales_of = [&](int b) {
      return Base::load_scales(w + b * block_bytes + dims.scales_offset() + g * Base::kScaleRowBytes, 0);
    };
    if (signed_levels(dims)) {
      for (int b = 0; b < 2; ++b) {
        const __m512 scale = scales_of(b);
        for (int64_t m = 0; m < tile_rows; ++m) {
          const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(&sums[m][b * 16]));
          _mm512_store_ps(&acc[m][b * 16], _mm512_fmadd_ps(s, scale, _mm512_load_ps(&acc[m][b * 16])));
        }
      }
      return;
    }
    for (int64_t m = 0; m < tile_rows; ++m) {
      const int32_t* row_sums = a.sums + (m0 + m) * a.sums_stride + g0 / int_layout::kKAlign;
      int32_t a_sum = 0;
      for (int64_t s = 0; s < group_k / int_layout::kKAlign; ++s) a_sum += row_sums[s];
      for (int b = 0; b < 2; ++b) {
        const __m512i s = _mm512_load_si512(&sums[m][b * 16]);
        __m512 v = _mm512_load_ps(&acc[m][b * 16]);
        if constexpr (Kind == QuantKind::kInt4Asym) {
          const __m512 minimum =
              _mm512_loadu_ps(reinterpret_cast<const float*>(w + b * block_bytes + dims.minimums_offset()) + g * 16);
          v = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(a_sum)), minimum, v);
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scales_of(b), v);
        } else {  // INT8: offset-binary weights (128)
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_set1_epi32(128 * a_sum))), scales_of(b), v);
        }
        _mm512_store_ps(&acc[m][b * 16], v);
      }
    }
  }
};

}  // namespace
}  // namespace kt::cpu
