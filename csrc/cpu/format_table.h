// [NOTE] The format table: one row per packed weight format, the one list of formats
// (as ggml-cpu's type_traits_cpu). A row says what the format is (name, kt-kernel
// method names, block geometry, row-length rule, group sizes), how weights get into it
// (its packer), what its kernels do to the activations, what decodes it independently
// (the oracle in kt_ops.reference), and the MoE kernel each CPU variant runs.
// Everything else reads it: moe_kernel(), the format names, the operator glue's
// checks, Python (_C.format_table() -> kt_ops.formats, kt_ops.doctor()), and the tests
// (tests/test_format_table.py holds docs/formats.md to it).
//
// Layering: the table sits above formats/ and kernels/ and points into both; neither
// includes it. formats/ keeps the geometry it needs to read a header (the layout
// headers, int_layout::kGroupSizes) and the ggml-type sub-table of format gguf
// (formats/gguf_types.h, kGgmlTypes), which the table's rows and Python read from there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "formats/dequantize_experts.h"
#include "formats/gguf_types.h"
#include "formats/packed_header.h"
#include "formats/quantize.h"
#include "isa/cpu_variant.h"
#include "isa/element_type.h"
#include "kernels/kernel_table.h"

namespace kt::cpu {

// What a format's kernels do to the activations (token rows, and the SiLU * up
// intermediate rows) before the dot products.
enum class ActivationQuant : uint8_t {
  kNone,          // converted to the kernel's float type (fp32 / bf16), not quantized
  kInt8PerToken,  // int8, one fp32 scale per token row (intermediate: per (token, slot))
  kGgmlBlocks,    // 8-bit blocks of the weight type's block, scale per block (as Q8_0 for
                  // 32-blocks, Q8_K for 256-blocks); float ggml types: none. The amx
                  // variant's tile path (prefill) rounds them to bf16 instead.
};

// What a matrix's row length K (H for gate and up, I for down) must be a multiple of.
enum class RowRule : uint8_t {
  kAny,        // any K >= 1; the packer pads K to a multiple of FormatRow::k_pad with zeros
  kGroupSize,  // the group size, which must divide both H and I
  kGgmlBlock,  // the block of the matrix's ggml type (1, 32 or 256); nothing is padded
};

// Every format's packer: gate, up [E, I, H] and down [E, H, I] row-major of `source`
// -> the header and blocks of `layout` in blob[0, layout.total_bytes).
using PackExpertsFn = void (*)(const void* gate, const void* up, const void* down, ElementType source,
                               const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

constexpr int kMaxMethodsPerFormat = 2;

struct FormatRow {
  PackedFormat format;  // the id a packed header stores
  const char* name;     // kt::pack_experts' `format`, packed_info()["format"]: "int4_asym"
  const char* methods[kMaxMethodsPerFormat];  // kt-kernel method names selecting it (nullptr: unused)
  bool zero_point;      // the methods select it with zero_point=True (else with False)
  // Block geometry. Weights are stored in blocks of `block_rows` output rows; a block is
  // 64-byte lines of `line_k` k values of each of its rows (`line_bytes` = 64), followed
  // by `scale_bytes` bytes of fp32 scale (and minimum) per row and group (int8: per row).
  // gguf stores rows of ggml blocks (block_rows 1, line_k 0): kGgmlTypes holds the
  // elements and bytes of each type's block.
  uint32_t block_rows;
  uint32_t line_k;
  uint32_t line_bytes;
  uint32_t scale_bytes;
  RowRule k_rule;
  // K is padded with zero weights to a multiple of this (1: not padded). down's K, the
  // intermediate, comes out of gate and up in whole blocks: it is padded to block_rows too.
  uint32_t k_pad;
  uint32_t max_k;        // the largest H and I the format takes (0: no limit)
  const uint32_t* group_sizes;  // the group sizes it takes (nullptr: no groups, group_size 0)
  size_t num_group_sizes;
  uint32_t default_group_size;  // pack_experts' default group size (0: no groups)
  bool scale_search;     // QuantOptions::scale_search applies to its packer
  PackExpertsFn pack;
  const char* packer;    // the packer's name, e.g. "pack_int_experts"
  // How weights get out of it: rows of one matrix of one expert -> fp32, bit for bit the
  // oracle's values (formats/dequantize_experts.h; kt::dequantize_experts runs it).
  DequantizeRowsFn dequantize;
  const char* dequantizer;  // its name, e.g. "dequantize_int_rows"
  ActivationQuant activations;
  const char* oracle;    // the kt_ops.reference function that decodes a blob of it
  MoeKernel by_variant[kNumCpuVariants];  // indexed by CpuVariant
  // Formats whose scale groups are fixed (fp8: 128 k, mxfp8: 32 k; fp8_perchannel and
  // the others: 0, by group_size or one per row): ceil(K / scale_group_k) scale rows.
  uint32_t scale_group_k = 0;
  uint32_t scale_pad = 1;        // a block's scales are padded to a multiple of this many bytes
  uint32_t row_tail_bytes = 0;   // bytes per row after the scales (mxfp8: a NaN addend)
  // `dequantize` writing through a RowsOut (row-major or the training backward's panels,
  // formats/dequantize_experts.h); nullptr where the format has only `dequantize`.
  DequantizeRowsToFn dequantize_to = nullptr;
};

// The rows, in header-id order.
struct FormatTable {
  const FormatRow* first;
  const FormatRow* last;
  const FormatRow* begin() const { return first; }
  const FormatRow* end() const { return last; }
};
FormatTable format_table();

// The row of a format id; throws std::invalid_argument for an id with no row.
const FormatRow& format_row(PackedFormat format);

// Names: "bf16", "int8", ... as the rows give them. parse_packed_format throws
// std::invalid_argument naming the formats that exist.
const char* packed_format_name(PackedFormat format);
PackedFormat parse_packed_format(const std::string& name);

// "none", "int8_per_token", "int8_ggml_blocks".
const char* activation_quant_name(ActivationQuant activations);
// "any", "group_size", "ggml_block".
const char* row_rule_name(RowRule rule);

// Whether the gguf kernel of `variant` dots `type` from its bytes (the AVX-512
// variants, for the types kGgmlTypes marks avx512_in_place; every variant, for Q8_0,
// Q4_0 and Q4_1; any number of tokens, except amx's tile path).
bool gguf_reads_in_place(const GgmlTypeInfo& type, CpuVariant variant);

}  // namespace kt::cpu
