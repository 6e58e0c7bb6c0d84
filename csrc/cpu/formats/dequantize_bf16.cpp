#include "dequantize_bf16.h"

#include <cstring>

#include "bf16_layout.h"

namespace kt::cpu {

void dequantize_bf16_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                          int64_t row_begin, int64_t row_end, float* out) {
  using bf16_layout::kBlockRows;
  using bf16_layout::kLineBytes;
  const bf16_layout::Dims dims(layout.shape.hidden_size, layout.shape.intermediate_size);
  const bool down = matrix == ExpertMatrix::kDown;
  const size_t block_bytes = down ? dims.down_block_bytes() : dims.gate_up_block_bytes();
  const int64_t K = down ? dims.intermediate : dims.hidden;
  for (int64_t r = row_begin; r < row_end; ++r, out += K) {
    // Line p holds k = 2p, 2p + 1 of the block's 16 rows: row n's pair is 4 bytes at 4n.
    const uint8_t* pairs = row_block(blob, layout, matrix, expert, r, block_bytes) + 4 * (r % kBlockRows);
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      uint32_t pair;
      std::memcpy(&pair, pairs + (k / 2) * kLineBytes, 4);
      const uint32_t low = pair << 16, high = pair & 0xffff0000u;
      std::memcpy(out + k, &low, 4);
      std::memcpy(out + k + 1, &high, 4);
    }
    if (k < K) {  // odd K: the last pair's first value
      uint32_t pair;
      std::memcpy(&pair, pairs + (k / 2) * kLineBytes, 4);
      const uint32_t low = pair << 16;
      std::memcpy(out + k, &low, 4);
    }
  }
}

}  // namespace kt::cpu
