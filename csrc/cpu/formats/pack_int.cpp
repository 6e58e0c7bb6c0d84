#include "pack_int.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "int_layout.h"
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
  // Lines: 4 consecutive k of a row are one 32-bit word of the line.
  for (int64_t l = 0; l < dims.lines; ++l) {
    uint8_t* line = out + l * int_layout::kLineBytes;
    for (int r = 0; r < kBlockRows; ++r) {
      const uint8_t* q = levels.data() + r * Kp;
      // int4 levels are < 16, so shifting a word by 4 keeps each nibble in its byte.
      const uint32_t word = int4 ? load_u32(q + 8 * l) | load_u32(q + 8 * l + 4) << 4
                                 : load_u32(q + 4 * l);
      std::memcpy(line + 4 * r, &word, sizeof(word));
    }
  }
}

}  // namespace

void pack_int_experts(const void* gate, const void* up, const void* down, ElementType type,
                      const PackedLayout& layout, const QuantOptions& options, uint8_t* blob) {
  const PackedShape& shape = layout.shape;
  const int_layout::Dims dims(shape);
  const int64_t H = dims.hidden, I = dims.intermediate;
  const size_t element = type == ElementType::kF32 ? 4 : 2;
  write_packed_header(layout, blob);
  const int64_t gate_up_jobs = shape.num_experts * dims.gate_up.blocks;
  const int64_t down_jobs = shape.num_experts * dims.down.blocks;
  Engine::instance().parallel_for(gate_up_jobs + down_jobs, [&](int64_t job) {
    if (job < gate_up_jobs) {
      // Block 2b is gate rows [16b, 16b + 16), block 2b + 1 the same rows of up.
      const int64_t expert = job / dims.gate_up.blocks, block = job % dims.gate_up.blocks;
      const auto* source = static_cast<const uint8_t*>(block % 2 == 0 ? gate : up) + expert * I * H * element;
      pack_block(source, type, shape.format, dims.gate_up, (block / 2) * kBlockRows, options,
                 blob + layout.gate_up_offset + expert * layout.gate_up_expert_bytes +
                     block * dims.gate_up.block_bytes());
    } else {
      const int64_t expert = (job - gate_up_jobs) / dims.down.blocks;
      const int64_t block = (job - gate_up_jobs) % dims.down.blocks;
      pack_block(static_cast<const uint8_t*>(down) + expert * H * I * element, type, shape.format,
                 dims.down, block * kBlockRows, options,
                 blob + layout.down_offset + expert * layout.down_expert_bytes +
                     block * dims.down.block_bytes());
    }
  });
}

}  // namespace kt::cpu
