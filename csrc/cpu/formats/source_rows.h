// Rows of the Hugging Face source weights (bf16 / fp16 / fp32) as fp32, for the packers.
#pragma once

#include <cstdint>

#include "../isa/element_type.h"

namespace kt::cpu {

// out[0, cols) = row `row` of a row-major [rows, cols] matrix of `type`.
void load_row(const void* matrix, ElementType type, int64_t row, int64_t cols, float* out);

}  // namespace kt::cpu
