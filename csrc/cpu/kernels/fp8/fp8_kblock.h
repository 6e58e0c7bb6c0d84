// The k block of the FP8 kernels (fp8_format.h) and the mxfp8 group geometry their weight
// sources (fp8_decode_*.h) rely on.
#pragma once

#include <cstdint>

#include "../../formats/fp8_layout.h"

namespace kt::cpu {

constexpr int64_t kFp8KBlockPairs = 128;  // 256 k: whole fp8 (128) and mxfp8 (32) groups
constexpr int64_t kMxGroupPairs = fp8_layout::kMxGroup / 2;
constexpr int64_t kMxGroupsPerKBlock = kFp8KBlockPairs / kMxGroupPairs;
static_assert(kFp8KBlockPairs * 2 % fp8_layout::kBlockGroup == 0, "k blocks must hold whole fp8 groups");
static_assert(kMxGroupPairs == 16, "the weight sources find a pair's mxfp8 group as p >> 4");

}  // namespace kt::cpu
