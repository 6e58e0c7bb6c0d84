// Packs Hugging Face expert weights into the BF16 layout (bf16_layout.h).
#pragma once

#include <cstdint>

#include "../isa/element_type.h"
#include "packed_header.h"
#include "quantize.h"

namespace kt::cpu {

// gate, up: [E, I, H] row-major of `source`; down: [E, H, I]. bf16 is copied, fp16 and
// fp32 are rounded to the nearest bf16 (ties to even). Writes the header and all blocks
// of `layout` (format bf16) into blob[0, layout.total_bytes). One job per (matrix,
// expert, 16-row block) on the Engine. `options` has nothing to tune for bf16; the
// parameter keeps every format's packer one signature (../format_table.h).
void pack_bf16_experts(const void* gate, const void* up, const void* down, ElementType source,
                       const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

}  // namespace kt::cpu
