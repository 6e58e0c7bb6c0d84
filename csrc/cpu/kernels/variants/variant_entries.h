// The entry points each variant translation unit exports (one per format).
#pragma once

#include "../moe_args.h"

namespace kt::cpu {

void moe_forward_bf16_avx2(const MoeArgs& args);
void moe_forward_bf16_avx512(const MoeArgs& args);
void moe_forward_bf16_avx512_bf16(const MoeArgs& args);
void moe_forward_bf16_amx(const MoeArgs& args);

}  // namespace kt::cpu
