#include "pack_bf16.h"

#include <cstring>

#include "../engine/engine.h"
#include "bf16_layout.h"

namespace kt::cpu {
namespace {

using bf16_layout::kBlockRows;

// Writes rows [row0, row0 + 16) of matrix [rows, cols] as one block [ceil(cols/2)][16][2];
// rows and columns past the matrix are zero.
void pack_block(const uint16_t* matrix, int64_t rows, int64_t cols, int64_t row0,
                int64_t pairs, uint16_t* block) {
  std::memset(block, 0, static_cast<size_t>(pairs) * kBlockRows * 2 * sizeof(uint16_t));
  for (int r = 0; r < kBlockRows && row0 + r < rows; ++r) {
    const uint16_t* row = matrix + (row0 + r) * cols;
    for (int64_t k = 0; k < cols; ++k) block[(k / 2) * kBlockRows * 2 + r * 2 + (k % 2)] = row[k];
  }
}

}  // namespace

void pack_bf16_experts(const uint16_t* gate, const uint16_t* up, const uint16_t* down,
                       const PackedLayout& layout, uint8_t* blob) {
  const PackedShape& shape = layout.shape;
  const bf16_layout::Dims dims(shape.hidden_size, shape.intermediate_size);
  const int64_t H = dims.hidden, I = dims.intermediate;
  write_packed_header(layout, blob);
  const int64_t gate_up_jobs = shape.num_experts * dims.gate_up_blocks;
  const int64_t down_jobs = shape.num_experts * dims.down_blocks;
  Engine::instance().parallel_for(gate_up_jobs + down_jobs, [&](int64_t job) {
    if (job < gate_up_jobs) {
      // Block 2b is gate rows [16b, 16b + 16), block 2b + 1 the same rows of up.
      const int64_t expert = job / dims.gate_up_blocks, block = job % dims.gate_up_blocks;
      const uint16_t* source = (block % 2 == 0 ? gate : up) + expert * I * H;
      auto* out = reinterpret_cast<uint16_t*>(blob + layout.gate_up_offset +
                                              expert * layout.gate_up_expert_bytes +
                                              block * dims.gate_up_block_bytes());
      pack_block(source, I, H, (block / 2) * kBlockRows, dims.hidden_pairs, out);
    } else {
      const int64_t expert = (job - gate_up_jobs) / dims.down_blocks;
      const int64_t block = (job - gate_up_jobs) % dims.down_blocks;
      auto* out = reinterpret_cast<uint16_t*>(blob + layout.down_offset +
                                              expert * layout.down_expert_bytes +
                                              block * dims.down_block_bytes());
      pack_block(down + expert * H * I, H, I, block * kBlockRows, dims.down_pairs, out);
    }
  });
}

}  // namespace kt::cpu
