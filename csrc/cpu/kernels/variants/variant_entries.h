// The entry points each variant translation unit exports (one per format).
#pragma once

#include "../moe_args.h"

namespace kt::cpu {

void bf16_moe_avx2(const MoeArgs& args);
void bf16_moe_avx512(const MoeArgs& args);
void bf16_moe_avx512_bf16(const MoeArgs& args);
void bf16_moe_amx(const MoeArgs& args);
void int8_moe_avx2(const MoeArgs& args);
void int8_moe_avx_vnni(const MoeArgs& args);
void int8_moe_avx512(const MoeArgs& args);
void int8_moe_avx512_vnni(const MoeArgs& args);
void int8_moe_avx512_bf16(const MoeArgs& args);
void int8_moe_amx(const MoeArgs& args);
void int4_moe_avx2(const MoeArgs& args);
void int4_moe_avx_vnni(const MoeArgs& args);
void int4_moe_avx512(const MoeArgs& args);
void int4_moe_avx512_vnni(const MoeArgs& args);
void int4_moe_avx512_bf16(const MoeArgs& args);
void int4_moe_amx(const MoeArgs& args);
void int4_asym_moe_avx2(const MoeArgs& args);
void int4_asym_moe_avx_vnni(const MoeArgs& args);
void int4_asym_moe_avx512(const MoeArgs& args);
void int4_asym_moe_avx512_vnni(const MoeArgs& args);
void int4_asym_moe_avx512_bf16(const MoeArgs& args);
void int4_asym_moe_amx(const MoeArgs& args);
void mxfp4_moe_avx2(const MoeArgs& args);
void mxfp4_moe_avx_vnni(const MoeArgs& args);
void mxfp4_moe_avx512(const MoeArgs& args);
void mxfp4_moe_avx512_vnni(const MoeArgs& args);
void mxfp4_moe_avx512_bf16(const MoeArgs& args);
void mxfp4_moe_amx(const MoeArgs& args);
void gguf_moe_avx2(const MoeArgs& args);
void gguf_moe_avx_vnni(const MoeArgs& args);
void gguf_moe_avx512(const MoeArgs& args);
void gguf_moe_avx512_vnni(const MoeArgs& args);
void gguf_moe_avx512_bf16(const MoeArgs& args);
void gguf_moe_amx(const MoeArgs& args);
void fp8_moe_avx2(const MoeArgs& args);
void fp8_moe_avx512(const MoeArgs& args);
void fp8_moe_avx512_bf16(const MoeArgs& args);
void fp8_moe_amx(const MoeArgs& args);
void fp8_perchannel_moe_avx2(const MoeArgs& args);
void fp8_perchannel_moe_avx512(const MoeArgs& args);
void fp8_perchannel_moe_avx512_bf16(const MoeArgs& args);
void fp8_perchannel_moe_amx(const MoeArgs& args);
void mxfp8_moe_avx2(const MoeArgs& args);
void mxfp8_moe_avx512(const MoeArgs& args);
void mxfp8_moe_avx512_bf16(const MoeArgs& args);
void mxfp8_moe_amx(const MoeArgs& args);

}  // namespace kt::cpu
