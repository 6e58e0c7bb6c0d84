// CPU implementation of kt::pack_experts: Hugging Face expert weights -> packed blob.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../cpu/engine/huge_pages.h"
#include "../cpu/format_table.h"
#include "checks.h"
#include "gguf_blob.h"

namespace kt::ops {
namespace {

// Checks gate_proj, up_proj [E, I, H] and down_proj [E, H, I] (float dtypes, CPU) and
// returns (E, I, H).
std::tuple<int64_t, int64_t, int64_t> check_expert_weights(const at::Tensor& gate_proj,
                                                           const at::Tensor& up_proj,
                                                           const at::Tensor& down_proj) {
  const auto float_types = {at::kBFloat16, at::kHalf, at::kFloat};
  check_dtype(gate_proj, "gate_proj", float_types);
  check_dtype(up_proj, "up_proj", float_types);
  check_dtype(down_proj, "down_proj", float_types);
  check_dim(gate_proj, "gate_proj", 3);
  check_dim(up_proj, "up_proj", 3);
  check_dim(down_proj, "down_proj", 3);
  for (const auto& [t, name] : {std::pair{&gate_proj, "gate_proj"}, {&up_proj, "up_proj"},
                                {&down_proj, "down_proj"}})
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be on the CPU; got ", t->device());
  const int64_t E = gate_proj.size(0), I = gate_proj.size(1), H = gate_proj.size(2);
  TORCH_CHECK_VALUE(up_proj.sizes() == gate_proj.sizes(), "up_proj must have the shape of gate_proj [E, I, H] = ",
                    gate_proj.sizes(), "; got ", up_proj.sizes());
  TORCH_CHECK_VALUE(down_proj.size(0) == E && down_proj.size(1) == H && down_proj.size(2) == I,
                    "down_proj must have shape [E, H, I] = [", E, ", ", H, ", ", I,
                    "] to match gate_proj ", gate_proj.sizes(), "; got ", down_proj.sizes());
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  TORCH_CHECK_VALUE(E > 0 && I > 0 && H > 0 && E < kMaxDim && I < kMaxDim && H < kMaxDim,
                    "expert weights need E, I, H in [1, 2^31); got gate_proj ", gate_proj.sizes());

  return {E, I, H};
}

cpu::ElementType source_type(at::ScalarType type) {
  return type == at::kFloat ? cpu::ElementType::kF32
         : type == at::kHalf ? cpu::ElementType::kF16
                             : cpu::ElementType::kBf16;
}

// A blob of `layout` holding the weights packed by `row`'s packer. The packers read bf16,
// fp16 and fp32 directly (no full-size converted copy); up and down take gate's dtype.
at::Tensor pack_with_row(const cpu::FormatRow& row, const at::Tensor& gate_proj, const at::Tensor& up_proj,
                         const at::Tensor& down_proj, const cpu::PackedLayout& layout,
                         const cpu::QuantOptions& options) {
  at::Tensor packed = at::empty({static_cast<int64_t>(layout.total_bytes)}, gate_proj.options().dtype(at::kByte));
  cpu::advise_huge_pages(packed.data_ptr(), static_cast<size_t>(packed.numel()));  // before first touch
  const at::ScalarType type = gate_proj.scalar_type();
  const at::Tensor gate = gate_proj.contiguous();
  const at::Tensor up = up_proj.to(type).contiguous();
  const at::Tensor down = down_proj.to(type).contiguous();
  row.pack(gate.const_data_ptr(), up.const_data_ptr(), down.const_data_ptr(), source_type(type), layout, options,
           packed.data_ptr<uint8_t>());
  return packed;
}

// 0 (no groups) and the group sizes of the table's grouped formats, ascending.
std::vector<int64_t> group_sizes() {
  std::set<int64_t> sizes = {0};
  for (const cpu::FormatRow& row : cpu::format_table())
    sizes.insert(row.group_sizes, row.group_sizes + row.num_group_sizes);
  return {sizes.begin(), sizes.end()};
}

// "0 (none), 32, 64 or 128".
std::string group_size_choices(const std::vector<int64_t>& sizes) {
  std::string choices = "0 (none)";
  for (size_t i = 1; i < sizes.size(); ++i)
    choices += (i + 1 == sizes.size() ? " or " : ", ") + std::to_string(sizes[i]);
  return choices;
}

at::Tensor pack_experts_cpu(const at::Tensor& gate_proj, const at::Tensor& up_proj,
                            const at::Tensor& down_proj, c10::string_view format,
                            int64_t group_size, bool scale_search) {
  RECORD_FUNCTION("kt::pack_experts", std::vector<c10::IValue>({gate_proj, down_proj}));
  const cpu::FormatRow& row = translate_errors(
      [&]() -> const cpu::FormatRow& { return cpu::format_row(cpu::parse_packed_format(std::string(format))); });
  TORCH_CHECK_VALUE(row.k_rule != cpu::RowRule::kGgmlBlock,
                    "format ", row.name, " needs a ggml type per matrix: use kt::pack_gguf_experts");
  const auto [E, I, H] = check_expert_weights(gate_proj, up_proj, down_proj);

  const std::vector<int64_t> sizes = group_sizes();
  TORCH_CHECK_VALUE(std::find(sizes.begin(), sizes.end(), group_size) != sizes.end(), "group_size must be ",
                    group_size_choices(sizes), "; got ", group_size);
  TORCH_CHECK_VALUE(!scale_search || row.scale_search, "scale_search applies to quantized formats, not ", row.name);

  cpu::PackedShape shape;
  shape.format = row.format;
  shape.num_experts = static_cast<uint32_t>(E);
  shape.hidden_size = static_cast<uint32_t>(H);
  shape.intermediate_size = static_cast<uint32_t>(I);
  shape.group_size = static_cast<uint32_t>(group_size);
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  cpu::QuantOptions options;
  options.scale_search = scale_search;
  return pack_with_row(row, gate_proj, up_proj, down_proj, layout, options);
}

at::Tensor pack_gguf_experts_cpu(const at::Tensor& gate_proj, const at::Tensor& up_proj,
                                 const at::Tensor& down_proj, at::IntArrayRef gguf_types) {
  RECORD_FUNCTION("kt::pack_gguf_experts", std::vector<c10::IValue>({gate_proj, down_proj}));
  const auto [E, I, H] = check_expert_weights(gate_proj, up_proj, down_proj);
  const cpu::PackedShape shape = gguf_shape(gguf_types.vec(), E, H, I);
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  return pack_with_row(cpu::format_row(shape.format), gate_proj, up_proj, down_proj, layout, cpu::QuantOptions());
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("pack_experts", &pack_experts_cpu);
  m.impl("pack_gguf_experts", &pack_gguf_experts_cpu);
}

}  // namespace kt::ops
