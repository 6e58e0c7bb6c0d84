// The avx512_vnni variant (AVX-512F/BW/VL/DQ + AVX512_VNNI, no AVX512_BF16: Cascade Lake
// and Ice Lake Xeons): the integer and GGUF formats with the 512-bit vpdpbusd
// micro-kernels of avx512_bf16 (which use no bf16 instruction). BF16 and the FP8 formats
// have no integer products: this variant runs the avx512 kernels for them
// (format_table.cpp). Everything after the target pragma is compiled for avx512_vnni only
// and lives in an anonymous namespace, so no other translation unit can pick up its code;
// headers before the pragma keep the baseline target.
#include "baseline_includes.h"

#pragma GCC push_options
// GCC 12 reports -Wmaybe-uninitialized inside its own shift intrinsics (their
// _mm*_undefined_* operand): a false positive, silenced for the ISA code only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")

#include "../gguf/gguf_format.h"
#include "../quant/quant_format.h"
#include "../quant/int_ops_avx512_vnni.h"

namespace kt::cpu {

void int8_moe_avx512_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx512Vnni, QuantKind::kInt8>>>(args);
}
void int4_moe_avx512_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx512Vnni, QuantKind::kInt4>>>(args);
}
void int4_asym_moe_avx512_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx512Vnni, QuantKind::kInt4Asym>>>(args);
}
void mxfp4_moe_avx512_vnni(const MoeArgs& args) {
  moe_forward<QuantFormat<QuantGemm<IntOpsAvx512Vnni, QuantKind::kMxfp4>>>(args);
}

void gguf_moe_avx512_vnni(const MoeArgs& args) { moe_forward<GgufFormat<IntOpsAvx512Vnni>>(args); }

}  // namespace kt::cpu

#pragma GCC diagnostic pop
#pragma GCC pop_options
