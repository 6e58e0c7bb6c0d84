// Packs Hugging Face expert weights (bf16) into the BF16 layout (bf16_layout.h).
#pragma once

#include <cstdint>

#include "packed_header.h"

namespace kt::cpu {

// gate, up: [E, I, H] row-major bf16 bits; down: [E, H, I]. Writes the header and all
// blocks of `layout` (format kBf16) into blob[0, layout.total_bytes). Runs on the Engine.
void pack_bf16_experts(const uint16_t* gate, const uint16_t* up, const uint16_t* down,
                       const PackedLayout& layout, uint8_t* blob);

}  // namespace kt::cpu
