// CPU implementation of kt::dequantize_experts: argument checks, then the blob's format's
// "dequantize rows" micro-kernel (the format table's column) on the Engine.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../cpu/engine/huge_pages.h"
#include "../cpu/format_table.h"
#include "../cpu/formats/dequantize_experts.h"
#include "checks.h"
#include "packed_blob.h"

namespace kt::ops {
namespace {

// expert_ids (1-D int32/int64, CPU) as int64, each in [0, experts); ValueError naming the
// first one out of range.
template <typename T>
std::vector<int64_t> checked_ids(const at::Tensor& expert_ids, int64_t experts) {
  const at::Tensor ids = expert_ids.contiguous();
  const T* p = ids.const_data_ptr<T>();
  std::vector<int64_t> out(static_cast<size_t>(ids.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < experts, "expert_ids[", i, "] = ", static_cast<int64_t>(p[i]),
                      " is out of range: the packed layer has ", experts, " experts (ids 0..", experts - 1, ")");
    out[i] = static_cast<int64_t>(p[i]);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dequantize_experts_cpu(const at::Tensor& packed,
                                                                      const at::Tensor& expert_ids,
                                                                      c10::optional<at::ScalarType> dtype) {
  RECORD_FUNCTION("kt::dequantize_experts", std::vector<c10::IValue>({packed, expert_ids}));
  const cpu::PackedLayout layout = read_packed(packed, "packed");
  check_dtype(expert_ids, "expert_ids", {at::kInt, at::kLong});
  check_dim(expert_ids, "expert_ids", 1);
  TORCH_CHECK_VALUE(expert_ids.device().is_cpu(), "expert_ids must be on the CPU; got ", expert_ids.device());
  const at::ScalarType out_type = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(out_type == at::kFloat || out_type == at::kBFloat16,
                   "dtype must be float32 or bfloat16 (or None: float32); got ", out_type);
  const int64_t E = layout.shape.num_experts, H = layout.shape.hidden_size, I = layout.shape.intermediate_size;
  const std::vector<int64_t> ids = expert_ids.scalar_type() == at::kInt ? checked_ids<int32_t>(expert_ids, E)
                                                                       : checked_ids<int64_t>(expert_ids, E);
  const int64_t n = static_cast<int64_t>(ids.size());
  const auto options = packed.options().dtype(out_type);
  at::Tensor gate = at::empty({n, I, H}, options), up = at::empty({n, I, H}, options);
  at::Tensor down = at::empty({n, H, I}, options);
  if (n == 0) return {gate, up, down};
  // Before first touch: a whole layer is GBs of fresh pages, and faulting them in 4 KiB
  // at a time cost more than decoding (S1 BF16, 2.4 GB fp32: 1.5 s of faults on 2 cores).
  for (at::Tensor* t : {&gate, &up, &down})
    cpu::advise_huge_pages(t->data_ptr(), static_cast<size_t>(t->nbytes()));
  const cpu::FormatRow& row = cpu::format_row(layout.shape.format);
  translate_errors([&] {
    cpu::dequantize_experts(row.dequantize, packed.const_data_ptr<uint8_t>(), layout, ids.data(), n,
                            out_type == at::kFloat ? cpu::ElementType::kF32 : cpu::ElementType::kBf16,
                            gate.data_ptr(), up.data_ptr(), down.data_ptr());
  });
  return {gate, up, down};
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("dequantize_experts", &dequantize_experts_cpu); }

}  // namespace kt::ops
