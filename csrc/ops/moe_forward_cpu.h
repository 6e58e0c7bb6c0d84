// The CPU forward of kt::moe_forward_train, for the training operators of
// moe_train_cpu.cpp (the LoRA forward runs the inference kernel through it).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace kt::ops {

// moe_forward_train's checks and kernel call: hidden_states [T, H], topk_ids and
// topk_weights [T, K], packed, the layer's intermediate_size, live_tokens as moe_forward's.
// gate_up_add: undefined, or fp32 contiguous [T, K, 2I] added to gate and up before the
// activation (only rows of routed slots are read; the others may hold anything).
// -> (output [T, H] in hidden_states' dtype, or fp32 with fp32_output; gate_up fp32
// [T, K, 2I], zero in rows of slots that route nowhere).
std::tuple<at::Tensor, at::Tensor> moe_forward_train_kernel(const at::Tensor& hidden_states,
                                                            const at::Tensor& topk_ids,
                                                            const at::Tensor& topk_weights,
                                                            const at::Tensor& packed, int64_t intermediate_size,
                                                            const at::Tensor& gate_up_add,
                                                            const c10::optional<at::Tensor>& live_tokens,
                                                            bool fp32_output = false);

}  // namespace kt::ops
