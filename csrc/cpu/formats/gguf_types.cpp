#include "gguf_types.h"

#include <stdexcept>

namespace kt::cpu {
namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::kF32, "F32", 1, 4, true},        {GgmlType::kF16, "F16", 1, 2, true},
    {GgmlType::kBf16, "BF16", 1, 2, true},      {GgmlType::kQ4_0, "Q4_0", 32, 18, false},
    {GgmlType::kQ4_1, "Q4_1", 32, 20, false},   {GgmlType::kQ5_0, "Q5_0", 32, 22, false},
    {GgmlType::kQ5_1, "Q5_1", 32, 24, false},   {GgmlType::kQ8_0, "Q8_0", 32, 34, false},
    {GgmlType::kQ2_K, "Q2_K", 256, 84, false},  {GgmlType::kQ3_K, "Q3_K", 256, 110, false},
    {GgmlType::kQ4_K, "Q4_K", 256, 144, false}, {GgmlType::kQ5_K, "Q5_K", 256, 176, false},
    {GgmlType::kQ6_K, "Q6_K", 256, 210, false},
};

// Names of the ggml types kt_ops has no kernel for, for the error message.
const char* unsupported_name(uint32_t id) {
  switch (id) {
    case 9: return "Q8_1";
    case 15: return "Q8_K";
    case 16: return "IQ2_XXS";
    case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS";
    case 19: return "IQ1_S";
    case 20: return "IQ4_NL";
    case 21: return "IQ3_S";
    case 22: return "IQ2_S";
    case 23: return "IQ4_XS";
    case 24: return "I8";
    case 25: return "I16";
    case 26: return "I32";
    case 27: return "I64";
    case 28: return "F64";
    case 29: return "IQ1_M";
    case 34: return "TQ1_0";
    case 35: return "TQ2_0";
    case 39: return "MXFP4";
    default: return nullptr;
  }
}

}  // namespace

const GgmlTypeInfo& ggml_type_info(uint32_t id) {
  for (const GgmlTypeInfo& info : kTypes)
    if (static_cast<uint32_t>(info.type) == id) return info;
  const char* name = unsupported_name(id);
  throw std::invalid_argument(
      std::string("GGUF tensor type ") + (name ? name : "id " + std::to_string(id)) +
      " is not supported; kt_ops computes F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, "
      "Q3_K, Q4_K, Q5_K and Q6_K experts");
}

uint64_t ggml_row_bytes(uint32_t id, uint64_t k, const std::string& what) {
  const GgmlTypeInfo& info = ggml_type_info(id);
  if (k == 0 || k % info.block_elems != 0)
    throw std::invalid_argument(what + ": GGUF type " + info.name + " stores rows in blocks of " +
                                std::to_string(info.block_elems) + " elements, but the row length is " +
                                std::to_string(k));
  return k / info.block_elems * info.block_bytes;
}

}  // namespace kt::cpu
