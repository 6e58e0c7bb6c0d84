// The BF16 layout's "dequantize rows" micro-kernel (dequantize_experts.h, bf16_layout.h).
#pragma once

#include "dequantize_experts.h"

namespace kt::cpu {

// Rows of a bf16 blob's matrix -> fp32 (each bf16 widened, exact).
void dequantize_bf16_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                          int64_t row_begin, int64_t row_end, float* out);
// The same values written through `out` (dequantize_experts.h's RowsOut).
void dequantize_bf16_rows_to(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                             int64_t row_begin, int64_t row_end, const RowsOut& out);

}  // namespace kt::cpu
