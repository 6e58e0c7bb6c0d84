// [NOTE] The GGUF (ggml) tensor types kt_ops computes on, with their block geometry as
// GGUF stores them (ggml-common.h; docs/formats.md). A row of K elements is K / block
// consecutive blocks; a stacked expert tensor [E, rows, K] is E * rows such rows.
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
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;      // as gguf.GGMLQuantizationType names it, e.g. "Q4_K"
  uint32_t block_elems;  // elements per block: 1 (float types), 32 or 256
  uint32_t block_bytes;  // bytes per block
  bool is_float;         // F32 / F16 / BF16: no quantization blocks
};

// Throws std::invalid_argument naming the type (or its id) when kt_ops has no kernel for it.
const GgmlTypeInfo& ggml_type_info(uint32_t id);

// Bytes of one row of k elements; throws std::invalid_argument (naming `what`) when k
// is not a multiple of the type's block.
uint64_t ggml_row_bytes(uint32_t id, uint64_t k, const std::string& what);

}  // namespace kt::cpu
