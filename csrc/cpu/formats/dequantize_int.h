// The INT8 / INT4 / MXFP4 layouts' "dequantize rows" micro-kernel (dequantize_experts.h, int_layout.h).
#pragma once

#include "dequantize_experts.h"

namespace kt::cpu {

// Rows of an int8, int4, int4_asym or mxfp4 blob's matrix -> fp32: int8 q * scale, int4
// (q - 8) * scale, int4_asym q * scale + minimum (rounded after the product and after the
// sum), mxfp4 kValues[q] * half_scale (exact).
void dequantize_int_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                         int64_t row_begin, int64_t row_end, float* out);
// The same values written through `out` (dequantize_experts.h's RowsOut: row-major rows or
// the training backward's panels).
void dequantize_int_rows_to(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                            int64_t row_begin, int64_t row_end, const RowsOut& out);

}  // namespace kt::cpu
