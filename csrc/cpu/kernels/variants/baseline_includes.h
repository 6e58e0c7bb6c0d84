// What a variant translation unit includes *before* its target pragma: the standard
// library and the ISA-independent headers, which must keep the baseline target so no
// AVX-512 instantiation of a shared inline function can reach another variant.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../engine/engine.h"
#include "../../engine/scratch.h"
#include "../../formats/bf16_layout.h"
#include "../../formats/gguf_types.h"
#include "../../formats/int_layout.h"
#include "../../isa/prefetch.h"
#include "../../isa/scalar_convert.h"
#include "../moe_args.h"
#include "../moe_plan.h"
#include "variant_entries.h"
