#include "pack_bf16.h"

#include <cstring>

#include "../engine/engine.h"
#include "../isa/scalar_convert.h"
#include "bf16_layout.h"

namespace kt::cpu {
namespace {

using bf16_layout::kBlockRows;

// Element i of a row of `kType` as bf16 bits.
template <ElementType kType>
uint16_t bf16_bits(const void* row, int64_t i) {
  if constexpr (kType == ElementType::kBf16) return static_cast<const uint16_t*>(row)[i];
  else if constexpr (kType == ElementType::kF32) return float_to_bf16(static_cast<const float*>(row)[i]);
  else return float_to_bf16(f16_to_float(static_cast<const uint16_t*>(row)[i]));
}

// Writes rows [row0, row0 + 16) of matrix [rows, cols] (of kType) as one block
// [ceil(cols/2)][16][2]; rows and columns past the matrix are zero.
template <ElementType kType>
void pack_block(const void* matrix, int64_t rows, int64_t cols, int64_t row0, int64_t pairs,
                uint16_t* block) {
  constexpr size_t kElement = kType == ElementType::kF32 ? 4 : 2;
  std::memset(block, 0, static_cast<size_t>(pairs) * kBlockRows * 2 * sizeof(uint16_t));
  for (int r = 0; r < kBlockRows && row0 + r < rows; ++r) {
    const void* row = static_cast<const uint8_t*>(matrix) + (row0 + r) * cols * kElement;
    for (int64_t k = 0; k < cols; ++k)
      block[(k / 2) * kBlockRows * 2 + r * 2 + (k % 2)] = bf16_bits<kType>(row, k);
  }
}

void pack_block(const void* matrix, ElementType type, int64_t rows, int64_t cols, int64_t row0,
                int64_t pairs, uint16_t* block) {
  switch (type) {
    case ElementType::kBf16: return pack_block<ElementType::kBf16>(matrix, rows, cols, row0, pairs, block);
    case ElementType::kF32: return pack_block<ElementType::kF32>(matrix, rows, cols, row0, pairs, block);
    case ElementType::kF16: return pack_block<ElementType::kF16>(matrix, rows, cols, row0, pairs, block);
  }
}

}  // namespace

void pack_bf16_experts(const void* gate, const void* up, const void* down, ElementType source,
                       const PackedLayout& layout, const QuantOptions& /*options*/, uint8_t* blob) {
  const PackedShape& shape = layout.shape;
  const bf16_layout::Dims dims(shape.hidden_size, shape.intermediate_size);
  const int64_t H = dims.hidden, I = dims.intermediate;
  const size_t element = source == ElementType::kF32 ? 4 : 2;
  write_packed_header(layout, blob);
  const int64_t gate_up_jobs = shape.num_experts * dims.gate_up_blocks;
  const int64_t down_jobs = shape.num_experts * dims.down_blocks;
  Engine::instance().parallel_for(gate_up_jobs + down_jobs, [&](int64_t job) {
    if (job < gate_up_jobs) {
      // Block 2b is gate rows [16b, 16b + 16), block 2b + 1 the same rows of up.
      const int64_t expert = job / dims.gate_up_blocks, block = job % dims.gate_up_blocks;
      const auto* matrix = static_cast<const uint8_t*>(block % 2 == 0 ? gate : up) + expert * I * H * element;
      auto* out = reinterpret_cast<uint16_t*>(blob + layout.gate_up_offset +
                                              expert * layout.gate_up_expert_bytes +
                                              block * dims.gate_up_block_bytes());
      pack_block(matrix, source, I, H, (block / 2) * kBlockRows, dims.hidden_pairs, out);
    } else {
      const int64_t expert = (job - gate_up_jobs) / dims.down_blocks;
      const int64_t block = (job - gate_up_jobs) % dims.down_blocks;
      auto* out = reinterpret_cast<uint16_t*>(blob + layout.down_offset +
                                              expert * layout.down_expert_bytes +
                                              block * dims.down_block_bytes());
      pack_block(static_cast<const uint8_t*>(down) + expert * H * I * element, source, H, I,
                 block * kBlockRows, dims.down_pairs, out);
    }
  });
}

}  // namespace kt::cpu
