// CPU implementation of kt::moe_forward: argument checks, then the kernel of the active
// CPU variant for the blob's format.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <limits>

#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/kernel_table.h"
#include "checks.h"
#include "packed_blob.h"

namespace kt::ops {
namespace {

cpu::ElementType element_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return cpu::ElementType::kF32;
    case at::kBFloat16: return cpu::ElementType::kBf16;
    default: return cpu::ElementType::kF16;
  }
}

template <typename Id>
void check_ids_in_range(const at::Tensor& ids, int64_t experts) {
  const Id* data = ids.const_data_ptr<Id>();
  const int64_t top_k = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK_VALUE(data[i] >= -1 && data[i] < experts, "topk_ids[", i / top_k, ", ",
                      i % top_k, "] = ", data[i], " is outside [-1, ", experts,
                      ") (-1 skips a slot; the packed experts hold E = ", experts, ")");
}

at::Tensor moe_forward_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, const at::Tensor& packed) {
  RECORD_FUNCTION("kt::moe_forward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  check_dtype(hidden_states, "hidden_states", {at::kBFloat16, at::kHalf, at::kFloat});
  check_dtype(topk_ids, "topk_ids", {at::kInt, at::kLong});
  check_dtype(topk_weights, "topk_weights", {at::kFloat, at::kBFloat16, at::kHalf});
  check_dim(hidden_states, "hidden_states", 2);
  check_dim(topk_ids, "topk_ids", 2);
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must have the shape of topk_ids ",
                    topk_ids.sizes(), "; got ", topk_weights.sizes());
  TORCH_CHECK_VALUE(topk_ids.size(0) == hidden_states.size(0), "topk_ids has ", topk_ids.size(0),
                    " rows but hidden_states has ", hidden_states.size(0), " tokens");
  check_cpu_contiguous(hidden_states, "hidden_states");
  check_cpu_contiguous(topk_ids, "topk_ids");
  check_cpu_contiguous(topk_weights, "topk_weights");
  const cpu::PackedLayout layout = read_packed(packed, "packed");
  const int64_t experts = layout.shape.num_experts;
  TORCH_CHECK_VALUE(hidden_states.size(1) == layout.shape.hidden_size, "hidden_states has hidden size ",
                    hidden_states.size(1), " but the packed experts have H = ",
                    layout.shape.hidden_size);
  TORCH_CHECK_VALUE(topk_ids.size(1) <= experts, "top-k = ", topk_ids.size(1),
                    " exceeds the number of experts E = ", experts);
  TORCH_CHECK_VALUE(topk_ids.numel() < std::numeric_limits<int32_t>::max(), "tokens x top-k = ",
                    topk_ids.numel(), " (token, slot) pairs is more than one call handles (2^31 - 1);"
                    " split the batch");
  if (topk_ids.scalar_type() == at::kLong)
    check_ids_in_range<int64_t>(topk_ids, experts);
  else
    check_ids_in_range<int32_t>(topk_ids, experts);

  at::Tensor output = at::empty_like(hidden_states);
  if (hidden_states.size(0) == 0) return output;
  cpu::MoeArgs args;
  args.hidden = hidden_states.const_data_ptr();
  args.hidden_type = element_type(hidden_states.scalar_type());
  args.tokens = hidden_states.size(0);
  args.topk_ids = topk_ids.const_data_ptr();
  args.topk_ids_int64 = topk_ids.scalar_type() == at::kLong;
  args.top_k = topk_ids.size(1);
  args.topk_weights = topk_weights.const_data_ptr();
  args.weights_type = element_type(topk_weights.scalar_type());
  args.packed = packed.const_data_ptr<uint8_t>();
  args.layout = layout;
  args.output = output.data_ptr();
  translate_errors([&] {
    cpu::moe_kernel(layout.shape.format, cpu::active_cpu_variant()).forward(args);
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("moe_forward", &moe_forward_cpu); }

}  // namespace kt::ops
