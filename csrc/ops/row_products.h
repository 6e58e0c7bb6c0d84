// Products whose rows are token rows, computed on the panel kernel
// (cpu/kernels/panel_gemm.h) so that a row's bits depend on that row of `a` alone: not on
// how many rows the call has, which other rows they are, or how many threads run it.
// ATen's sgemm blocks (and, outside a parallel region, splits over threads) by the row
// count, so a token's LoRA branch or recomputed g and u differed in the last bits between
// a call of one token and a call of forty. Each element is one FMA chain over the
// contraction index in ascending order.
#pragma once

#include <ATen/ATen.h>

namespace kt::ops {

// a b: a fp32 [n, R], b fp32 [R, C] -> fp32 [n, C] (contiguous).
at::Tensor rows_times(const at::Tensor& a, const at::Tensor& b);

// a w^T: a fp32 [n, R], w fp32 [C, R] -> fp32 [n, C] (contiguous).
at::Tensor rows_times_transposed(const at::Tensor& a, const at::Tensor& w);

// out[:, col0 : col0 + c) = a w^T for a row-major fp32 w [c, R] (leading dimension R) at
// `w`: a fp32 [n, R] contiguous, out fp32 [n, ldc] contiguous. `panel` is scratch of at least
// cpu::panel_floats(R, c) floats.
void rows_times_transposed_into(const at::Tensor& a, const float* w, int64_t c, at::Tensor& out, int64_t col0,
                                float* panel);

}  // namespace kt::ops
