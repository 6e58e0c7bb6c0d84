#include "glu_blob.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "../cpu/engine/huge_pages.h"
#include "checks.h"
#include "packed_blob.h"

namespace kt::ops {
namespace {

// The end of the weights of `layout` (the byte after its last matrix).
uint64_t weights_end(const cpu::PackedLayout& layout) {
  const uint64_t E = layout.shape.num_experts;
  if (layout.shape.format != cpu::PackedFormat::kGguf) return layout.down_offset + E * layout.down_expert_bytes;
  uint64_t end = cpu::kPackedHeaderBytes;
  for (int m = 0; m < 3; ++m) end = std::max(end, layout.matrix_offset[m] + E * layout.matrix_expert_bytes[m]);
  return end;
}

// bias [E, n] of any float dtype (or None: zeros) -> dst [E, n16] fp32, zero-padded.
void store_bias(const std::optional<at::Tensor>& bias, const char* name, int64_t E, int64_t n, int64_t n16,
                float* dst) {
  at::Tensor out = at::from_blob(dst, {E, n16}, at::TensorOptions().dtype(at::kFloat));
  out.zero_();
  if (!bias.has_value()) return;
  const at::Tensor& b = *bias;
  TORCH_CHECK_VALUE(at::isFloatingType(b.scalar_type()) && b.element_size() >= 2 && b.scalar_type() != at::kFloat8_e8m0fnu,
                    name, " must be a float tensor (float32, bfloat16 or float16); got ", b.scalar_type());
  TORCH_CHECK_VALUE(b.device().is_cpu(), name, " must be on the CPU; got ", b.device());
  TORCH_CHECK_VALUE(b.dim() == 2 && b.size(0) == E && b.size(1) == n, name, " must be [", E, ", ", n, "]; got ",
                    b.sizes());
  out.narrow(1, 0, n).copy_(b);
}

}  // namespace

at::Tensor set_activation(const at::Tensor& packed, double swiglu_limit, double swiglu_alpha,
                          const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                          const std::optional<at::Tensor>& down_bias) {
  const cpu::PackedLayout old = read_packed(packed, "packed");
  TORCH_CHECK_VALUE(std::isfinite(swiglu_limit) && swiglu_limit >= 0.0 && std::isfinite(swiglu_alpha) &&
                        swiglu_alpha >= 0.0 && swiglu_limit < 3.0e38 && swiglu_alpha < 3.0e38,
                    "swiglu_limit and swiglu_alpha must be finite and >= 0 (0: off), below 3e38; got ", swiglu_limit,
                    " and ", swiglu_alpha);
  // The header holds fp32: a positive value that rounds to 0 there would read as "off".
  TORCH_CHECK_VALUE((swiglu_limit == 0.0) == (static_cast<float>(swiglu_limit) == 0.0f) &&
                        (swiglu_alpha == 0.0) == (static_cast<float>(swiglu_alpha) == 0.0f),
                    "swiglu_limit and swiglu_alpha must be 0 (off) or nonzero in float32 (the layer's header holds "
                    "float32); got ", swiglu_limit, " and ", swiglu_alpha);
  cpu::PackedShape shape = old.shape;
  shape.glu.swiglu_limit = static_cast<float>(swiglu_limit);
  shape.glu.swiglu_alpha = static_cast<float>(swiglu_alpha);
  shape.glu.biases = gate_bias.has_value() || up_bias.has_value() || down_bias.has_value();
  const uint64_t end = weights_end(old);
  const cpu::PackedLayout layout = translate_errors([&] {
    if (shape.format != cpu::PackedFormat::kGguf) return cpu::packed_layout(shape);
    const uint64_t bias_offset = shape.glu.biases ? (end + 63) / 64 * 64 : 0;
    return cpu::gguf_layout(shape, old.matrix_offset,
                            shape.glu.biases ? bias_offset + cpu::glu_bias_bytes(shape) : end, bias_offset);
  });
  at::Tensor out = at::empty({static_cast<int64_t>(layout.total_bytes)}, packed.options());
  cpu::advise_huge_pages(out.data_ptr(), static_cast<size_t>(out.numel()));
  const int64_t body = static_cast<int64_t>(end - cpu::kPackedHeaderBytes), at_body = cpu::kPackedHeaderBytes;
  out.narrow(0, at_body, body).copy_(packed.narrow(0, at_body, body));
  uint8_t* blob = out.data_ptr<uint8_t>();
  if (layout.total_bytes > end && !shape.glu.biases)  // padding between the weights and the end
    std::fill(blob + end, blob + layout.total_bytes, uint8_t{0});
  if (shape.glu.biases) {
    const int64_t E = shape.num_experts, I = shape.intermediate_size, H = shape.hidden_size;
    const int64_t I16 = (I + 15) / 16 * 16, H16 = (H + 15) / 16 * 16;
    std::fill(blob + end, blob + layout.bias_offset, uint8_t{0});
    float* biases = reinterpret_cast<float*>(blob + layout.bias_offset);
    store_bias(gate_bias, "gate_bias", E, I, I16, biases);
    store_bias(up_bias, "up_bias", E, I, I16, biases + E * I16);
    store_bias(down_bias, "down_bias", E, H, H16, biases + 2 * E * I16);
  }
  cpu::write_packed_header(layout, blob);
  return out;
}

}  // namespace kt::ops
