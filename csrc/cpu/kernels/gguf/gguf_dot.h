// [NOTE] The GGUF dot-product micro-kernels: NR decoded weight rows (gguf_decode.h)
// against one activation row, for every quantized type; written once over a set of
// integer operations (quant/int_ops_*.h: vpdpbusd, or vpmaddubsw + vpmaddwd) and fp32
// vector operations. Per 64 weights: one integer dot per row (int32 per 4 weights),
// converted and scaled by weight scale x activation scale per lane; the minimums are
// removed once per 256 weights with the activation's per-16 sums. The activation
// registers are loaded once for the NR rows.
#pragma once

#include <cstdint>

#include "gguf_act.h"
#include "gguf_decode.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

// out[i] = dot(weight row i, activation row) for i < NR; rows are `units` decoded units.
// kUnitScale: one activation scale per 256 values (K-quants), applied once per unit.
template <class Ops, bool kInt8, bool kUnitScale, int NR>
void gguf_dot_rows(const GgufDecoded* const* rows, const int8_t* aq, const float* as,
                   const float* asum, const int32_t* bias4, int64_t units, float* out) {
  using V = typename Ops::Vec;
  constexpr int W = V::kWidth, R = Ops::kRegsPerLine;
  typename V::Reg acc[NR], accm[NR], unit[NR];
  for (int i = 0; i < NR; ++i) acc[i] = accm[i] = V::zero();
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>(aq + u * kGgufSuper);
    for (int i = 0; i < NR; ++i) unit[i] = V::zero();
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < R; ++r) {
        const typename Ops::IReg ai = Ops::load(a + 64 * c, r);
        const typename V::Reg sa = V::load(as + u * 64 + 16 * c + r * W);
        // Q8_0 offset binary on vpdpbusd: start from -128 * sum(a) per lane.
        const typename Ops::IReg start =
            kInt8 && Ops::kInt8Bias != 0
                ? Ops::load(reinterpret_cast<const uint8_t*>(bias4 + u * 64 + 16 * c), r)
                : Ops::zero();
        for (int i = 0; i < NR; ++i) {
          const GgufDecoded& w = rows[i][u];
          const typename Ops::IReg wi = Ops::load(w.q + 64 * c, r);
          const typename Ops::IReg p = kInt8 ? Ops::dot_int8(start, wi, ai) : Ops::dot(start, wi, ai);
          if (kUnitScale)
            unit[i] = V::fma(Ops::to_float(p), V::load(w.scale + 16 * c + r * W), unit[i]);
          else
            acc[i] = V::fma(Ops::to_float(p), V::mul(V::load(w.scale + 16 * c + r * W), sa), acc[i]);
        }
      }
    if (kUnitScale) {
      const typename V::Reg da = V::set1(as[u * 64]);
      for (int i = 0; i < NR; ++i) acc[i] = V::fma(unit[i], da, acc[i]);
    }
    for (int v = 0; v < 16; v += W) {
      const typename V::Reg s = V::load(asum + u * 16 + v);
      for (int i = 0; i < NR; ++i) accm[i] = V::fma(V::load(rows[i][u].minimum + v), s, accm[i]);
    }
  }
  for (int i = 0; i < NR; ++i) out[i] = V::reduce_add(acc[i]) - V::reduce_add(accm[i]);
}

// Float weight types: out[i] = dot(fp32 weight row i, fp32 activation row), kp values.
template <class V, int NR>
void gguf_dot_rows_float(const float* const* rows, const float* x, int64_t kp, float* out) {
  constexpr int W = V::kWidth;
  typename V::Reg acc[NR];
  for (int i = 0; i < NR; ++i) acc[i] = V::zero();
  for (int64_t k = 0; k < kp; k += W) {
    const typename V::Reg xv = V::load(x + k);
    for (int i = 0; i < NR; ++i) acc[i] = V::fma(V::load(rows[i] + k), xv, acc[i]);
  }
  for (int i = 0; i < NR; ++i) out[i] = V::reduce_add(acc[i]);
}

}  // namespace
}  // namespace kt::cpu
