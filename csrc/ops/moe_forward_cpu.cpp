// CPU implementation of kt::moe_forward and kt::moe_forward_train: argument checks, then the kernel of the active
// CPU variant for the blob's format.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/kernel_table.h"
#include "checks.h"
#include "moe_call.h"
#include "moe_forward_cpu.h"

namespace kt::ops {
namespace {

// moe_forward_train's extra arguments and result.
struct TrainCall {
  int64_t intermediate_size = 0;
  at::Tensor delta;    // fp32 contiguous [T, K, 2I], or undefined
  bool fp32_output = false;
  at::Tensor gate_up;  // the result: fp32 [T, K, 2I]
};

// The checks and kernel call of moe_forward and (train != null) moe_forward_train.
at::Tensor run_forward(const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& packed, const c10::optional<at::Tensor>& live_tokens,
                       TrainCall* train = nullptr) {
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
  at::TensorOptions out_options = hidden_states.options();
  if (train != nullptr) {
    const int64_t I = args.layout.shape.intermediate_size;
    TORCH_CHECK_VALUE(train->intermediate_size == I, "intermediate_size = ", train->intermediate_size,
                      " but the packed layer's intermediate size is ", I);
    if (train->delta.defined()) args.gate_up_add = train->delta.const_data_ptr<float>();
    train->gate_up = at::empty({hidden_states.size(0), topk_ids.size(1), 2 * I},
                               hidden_states.options().dtype(at::kFloat));
    zero_unrouted_rows(train->gate_up, topk_ids, args.tokens);  // the kernel writes the others
    args.gate_up_out = train->gate_up.data_ptr<float>();
    if (train->fp32_output) {
      args.output_type = cpu::ElementType::kF32;
      out_options = out_options.dtype(at::kFloat);
    }
  }

  const std::vector<int64_t> out_shape = {hidden_states.size(0), hidden_states.size(1)};
  at::Tensor output = args.tokens == hidden_states.size(0) ? at::empty(out_shape, out_options)
                                                           : at::zeros(out_shape, out_options);
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

at::Tensor moe_forward_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& live_tokens) {
  RECORD_FUNCTION("kt::moe_forward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  return run_forward(hidden_states, topk_ids, topk_weights, packed, live_tokens);
}

std::tuple<at::Tensor, at::Tensor> moe_forward_train_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                                         const at::Tensor& topk_weights, const at::Tensor& packed,
                                                         int64_t intermediate_size,
                                                         const c10::optional<at::Tensor>& gate_up_delta,
                                                         const c10::optional<at::Tensor>& live_tokens) {
  RECORD_FUNCTION("kt::moe_forward_train", std::vector<c10::IValue>({hidden_states, topk_ids}));
  at::Tensor delta;
  if (gate_up_delta.has_value()) {
    check_dim(hidden_states, "hidden_states", 2);
    check_dim(topk_ids, "topk_ids", 2);
    check_slot_rows(*gate_up_delta, "gate_up_delta", topk_ids, intermediate_size, {at::kFloat, at::kBFloat16, at::kHalf});
    delta = gate_up_delta->to(at::kFloat).contiguous();
  }
  return moe_forward_train_kernel(hidden_states, topk_ids, topk_weights, packed, intermediate_size, delta,
                                  live_tokens);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_forward_train_kernel(const at::Tensor& hidden_states,
                                                            const at::Tensor& topk_ids,
                                                            const at::Tensor& topk_weights,
                                                            const at::Tensor& packed, int64_t intermediate_size,
                                                            const at::Tensor& gate_up_add,
                                                            const c10::optional<at::Tensor>& live_tokens,
                                                            bool fp32_output) {
  TrainCall train;
  train.intermediate_size = intermediate_size;
  train.delta = gate_up_add;
  train.fp32_output = fp32_output;
  at::Tensor output = run_forward(hidden_states, topk_ids, topk_weights, packed, live_tokens, &train);
  return {output, train.gate_up};
}

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("moe_forward", &moe_forward_cpu);
  m.impl("moe_forward_train", &moe_forward_train_cpu);
}

}  // namespace kt::ops
