// Quantizes Hugging Face expert weights into the INT8 / INT4 layouts (int_layout.h).
#pragma once

#include <cstdint>

#include "../isa/element_type.h"
#include "packed_header.h"
#include "quantize.h"

namespace kt::cpu {

// gate, up: [E, I, H] row-major of `type`; down: [E, H, I]. Writes the header and all
// blocks of `layout` (format int8, int4 or int4_asym) into blob[0, layout.total_bytes).
// One job per (matrix, expert, 16-row block) on the Engine.
void pack_int_experts(const void* gate, const void* up, const void* down, ElementType type,
                      const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

}  // namespace kt::cpu
