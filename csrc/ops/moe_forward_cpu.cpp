// CPU implementation of kt::moe_forward: argument checks, then the kernel of the active
// CPU variant for the blob's format.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/kernel_table.h"
#include "checks.h"
#include "moe_call.h"

namespace kt::ops {
namespace {

at::Tensor moe_forward_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& live_tokens) {
  RECORD_FUNCTION("kt::moe_forward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  cpu::MoeArgs args = check_moe_call(hidden_states, topk_ids, topk_weights, packed);
  check_live_tokens(live_tokens);
  check_cpu_contiguous(hidden_states, "hidden_states");
  check_cpu_contiguous(topk_ids, "topk_ids");
  check_cpu_contiguous(topk_weights, "topk_weights");
  if (live_tokens.has_value()) {
    TORCH_CHECK_VALUE(live_tokens->device().is_cpu(), "live_tokens must be on the CPU with CPU inputs; got ",
                      live_tokens->device());
    std::string error;
    args.tokens = clamp_live_tokens(live_tokens->item<int64_t>(), args.tokens, &error);
    TORCH_CHECK_VALUE(error.empty(), error);
  }
  const std::string bad = find_bad_expert_id(topk_ids.const_data_ptr(), args.topk_ids_int64, args.tokens,
                                             args.top_k, args.layout.shape.num_experts);
  TORCH_CHECK_VALUE(bad.empty(), bad);

  at::Tensor output = args.tokens == hidden_states.size(0) ? at::empty_like(hidden_states)
                                                           : at::zeros_like(hidden_states);
  if (args.tokens == 0) return output;
  args.hidden = hidden_states.const_data_ptr();
  args.topk_ids = topk_ids.const_data_ptr();
  args.topk_weights = topk_weights.const_data_ptr();
  args.output = output.data_ptr();
  translate_errors([&] {
    cpu::moe_kernel(args.layout.shape.format, cpu::active_cpu_variant()).forward(args);
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("moe_forward", &moe_forward_cpu); }

}  // namespace kt::ops
