// [NOTE] The kernel table: for each packed format, the MoE forward of every CPU variant
// (as ggml-cpu's type_traits_cpu). A variant without its own kernel for a format names
// the kernel it runs instead, so kt_ops.doctor() can say exactly what executes.
#pragma once

#include "../formats/packed_header.h"
#include "../isa/cpu_variant.h"
#include "moe_args.h"

namespace kt::cpu {

using MoeForwardFn = void (*)(const MoeArgs&);

struct MoeKernel {
  MoeForwardFn forward;
  const char* name;  // e.g. "bf16/avx512_bf16 (vdpbf16ps)"
};

// Throws std::invalid_argument for a format with no kernels.
MoeKernel moe_kernel(PackedFormat format, CpuVariant variant);

}  // namespace kt::cpu
