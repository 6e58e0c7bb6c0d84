#include "pack_int.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "int_layout.h"
#include "mxfp4_block.h"
#include "source_rows.h"

namespace kt::cpu {
namespace {

using int_layout::kBlockRows;
using int_layout::MatrixDims;

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The 64-byte lines of one block from its levels [16][dims.padded_k] (int8 as offset
// binary, int4 as 0..15): 4 consecutive k of a row are one 32-bit word of a line (int4:
// the low nibbles k = 8l..8l+3, the high nibbles the next four).
void write_lines(const uint8_t* levels, bool int4, const MatrixDims& dims, uint8_t* out) {
  for (int64_t l = 0; l < dims.lines; ++l) {
    uint8_t* line = out + l * int_layout::kLineBytes;
    for (int r = 0; r < kBlockRows; ++r) {
      const uint8_t* q = levels + r * dims.padded_k;
      // int4 levels are < 16, so shifting a word by 4 keeps each nibble in its byte.
      const uint32_t word = int4 ? load_u32(q + 8 * l) | load_u32(q + 8 * l + 4) << 4
                                 : load_u32(q + 4 * l);
      std::memcpy(line + 4 * r, &word, sizeof(word));
    }
  }
}

// MXFP4: one row's GGUF MXFP4 blocks (dims.groups of 17 bytes) -> its codes (`codes`,
// 0..15 in k order, the INT4 lines' levels) and its bf16 half-scales (column r of the
// block's scale rows, exact: half_scale_bits has no low 16 bits).
void mxfp4_row(const uint8_t* blocks, const MatrixDims& dims, int r, uint8_t* codes, uint16_t* scales) {
  for (int64_t g = 0; g < dims.groups; ++g) {
    const uint8_t* block = blocks + g * mxfp4::kBlockBytes;
    scales[g * kBlockRows + r] = static_cast<uint16_t>(mxfp4::half_scale_bits(block[0]) >> 16);
    for (int j = 0; j < 16; ++j) {  // byte 1 + j: weight j (low nibble), j + 16 (high)
      codes[32 * g + j] = block[1 + j] & 15;
      codes[32 * g + 16 + j] = block[1 + j] >> 4;
    }
  }
}

// Rows [row0, row0 + 16) into one mxfp4 block at `out`: row_blocks(row, tmp) gives a
// row's GGUF MXFP4 blocks (tmp: dims.groups * 17 bytes it may fill). Rows past the matrix
// are code 0 with scale 0; the scale rows' padding is zero.
template <typename RowBlocks>
void pack_mxfp4_block(const MatrixDims& dims, int64_t row0, const RowBlocks& row_blocks, uint8_t* out) {
  thread_local std::vector<uint8_t> levels, tmp;
  levels.assign(kBlockRows * dims.k, 0);
  tmp.resize(dims.groups * mxfp4::kBlockBytes);
  auto* scales = reinterpret_cast<uint16_t*>(out + dims.scales_offset());
  std::memset(scales, 0, dims.scales_bytes());
  for (int r = 0; r < kBlockRows && row0 + r < dims.rows; ++r)
    mxfp4_row(row_blocks(row0 + r, tmp.data()), dims, r, levels.data() + r * dims.k, scales);
  write_lines(levels.data(), true, dims, out);
}

// Quantizes rows [row0, row0 + 16) of `matrix` ([dims.rows, dims.k] of `type`) into one
// block at `out` (int_layout.h). Rows past the matrix are zero weights.
void pack_block(const void* matrix, ElementType type, PackedFormat format, const MatrixDims& dims,
                int64_t row0, const QuantOptions& options, uint8_t* out) {
  const int64_t K = dims.k, Kp = dims.padded_k;
  thread_local std::vector<float> row;
  thread_local std::vector<uint8_t> levels;  // [16][Kp]: int8 as offset binary, int4 as 0..15
  row.resize(K);
  levels.resize(kBlockRows * Kp);
  float* scales = reinterpret_cast<float*>(out + dims.scales_offset());       // [groups][16]
  float* minimums = reinterpret_cast<float*>(out + dims.minimums_offset());   // [groups][16]
  std::vector<float> row_scales(dims.groups), row_minimums(dims.groups);
  const bool int4 = int_layout::is_int4(format);
  const uint8_t zero = int4 ? (dims.minimums ? 0 : int_layout::kInt4Zero) : int_layout::kInt8Zero;
  for (int r = 0; r < kBlockRows; ++r) {
    uint8_t* q = levels.data() + r * Kp;
    std::fill(q, q + Kp, zero);
    std::fill(row_scales.begin(), row_scales.end(), 0.0f);
    std::fill(row_minimums.begin(), row_minimums.end(), 0.0f);
    if (row0 + r < dims.rows) {
      load_row(matrix, type, row0 + r, K, row.data());
      if (int4) {
        quantize_int4_row(row.data(), K, dims.group, options, q, row_scales.data(),
                          dims.minimums ? row_minimums.data() : nullptr);
      } else {
        quantize_int8_row(row.data(), K, options, reinterpret_cast<int8_t*>(q), row_scales.data());
        for (int64_t k = 0; k < K; ++k) q[k] = static_cast<uint8_t>(q[k] + int_layout::kInt8Zero);
      }
    }
    for (int64_t g = 0; g < dims.groups; ++g) {
      scales[g * kBlockRows + r] = row_scales[g];
      if (dims.minimums) minimums[g * kBlockRows + r] = row_minimums[g];
    }
  }
  write_lines(levels.data(), int4, dims, out);
}

// Rows [row0, row0 + 16) of one expert's already-quantized int4 matrix (`source`
// pointers at that expert) into one block at `out`. Rows past the matrix are zero weights.
void copy_int4_block(const Int4Source& source, const MatrixDims& dims, int64_t row0, uint8_t* out) {
  const int64_t K = dims.k, groups = dims.groups;
  thread_local std::vector<uint8_t> levels;
  levels.resize(kBlockRows * K);
  float* scales = reinterpret_cast<float*>(out + dims.scales_offset());
  float* minimums = reinterpret_cast<float*>(out + dims.minimums_offset());
  const uint8_t zero = dims.minimums ? 0 : int_layout::kInt4Zero;
  for (int r = 0; r < kBlockRows; ++r) {
    uint8_t* q = levels.data() + r * K;
    const int64_t row = row0 + r;
    if (row >= dims.rows) {
      std::fill(q, q + K, zero);
      for (int64_t g = 0; g < groups; ++g) {
        scales[g * kBlockRows + r] = 0.0f;
        if (dims.minimums) minimums[g * kBlockRows + r] = 0.0f;
      }
      continue;
    }
    const uint8_t* packed = source.nibbles + row * (K / 2);
    for (int64_t k = 0; k < K; k += 2) {
      q[k] = packed[k / 2] & 0x0F;
      q[k + 1] = packed[k / 2] >> 4;
    }
    for (int64_t g = 0; g < groups; ++g) {
      scales[g * kBlockRows + r] = source.scales[row * groups + g];
      if (dims.minimums) minimums[g * kBlockRows + r] = source.minimums[row * groups + g];
    }
  }
  write_lines(levels.data(), true, dims, out);
}

// Rows [row0, row0 + 16) of one expert's already-quantized int8 matrix (`source` pointers
// at that expert) into one block at `out`. Rows past the matrix, and k past K, are zero.
void copy_int8_block(const Int8Source& source, const MatrixDims& dims, int64_t row0, uint8_t* out) {
  const int64_t K = dims.k, Kp = dims.padded_k;
  thread_local std::vector<uint8_t> levels;
  levels.resize(kBlockRows * Kp);
  float* scales = reinterpret_cast<float*>(out + dims.scales_offset());  // one group: [16]
  for (int r = 0; r < kBlockRows; ++r) {
    uint8_t* q = levels.data() + r * Kp;
    std::fill(q, q + Kp, static_cast<uint8_t>(int_layout::kInt8Zero));
    const int64_t row = row0 + r;
    scales[r] = 0.0f;
    if (row >= dims.rows) continue;
    const int8_t* src = source.levels + row * K;
    for (int64_t k = 0; k < K; ++k) q[k] = static_cast<uint8_t>(src[k] + int_layout::kInt8Zero);
    scales[r] = source.scales[row];
  }
  write_lines(levels.data(), false, dims, out);
}

}  // namespace

namespace {

// Runs `block(matrix, expert, block index, first row, out)` for every 16-row block of
// every expert on the Engine, after writing the header. Gate block 2b and up block
// 2b + 1 hold rows [16b, 16b + 16) of gate and up (interleaved).
template <typename Block>
void for_each_block(const PackedLayout& layout, uint8_t* blob, const Block& block) {
  const int_layout::Dims dims(layout.shape);
  write_packed_header(layout, blob);
  const int64_t gate_up_jobs = layout.shape.num_experts * dims.gate_up.blocks;
  const int64_t down_jobs = layout.shape.num_experts * dims.down.blocks;
  Engine::instance().parallel_for(gate_up_jobs + down_jobs, [&](int64_t job) {
    if (job < gate_up_jobs) {
      const int64_t expert = job / dims.gate_up.blocks, b = job % dims.gate_up.blocks;
      block(b % 2, expert, dims.gate_up, (b / 2) * kBlockRows,
            blob + layout.gate_up_offset + expert * layout.gate_up_expert_bytes + b * dims.gate_up.block_bytes());
    } else {
      const int64_t expert = (job - gate_up_jobs) / dims.down.blocks, b = (job - gate_up_jobs) % dims.down.blocks;
      block(2, expert, dims.down, b * kBlockRows,
            blob + layout.down_offset + expert * layout.down_expert_bytes + b * dims.down.block_bytes());
    }
  });
}

// for_each_block over float sources: block(source, matrix dims, first row, out) with
// `source` the expert's matrix ([rows, k] of `type`) of gate, up or down.
template <typename Block>
void for_each_source_block(const void* gate, const void* up, const void* down, ElementType type,
                           const PackedLayout& layout, uint8_t* blob, const Block& block) {
  const int_layout::Dims dims(layout.shape);
  const size_t element = type == ElementType::kF32 ? 4 : 2;
  const void* matrices[3] = {gate, up, down};
  const int64_t expert_elements = dims.hidden * dims.intermediate;
  for_each_block(layout, blob, [&](int m, int64_t expert, const MatrixDims& matrix, int64_t row0, uint8_t* out) {
    block(static_cast<const uint8_t*>(matrices[m]) + expert * expert_elements * element, matrix, row0, out);
  });
}

}  // namespace

void pack_int_experts(const void* gate, const void* up, const void* down, ElementType type,
                      const PackedLayout& layout, const QuantOptions& options, uint8_t* blob) {
  for_each_source_block(gate, up, down, type, layout, blob,
                        [&](const uint8_t* source, const MatrixDims& matrix, int64_t row0, uint8_t* out) {
    pack_block(source, type, layout.shape.format, matrix, row0, options, out);
  });
  mark_integer_zeros(layout, blob);
}

bool mark_integer_zeros(const PackedLayout& layout, uint8_t* blob) {
  if (layout.shape.format != PackedFormat::kInt4Asym) return false;
  const int_layout::Dims dims(layout.shape);
  const auto integral = [](const uint8_t* block, const MatrixDims& m) {
    const float* scales = reinterpret_cast<const float*>(block + m.scales_offset());
    const float* minimums = reinterpret_cast<const float*>(block + m.minimums_offset());
    for (int64_t i = 0; i < m.groups * kBlockRows; ++i) {
      const float s = scales[i], minimum = minimums[i];
      if (s == 0.0f) {
        if (minimum != 0.0f) return false;
        continue;
      }
      // The kernels take z from a reciprocal estimate (int_ops_avx512.h): a normal scale
      // of a sane size (a subnormal one's estimate is infinite).
      const float z = -minimum / s;  // exact when minimum is -z * s
      if (!std::isnormal(s) || std::fabs(s) > 0x1p64f || !(z >= 0.0f && z <= kMaxIntegerZero) ||
          z != std::nearbyint(z) ||
          -static_cast<double>(z) * s != static_cast<double>(minimum))
        return false;
    }
    return true;
  };
  for (uint32_t e = 0; e < layout.shape.num_experts; ++e) {
    for (int64_t b = 0; b < dims.gate_up.blocks; ++b)
      if (!integral(blob + layout.gate_up_offset + e * layout.gate_up_expert_bytes + b * dims.gate_up.block_bytes(),
                    dims.gate_up))
        return false;
    for (int64_t b = 0; b < dims.down.blocks; ++b)
      if (!integral(blob + layout.down_offset + e * layout.down_expert_bytes + b * dims.down.block_bytes(), dims.down))
        return false;
  }
  PackedLayout marked = layout;
  marked.shape.integer_zeros = true;
  write_packed_header(marked, blob);
  return true;
}

void pack_mxfp4_experts(const void* gate, const void* up, const void* down, ElementType type,
                        const PackedLayout& layout, const QuantOptions&, uint8_t* blob) {
  for_each_source_block(gate, up, down, type, layout, blob,
                        [&](const uint8_t* source, const MatrixDims& matrix, int64_t row0, uint8_t* out) {
    thread_local std::vector<float> row;
    row.resize(matrix.k);
    pack_mxfp4_block(matrix, row0, [&](int64_t r, uint8_t* tmp) {
      load_row(source, type, r, matrix.k, row.data());  // ggml's rounding (mxfp4_block.h)
      for (int64_t g = 0; g < matrix.groups; ++g)
        mxfp4::quantize_block(row.data() + g * mxfp4::kBlockElems, tmp + g * mxfp4::kBlockBytes);
      return static_cast<const uint8_t*>(tmp);
    }, out);
  });
}

void pack_mxfp4_blocks(const uint8_t* const blocks[3], const PackedLayout& layout, uint8_t* blob) {
  const int_layout::Dims dims(layout.shape);
  for_each_block(layout, blob, [&](int m, int64_t expert, const MatrixDims& matrix, int64_t row0, uint8_t* out) {
    const int64_t row_bytes = matrix.groups * mxfp4::kBlockBytes;
    const uint8_t* first = blocks[m] + expert * matrix.rows * row_bytes;
    pack_mxfp4_block(matrix, row0, [&](int64_t r, uint8_t*) { return first + r * row_bytes; }, out);
  });
}

void pack_int4_sources(const Int4Source sources[3], const PackedLayout& layout, uint8_t* blob) {
  const int_layout::Dims dims(layout.shape);
  for_each_block(layout, blob, [&](int m, int64_t expert, const MatrixDims& matrix, int64_t row0, uint8_t* out) {
    const int64_t rows = matrix.rows, k = matrix.k, groups = matrix.groups;
    Int4Source source = sources[m];
    source.nibbles += expert * rows * (k / 2);
    source.scales += expert * rows * groups;
    if (source.minimums != nullptr) source.minimums += expert * rows * groups;
    copy_int4_block(source, matrix, row0, out);
  });
  mark_integer_zeros(layout, blob);
}

void pack_int8_sources(const Int8Source sources[3], const PackedLayout& layout, uint8_t* blob) {
  for_each_block(layout, blob, [&](int m, int64_t expert, const MatrixDims& matrix, int64_t row0, uint8_t* out) {
    Int8Source source = sources[m];
    source.levels += expert * matrix.rows * matrix.k;
    source.scales += expert * matrix.rows;
    copy_int8_block(source, matrix, row0, out);
  });
}

}  // namespace kt::cpu
