// [NOTE] The kernel columns of the format table (../format_table.h): for each packed
// format, the MoE forward that each CPU variant runs (as ggml-cpu's type_traits_cpu). A
// variant without its own kernel for a format names the kernel it runs instead
// ("bf16/avx_vnni (the avx2 kernel: ...)"), so kt_ops.doctor() says exactly what executes. The rows are in ../format_table.cpp; this
// header is what the operator glue needs to call one.
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

// The kernel of `format`'s row under `variant`. Throws std::invalid_argument for a
// format id with no row.
MoeKernel moe_kernel(PackedFormat format, CpuVariant variant);

}  // namespace kt::cpu
