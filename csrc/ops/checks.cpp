#include "checks.h"

#include <sstream>

namespace kt::ops {

void check_dtype(const at::Tensor& t, const char* name,
                 std::initializer_list<at::ScalarType> allowed) {
  for (at::ScalarType type : allowed)
    if (t.scalar_type() == type) return;
  std::ostringstream expected;
  const char* separator = "";
  for (at::ScalarType type : allowed) {
    expected << separator << c10::toString(type);
    separator = ", ";
  }
  TORCH_CHECK_TYPE(false, name, " must have dtype ", expected.str(), "; got ", t.scalar_type());
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D; got shape ", t.sizes());
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU for this kernel; got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name,
                    " must be contiguous; got strides ", t.strides(), " for shape ", t.sizes(),
                    " (call .contiguous())");
}

}  // namespace kt::ops
