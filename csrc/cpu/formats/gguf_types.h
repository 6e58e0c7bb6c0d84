// [NOTE] The GGUF (ggml) tensor types kt_ops computes on: the sub-table of format gguf
// (../format_table.h), with each type's block geometry as GGUF stores it (ggml-common.h;
// docs/formats.md). A row of K elements is K / block consecutive blocks; a stacked
// expert tensor [E, rows, K] is E * rows such rows. It lives here, below the format
// table, because the header reader and the GGUF packer need the geometry too.
#pragma once

#include <cstdint>
#include <string>

namespace kt::cpu {

// ggml_type ids (the values GGUF files store).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBf16 = 30,
  kMxfp4 = 39,  // formats/mxfp4_block.h
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;      // as gguf.GGMLQuantizationType names it, e.g. "Q4_K"
  uint32_t block_elems;  // elements per block: 1 (float types), 32 or 256
  uint32_t block_bytes;  // bytes per block
  bool is_float;         // F32 / F16 / BF16: no quantization blocks
  // The type llama.cpp stores a tensor in instead when its row length is not a multiple
  // of this type's block (llama-quant.cpp; K-quants only), or nullptr. It need not be a
  // type kt_ops computes (IQ4_NL is not).
  const char* llama_cpp_fallback;
  // The AVX-512 variants (avx512, avx512_vnni, avx512_bf16, amx) dot this type straight from its
  // bytes for any number of tokens instead of decoding its rows first
  // (kernels/gguf/gguf_q4k_avx512.h (Q4_K, Q5_K), gguf_q6k_avx512.h, gguf_q23k_avx512.h,
  // gguf_block32_avx512.h (the 32-weight types, MXFP4 included)).
  bool avx512_in_place;
  // avx2 and avx_vnni do too (kernels/gguf/gguf_block32_avx2.h: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4;
  // gguf_kquant_avx2.h: the K-quants).
  bool avx2_in_place;
};

// Whether a variant's gguf kernel dots `type` from its bytes; wide: an AVX-512 variant.
// The kernels (gguf_rows.h) and the table Python reads (gguf_reads_in_place) ask this.
inline bool gguf_in_place(const GgmlTypeInfo& type, bool wide) {
  return wide ? type.avx512_in_place : type.avx2_in_place;
}

// Every type kt_ops computes (docs/formats.md has a row for each): float types first,
// then by block size and bits.
inline constexpr GgmlTypeInfo kGgmlTypes[] = {
    {GgmlType::kF32, "F32", 1, 4, true, nullptr, false, false},
    {GgmlType::kF16, "F16", 1, 2, true, nullptr, false, false},
    {GgmlType::kBf16, "BF16", 1, 2, true, nullptr, false, false},
    {GgmlType::kQ4_0, "Q4_0", 32, 18, false, nullptr, true, true},
    {GgmlType::kQ4_1, "Q4_1", 32, 20, false, nullptr, true, true},
    {GgmlType::kMxfp4, "MXFP4", 32, 17, false, nullptr, true, true},
    {GgmlType::kQ5_0, "Q5_0", 32, 22, false, nullptr, true, true},
    {GgmlType::kQ5_1, "Q5_1", 32, 24, false, nullptr, true, true},
    {GgmlType::kQ8_0, "Q8_0", 32, 34, false, nullptr, true, true},
    {GgmlType::kQ2_K, "Q2_K", 256, 84, false, "IQ4_NL", true, true},
    {GgmlType::kQ3_K, "Q3_K", 256, 110, false, "IQ4_NL", true, true},
    {GgmlType::kQ4_K, "Q4_K", 256, 144, false, "Q5_0", true, true},
    {GgmlType::kQ5_K, "Q5_K", 256, 176, false, "Q5_1", true, true},
    {GgmlType::kQ6_K, "Q6_K", 256, 210, false, "Q8_0", true, true},
};

// The row of kGgmlTypes for a ggml type id, or nullptr when kt_ops has no kernel for it
// (usable at compile time; ggml_type_info is the checked run-time lookup).
constexpr const GgmlTypeInfo* find_ggml_type(uint32_t id) {
  for (const GgmlTypeInfo& info : kGgmlTypes)
    if (static_cast<uint32_t>(info.type) == id) return &info;
  return nullptr;
}

// Elements per block of a type kt_ops computes, at compile time (0: not in kGgmlTypes).
constexpr uint32_t ggml_block_elems(GgmlType type) {
  const GgmlTypeInfo* info = find_ggml_type(static_cast<uint32_t>(type));
  return info != nullptr ? info->block_elems : 0;
}

// find_ggml_type's row; throws std::invalid_argument naming the type (or its id) when kt_ops
// has no kernel for it.
const GgmlTypeInfo& ggml_type_info(uint32_t id);

// Bytes of one row of k elements; throws std::invalid_argument (naming `what`) when k
// is not a multiple of the type's block.
uint64_t ggml_row_bytes(uint32_t id, uint64_t k, const std::string& what);

}  // namespace kt::cpu
