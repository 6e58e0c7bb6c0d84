// The entry points each variant translation unit exports (one per format).
#pragma once

#include "../moe_args.h"

namespace kt::cpu {

void moe_forward_bf16_avx2(const MoeArgs& args);
void moe_forward_bf16_avx512(const MoeArgs& args);
void moe_forward_bf16_avx512_bf16(const MoeArgs& args);
void moe_forward_bf16_amx(const MoeArgs& args);
void moe_forward_int8_avx2(const MoeArgs& args);
void moe_forward_int8_avx512(const MoeArgs& args);
void moe_forward_int8_avx512_bf16(const MoeArgs& args);
void moe_forward_int8_amx(const MoeArgs& args);
void moe_forward_int4_avx2(const MoeArgs& args);
void moe_forward_int4_avx512(const MoeArgs& args);
void moe_forward_int4_avx512_bf16(const MoeArgs& args);
void moe_forward_int4_amx(const MoeArgs& args);
void moe_forward_int4_asym_avx2(const MoeArgs& args);
void moe_forward_int4_asym_avx512(const MoeArgs& args);
void moe_forward_int4_asym_avx512_bf16(const MoeArgs& args);
void moe_forward_int4_asym_amx(const MoeArgs& args);
void moe_forward_gguf_avx2(const MoeArgs& args);
void moe_forward_gguf_avx512(const MoeArgs& args);
void moe_forward_gguf_avx512_bf16(const MoeArgs& args);
void moe_forward_gguf_amx(const MoeArgs& args);

}  // namespace kt::cpu
