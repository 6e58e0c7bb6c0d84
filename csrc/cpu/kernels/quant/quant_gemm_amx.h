// [NOTE] INT8 / INT4 GEMM on AMX tiles (tdpbsud: signed int8 activations x unsigned
// weight bytes -> int32) for experts with more tokens than one vector micro-tile.
// An INT8 block's lines are AMX's B layout already (16 lines = a B tile of 64 k);
// INT4 lines are unpacked per k step into a 1-2 KiB B tile buffer (AMX reads tiles
// from memory; nothing larger is ever dequantized). Per pass: 32 rows x 2 blocks in
// C tiles tmm0..3, A = tmm4..5, B = tmm6..7. int32 sums are flushed to fp32 per group
// (int8: every kInt8FlushK k) exactly as QuantGemm does, so both give the same numbers;
// an INT8 k tail left to the vector micro-kernel starts on a flush boundary.
// k step: 64 k (int8, int4 with groups of 64/128), 32 k for int4 groups of 32.
// What tiles do not cover (the decode path, an int8 k tail of 32, an odd last block)
// the driver runs with the AVX512_VNNI micro-kernel this struct inherits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../../isa/vec_avx512.h"
#include "../bf16/bf16_gemm_amx.h"
#include "../tile_coverage.h"
#include "int_ops_avx512_vnni.h"
#include "quant_gemm.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

template <QuantKind Kind>
struct QuantGemmAmx : QuantGemm<IntOpsAvx512Vnni, Kind> {
  using Base = QuantGemm<IntOpsAvx512Vnni, Kind>;
  static constexpr bool kInt4 = Base::kInt4;

  static TileCoverage tile_gemm(const QuantRows& a, int64_t rows, const int_layout::MatrixDims& dims,
                                const uint8_t* w, int blocks, float* c, int64_t ldc) {
    const int64_t k_step = kInt4 ? std::min<int64_t>(dims.group, 64) : 64;
    // INT8 tiles take k in steps of 64; when K is not a multiple of 64 the tail left to
    // the vector micro-kernel starts on a flush boundary (same flushes as decode).
    const int64_t covered_k = kInt4 || dims.padded_k % 64 == 0 ? dims.padded_k
                                                                : dims.padded_k / kInt8FlushK * kInt8FlushK;
    const TileCoverage done{covered_k, blocks / 2 * 2};
    if (done.pairs == 0 || done.blocks == 0) return {0, 0};
    configure(k_step);
    for (int64_t m0 = 0; m0 < rows; m0 += 32)
      for (int b0 = 0; b0 < done.blocks; b0 += 2)
        tile_pass(a, m0, std::min<int64_t>(32, rows - m0), dims, w + b0 * dims.block_bytes(), k_step,
                  covered_k, c + m0 * ldc + b0 * 16, ldc);
    _tile_release();
    return done;
  }

 private:
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
  // line l = quad 2l, high = quad 2l + 1).
  // MXFP4: the codes' levels (Base::mxfp4_levels).
  static void unpack_b(const uint8_t* line, int64_t k_step, uint8_t* tile) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int64_t l = 0; l < k_step / 8; ++l) {
      const __m512i v = _mm512_loadu_si512(line + l * 64);
      __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      if constexpr (Kind == QuantKind::kMxfp4) {
        lo = Base::mxfp4_levels(lo);
        hi = Base::mxfp4_levels(hi);
      }
      _mm512_store_si512(tile + (2 * l) * 64, lo);
      _mm512_store_si512(tile + (2 * l + 1) * 64, hi);
    }
  }

  // Rows [m0, m0 + tile_rows) x 2 blocks at w over k in [0, covered_k) -> c.
  static void tile_pass(const QuantRows& a, int64_t m0, int64_t tile_rows, const int_layout::MatrixDims& dims,
                        const uint8_t* w, int64_t k_step, int64_t covered_k, float* c, int64_t ldc) {
    const int8_t* a0 = a.levels + m0 * a.stride;
    const int8_t* a1 = a0 + 16 * a.stride;
    const bool two_row_tiles = tile_rows > 16;
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    const int64_t group = kInt4 ? dims.group : kInt8FlushK;
    alignas(64) float acc[32][32] = {};
    alignas(64) int32_t sums[32][32];
    alignas(64) uint8_t b_tiles[2][16 * 64];
    for (int64_t g0 = 0; g0 < covered_k; g0 += group) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const int64_t group_k = std::min(group, covered_k - g0);
      for (int64_t k = g0; k < g0 + group_k; k += k_step) {
        _tile_loadd(4, a0 + k, a.stride);
        if constexpr (kInt4) {
          unpack_b(w + (k / 8) * 64, k_step, b_tiles[0]);
          unpack_b(w + block_bytes + (k / 8) * 64, k_step, b_tiles[1]);
          _tile_loadd(6, b_tiles[0], 64);
          _tile_loadd(7, b_tiles[1], 64);
        } else {
          if (m0 == 0)  // the first row tile streams the weights from DRAM
            for (int line = 0; line < 16; ++line) {
              _mm_prefetch(reinterpret_cast<const char*>(w + (k / 4 + 128 + line) * 64), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(w + block_bytes + (k / 4 + 128 + line) * 64), _MM_HINT_T1);
            }
          _tile_loadd(6, w + (k / 4) * 64, 64);
          _tile_loadd(7, w + block_bytes + (k / 4) * 64, 64);
        }
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        if (two_row_tiles) {
          _tile_loadd(5, a1 + k, a.stride);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
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

  // acc += the group's sums, unbiased and scaled (QuantGemm::flush_group's arithmetic).
  static void flush(const QuantRows& a, int64_t m0, int64_t tile_rows, const int_layout::MatrixDims& dims,
                    const uint8_t* w, int64_t g0, int64_t group_k, const int32_t (&sums)[32][32],
                    float (&acc)[32][32]) {
    const int64_t block_bytes = static_cast<int64_t>(dims.block_bytes());
    const int64_t g = kInt4 ? g0 / dims.group : 0;
    for (int64_t m = 0; m < tile_rows; ++m) {
      const int32_t* row_sums = a.sums + (m0 + m) * a.sums_stride + g0 / int_layout::kKAlign;
      int32_t a_sum = 0;
      for (int64_t s = 0; s < group_k / int_layout::kKAlign; ++s) a_sum += row_sums[s];
      for (int b = 0; b < 2; ++b) {
        const uint8_t* block = w + b * block_bytes;
        const __m512 scale = Base::load_scales(block + dims.scales_offset() + g * Base::kScaleRowBytes, 0);
        const __m512i s = _mm512_load_si512(&sums[m][b * 16]);
        __m512 v = _mm512_load_ps(&acc[m][b * 16]);
        if constexpr (Kind == QuantKind::kInt4Asym) {
          const __m512 minimum = _mm512_loadu_ps(
              reinterpret_cast<const float*>(block + dims.minimums_offset()) + g * 16);
          v = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(a_sum)), minimum, v);
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, v);
        } else {
          const int32_t bias = Kind == QuantKind::kInt8    ? 128
                               : Kind == QuantKind::kMxfp4 ? int_layout::kMxfp4LevelBias
                                                           : int_layout::kInt4Zero;
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_set1_epi32(bias * a_sum))), scale, v);
        }
        _mm512_store_ps(&acc[m][b * 16], v);
      }
    }
  }
};

}  // namespace
}  // namespace kt::cpu
