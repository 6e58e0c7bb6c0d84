#include "gguf_types.h"

#include <iterator>
#include <stdexcept>

namespace kt::cpu {
namespace {

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
    default: return nullptr;
  }
}

// "F32, F16, ... and Q6_K": the types of kGgmlTypes, for the error message.
std::string supported_names() {
  std::string names;
  const size_t count = std::size(kGgmlTypes);
  for (size_t i = 0; i < count; ++i)
    names += std::string(i == 0 ? "" : i + 1 == count ? " and " : ", ") + kGgmlTypes[i].name;
  return names;
}

}  // namespace

const GgmlTypeInfo& ggml_type_info(uint32_t id) {
  if (const GgmlTypeInfo* info = find_ggml_type(id)) return *info;
  const char* name = unsupported_name(id);
  throw std::invalid_argument(std::string("GGUF tensor type ") + (name ? name : "id " + std::to_string(id)) +
                              " is not supported; kt_ops computes " + supported_names() + " experts");
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
