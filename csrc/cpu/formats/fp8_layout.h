// [NOTE] The FP8 packed layouts (fp8, fp8_perchannel, mxfp8), shared by every ISA.
// docs/formats.md has the same description for users.
//
// Weights stay e4m3 bytes (the checkpoint's codes, never widened). Like BF16 and INT8, a
// matrix [rows, K] is stored in blocks of 16 output rows, gate and up blocks interleaved.
// A block is
//   codes   [Kp/2][16][2] u8  k-pair p, row n, i: byte 32 p + 2 n + i = e4m3 code of w(n, 2p + i)
//                             (the BF16 line's order with one byte per weight: 32 codes
//                             decode into one vdpbf16ps operand)
//   scales  [S][16]           per k-group and output row: fp32 (fp8: S = ceil(K / 128);
//                             fp8_perchannel: S = 1) or ue8m0 bytes (mxfp8: S = ceil(K / 32),
//                             padded to a 64-byte multiple)
//   addend  [16] fp32         mxfp8 only: 0, or NaN for a row holding a NaN code or scale
// Kp = round_up(K, 32): k past K has code 0 (w = 0). Rows past the matrix have code 0 and
// scale 0 (mxfp8: exponent code 127).
//   fp8:            w(n, k) = e4m3(code) * scale[k / 128][n]
//   fp8_perchannel: w(n, k) = e4m3(code) * scale[0][n]
//   mxfp8:          w(n, k) = e4m3(code) * 2^(e[k / 32][n] - 127)   (e = 255: NaN)
// e4m3 NaN codes (0x7f, 0xff) are never decoded as NaN by the kernels: the packer sets the
// scale of their (row, group) to NaN (mxfp8: exponent 255 and the row's addend NaN), so
// the row's outputs are NaN, as a NaN weight makes them. mxfp8 exponent codes are kept in
// [kMinMxExponent, kMaxMxExponent] (or 255): the kernels add them to bf16 exponents.
#pragma once

#include <cstddef>
#include <cstdint>

#include "packed_header.h"

namespace kt::cpu::fp8_layout {

constexpr int kBlockRows = 16;
constexpr int64_t kKAlign = 32;         // K padding: whole MX groups and 64-byte lines
constexpr int64_t kBlockGroup = 128;    // fp8: one scale per 128 x 128 weights
constexpr int64_t kMxGroup = 32;        // mxfp8: one exponent per 32 weights along k
// mxfp8 exponent codes the kernels take (and 255, NaN): every nonzero e4m3 value times
// 2^(e - 127) stays a normal bf16. The packer rejects others, except lower codes on a group
// whose codes are all zero (stored as kMxOne).
constexpr int kMinMxExponent = 10;
constexpr int kMaxMxExponent = 246;
constexpr int kMxOne = 127;
constexpr int kMxNan = 255;

constexpr int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

constexpr bool is_fp8(PackedFormat format) {
  return format == PackedFormat::kFp8 || format == PackedFormat::kFp8PerChannel ||
         format == PackedFormat::kMxfp8;
}

// k per scale group (fp8_perchannel: 0, one group spanning K).
constexpr int64_t group_k(PackedFormat format) {
  return format == PackedFormat::kFp8 ? kBlockGroup : format == PackedFormat::kMxfp8 ? kMxGroup : 0;
}

// One packed matrix: `rows` output rows in `blocks` 16-row blocks, input dimension `k`.
struct MatrixDims {
  int64_t rows = 0;
  int64_t blocks = 0;
  int64_t k = 0;
  int64_t padded_k = 0;
  int64_t group = 0;      // k per scale group (fp8_perchannel: padded_k)
  int64_t groups = 0;     // scale rows per block
  bool byte_scales = false;  // mxfp8: ue8m0 bytes, else fp32

  constexpr MatrixDims(PackedFormat format, int64_t rows_, int64_t blocks_, int64_t k_)
      : rows(rows_),
        blocks(blocks_),
        k(k_),
        padded_k(round_up(k_, kKAlign)),
        group(group_k(format) ? group_k(format) : round_up(k_, kKAlign)),
        groups(group_k(format) ? (k_ + group_k(format) - 1) / group_k(format) : 1),
        byte_scales(format == PackedFormat::kMxfp8) {}

  constexpr size_t scales_offset() const { return static_cast<size_t>(padded_k) * kBlockRows; }
  // mxfp8: the row addends after the exponent codes.
  constexpr size_t addend_offset() const {
    return scales_offset() + static_cast<size_t>(round_up(groups * kBlockRows, 64));
  }
  constexpr size_t block_bytes() const {
    return byte_scales ? addend_offset() + kBlockRows * 4 : scales_offset() + groups * kBlockRows * 4;
  }
  constexpr size_t expert_bytes() const { return blocks * block_bytes(); }
};

// gate_up: 2 * I16 / 16 blocks (gate and up interleaved), K = H; down: H16 / 16 blocks, K = I.
struct Dims {
  int64_t hidden, intermediate, intermediate16, hidden16;
  MatrixDims gate_up, down;

  explicit Dims(const PackedShape& s)
      : hidden(s.hidden_size),
        intermediate(s.intermediate_size),
        intermediate16(round_up(s.intermediate_size, kBlockRows)),
        hidden16(round_up(s.hidden_size, kBlockRows)),
        gate_up(s.format, s.intermediate_size, 2 * round_up(s.intermediate_size, kBlockRows) / kBlockRows,
                s.hidden_size),
        down(s.format, s.hidden_size, round_up(s.hidden_size, kBlockRows) / kBlockRows, s.intermediate_size) {}
};

}  // namespace kt::cpu::fp8_layout
