#include "source_rows.h"

#include <cstring>

#include "../isa/scalar_convert.h"

namespace kt::cpu {

void load_row(const void* matrix, ElementType type, int64_t row, int64_t cols, float* out) {
  const int64_t begin = row * cols;
  switch (type) {
    case ElementType::kF32:
      std::memcpy(out, static_cast<const float*>(matrix) + begin, cols * sizeof(float));
      return;
    case ElementType::kBf16: {
      const uint16_t* p = static_cast<const uint16_t*>(matrix) + begin;
      for (int64_t k = 0; k < cols; ++k) out[k] = bf16_to_float(p[k]);
      return;
    }
    default: {
      const uint16_t* p = static_cast<const uint16_t*>(matrix) + begin;
      for (int64_t k = 0; k < cols; ++k) out[k] = f16_to_float(p[k]);
      return;
    }
  }
}

}  // namespace kt::cpu
