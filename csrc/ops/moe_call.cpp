#include "moe_call.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <vector>

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
std::string first_bad(const Id* ids, int64_t count, int64_t top_k, int64_t experts) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] >= -1 && ids[i] < experts) continue;
    std::ostringstream message;
    message << "topk_ids[" << i / top_k << ", " << i % top_k << "] = " << ids[i] << " is outside [-1, "
            << experts << ") (-1 skips a slot; the packed experts hold E = " << experts << ")";
    return message.str();
  }
  return {};
}

}  // namespace

std::vector<cpu::MoePart> check_moe_parts(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                          const at::Tensor& topk_weights, at::TensorList parts,
                                          at::IntArrayRef nodes, cpu::MoeArgs* args) {
  TORCH_CHECK_VALUE(!parts.empty(), "parts must hold at least one packed blob");
  TORCH_CHECK_VALUE(nodes.size() == parts.size(), "nodes has ", nodes.size(), " entries but parts has ", parts.size(),
                    " (one NUMA node id per part)");
  std::vector<cpu::MoePart> blobs;
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::string name = "parts[" + std::to_string(p) + "]";
    const cpu::MoeArgs part = check_moe_call(hidden_states, topk_ids, topk_weights, parts[p], name.c_str());
    if (p == 0) *args = part;
    TORCH_CHECK_VALUE(part.layout.shape.num_experts == args->layout.shape.num_experts, name, " holds ",
                      part.layout.shape.num_experts, " experts but parts[0] holds ", args->layout.shape.num_experts,
                      " (the parts of one layer hold every expert)");
    TORCH_CHECK_VALUE(nodes[p] >= 0 && nodes[p] < (int64_t{1} << 30), "nodes[", p, "] = ", nodes[p],
                      " is not a NUMA node id");
    blobs.push_back({part.packed, part.layout, static_cast<int>(nodes[p])});
  }
  return blobs;
}

cpu::MoeArgs check_moe_call(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& packed, const char* packed_name) {
  check_dtype(hidden_states, "hidden_states", {at::kBFloat16, at::kHalf, at::kFloat});
  check_dtype(topk_ids, "topk_ids", {at::kInt, at::kLong});
  check_dtype(topk_weights, "topk_weights", {at::kFloat, at::kBFloat16, at::kHalf});
  check_dim(hidden_states, "hidden_states", 2);
  check_dim(topk_ids, "topk_ids", 2);
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must have the shape of topk_ids ",
                    topk_ids.sizes(), "; got ", topk_weights.sizes());
  TORCH_CHECK_VALUE(topk_ids.size(0) == hidden_states.size(0), "topk_ids has ", topk_ids.size(0),
                    " rows but hidden_states has ", hidden_states.size(0), " tokens");
  const cpu::PackedLayout layout = read_packed(packed, packed_name);
  const int64_t experts = layout.shape.num_experts;
  TORCH_CHECK_VALUE(hidden_states.size(1) == layout.shape.hidden_size, "hidden_states has hidden size ",
                    hidden_states.size(1), " but ", packed_name, " (the packed experts) has H = ",
                    layout.shape.hidden_size);
  TORCH_CHECK_VALUE(topk_ids.numel() < std::numeric_limits<int32_t>::max(), "tokens x top-k = ",
                    topk_ids.numel(), " (token, slot) pairs is more than one call handles (2^31 - 1);"
                    " split the batch");
  cpu::MoeArgs args;
  args.hidden_type = element_type(hidden_states.scalar_type());
  args.output_type = args.hidden_type;
  args.tokens = hidden_states.size(0);
  args.topk_ids_int64 = topk_ids.scalar_type() == at::kLong;
  args.top_k = topk_ids.size(1);
  args.weights_type = element_type(topk_weights.scalar_type());
  args.packed = packed.const_data_ptr<uint8_t>();
  args.layout = layout;
  return args;
}

void check_live_tokens(const c10::optional<at::Tensor>& live_tokens) {
  if (!live_tokens.has_value()) return;
  check_dtype(*live_tokens, "live_tokens", {at::kInt, at::kLong});
  TORCH_CHECK_VALUE(live_tokens->numel() == 1, "live_tokens must hold one value (the live batch size); got shape ",
                    live_tokens->sizes());
}

int64_t clamp_live_tokens(int64_t value, int64_t tokens, std::string* error) {
  if (value >= 0 && value <= tokens) return value;
  if (error != nullptr) {
    std::ostringstream message;
    message << "live_tokens = " << value << " is outside [0, " << tokens << "] (the batch holds " << tokens
            << " tokens)";
    *error = message.str();
  }
  return value < 0 ? 0 : tokens;
}

std::string find_bad_expert_id(const void* ids, bool int64, int64_t tokens, int64_t top_k, int64_t experts) {
  const int64_t count = tokens * top_k;
  return int64 ? first_bad(static_cast<const int64_t*>(ids), count, top_k, experts)
               : first_bad(static_cast<const int32_t*>(ids), count, top_k, experts);
}

void check_slot_rows(const at::Tensor& t, const char* name, const at::Tensor& topk_ids, int64_t intermediate_size,
                     std::initializer_list<at::ScalarType> allowed) {
  check_dtype(t, name, allowed);
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU; got ", t.device());
  const std::vector<int64_t> want = {topk_ids.size(0), topk_ids.size(1), 2 * intermediate_size};
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(want), name, " must be [T, K, 2 * I] = ", at::IntArrayRef(want),
                    "; got ", t.sizes());
}

void zero_unrouted_rows(at::Tensor& rows_by_slot, const at::Tensor& topk_ids, int64_t live) {
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t K = ids.size(1), slots = ids.numel(), cols = rows_by_slot.numel() / std::max<int64_t>(slots, 1);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  float* rows = rows_by_slot.data_ptr<float>();
  for (int64_t s = 0; s < slots; ++s)
    if (id[s] < 0 || s / K >= live) std::fill(rows + s * cols, rows + (s + 1) * cols, 0.0f);
}

}  // namespace kt::ops
