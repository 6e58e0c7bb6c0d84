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
};

}  // namespace

MoeKernel moe_kernel(PackedFormat format, CpuVariant variant) {
  for (const FormatRow& row : kRows)
    if (row.format == format) return row.by_variant[static_cast<int>(variant)];
  throw std::invalid_argument("no MoE kernel for packed format id " +
                              std::to_string(static_cast<uint32_t>(format)));
}

}  // namespace kt::cpu
