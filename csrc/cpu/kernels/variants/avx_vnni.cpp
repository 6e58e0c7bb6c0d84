// The avx_vnni variant (AVX2 + FMA + F16C + AVX-VNNI): the integer kernels (INT8, INT4,
// every GGUF type) instantiated with the 256-bit vpdpbusd operations; BF16 has no integer
// dot and runs the avx2 kernel (format_table.cpp names it). Everything after the target
// pragma is compiled for avx_vnni only and lives in an anonymous namespace, so no other
// translation unit can pick up its code; headers before the pragma keep the baseline target.
#include "baseline_includes.h"

#pragma GCC push_options
// GCC 12 reports -Wmaybe-uninitialized inside its own shift intrinsics (their
// _mm*_undefined_* operand): a false positive, silenced for the ISA code only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")

#include "../gguf/gguf_format.h"
#include "../quant/quant_format.h"
#include "../quant/int_ops_avx_vnni.h"

namespace kt::cpu {

void int8_moe_avx_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvxVnni, QuantKind::kInt8>>>(args);
}
void int4_moe_avx_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvxVnni, QuantKind::kInt4>>>(args);
}
void int4_asym_moe_avx_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvxVnni, QuantKind::kInt4Asym>>>(args);
}
void mxfp4_moe_avx_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvxVnni, QuantKind::kMxfp4>>>(args);
}

void gguf_moe_avx_vnni(const MoeArgs& args) { moe_forward<GgufFormat<IntOpsAvxVnni>>(args); }

}  // namespace kt::cpu

#pragma GCC diagnostic pop
#pragma GCC pop_options
