// Elementwise math written once against the Vec interface (vec_avx512.h, vec_avx2.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// exp(x) with relative error ~2e-7 on [-87, 88] (Cephes polynomial); inputs outside
// are clamped, so the result stays finite; NaN propagates through silu's division.
template <class V>
typename V::Reg vec_exp(typename V::Reg x) {
  using Reg = typename V::Reg;
  x = V::max(V::min(x, V::set1(88.0f)), V::set1(-87.0f));
  const Reg n = V::round_nearest(V::mul(x, V::set1(1.44269504088896341f)));
  Reg r = V::fma(n, V::set1(-0.693359375f), x);  // x - n * ln2, in two parts
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  Reg p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  p = V::fma(V::mul(p, r), r, V::add(r, V::set1(1.0f)));
  return V::mul(p, V::pow2(n));
}

// Whether any lane of r is NaN. With poison = V::fma(x, 0, poison) over a row (poison
// starting at zero), it says whether the row held a NaN or an infinity.
template <class V>
bool any_nan(typename V::Reg r) {
  float lanes[V::kWidth];
  V::store(lanes, r);
  bool nan = false;
  for (float lane : lanes) nan |= lane != lane;
  return nan;
}

// The largest |x[i]| of x[0, n) and whether every x[i] is finite: the activation
// quantizers' one pass over a row or block (quant/activation_quant.h, gguf/gguf_act.h,
// fp8/fp8_format.h). A NaN does not raise the maximum (an infinity does); any n.
struct AbsMax {
  float value;
  bool finite;
};
template <class V>
AbsMax abs_max(const float* x, int64_t n) {
  constexpr int W = V::kWidth;
  const int64_t body = n / W * W;
  typename V::Reg top = V::zero(), poison = V::zero();
  for (int64_t i = 0; i < body; i += W) {
    const typename V::Reg v = V::load(x + i);
    top = V::max(V::abs(v), top);           // maxps: a NaN lane keeps top
    poison = V::fma(v, V::zero(), poison);  // NaN once a lane saw NaN or inf
  }
  AbsMax m{V::reduce_max(top), !any_nan<V>(poison)};
  for (int64_t i = body; i < n; ++i) {
    if (!std::isnan(x[i])) m.value = std::max(m.value, std::fabs(x[i]));
    m.finite &= static_cast<bool>(std::isfinite(x[i]));
  }
  return m;
}

// silu(g) * u = g / (1 + exp(-g)) * u
template <class V>
typename V::Reg vec_silu_mul(typename V::Reg g, typename V::Reg u) {
  const typename V::Reg one = V::set1(1.0f);
  return V::mul(V::div(g, V::add(one, vec_exp<V>(V::sub(V::zero(), g)))), u);
}

}  // namespace
}  // namespace kt::cpu
