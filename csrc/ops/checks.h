// Argument checks for the operator glue. Each names the argument and the value received,
// and raises the Python exception that fits: TypeError for a dtype, ValueError for a
// shape, layout, device or value.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <stdexcept>
#include <string>

namespace kt::ops {

void check_dtype(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> allowed);
void check_dim(const at::Tensor& t, const char* name, int64_t dim);
void check_cpu_contiguous(const at::Tensor& t, const char* name);

// Runs fn, turning std::invalid_argument from the kernels into ValueError.
template <typename F>
auto translate_errors(F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace kt::ops
