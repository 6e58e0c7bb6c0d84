// The arguments of one MoE forward call, as plain pointers and sizes (no torch types),
// checked by the operator glue (csrc/ops) before a kernel sees them.
#pragma once

#include <cstdint>

#include "../formats/packed_header.h"
#include "../isa/element_type.h"

namespace kt::cpu {

struct MoeArgs {
  const void* hidden = nullptr;  // [tokens, hidden_size] of hidden_type, row-major
  ElementType hidden_type = ElementType::kBf16;
  int64_t tokens = 0;
  const void* topk_ids = nullptr;  // [tokens, top_k] int32 or int64, each in [-1, E)
  bool topk_ids_int64 = false;
  int64_t top_k = 0;
  const void* topk_weights = nullptr;  // [tokens, top_k] of weights_type
  ElementType weights_type = ElementType::kF32;
  const uint8_t* packed = nullptr;  // blob described by `layout` (header validated)
  PackedLayout layout;
  void* output = nullptr;  // [tokens, hidden_size] of output_type
  // The operators' output has hidden_type; a part of a layer (moe_parts.h) writes fp32.
  ElementType output_type = ElementType::kBf16;
  // Training (kt::moe_forward_train), both optional, fp32 [tokens * top_k, 2 * I] in slot
  // order (row t * top_k + j; gate in columns [0, I), up in [I, 2I)):
  const float* gate_up_add = nullptr;  // added to gate and up before the activation
  float* gate_up_out = nullptr;        // gate and up as the activation sees them (after the
                                       // format's scale, the biases and gate_up_add); rows
                                       // of skipped slots are not written
};

}  // namespace kt::cpu
