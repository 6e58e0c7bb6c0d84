// CPU implementation of kt::pack_int8_experts: INT8 levels and per-row scales (kt-kernel's
// converted AMXINT8 weights, un-tiled by kt_ops/kt_kernel_weights.py; W8A8 checkpoints,
// kt_ops/hf_int8.py) -> packed int8 blob, copied, never re-quantized.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <vector>

#include "../cpu/engine/huge_pages.h"
#include "../cpu/formats/pack_int.h"
#include "checks.h"

namespace kt::ops {
namespace {

constexpr const char* kNames[3] = {"gate_proj", "up_proj", "down_proj"};
constexpr const char* kScaleNames[3] = {"gate_scale", "up_scale", "down_scale"};

at::Tensor pack_int8_experts_cpu(const at::Tensor& gate_proj, const at::Tensor& up_proj, const at::Tensor& down_proj,
                                 const at::Tensor& gate_scale, const at::Tensor& up_scale,
                                 const at::Tensor& down_scale) {
  RECORD_FUNCTION("kt::pack_int8_experts", std::vector<c10::IValue>({gate_proj, down_proj}));
  const at::Tensor* weights[3] = {&gate_proj, &up_proj, &down_proj};
  const at::Tensor* scales[3] = {&gate_scale, &up_scale, &down_scale};
  for (int m = 0; m < 3; ++m) {
    TORCH_CHECK_VALUE(weights[m]->device().is_cpu(), kNames[m], " must be on the CPU; got ", weights[m]->device());
    check_dtype(*weights[m], kNames[m], {at::kChar});
    check_dim(*weights[m], kNames[m], 3);
  }
  const int64_t E = gate_proj.size(0), I = gate_proj.size(1), H = gate_proj.size(2);
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  TORCH_CHECK_VALUE(E > 0 && I > 0 && H > 0 && E < kMaxDim && I < kMaxDim && H < kMaxDim,
                    "expert weights need E, I, H in [1, 2^31); got gate_proj ", gate_proj.sizes());
  TORCH_CHECK_VALUE(up_proj.sizes() == gate_proj.sizes(), "up_proj must have the shape of gate_proj ",
                    gate_proj.sizes(), "; got ", up_proj.sizes());
  TORCH_CHECK_VALUE(down_proj.size(0) == E && down_proj.size(1) == H && down_proj.size(2) == I,
                    "down_proj must be [E, H, I] = [", E, ", ", H, ", ", I, "] to match gate_proj ", gate_proj.sizes(),
                    "; got ", down_proj.sizes());
  const int64_t rows[3] = {I, I, H};
  cpu::PackedShape shape;
  shape.format = cpu::PackedFormat::kInt8;
  shape.num_experts = static_cast<uint32_t>(E);
  shape.hidden_size = static_cast<uint32_t>(H);
  shape.intermediate_size = static_cast<uint32_t>(I);
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  at::Tensor levels[3], scale_values[3];
  cpu::Int8Source sources[3];
  for (int m = 0; m < 3; ++m) {
    const at::Tensor& s = *scales[m];
    TORCH_CHECK_VALUE(s.device().is_cpu(), kScaleNames[m], " must be on the CPU; got ", s.device());
    check_dtype(s, kScaleNames[m], {at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK_VALUE(s.dim() == 2 && s.size(0) == E && s.size(1) == rows[m], kScaleNames[m], " must be [E, N] = [",
                      E, ", ", rows[m], "] (one scale per row of ", kNames[m], "); got ", s.sizes());
    // Every int8 level, -128 included: it is the stored byte 0 (q + 128), which every
    // variant's kernel multiplies as -128 (tests/test_int8_checkpoint.py); kt_ops' own
    // quantizer writes -127 ... 127, llm-compressor's W8A8 checkpoints also -128.
    levels[m] = weights[m]->contiguous();
    scale_values[m] = s.to(at::kFloat).contiguous();
    sources[m].levels = levels[m].const_data_ptr<int8_t>();
    sources[m].scales = scale_values[m].const_data_ptr<float>();
  }
  at::Tensor packed = at::empty({static_cast<int64_t>(layout.total_bytes)}, gate_proj.options().dtype(at::kByte));
  cpu::advise_huge_pages(packed.data_ptr(), static_cast<size_t>(packed.numel()));
  translate_errors([&] { cpu::pack_int8_sources(sources, layout, packed.data_ptr<uint8_t>()); });
  return packed;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("pack_int8_experts", &pack_int8_experts_cpu); }

}  // namespace kt::ops
