// [NOTE] Dynamic activation quantization for the INT8 / INT4 kernels: a row of fp32
// activations -> int8 in [-127, 127] with one fp32 scale (symmetric, scale = max|x| / 127)
// and the int32 sum of each 32 consecutive levels (the kernels' offset corrections).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../../formats/int_layout.h"
#include "../../isa/vec_math.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// The levels of x[0, n) whose largest magnitude amax (> 0) is below 127 / FLT_MAX, where
// 127 / amax is no fp32 number (every level came out +-127): the values are taken 2^64
// times (exact), quantized as any row, and the scale, (2^64 amax / 127) 2^-64, is returned
// (kt_ops.reference.fake_quantize_activations does the same).
inline float tiny_row_levels(const float* x, int64_t n, float amax, int8_t* q) {
  constexpr float kUp = 0x1p64f, kDown = 0x1p-64f;
  const float inv = 127.0f / (amax * kUp);
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<int8_t>(std::clamp(static_cast<int>(std::lrint(x[i] * kUp * inv)), -127, 127));
  return amax * kUp / 127.0f * kDown;
}

// x[0, n) -> q[0, cols) (zero past n), sums[0, cols / 32); returns the scale
// (x ~ scale * q). cols is a multiple of 32. A row holding a NaN or an infinity gets
// scale NaN (and q = 0), so every result computed from it is NaN: the row's own output,
// no other.
template <class V>
float quantize_activation_row(const float* x, int64_t n, int64_t cols, int8_t* q, int32_t* sums) {
  constexpr int W = V::kWidth;
  const int64_t body = n / W * W;
  const AbsMax top = abs_max<V>(x, n);
  const float amax = top.value;
  if (!top.finite) {
    std::fill(q, q + cols, int8_t{0});
    std::fill(sums, sums + cols / int_layout::kKAlign, 0);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  float scale = amax / 127.0f;
  if (std::isinf(inv)) {  // max|x| < 127 / FLT_MAX: see tiny_row_levels
    scale = tiny_row_levels(x, n, amax, q);
  } else {
    const typename V::Reg vinv = V::set1(inv);
    for (int64_t i = 0; i < body; i += W) V::store_int8(q + i, V::mul(V::load(x + i), vinv));
    for (int64_t i = body; i < n; ++i)
      q[i] = static_cast<int8_t>(std::clamp(static_cast<int>(std::lrint(x[i] * inv)), -127, 127));
  }
  std::fill(q + n, q + cols, int8_t{0});
  for (int64_t s = 0; s < cols / int_layout::kKAlign; ++s) {
    int32_t sum = 0;
    for (int64_t i = 0; i < int_layout::kKAlign; ++i) sum += q[s * int_layout::kKAlign + i];
    sums[s] = sum;
  }
  return scale;
}

}  // namespace
}  // namespace kt::cpu
