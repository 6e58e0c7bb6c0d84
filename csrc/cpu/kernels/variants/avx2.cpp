// The avx2 variant (AVX2 + FMA + F16C): the generic kernels instantiated with this ISA's
// micro-kernels. Everything after the target pragma is compiled for avx2 only and
// lives in an anonymous namespace, so no other translation unit can pick up its code;
// headers before the pragma keep the baseline target.
#include "baseline_includes.h"

#pragma GCC push_options
// GCC 12 reports -Wmaybe-uninitialized inside its own shift intrinsics (their
// _mm*_undefined_* operand): a false positive, silenced for the ISA code only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c,bmi2")

#include "../bf16/bf16_gemm_avx2.h"
#include "../bf16/bf16_format.h"
#include "../fp8/fp8_decode_avx2.h"
#include "../fp8/fp8_format.h"
#include "../gguf/gguf_format.h"
#include "../quant/quant_format.h"
#include "../quant/int_ops_avx2.h"

namespace kt::cpu {

void bf16_moe_avx2(const MoeArgs& args) { moe_forward<Bf16Format<Bf16GemmAvx2>>(args); }
void int8_moe_avx2(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx2, QuantKind::kInt8>>>(args);
}
void int4_moe_avx2(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx2, QuantKind::kInt4>>>(args);
}
void int4_asym_moe_avx2(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx2, QuantKind::kInt4Asym>>>(args);
}
void mxfp4_moe_avx2(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx2, QuantKind::kMxfp4>>>(args);
}

void fp8_moe_avx2(const MoeArgs& args) { moe_forward<Fp8Format<Fp8OpsAvx2, PackedFormat::kFp8>>(args); }
void fp8_perchannel_moe_avx2(const MoeArgs& args) { moe_forward<Fp8Format<Fp8OpsAvx2, PackedFormat::kFp8PerChannel>>(args); }
void mxfp8_moe_avx2(const MoeArgs& args) { moe_forward<Fp8Format<Fp8OpsAvx2, PackedFormat::kMxfp8>>(args); }

void gguf_moe_avx2(const MoeArgs& args) { moe_forward<GgufFormat<IntOpsAvx2>>(args); }

}  // namespace kt::cpu

#pragma GCC diagnostic pop
#pragma GCC pop_options
