// The FP8 layouts' "dequantize rows" micro-kernel (dequantize_experts.h, fp8_layout.h).
#pragma once

#include "dequantize_experts.h"

namespace kt::cpu {

// Rows of an fp8, fp8_perchannel or mxfp8 blob's matrix -> fp32: e4m3(code) * scale +
// addend (rounded after the product and after the sum), the addend being the mxfp8 row's
// (0, or NaN for a row holding a NaN code or exponent) and 0 for the others, so a -0
// product reads +0, as in the oracle.
void dequantize_fp8_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                         int64_t row_begin, int64_t row_end, float* out);
// The same values written through `out` (dequantize_experts.h's RowsOut).
void dequantize_fp8_rows_to(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                            int64_t row_begin, int64_t row_end, const RowsOut& out);

}  // namespace kt::cpu
