// The amx variant (AVX-512 + AVX512_BF16 + AMX-BF16 tiles): the generic kernels instantiated with this ISA's
// micro-kernels. Everything after the target pragma is compiled for amx only and
// lives in an anonymous namespace, so no other translation unit can pick up its code;
// headers before the pragma keep the baseline target.
#include "baseline_includes.h"

#pragma GCC push_options
// GCC 12 reports -Wmaybe-uninitialized inside its own shift intrinsics (their
// _mm*_undefined_* operand): a false positive, silenced for the ISA code only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,amx-tile,amx-bf16,amx-int8,avx2,fma,f16c,bmi2")

#include "../bf16/bf16_gemm_amx.h"
#include "../gguf/gguf_amx.h"
#include "../bf16/bf16_format.h"
#include "../fp8/fp8_amx.h"
#include "../fp8/fp8_format.h"
#include "../gguf/gguf_format.h"
#include "../quant/quant_format.h"
#include "../quant/int_ops_avx512_vnni.h"
#include "../quant/quant_gemm_amx.h"

namespace kt::cpu {

void bf16_moe_amx(const MoeArgs& args) { moe_forward<Bf16Format<Bf16GemmAmx>>(args); }
void int8_moe_amx(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemmAmx<QuantKind::kInt8>>>(args);
}
void int4_moe_amx(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemmAmx<QuantKind::kInt4>>>(args);
}
void int4_asym_moe_amx(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemmAmx<QuantKind::kInt4Asym>>>(args);
}
void mxfp4_moe_amx(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemmAmx<QuantKind::kMxfp4>>>(args);
}

void gguf_moe_amx(const MoeArgs& args) { moe_forward<GgufFormat<IntOpsAvx512Vnni, GgufAmx>>(args); }

void fp8_moe_amx(const MoeArgs& args) { moe_forward<Fp8Format<Fp8OpsAmx, PackedFormat::kFp8>>(args); }
void fp8_perchannel_moe_amx(const MoeArgs& args) { moe_forward<Fp8Format<Fp8OpsAmx, PackedFormat::kFp8PerChannel>>(args); }
void mxfp8_moe_amx(const MoeArgs& args) { moe_forward<Fp8Format<Fp8OpsAmx, PackedFormat::kMxfp8>>(args); }

}  // namespace kt::cpu

#pragma GCC diagnostic pop
#pragma GCC pop_options
