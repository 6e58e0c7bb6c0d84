// CPU implementation of kt::pack_int4_experts: an INT4 checkpoint's levels, scales and
// (asymmetric) minimums -> packed int4 / int4_asym blob, copied, never re-quantized.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "../cpu/engine/huge_pages.h"
#include "../cpu/formats/pack_int.h"
#include "checks.h"

namespace kt::ops {
namespace {

constexpr const char* kNames[3] = {"gate_proj", "up_proj", "down_proj"};
constexpr const char* kScaleNames[3] = {"gate_scale", "up_scale", "down_scale"};
constexpr const char* kMinimumNames[3] = {"gate_min", "up_min", "down_min"};

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU; got ", t.device());
}

// A float32 [E, N, K / G] tensor (scales or minimums), contiguous.
at::Tensor group_values(const at::Tensor& t, const char* name, int m, int64_t E, int64_t N, int64_t K, int64_t G) {
  check_cpu(t, name);
  check_dtype(t, name, {at::kFloat, at::kBFloat16, at::kHalf});
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == E && t.size(1) == N && t.size(2) == K / G, name, " must be [E, N, K / ",
                    "group_size] = [", E, ", ", N, ", ", K / G, "] for ", kNames[m], " of [", E, ", ", N, ", ", K,
                    "] levels; got ", t.sizes());
  return t.to(at::kFloat).contiguous();
}

at::Tensor pack_int4_experts_cpu(const at::Tensor& gate_proj, const at::Tensor& up_proj, const at::Tensor& down_proj,
                                 const at::Tensor& gate_scale, const at::Tensor& up_scale,
                                 const at::Tensor& down_scale, const c10::optional<at::Tensor>& gate_min,
                                 const c10::optional<at::Tensor>& up_min, const c10::optional<at::Tensor>& down_min,
                                 int64_t group_size) {
  RECORD_FUNCTION("kt::pack_int4_experts", std::vector<c10::IValue>({gate_proj, down_proj}));
  const at::Tensor* weights[3] = {&gate_proj, &up_proj, &down_proj};
  const at::Tensor* scales[3] = {&gate_scale, &up_scale, &down_scale};
  const c10::optional<at::Tensor>* minimums[3] = {&gate_min, &up_min, &down_min};
  const int given = gate_min.has_value() + up_min.has_value() + down_min.has_value();
  TORCH_CHECK_VALUE(given == 0 || given == 3, "give all three of gate_min, up_min, down_min (int4_asym) or none ",
                    "(int4); got ", given);
  for (int m = 0; m < 3; ++m) {
    check_cpu(*weights[m], kNames[m]);
    check_dtype(*weights[m], kNames[m], {at::kByte});
    check_dim(*weights[m], kNames[m], 3);
  }
  const int64_t E = gate_proj.size(0), I = gate_proj.size(1), H = gate_proj.size(2) * 2;
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  TORCH_CHECK_VALUE(E > 0 && I > 0 && H > 0 && E < kMaxDim && I < kMaxDim && H < kMaxDim,
                    "expert weights need E, I, H in [1, 2^31); got gate_proj ", gate_proj.sizes(), " (H = 2 x ",
                    gate_proj.size(2), ")");
  const int64_t rows[3] = {I, I, H}, cols[3] = {H, H, 0};
  TORCH_CHECK_VALUE(down_proj.size(0) == E && down_proj.size(1) == H, "down_proj must be [E, H, I / 2] = [", E, ", ",
                    H, ", I / 2] to match gate_proj ", gate_proj.sizes(), "; got ", down_proj.sizes());
  const int64_t K_down = down_proj.size(2) * 2;
  TORCH_CHECK_VALUE(K_down == I, "down_proj holds ", K_down, " levels per row but gate_proj has I = ", I, " rows");
  TORCH_CHECK_VALUE(up_proj.sizes() == gate_proj.sizes(), "up_proj must have the shape of gate_proj ",
                    gate_proj.sizes(), "; got ", up_proj.sizes());
  cpu::PackedShape shape;
  shape.format = given ? cpu::PackedFormat::kInt4Asym : cpu::PackedFormat::kInt4;
  shape.num_experts = static_cast<uint32_t>(E);
  shape.hidden_size = static_cast<uint32_t>(H);
  shape.intermediate_size = static_cast<uint32_t>(I);
  TORCH_CHECK_VALUE(group_size > 0 && group_size < kMaxDim, "group_size must be positive; got ", group_size);
  shape.group_size = static_cast<uint32_t>(group_size);
  // Validates the group size against H and I (a multiple that divides both).
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  at::Tensor nibbles[3], scale_values[3], minimum_values[3];
  cpu::Int4Source sources[3];
  for (int m = 0; m < 3; ++m) {
    const int64_t K = m == 2 ? I : cols[m];
    nibbles[m] = weights[m]->contiguous();
    scale_values[m] = group_values(*scales[m], kScaleNames[m], m, E, rows[m], K, group_size);
    sources[m].nibbles = nibbles[m].const_data_ptr<uint8_t>();
    sources[m].scales = scale_values[m].const_data_ptr<float>();
    if (given) {
      minimum_values[m] = group_values(**minimums[m], kMinimumNames[m], m, E, rows[m], K, group_size);
      sources[m].minimums = minimum_values[m].const_data_ptr<float>();
    }
  }
  at::Tensor packed = at::empty({static_cast<int64_t>(layout.total_bytes)}, gate_proj.options().dtype(at::kByte));
  cpu::advise_huge_pages(packed.data_ptr(), static_cast<size_t>(packed.numel()));
  translate_errors([&] { cpu::pack_int4_sources(sources, layout, packed.data_ptr<uint8_t>()); });
  return packed;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("pack_int4_experts", &pack_int4_experts_cpu); }

}  // namespace kt::ops
