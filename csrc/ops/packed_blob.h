// Reads the header of a packed-experts tensor after checking the tensor itself.
#pragma once

#include <ATen/core/Tensor.h>

#include "../cpu/formats/packed_header.h"

namespace kt::ops {

// packed must be a contiguous 1-D uint8 CPU tensor holding a valid blob; raises
// ValueError naming `name` otherwise.
cpu::PackedLayout read_packed(const at::Tensor& packed, const char* name);

}  // namespace kt::ops
