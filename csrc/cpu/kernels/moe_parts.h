// [NOTE] A layer split into parts over its intermediate dimension (kt_ops/parts.py): part
// p holds gate/up rows and down columns [a_p, b_p) of every expert, its own packed blob,
// and the layer's output is the sum of the parts' outputs (tensor parallel, as kt-kernel
// splits experts over NUMA nodes). Every part runs at once on the threads of its node
// (Engine::run_on_nodes), its blob read from that node's memory, through the one MoE
// driver of its format (moe_driver.h) into its own fp32 partial output; the partials are
// then summed in part order, a fixed order, so the result does not depend on which part
// finishes first, and a part's own result does not depend on how many threads its node
// has (moe_driver.h, batch invariance).
#pragma once

#include <cstdint>
#include <vector>

#include "../formats/packed_header.h"
#include "../isa/cpu_variant.h"
#include "moe_args.h"

namespace kt::cpu {

struct MoePart {
  const uint8_t* packed = nullptr;  // blob described by `layout` (header validated)
  PackedLayout layout;
  int node = 0;  // NUMA node id whose threads run it
};

// out = sum over parts p (in order) of moe_forward(args with p's blob), in
// args.output_type. `args` holds the activations, routing and output (its packed blob and
// layout are not read); parts: at least one, all of one E and H. partials: fp32 scratch
// [parts.size(), args.tokens, H]. Throws std::invalid_argument for a node the engine
// does not have.
void moe_forward_parts(const MoeArgs& args, const std::vector<MoePart>& parts, float* partials,
                       CpuVariant variant);

}  // namespace kt::cpu
