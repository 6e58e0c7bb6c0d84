#include "format_table.h"

#include <iterator>
#include <stdexcept>

#include "formats/bf16_layout.h"
#include "formats/dequantize_bf16.h"
#include "formats/dequantize_fp8.h"
#include "formats/dequantize_gguf.h"
#include "formats/dequantize_int.h"
#include "formats/fp8_layout.h"
#include "formats/pack_fp8.h"
#include "formats/gguf_quantize.h"
#include "formats/int_layout.h"
#include "formats/pack_bf16.h"
#include "formats/pack_int.h"
#include "kernels/variants/variant_entries.h"

namespace kt::cpu {
namespace {

constexpr const char* kOracle = "kt_ops.reference.dequantize";
constexpr const uint32_t* kInt4Groups = int_layout::kGroupSizes;
constexpr size_t kNumInt4Groups = std::size(int_layout::kGroupSizes);
constexpr uint32_t kInt4DefaultGroup = 128;  // kt-kernel's default
constexpr uint32_t kMxfp4Groups[] = {int_layout::kMxfp4Group};

// Rows in header-id order (checked below). The bf16 and int layouts store 16-row blocks
// of 64-byte lines (bf16_layout.h, int_layout.h); gguf rows of ggml blocks (gguf_types.h).
constexpr FormatRow kRows[] = {
    {PackedFormat::kBf16, "bf16", {"BF16", nullptr}, false,
     bf16_layout::kBlockRows, 2, bf16_layout::kLineBytes, 0,
     RowRule::kAny, 2, 0, nullptr, 0, 0, false,
     pack_bf16_experts, "pack_bf16_experts", dequantize_bf16_rows, "dequantize_bf16_rows",
     ActivationQuant::kNone, kOracle,
     {{bf16_moe_avx2, "bf16/avx2 (fp32 FMA on widened bf16)"},
      {bf16_moe_avx2, "bf16/avx_vnni (the avx2 kernel: fp32 FMA on widened bf16)"},
      {bf16_moe_avx512, "bf16/avx512 (fp32 FMA on widened bf16)"},
      {bf16_moe_avx512, "bf16/avx512_vnni (the avx512 kernel: fp32 FMA on widened bf16)"},
      {bf16_moe_avx512_bf16, "bf16/avx512_bf16 (vdpbf16ps)"},
      {bf16_moe_amx, "bf16/amx (tdpbf16ps tiles; vdpbf16ps for decode and tails)"}},
     0, 1, 0, dequantize_bf16_rows_to},
    {PackedFormat::kInt8, "int8", {"AMXINT8", "MOE_INT8"}, false,
     int_layout::kBlockRows, 4, int_layout::kLineBytes, 4,
     RowRule::kAny, int_layout::kKAlign, int_layout::kInt8MaxK, nullptr, 0, 0, true,
     pack_int_experts, "pack_int_experts", dequantize_int_rows, "dequantize_int_rows",
     ActivationQuant::kInt8PerToken, kOracle,
     {{int8_moe_avx2, "int8/avx2 (vpmaddubsw + vpmaddwd)"},
      {int8_moe_avx_vnni, "int8/avx_vnni (256-bit vpdpbusd)"},
      {int8_moe_avx512, "int8/avx512 (vpmaddubsw + vpmaddwd)"},
      {int8_moe_avx512_vnni, "int8/avx512_vnni (vpdpbusd)"},
      {int8_moe_avx512_bf16, "int8/avx512_bf16 (vpdpbusd)"},
      {int8_moe_amx, "int8/amx (tdpbsud tiles; vpdpbusd for decode and tails)"}},
     0, 1, 0, dequantize_int_rows_to},
    {PackedFormat::kInt4, "int4", {"AMXINT4", "MOE_INT4"}, false,
     int_layout::kBlockRows, 8, int_layout::kLineBytes, 4,
     RowRule::kGroupSize, 1, 0, kInt4Groups, kNumInt4Groups, kInt4DefaultGroup, true,
     pack_int_experts, "pack_int_experts", dequantize_int_rows, "dequantize_int_rows",
     ActivationQuant::kInt8PerToken, kOracle,
     {{int4_moe_avx2, "int4/avx2 (vpmaddubsw + vpmaddwd)"},
      {int4_moe_avx_vnni, "int4/avx_vnni (256-bit vpdpbusd)"},
      {int4_moe_avx512, "int4/avx512 (vpmaddubsw + vpmaddwd)"},
      {int4_moe_avx512_vnni, "int4/avx512_vnni (vpdpbusd)"},
      {int4_moe_avx512_bf16, "int4/avx512_bf16 (vpdpbusd)"},
      {int4_moe_amx, "int4/amx (tdpbssd tiles on signed levels; vpdpbusd for decode and tails)"}},
     0, 1, 0, dequantize_int_rows_to},
    {PackedFormat::kInt4Asym, "int4_asym", {"AMXINT4", "MOE_INT4"}, true,
     int_layout::kBlockRows, 8, int_layout::kLineBytes, 8,
     RowRule::kGroupSize, 1, 0, kInt4Groups, kNumInt4Groups, kInt4DefaultGroup, true,
     pack_int_experts, "pack_int_experts", dequantize_int_rows, "dequantize_int_rows",
     ActivationQuant::kInt8PerToken, kOracle,
     {{int4_asym_moe_avx2, "int4_asym/avx2 (vpmaddubsw + vpmaddwd)"},
      {int4_asym_moe_avx_vnni, "int4_asym/avx_vnni (256-bit vpdpbusd)"},
      {int4_asym_moe_avx512, "int4_asym/avx512 (vpmaddubsw + vpmaddwd)"},
      {int4_asym_moe_avx512_vnni, "int4_asym/avx512_vnni (vpdpbusd)"},
      {int4_asym_moe_avx512_bf16, "int4_asym/avx512_bf16 (vpdpbusd)"},
      {int4_asym_moe_amx, "int4_asym/amx (tdpbsud tiles; vpdpbusd for decode and tails)"}},
     0, 1, 0, dequantize_int_rows_to},
    {PackedFormat::kGguf, "gguf", {"LLAMAFILE", nullptr}, false,
     1, 0, 0, 0,
     RowRule::kGgmlBlock, 1, 0, nullptr, 0, 0, false,
     pack_gguf_experts, "pack_gguf_experts", dequantize_gguf_rows, "dequantize_gguf_rows",
     ActivationQuant::kGgmlBlocks, kOracle,
     {{gguf_moe_avx2,
       "gguf/avx2 (vpmaddubsw + vpmaddwd; in-place types dotted from their bytes, the others decoded once per job)"},
      {gguf_moe_avx_vnni,
       "gguf/avx_vnni (256-bit vpdpbusd; in-place types dotted from their bytes, the others decoded once per job)"},
      {gguf_moe_avx512,
       "gguf/avx512 (vpmaddubsw + vpmaddwd; in-place types dotted from their bytes, the others "
       "decoded once per job)"},
      {gguf_moe_avx512_vnni,
       "gguf/avx512_vnni (vpdpbusd; in-place types dotted from their bytes, the others decoded once per job)"},
      {gguf_moe_avx512_bf16,
       "gguf/avx512_bf16 (vpdpbusd; in-place types dotted from their bytes, the others decoded once per job)"},
      {gguf_moe_amx,
       "gguf/amx (the avx512_bf16 path; tdpbf16ps tiles on rows decoded to bf16 for calls of layers with a "
       "float-type matrix averaging >= 8 tokens per expert)"}}},
    {PackedFormat::kFp8, "fp8", {"FP8", nullptr}, false,
     fp8_layout::kBlockRows, 4, 64, 4,
     RowRule::kAny, fp8_layout::kKAlign, 0, nullptr, 0, 0, false,
     pack_fp8_experts, "pack_fp8_experts", dequantize_fp8_rows, "dequantize_fp8_rows",
     ActivationQuant::kNone, kOracle,
     {{fp8_moe_avx2, "fp8/avx2 (e4m3 -> fp32 in registers by integer ops, fp32 FMA)"},
      {fp8_moe_avx2, "fp8/avx_vnni (the avx2 kernel: e4m3 -> fp32 in registers, fp32 FMA)"},
      {fp8_moe_avx512, "fp8/avx512 (e4m3 -> bf16 in registers, widened to fp32, fp32 FMA)"},
      {fp8_moe_avx512, "fp8/avx512_vnni (the avx512 kernel: e4m3 -> bf16 in registers, widened to fp32, fp32 FMA)"},
      {fp8_moe_avx512_bf16, "fp8/avx512_bf16 (e4m3 -> bf16 in registers, vdpbf16ps)"},
      {fp8_moe_amx, "fp8/amx (tdpbf16ps tiles on BF16 lines decoded once per call for experts with more than 6 tokens; the avx512_bf16 kernel below that)"}},
     fp8_layout::kBlockGroup, 1, 0, dequantize_fp8_rows_to},
    {PackedFormat::kFp8PerChannel, "fp8_perchannel", {"FP8_PERCHANNEL", nullptr}, false,
     fp8_layout::kBlockRows, 4, 64, 4,
     RowRule::kAny, fp8_layout::kKAlign, 0, nullptr, 0, 0, false,
     pack_fp8_experts, "pack_fp8_experts", dequantize_fp8_rows, "dequantize_fp8_rows",
     ActivationQuant::kNone, kOracle,
     {{fp8_perchannel_moe_avx2, "fp8_perchannel/avx2 (e4m3 -> fp32 in registers by integer ops, fp32 FMA)"},
      {fp8_perchannel_moe_avx2, "fp8_perchannel/avx_vnni (the avx2 kernel: e4m3 -> fp32 in registers, fp32 FMA)"},
      {fp8_perchannel_moe_avx512, "fp8_perchannel/avx512 (e4m3 -> bf16 in registers, widened to fp32, fp32 FMA)"},
      {fp8_perchannel_moe_avx512, "fp8_perchannel/avx512_vnni (the avx512 kernel: e4m3 -> bf16 in registers, widened to fp32, fp32 FMA)"},
      {fp8_perchannel_moe_avx512_bf16, "fp8_perchannel/avx512_bf16 (e4m3 -> bf16 in registers, vdpbf16ps)"},
      {fp8_perchannel_moe_amx, "fp8_perchannel/amx (tdpbf16ps tiles on BF16 lines decoded once per call for experts with more than 6 tokens; the avx512_bf16 kernel below that)"}},
     0, 1, 0, dequantize_fp8_rows_to},
    {PackedFormat::kMxfp8, "mxfp8", {"MXFP8", nullptr}, false,
     fp8_layout::kBlockRows, 4, 64, 1,
     RowRule::kAny, fp8_layout::kKAlign, 0, nullptr, 0, 0, false,
     pack_fp8_experts, "pack_fp8_experts", dequantize_fp8_rows, "dequantize_fp8_rows",
     ActivationQuant::kNone, kOracle,
     {{mxfp8_moe_avx2, "mxfp8/avx2 (e4m3 -> fp32 in registers by integer ops times the 2^e scale, fp32 FMA; prefill and exponent codes above 134: via fp16)"},
      {mxfp8_moe_avx2, "mxfp8/avx_vnni (the avx2 kernel: e4m3 -> fp32 in registers, fp32 FMA)"},
      {mxfp8_moe_avx512, "mxfp8/avx512 (e4m3 -> bf16 in registers, widened to fp32, fp32 FMA)"},
      {mxfp8_moe_avx512, "mxfp8/avx512_vnni (the avx512 kernel: e4m3 -> bf16 in registers, widened to fp32, fp32 FMA)"},
      {mxfp8_moe_avx512_bf16, "mxfp8/avx512_bf16 (e4m3 -> bf16 in registers, vdpbf16ps)"},
      {mxfp8_moe_amx, "mxfp8/amx (tdpbf16ps tiles on BF16 lines decoded once per call for experts with more than 6 tokens; the avx512_bf16 kernel below that)"}},
     fp8_layout::kMxGroup, 64, 4, dequantize_fp8_rows_to},
    {PackedFormat::kMxfp4, "mxfp4", {"MXFP4", nullptr}, false,
     int_layout::kBlockRows, 8, int_layout::kLineBytes, 2,
     RowRule::kGroupSize, 1, 0, kMxfp4Groups, std::size(kMxfp4Groups), int_layout::kMxfp4Group, false,
     pack_mxfp4_experts, "pack_mxfp4_experts", dequantize_int_rows, "dequantize_int_rows",
     ActivationQuant::kInt8PerToken, kOracle,
     {{mxfp4_moe_avx2, "mxfp4/avx2 (codes to levels by vpshufb, vpmaddubsw + vpmaddwd)"},
      {mxfp4_moe_avx_vnni, "mxfp4/avx_vnni (codes to levels by vpshufb, 256-bit vpdpbusd)"},
      {mxfp4_moe_avx512, "mxfp4/avx512 (codes to levels by vpshufb, vpmaddubsw + vpmaddwd)"},
      {mxfp4_moe_avx512_vnni, "mxfp4/avx512_vnni (codes to levels by vpshufb, vpdpbusd)"},
      {mxfp4_moe_avx512_bf16, "mxfp4/avx512_bf16 (codes to levels by vpshufb, vpdpbusd)"},
      {mxfp4_moe_amx, "mxfp4/amx (tdpbssd tiles on the codes' signed levels; vpdpbusd for decode and tails)"}},
     0, 64, 0, dequantize_int_rows_to},
};

constexpr bool rows_in_id_order() {
  for (size_t i = 0; i < std::size(kRows); ++i)
    if (static_cast<size_t>(kRows[i].format) != i + 1) return false;
  return true;
}
static_assert(rows_in_id_order(), "kRows must list the formats in PackedFormat id order, 1 first");

}  // namespace

FormatTable format_table() { return {std::begin(kRows), std::end(kRows)}; }

const FormatRow& format_row(PackedFormat format) {
  const size_t id = static_cast<size_t>(format);
  if (id < 1 || id > std::size(kRows))
    throw std::invalid_argument("unknown packed format id " + std::to_string(id));
  return kRows[id - 1];
}

MoeKernel moe_kernel(PackedFormat format, CpuVariant variant) {
  return format_row(format).by_variant[static_cast<int>(variant)];
}

const char* packed_format_name(PackedFormat format) { return format_row(format).name; }

PackedFormat parse_packed_format(const std::string& name) {
  std::string names;
  for (const FormatRow& row : kRows) {
    if (name == row.name) return row.format;
    names += std::string(names.empty() ? "" : ", ") + row.name;
  }
  throw std::invalid_argument("unknown packed format '" + name + "'; expected one of: " + names);
}

const char* activation_quant_name(ActivationQuant activations) {
  switch (activations) {
    case ActivationQuant::kNone: return "none";
    case ActivationQuant::kInt8PerToken: return "int8_per_token";
    case ActivationQuant::kGgmlBlocks: return "int8_ggml_blocks";
  }
  throw std::invalid_argument("unknown activation quantization");
}

const char* row_rule_name(RowRule rule) {
  switch (rule) {
    case RowRule::kAny: return "any";
    case RowRule::kGroupSize: return "group_size";
    case RowRule::kGgmlBlock: return "ggml_block";
  }
  throw std::invalid_argument("unknown row-length rule");
}

bool gguf_reads_in_place(const GgmlTypeInfo& type, CpuVariant variant) {
  return gguf_in_place(type, variant >= CpuVariant::kAvx512);
}

}  // namespace kt::cpu
