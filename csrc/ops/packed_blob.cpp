#include "packed_blob.h"

#include "checks.h"

namespace kt::ops {

cpu::PackedLayout read_packed(const at::Tensor& packed, const char* name) {
  check_dtype(packed, name, {at::kByte});
  check_dim(packed, name, 1);
  check_cpu_contiguous(packed, name);
  return translate_errors([&] {
    return cpu::read_packed_header(packed.const_data_ptr<uint8_t>(),
                                   static_cast<size_t>(packed.numel()));
  });
}

}  // namespace kt::ops
