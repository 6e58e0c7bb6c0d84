#include "dequantize_fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "fp8_layout.h"

namespace kt::cpu {
namespace {

using fp8_layout::kBlockRows;

// e4m3 (float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN) of every code, exact.
std::array<float, 256> e4m3_values() {
  std::array<float, 256> values{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 15, mantissa = code & 7;
    float v = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                            : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
    if ((code & 0x7f) == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
    values[code] = code & 0x80 ? -v : v;
  }
  return values;
}

const std::array<float, 256> kE4m3 = e4m3_values();

// 2^(e - 127), e = 255 NaN (OCP MX E8M0).
float ue8m0(uint8_t e) {
  if (e == fp8_layout::kMxNan) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

}  // namespace

void dequantize_fp8_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                         int64_t row_begin, int64_t row_end, float* out) {
  const fp8_layout::Dims dims(layout.shape);
  const bool down = matrix == ExpertMatrix::kDown;
  const fp8_layout::MatrixDims& m = down ? dims.down : dims.gate_up;
  for (int64_t r = row_begin; r < row_end; ++r, out += m.k) {
    const uint8_t* b = row_block(blob, layout, matrix, expert, r, m.block_bytes());
    const int n = static_cast<int>(r % kBlockRows);
    float addend = 0.0f;
    if (m.byte_scales) std::memcpy(&addend, b + m.addend_offset() + 4 * n, 4);
    // k-pair p of row n: 2 codes at 32 p + 2 n.
    const uint8_t* codes = b + 2 * n;
    for (int64_t g = 0; g < m.groups; ++g) {
      float scale;
      if (m.byte_scales) scale = ue8m0(b[m.scales_offset() + g * kBlockRows + n]);
      else std::memcpy(&scale, b + m.scales_offset() + (g * kBlockRows + n) * 4, 4);
      const int64_t end = std::min<int64_t>((g + 1) * m.group, m.k);
      for (int64_t k = g * m.group; k < end; ++k) {
        const float product = kE4m3[codes[(k / 2) * 32 + (k & 1)]] * scale;
        out[k] = product + addend;
      }
    }
  }
}

}  // namespace kt::cpu
