#include "kernel_table.h"

#include <stdexcept>
#include <string>

#include "variants/variant_entries.h"

namespace kt::cpu {
namespace {

struct FormatRow {
  PackedFormat format;
  MoeKernel by_variant[kNumCpuVariants];  // indexed by CpuVariant
};

const FormatRow kRows[] = {
    {PackedFormat::kBf16,
     {{moe_forward_bf16_avx2, "bf16/avx2 (fp32 FMA on widened bf16)"},
      {moe_forward_bf16_avx512, "bf16/avx512 (fp32 FMA on widened bf16)"},
      {moe_forward_bf16_avx512_bf16, "bf16/avx512_bf16 (vdpbf16ps)"},
      {moe_forward_bf16_amx, "bf16/amx (tdpbf16ps tiles; vdpbf16ps for decode and tails)"}}},
    {PackedFormat::kInt8,
     {{moe_forward_int8_avx2, "int8/avx2 (vpmaddubsw + vpmaddwd)"},
      {moe_forward_int8_avx512, "int8/avx512 (vpmaddubsw + vpmaddwd)"},
      {moe_forward_int8_avx512_bf16, "int8/avx512_bf16 (vpdpbusd)"},
      {moe_forward_int8_amx, "int8/amx (tdpbsud tiles; vpdpbusd for decode and tails)"}}},
    {PackedFormat::kInt4,
     {{moe_forward_int4_avx2, "int4/avx2 (vpmaddubsw + vpmaddwd)"},
      {moe_forward_int4_avx512, "int4/avx512 (vpmaddubsw + vpmaddwd)"},
      {moe_forward_int4_avx512_bf16, "int4/avx512_bf16 (vpdpbusd)"},
      {moe_forward_int4_amx, "int4/amx (tdpbsud tiles; vpdpbusd for decode and tails)"}}},
    {PackedFormat::kInt4Asym,
     {{moe_forward_int4_asym_avx2, "int4_asym/avx2 (vpmaddubsw + vpmaddwd)"},
      {moe_forward_int4_asym_avx512, "int4_asym/avx512 (vpmaddubsw + vpmaddwd)"},
      {moe_forward_int4_asym_avx512_bf16, "int4_asym/avx512_bf16 (vpdpbusd)"},
      {moe_forward_int4_asym_amx, "int4_asym/amx (tdpbsud tiles; vpdpbusd for decode and tails)"}}},
    {PackedFormat::kGguf,
     {{moe_forward_gguf_avx2, "gguf/avx2 (vpmaddubsw + vpmaddwd on decoded blocks)"},
      {moe_forward_gguf_avx512, "gguf/avx512 (vpmaddubsw + vpmaddwd on decoded blocks; Q4_K decode in place)"},
      {moe_forward_gguf_avx512_bf16, "gguf/avx512_bf16 (vpdpbusd on decoded blocks; Q4_K decode in place)"},
      {moe_forward_gguf_amx, "gguf/amx (the avx512_bf16 kernel: vpdpbusd on decoded blocks; no tile path yet)"}}},
};

}  // namespace

MoeKernel moe_kernel(PackedFormat format, CpuVariant variant) {
  for (const FormatRow& row : kRows)
    if (row.format == format) return row.by_variant[static_cast<int>(variant)];
  throw std::invalid_argument("no MoE kernel for packed format id " +
                              std::to_string(static_cast<uint32_t>(format)));
}

}  // namespace kt::cpu
