// [NOTE] The INT8 and INT4 packed layouts, shared by every ISA (AVX2, AVX-512,
// AVX512_VNNI, AMX). docs/formats.md has the same description for users.
//
// Like BF16 (bf16_layout.h), a matrix [rows, K] is stored in blocks of 16 output rows,
// gate and up blocks interleaved. A block is
//   lines    [L][64 bytes]        the quantized weights, k ascending
//   scales   [S][16] fp32         per output row (int8: S = 1) or per k-group (int4)
//   minimums [S][16] fp32         int4_asym only: w = scale * q + minimum
// INT8 (per output channel, symmetric): line l holds k = 4l..4l+3 of the 16 rows,
//   byte 4n + i = q(n, 4l + i) + 128, q in [-127, 127]   (u8 "offset binary");
//   w(n, k) = scale[n] * q(n, k). K is padded to a multiple of 32 with q = 0.
//   One line is one vpdpbusd operand, 16 lines are one AMX B tile.
// INT4 (group-wise along k, groups of G = 32/64/128 which must divide K): line l holds
//   k = 8l..8l+7, byte 4n + i = q(n, 8l + i) | q(n, 8l + 4 + i) << 4, q in [0, 15];
//   the low nibbles of a line are the INT8 line of k = 8l..8l+3, the high nibbles the
//   next one, so one AND and one shift unpack a line into two vpdpbusd operands.
//   int4:      w(n, k) = scale[g][n] * (q(n, k) - 8)          g = k / G
//   int4_asym: w(n, k) = scale[g][n] * q(n, k) + minimum[g][n]
//              With the header's integer-zero flag (PackedShape::integer_zeros: every
//              minimum is -z * scale, z an integer in [0, 16]) the kernels take z =
//              -minimum / scale (exact) and compute scale * sum (q - z) a per group, one
//              exact integer sum (AMX: q - z as signed tile bytes), instead of adding
//              minimum * sum a in fp32.
// MXFP4 (OCP MX e2m1, G = 32): the INT4 lines with q an e2m1 code (0..15) and the scales
//   bf16, 32 bytes per group row (padded to a multiple of 64 bytes per block):
//   mxfp4:     w(n, k) = half_scale[g][n] * kValues[q(n, k)]   (mxfp4_block.h: the doubled
//              e2m1 values 0, +-1, +-2, +-3, +-4, +-6, +-8, +-12; half_scale = 2^(e - 128),
//              exact in bf16 for every exponent e, NaN for e = 255)
//   The kernels map each code to kValues + 16 (one vpshufb) and dot it as an INT4 level
//   with zero point 16. 0.5625 bytes per weight: 1.06x a checkpoint's 17 bytes per 32.
// Rows past the matrix have q = zero point (mxfp4: code 0) and scale 0.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mxfp4_block.h"
#include "packed_header.h"

namespace kt::cpu::int_layout {

constexpr int kBlockRows = 16;
constexpr size_t kLineBytes = 64;
constexpr int64_t kKAlign = 32;          // K padding (int8) and activation-sum granularity
constexpr uint32_t kInt8MaxK = 65536;    // int32 sums of u8 x s8 products stay exact
constexpr int kInt8Zero = 128;           // stored byte of q = 0 (int8)
constexpr int kInt4Zero = 8;             // q of w = 0 (symmetric int4)
// INT4 k-groups (kt-kernel's sizes): multiples of kKAlign, so a group's activation sums
// are whole 32-k sums. The format table reads the allowed sizes from here.
constexpr uint32_t kGroupSizes[] = {32, 64, 128};

constexpr int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Formats of nibble lines and k-groups: int4, int4_asym and mxfp4.
constexpr bool is_int4(PackedFormat format) {
  return format == PackedFormat::kInt4 || format == PackedFormat::kInt4Asym || format == PackedFormat::kMxfp4;
}

constexpr uint32_t kMxfp4Group = 32;   // mxfp4: k per exponent, its only group size
constexpr int kMxfp4LevelBias = mxfp4::kLevelBias;  // the kernels' level of code q: kValues[q] + 16
constexpr size_t kMxfp4ScaleRowBytes = 32;  // one bf16 half-scale per row of a block

// One packed matrix: `rows` output rows (padded to 16 per block), input dimension `k`.
struct MatrixDims {
  int64_t rows = 0;    // real output rows
  int64_t blocks = 0;  // 16-row blocks
  int64_t k = 0;       // real input columns
  int64_t padded_k = 0;
  int64_t group = 0;   // int4: G; int8: padded_k (one scale per row)
  int64_t lines = 0;   // 64-byte weight lines per block
  int64_t groups = 0;  // scale rows per block
  bool minimums = false;
  bool integer_zeros = false;  // int4_asym: PackedShape::integer_zeros
  size_t scale_row_bytes = kLineBytes;  // bytes per scale row: 16 fp32, or mxfp4's 16 bf16

  constexpr MatrixDims(PackedFormat format, int64_t rows_, int64_t blocks_, int64_t k_, int64_t g,
                       bool integer_zeros_ = false)
      : rows(rows_),
        blocks(blocks_),
        k(k_),
        padded_k(is_int4(format) ? k_ : round_up(k_, kKAlign)),
        group(is_int4(format) ? g : round_up(k_, kKAlign)),
        lines(is_int4(format) ? k_ / 8 : round_up(k_, kKAlign) / 4),
        groups(is_int4(format) ? k_ / g : 1),
        minimums(format == PackedFormat::kInt4Asym),
        integer_zeros(format == PackedFormat::kInt4Asym && integer_zeros_),
        scale_row_bytes(format == PackedFormat::kMxfp4 ? kMxfp4ScaleRowBytes : kLineBytes) {}

  constexpr size_t scales_offset() const { return static_cast<size_t>(lines) * kLineBytes; }
  // The scale rows, padded to whole 64-byte lines (only mxfp4's 32-byte rows need it).
  constexpr size_t scales_bytes() const {
    return static_cast<size_t>(round_up(groups * static_cast<int64_t>(scale_row_bytes), kLineBytes));
  }
  constexpr size_t minimums_offset() const { return scales_offset() + scales_bytes(); }
  constexpr size_t block_bytes() const { return minimums_offset() + (minimums ? groups * kLineBytes : 0); }
  constexpr size_t expert_bytes() const { return blocks * block_bytes(); }
};

// gate_up: 2 * I16 / 16 blocks (gate and up interleaved), K = H.
// down: H16 / 16 blocks, K = I.
struct Dims {
  int64_t hidden, intermediate, intermediate16, hidden16;
  MatrixDims gate_up, down;

  explicit Dims(const PackedShape& s)
      : hidden(s.hidden_size),
        intermediate(s.intermediate_size),
        intermediate16(round_up(s.intermediate_size, kBlockRows)),
        hidden16(round_up(s.hidden_size, kBlockRows)),
        gate_up(s.format, s.intermediate_size, 2 * round_up(s.intermediate_size, kBlockRows) / kBlockRows,
                s.hidden_size, s.group_size, s.integer_zeros),
        down(s.format, s.hidden_size, round_up(s.hidden_size, kBlockRows) / kBlockRows,
             s.intermediate_size, s.group_size, s.integer_zeros) {}
};

}  // namespace kt::cpu::int_layout
