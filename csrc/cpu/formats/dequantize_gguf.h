// The gguf format's "dequantize rows" micro-kernel (dequantize_experts.h, gguf_types.h).
#pragma once

#include "dequantize_experts.h"

namespace kt::cpu {

// Rows of a gguf blob's matrix -> fp32, every ggml type of kGgmlTypes decoded with the
// formulas of gguf.quants.dequantize (the oracle; ggml's dequantize_row_* compute the same
// values) in their order of operations; MXFP4 as mxfp4_block.h (exponent 255: NaN).
void dequantize_gguf_rows(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                          int64_t row_begin, int64_t row_end, float* out);

}  // namespace kt::cpu
