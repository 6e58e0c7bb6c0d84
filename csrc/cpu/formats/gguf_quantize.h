// [NOTE] Online quantization into GGUF blocks (round-to-nearest), byte for byte as GGUF
// stores them. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 (mxfp4_block.h) follow ggml's
// reference quantizers (quantize_row_*_ref, which gguf.quants reproduces bit for bit);
// the K-quants use a plain round-to-nearest of each sub-block's range (not ggml's
// iterative search), which yields valid blocks that any GGUF reader decodes.
#pragma once

#include <cstdint>

#include "../isa/element_type.h"
#include "packed_header.h"
#include "quantize.h"

namespace kt::cpu {

// x[0, k) -> k / block blocks of ggml type `type` at out (F32 / F16 / BF16 store the
// values). k must be a multiple of the type's block (ggml_row_bytes checks it).
void gguf_quantize_row(uint32_t type, const float* x, int64_t k, uint8_t* out);

// gate, up: [E, I, H] row-major of `source`; down: [E, H, I]. Writes the header and the
// three matrices of `layout` (format gguf, a ggml type per matrix) into
// blob[0, layout.total_bytes), one job per (matrix, expert, 16 rows) on the Engine.
// `options` has nothing to tune here (round-to-nearest); the parameter keeps every
// format's packer one signature (../format_table.h).
void pack_gguf_experts(const void* gate, const void* up, const void* down, ElementType source,
                       const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

}  // namespace kt::cpu
