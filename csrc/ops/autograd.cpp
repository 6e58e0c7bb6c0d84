// The Autograd kernels of the inference operators kt::moe_forward and kt::moe_forward_parts,
// in C++ so that a call that needs no gradient (every inference call) goes straight to the
// CPU or CUDA kernel. Registered from Python with torch.library.register_autograd, these
// operators ran a Python function on every call, gradient or not (torch's generated
// autograd_impl: ~10 us of a ~16 us call of a tiny layer on the AMX Xeon, 2026-12-03).
//
// The experts are frozen: gradients flow to hidden_states and topk_weights only, from
// kt::moe_backward (csrc/ops/moe_train_cpu.cpp; on CUDA inputs its host-copying kernel,
// kt_ops/autograd.py). The training operators (moe_forward_train, moe_lora_forward) keep
// their Python registrations in kt_ops/autograd.py: they run only when a gradient is needed.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace kt::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether autograd records this call: grad mode on and a differentiable input requiring a
// gradient (topk_ids and the blobs get none).
bool records(const at::Tensor& hidden_states, const at::Tensor& topk_weights) {
  return at::GradMode::is_enabled() && (hidden_states.requires_grad() || topk_weights.requires_grad());
}

at::Tensor call_moe_forward(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& packed,
                            const std::optional<at::Tensor>& live_tokens) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kt::moe_forward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const std::optional<at::Tensor>&)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(hidden_states, topk_ids, topk_weights, packed, live_tokens);
}

at::Tensor call_moe_forward_parts(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                  const at::Tensor& topk_weights, at::TensorList parts, at::IntArrayRef nodes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kt::moe_forward_parts", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               at::TensorList, at::IntArrayRef)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(hidden_states, topk_ids, topk_weights, parts, nodes);
}

// kt::moe_backward: (grad_hidden, grad_weights) of one packed layer.
std::tuple<at::Tensor, at::Tensor> call_moe_backward(const at::Tensor& grad_output, const at::Tensor& hidden_states,
                                                     const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                                     const at::Tensor& packed,
                                                     const std::optional<at::Tensor>& live_tokens) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kt::moe_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&)>();
  return op.call(grad_output, hidden_states, topk_ids, topk_weights, packed, live_tokens);
}

class MoeForwardFunction : public torch::autograd::Function<MoeForwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& packed,
                            const std::optional<at::Tensor>& live_tokens) {
    at::Tensor output = call_moe_forward(hidden_states, topk_ids, topk_weights, packed, live_tokens);
    if (live_tokens.has_value() && live_tokens->defined()) {
      ctx->save_for_backward({hidden_states, topk_ids, topk_weights, packed, *live_tokens});
    } else {
      ctx->save_for_backward({hidden_states, topk_ids, topk_weights, packed});
    }
    return output;
  }

  // One gradient per forward argument: hidden_states, topk_ids, topk_weights, packed, live_tokens.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> live_tokens =
        saved.size() > 4 ? std::optional<at::Tensor>(saved[4]) : std::nullopt;
    auto [grad_hidden, grad_weights] =
        call_moe_backward(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3], live_tokens);
    return {ctx->needs_input_grad(0) ? grad_hidden : at::Tensor(), at::Tensor(),
            ctx->needs_input_grad(2) ? grad_weights : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class MoeForwardPartsFunction : public torch::autograd::Function<MoeForwardPartsFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, at::TensorList parts, at::IntArrayRef nodes) {
    at::Tensor output = call_moe_forward_parts(hidden_states, topk_ids, topk_weights, parts, nodes);
    variable_list saved = {hidden_states, topk_ids, topk_weights};
    saved.insert(saved.end(), parts.begin(), parts.end());
    ctx->save_for_backward(saved);
    return output;
  }

  // moe_forward_parts is the sum of its parts' moe_forward: the gradients are the sums of
  // the parts' moe_backward, in part order. One gradient per forward variable: hidden_states,
  // topk_ids, topk_weights, each part, nodes.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor grad_output = grads[0].contiguous();
    at::Tensor grad_hidden;
    at::Tensor grad_weights;
    for (size_t part = 3; part < saved.size(); ++part) {
      auto [gx, gw] = call_moe_backward(grad_output, saved[0], saved[1], saved[2], saved[part], std::nullopt);
      grad_hidden = grad_hidden.defined() ? grad_hidden + gx : gx;
      grad_weights = grad_weights.defined() ? grad_weights + gw : gw;
    }
    variable_list result(saved.size() + 1);
    if (ctx->needs_input_grad(0)) result[0] = grad_hidden;
    if (ctx->needs_input_grad(2)) result[2] = grad_weights;
    return result;
  }
};

at::Tensor moe_forward_autograd(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                const at::Tensor& topk_weights, const at::Tensor& packed,
                                const std::optional<at::Tensor>& live_tokens) {
  if (!records(hidden_states, topk_weights)) {
    return call_moe_forward(hidden_states, topk_ids, topk_weights, packed, live_tokens);
  }
  return MoeForwardFunction::apply(hidden_states, topk_ids, topk_weights, packed, live_tokens);
}

at::Tensor moe_forward_parts_autograd(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                      const at::Tensor& topk_weights, at::TensorList parts, at::IntArrayRef nodes) {
  if (!records(hidden_states, topk_weights)) {
    return call_moe_forward_parts(hidden_states, topk_ids, topk_weights, parts, nodes);
  }
  return MoeForwardPartsFunction::apply(hidden_states, topk_ids, topk_weights, parts, nodes);
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, Autograd, m) {
  m.impl("moe_forward", &moe_forward_autograd);
  m.impl("moe_forward_parts", &moe_forward_parts_autograd);
}

}  // namespace kt::ops
