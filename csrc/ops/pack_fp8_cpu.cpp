// CPU implementation of kt::pack_fp8_experts: an FP8 checkpoint's e4m3 experts and their
// scales -> packed blob, read in place (the codes are re-tiled, never widened).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "../cpu/engine/huge_pages.h"
#include "../cpu/format_table.h"
#include "../cpu/formats/fp8_layout.h"
#include "../cpu/formats/pack_fp8.h"
#include "checks.h"

namespace kt::ops {
namespace {

constexpr const char* kNames[3] = {"gate_proj", "up_proj", "down_proj"};
constexpr const char* kScaleNames[3] = {"gate_scale", "up_scale", "down_scale"};

// The e4m3 codes of a weight tensor [E, N, K] as a contiguous uint8 CPU tensor.
at::Tensor codes_of(const at::Tensor& w, int m, int64_t E, int64_t N, int64_t K) {
  TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat8_e4m3fn || w.scalar_type() == at::kByte, kNames[m],
                    " must hold e4m3 codes (float8_e4m3fn, or uint8 bytes) for an FP8 format; got ", w.scalar_type());
  TORCH_CHECK_VALUE(w.device().is_cpu(), kNames[m], " must be on the CPU; got ", w.device());
  TORCH_CHECK_VALUE(w.dim() == 3 && w.size(0) == E && w.size(1) == N && w.size(2) == K, kNames[m], " must be [", E,
                    ", ", N, ", ", K, "]; got ", w.sizes());
  return w.contiguous().view(at::kByte);
}

// The scales of matrix m as the packer takes them: [E, N, groups] fp32 per row (fp8,
// fp8_perchannel) or uint8 (mxfp8).
at::Tensor scales_of(const at::Tensor& s, int m, cpu::PackedFormat format, int64_t E, int64_t N, int64_t K) {
  const char* name = kScaleNames[m];
  TORCH_CHECK_VALUE(s.device().is_cpu(), name, " must be on the CPU; got ", s.device());
  if (format == cpu::PackedFormat::kMxfp8) {
    const int64_t G = (K + cpu::fp8_layout::kMxGroup - 1) / cpu::fp8_layout::kMxGroup;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kByte || s.scalar_type() == at::kFloat8_e8m0fnu, name,
                      " of format mxfp8 must hold ue8m0 exponent bytes (uint8 or float8_e8m0fnu); got ",
                      s.scalar_type());
    TORCH_CHECK_VALUE(s.dim() == 3 && s.size(0) == E && s.size(1) == N && s.size(2) == G, name,
                      " of format mxfp8 must be [E, N, ceil(K / 32)] = [", E, ", ", N, ", ", G, "] for ", kNames[m],
                      " [", E, ", ", N, ", ", K, "]; got ", s.sizes());
    return s.contiguous().view(at::kByte);
  }
  // An allowlist: the floating types torch adds (float4_e2m1fn_x2 came through a denylist
  // of the fp8 ones and failed in the copy below with NotImplementedError).
  const at::ScalarType st = s.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble, name,
                    " of format ", cpu::packed_format_name(format),
                    " must be a float tensor (float32, bfloat16, float16 or float64); got ", st);
  const at::Tensor f = s.to(at::kFloat);
  if (format == cpu::PackedFormat::kFp8PerChannel) {
    const bool ok = (f.dim() == 2 && f.size(0) == E && f.size(1) == N) ||
                    (f.dim() == 3 && f.size(0) == E && f.size(1) == N && f.size(2) == 1);
    TORCH_CHECK_VALUE(ok, name, " of format fp8_perchannel must be [E, N] or [E, N, 1] = [", E, ", ", N, "] for ",
                      kNames[m], " [", E, ", ", N, ", ", K, "]; got ", s.sizes());
    return f.reshape({E, N, 1}).contiguous();
  }
  const int64_t block = cpu::fp8_layout::kBlockGroup, G = (K + block - 1) / block, R = (N + block - 1) / block;
  const bool blocks = f.dim() == 3 && f.size(0) == E && f.size(1) == R && f.size(2) == G;
  const bool rows = f.dim() == 3 && f.size(0) == E && f.size(1) == N && f.size(2) == G;
  TORCH_CHECK_VALUE(blocks || rows, name, " of format fp8 must be [E, ceil(N / 128), ceil(K / 128)] = [", E, ", ", R,
                    ", ", G, "] (or per row [", E, ", ", N, ", ", G, "]) for ", kNames[m], " [", E, ", ", N, ", ", K,
                    "]; got ", s.sizes());
  if (rows) return f.contiguous();
  return f.repeat_interleave(block, 1).narrow(1, 0, N).contiguous();
}

at::Tensor pack_fp8_experts_cpu(const at::Tensor& gate_proj, const at::Tensor& up_proj, const at::Tensor& down_proj,
                                const at::Tensor& gate_scale, const at::Tensor& up_scale,
                                const at::Tensor& down_scale, c10::string_view format) {
  RECORD_FUNCTION("kt::pack_fp8_experts", std::vector<c10::IValue>({gate_proj, down_proj}));
  const cpu::FormatRow& row = translate_errors(
      [&]() -> const cpu::FormatRow& { return cpu::format_row(cpu::parse_packed_format(std::string(format))); });
  TORCH_CHECK_VALUE(cpu::fp8_layout::is_fp8(row.format), "kt::pack_fp8_experts packs the FP8 formats (fp8, ",
                    "fp8_perchannel, mxfp8), not ", row.name, ": use kt::pack_experts");
  TORCH_CHECK_VALUE(gate_proj.dim() == 3, "gate_proj must be [E, I, H]; got ", gate_proj.sizes());
  const int64_t E = gate_proj.size(0), I = gate_proj.size(1), H = gate_proj.size(2);
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  TORCH_CHECK_VALUE(E > 0 && I > 0 && H > 0 && E < kMaxDim && I < kMaxDim && H < kMaxDim,
                    "expert weights need E, I, H in [1, 2^31); got gate_proj ", gate_proj.sizes());
  const at::Tensor* weights[3] = {&gate_proj, &up_proj, &down_proj};
  const at::Tensor* scales[3] = {&gate_scale, &up_scale, &down_scale};
  const int64_t rows[3] = {I, I, H}, cols[3] = {H, H, I};
  at::Tensor codes[3], packed_scales[3];
  for (int m = 0; m < 3; ++m) {
    codes[m] = codes_of(*weights[m], m, E, rows[m], cols[m]);
    packed_scales[m] = scales_of(*scales[m], m, row.format, E, rows[m], cols[m]);
  }
  cpu::PackedShape shape;
  shape.format = row.format;
  shape.num_experts = static_cast<uint32_t>(E);
  shape.hidden_size = static_cast<uint32_t>(H);
  shape.intermediate_size = static_cast<uint32_t>(I);
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  at::Tensor packed = at::empty({static_cast<int64_t>(layout.total_bytes)}, gate_proj.options().dtype(at::kByte));
  cpu::advise_huge_pages(packed.data_ptr(), static_cast<size_t>(packed.numel()));
  cpu::Fp8Source sources[3];
  for (int m = 0; m < 3; ++m) sources[m] = {codes[m].const_data_ptr<uint8_t>(), packed_scales[m].const_data_ptr()};
  translate_errors([&] { cpu::pack_fp8_sources(sources, layout, packed.data_ptr<uint8_t>()); });
  return packed;
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("pack_fp8_experts", &pack_fp8_experts_cpu); }

}  // namespace kt::ops
