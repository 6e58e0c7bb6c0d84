#include "row_products.h"

#include <algorithm>
#include <vector>

#include "../cpu/kernels/panel_gemm.h"

namespace kt::ops {
namespace {

void check_operands(const at::Tensor& a, int64_t contraction, const char* what) {
  TORCH_INTERNAL_ASSERT(a.dim() == 2 && a.scalar_type() == at::kFloat, what, ": a must be fp32 [n, R]");
  TORCH_INTERNAL_ASSERT(a.size(1) == contraction, what, ": a has ", a.size(1), " columns, the other operand ",
                        contraction, " rows");
}

// out = a panel: panel-packed b with R rows and C columns.
at::Tensor times_panel(const at::Tensor& a, const std::vector<float>& panel, int64_t C) {
  const at::Tensor rows = a.contiguous();
  at::Tensor out = at::zeros({rows.size(0), C}, rows.options());
  if (rows.size(0) == 0 || C == 0) return out;
  cpu::panel_gemm_add(rows.const_data_ptr<float>(), rows.size(1), rows.size(0), panel.data(), rows.size(1), C,
                      out.mutable_data_ptr<float>(), C);
  return out;
}

}  // namespace

at::Tensor rows_times(const at::Tensor& a, const at::Tensor& b) {
  TORCH_INTERNAL_ASSERT(b.dim() == 2 && b.scalar_type() == at::kFloat, "rows_times: b must be fp32 [R, C]");
  check_operands(a, b.size(0), "rows_times");
  const at::Tensor src = b.contiguous();
  const int64_t R = src.size(0), C = src.size(1);
  std::vector<float> panel(static_cast<size_t>(cpu::panel_floats(R, C)));
  if (R > 0 && C > 0) cpu::pack_panel_rows(src.const_data_ptr<float>(), C, R, C, panel.data(), R, 0);
  return times_panel(a, panel, C);
}

at::Tensor rows_times_transposed(const at::Tensor& a, const at::Tensor& w) {
  TORCH_INTERNAL_ASSERT(w.dim() == 2 && w.scalar_type() == at::kFloat,
                        "rows_times_transposed: w must be fp32 [C, R]");
  check_operands(a, w.size(1), "rows_times_transposed");
  const at::Tensor src = w.contiguous();
  const int64_t C = src.size(0), R = src.size(1);
  std::vector<float> panel(static_cast<size_t>(cpu::panel_floats(R, C)));
  if (R > 0 && C > 0) cpu::pack_panel_transposed(src.const_data_ptr<float>(), R, R, C, panel.data());
  return times_panel(a, panel, C);
}

void rows_times_transposed_into(const at::Tensor& a, const float* w, int64_t c, at::Tensor& out, int64_t col0,
                                float* panel) {
  check_operands(a, a.size(1), "rows_times_transposed_into");
  TORCH_INTERNAL_ASSERT(a.is_contiguous() && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                        out.size(0) == a.size(0) && col0 + c <= out.size(1));
  const int64_t n = a.size(0), R = a.size(1);
  if (n == 0 || c == 0) return;
  cpu::pack_panel_transposed(w, R, R, c, panel);
  float* dst = out.mutable_data_ptr<float>() + col0;
  for (int64_t i = 0; i < n; ++i) std::fill(dst + i * out.size(1), dst + i * out.size(1) + c, 0.0f);
  cpu::panel_gemm_add(a.const_data_ptr<float>(), R, n, panel, R, c, dst, out.size(1));
}

}  // namespace kt::ops
