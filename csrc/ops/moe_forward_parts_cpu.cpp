// CPU implementation of kt::moe_forward_parts: a layer split into parts over the
// intermediate dimension, every part at once on the threads of its NUMA node, the fp32
// partial outputs summed once in part order (cpu/kernels/moe_parts.h).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/moe_parts.h"
#include "checks.h"
#include "moe_call.h"

namespace kt::ops {
namespace {

at::Tensor moe_forward_parts_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                 const at::Tensor& topk_weights, at::TensorList parts, at::IntArrayRef nodes) {
  RECORD_FUNCTION("kt::moe_forward_parts", std::vector<c10::IValue>({hidden_states, topk_ids}));
  cpu::MoeArgs args;
  const std::vector<cpu::MoePart> blobs = check_moe_parts(hidden_states, topk_ids, topk_weights, parts, nodes, &args);
  check_cpu_contiguous(hidden_states, "hidden_states");
  check_cpu_contiguous(topk_ids, "topk_ids");
  check_cpu_contiguous(topk_weights, "topk_weights");
  const std::string bad = find_bad_expert_id(topk_ids.const_data_ptr(), args.topk_ids_int64, args.tokens,
                                             args.top_k, args.layout.shape.num_experts);
  TORCH_CHECK_VALUE(bad.empty(), bad);

  at::Tensor output = at::empty_like(hidden_states);
  if (args.tokens == 0) return output;
  // [parts, T, H] fp32: each part's output before the sum.
  at::Tensor partials = at::empty({static_cast<int64_t>(parts.size()), hidden_states.size(0), hidden_states.size(1)},
                                  hidden_states.options().dtype(at::kFloat));
  args.hidden = hidden_states.const_data_ptr();
  args.topk_ids = topk_ids.const_data_ptr();
  args.topk_weights = topk_weights.const_data_ptr();
  args.output = output.data_ptr();
  translate_errors([&] {
    cpu::moe_forward_parts(args, blobs, partials.data_ptr<float>(), cpu::active_cpu_variant());
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("moe_forward_parts", &moe_forward_parts_cpu); }

}  // namespace kt::ops
