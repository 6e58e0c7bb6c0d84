#include "dequantize_int.h"

#include <cstring>

#include "int_layout.h"

namespace kt::cpu {
namespace {

using int_layout::kBlockRows;
using int_layout::kLineBytes;

inline float load_float(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Row n of a block: line l holds its 4 bytes at 64 l + 4 n (int_layout.h).
void int8_row(const uint8_t* block, const int_layout::MatrixDims& dims, int n, float* out) {
  const float scale = load_float(block + dims.scales_offset() + 4 * n);
  const uint8_t* bytes = block + 4 * n;
  for (int64_t k = 0; k < dims.k; ++k) {
    const uint8_t* line = bytes + (k / 4) * kLineBytes;
    out[k] = static_cast<float>(line[k % 4] - int_layout::kInt8Zero) * scale;
  }
}

// Line l holds k = 8l + i (low nibbles of row n's 4 bytes) and 8l + 4 + i (high nibbles).
template <bool kMinimums>
void int4_row(const uint8_t* block, const int_layout::MatrixDims& dims, int n, float* out) {
  const uint8_t* bytes = block + 4 * n;
  for (int64_t g = 0; g < dims.groups; ++g) {
    const float scale = load_float(block + dims.scales_offset() + (g * kBlockRows + n) * 4);
    const float minimum = kMinimums ? load_float(block + dims.minimums_offset() + (g * kBlockRows + n) * 4) : 0.0f;
    for (int64_t k = g * dims.group; k < (g + 1) * dims.group; k += 8) {
      uint32_t word;  // byte i: k + i (low nibble), k + 4 + i (high nibble)
      std::memcpy(&word, bytes + (k / 8) * kLineBytes, 4);
      for (int i = 0; i < 8; ++i) {
        const int q = static_cast<int>((word >> (i < 4 ? 8 * i : 8 * (i - 4) + 4)) & 15);
        if (kMinimums) {
          const float product = static_cast<float>(q) * scale;
          out[k + i] = product + minimum;
        } else {
          out[k + i] = static_cast<float>(q - int_layout::kInt4Zero) * scale;
        }
      }
    }
  }
}

}  // namespace

void dequantize_int_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                         int64_t row_begin, int64_t row_end, float* out) {
  const int_layout::Dims dims(layout.shape);
  const bool down = matrix == ExpertMatrix::kDown;
  const int_layout::MatrixDims& m = down ? dims.down : dims.gate_up;
  const PackedFormat format = layout.shape.format;
  for (int64_t r = row_begin; r < row_end; ++r, out += m.k) {
    const uint8_t* b = row_block(blob, layout, matrix, expert, r, m.block_bytes());
    const int n = static_cast<int>(r % kBlockRows);
    if (format == PackedFormat::kInt8) int8_row(b, m, n, out);
    else if (format == PackedFormat::kInt4) int4_row<false>(b, m, n, out);
    else int4_row<true>(b, m, n, out);
  }
}

}  // namespace kt::cpu
