// The activation between gate/up and down (formats/packed_header.h, GluSpec) on fp32
// vectors, and where a blob's expert biases are. Include only from a variant translation
// unit, after its target pragma.
#pragma once

#include <cstdint>

#include "../formats/packed_header.h"
#include "../isa/vec_math.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// act(g, u) of one layer. Every clamp keeps NaN (min/max return their second operand
// when either is NaN, and g, u are always the second), so a NaN weight stays visible.
template <class V>
class Glu {
 public:
  using Reg = typename V::Reg;

  explicit Glu(const GluSpec& spec)
      : clamp_(spec.swiglu_limit > 0.0f),
        alpha_(spec.swiglu_alpha > 0.0f),
        limit_(V::set1(spec.swiglu_limit)),
        neg_limit_(V::set1(-spec.swiglu_limit)),
        neg_alpha_(V::set1(-spec.swiglu_alpha)) {}

  Reg apply(Reg g, Reg u) const {
    if (clamp_) {
      g = V::min(limit_, g);                    // gate: from above only (gpt-oss, DeepSeek-V4)
      u = V::max(neg_limit_, V::min(limit_, u));
    }
    if (!alpha_) return vec_silu_mul<V>(g, u);  // silu(g) * u
    const Reg one = V::set1(1.0f);              // g * sigmoid(alpha g) * (u + 1)
    return V::mul(V::div(g, V::add(one, vec_exp<V>(V::mul(neg_alpha_, g)))), V::add(u, one));
  }

 private:
  bool clamp_, alpha_;
  Reg limit_, neg_limit_, neg_alpha_;
};

// A blob's fp32 biases (packed_header.h): gate and up [E, I16], down [E, H16]; all
// nullptr when the blob has none.
struct GluBiases {
  const float* gate = nullptr;
  const float* up = nullptr;
  const float* down = nullptr;

  GluBiases(const PackedLayout& layout, const uint8_t* blob) {
    if (!layout.shape.glu.biases) return;
    const int64_t E = layout.shape.num_experts, I16 = (int64_t{layout.shape.intermediate_size} + 15) / 16 * 16;
    gate = reinterpret_cast<const float*>(blob + layout.bias_offset);
    up = gate + E * I16;
    down = up + E * I16;
  }
};

}  // namespace
}  // namespace kt::cpu
