#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kt::cpu {
namespace {

// Candidate scales of the search, as fractions of the round-to-nearest scale.
constexpr int kCandidates = 16;
constexpr float kCandidateStep = 0.015f;  // 1.0, 0.985, ..., 0.775

inline int round_int(float x) { return static_cast<int>(std::lrint(x)); }

// Round-to-nearest fast path, written so the compiler vectorizes it for the baseline
// ISA (SSE2): lane-wise max/min reductions and magic-number rounding (ties to even).
constexpr int kLanes = 8;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

struct Range {
  float lo, hi;
};

Range value_range(const float* w, int64_t n) {
  if (n == 0) return {0.0f, 0.0f};
  float lo[kLanes], hi[kLanes];
  for (int j = 0; j < kLanes; ++j) lo[j] = hi[j] = w[0];
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      lo[j] = w[k + j] < lo[j] ? w[k + j] : lo[j];
      hi[j] = w[k + j] > hi[j] ? w[k + j] : hi[j];
    }
  Range r{lo[0], hi[0]};
  for (int j = 1; j < kLanes; ++j) r = {std::min(r.lo, lo[j]), std::max(r.hi, hi[j])};
  for (; k < n; ++k) r = {std::min(r.lo, w[k]), std::max(r.hi, w[k])};
  return r;
}

// 1 / scale, 0 for a zero scale. Infinite where |scale| < 1 / FLT_MAX (the subnormal scale
// of a row or group of tiny weights): scaled() then divides instead, since w * inf would
// put every weight of the row on an extreme level.
float inverse(float scale) { return scale != 0.0f ? 1.0f / scale : 0.0f; }

// w / scale as w * inv (inv = inverse(scale)): the same bits as before for every scale
// whose inverse is finite.
float scaled(float w, float inv, float scale) { return std::isinf(inv) ? w / scale : w * inv; }

// q[k] = clamp(round((w[k] - shift) / scale), lo, hi) + offset as bytes (two's complement
// for negative levels; scale 0 gives level 0). The clamped value is below 2^22 in
// magnitude, where the magic rounding is exact.
void round_levels(const float* w, int64_t n, float shift, float scale, float lo, float hi, int offset,
                  uint8_t* q) {
  const float inv = inverse(scale);
  for (int64_t k = 0; k < n; ++k) {
    float x = scaled(w[k] - shift, inv, scale);
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    q[k] = static_cast<uint8_t>(static_cast<int>((x + kRoundMagic) - kRoundMagic) + offset);
  }
}

// A scale rounded to 20 significant bits, so that z * scale is exact in fp32 for every
// zero point z < 16 (the minimum of an int4_asym group with an integer zero point,
// PackedShape::integer_zeros). Non-finite scales stay as they are.
float zero_point_scale(float scale) {
  if (!std::isfinite(scale)) return scale;
  uint32_t bits;
  std::memcpy(&bits, &scale, sizeof(bits));
  bits = (bits + 0x8u) & ~0xfu;
  std::memcpy(&scale, &bits, sizeof(bits));
  return scale;
}

// Symmetric: q = clamp(round(w / scale), lo, hi); returns the squared error.
float quantize_symmetric(const float* w, int64_t n, float scale, int lo, int hi, int* q) {
  const float inv = inverse(scale);
  float error = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    q[k] = std::clamp(round_int(scaled(w[k], inv, scale)), lo, hi);
    const float d = w[k] - scale * static_cast<float>(q[k]);
    error += d * d;
  }
  return error;
}

// Asymmetric: q = clamp(round((w - minimum) / scale), 0, 15); returns the squared error.
float quantize_asymmetric(const float* w, int64_t n, float scale, float minimum, int* q) {
  const float inv = inverse(scale);
  float error = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    q[k] = std::clamp(round_int(scaled(w[k] - minimum, inv, scale)), 0, 15);
    const float d = w[k] - (scale * static_cast<float>(q[k]) + minimum);
    error += d * d;
  }
  return error;
}

// The scale minimising sum (w - scale * q)^2 for fixed q (least squares), or `fallback`.
float refit_scale(const float* w, const int* q, int64_t n, float fallback) {
  double wq = 0.0, qq = 0.0;
  for (int64_t k = 0; k < n; ++k) {
    wq += static_cast<double>(w[k]) * q[k];
    qq += static_cast<double>(q[k]) * q[k];
  }
  return qq > 0.0 ? static_cast<float>(wq / qq) : fallback;
}

// Symmetric group/row: RTN scale from the extreme value, optionally searched.
// `extreme_levels` maps the extreme value to a level: -8 for int4 (the sign-keeping
// trick of GGML's Q4_0, which uses all 16 levels), 127 for int8 (by magnitude).
float quantize_symmetric_block(const float* w, int64_t n, int lo, int hi, bool signed_extreme,
                               bool search, int* q, int* best_q) {
  float extreme = 0.0f;
  for (int64_t k = 0; k < n; ++k)
    if (std::fabs(w[k]) > std::fabs(extreme)) extreme = w[k];
  if (extreme == 0.0f) {
    std::fill(q, q + n, 0);
    return 0.0f;
  }
  const float base = signed_extreme ? extreme / static_cast<float>(lo) : std::fabs(extreme) / hi;
  float best_scale = base;
  float best_error = quantize_symmetric(w, n, base, lo, hi, q);
  if (!search) return best_scale;
  std::copy(q, q + n, best_q);
  for (int c = 0; c < kCandidates; ++c) {
    float scale = base * (1.0f - kCandidateStep * c);
    if (c > 0) quantize_symmetric(w, n, scale, lo, hi, q);
    scale = refit_scale(w, q, n, scale);
    const float error = quantize_symmetric(w, n, scale, lo, hi, q);
    if (error < best_error) {
      best_error = error;
      best_scale = scale;
      std::copy(q, q + n, best_q);
    }
  }
  std::copy(best_q, best_q + n, q);
  return best_scale;
}

// Asymmetric group: RTN over [min, max], optionally searched over narrowed ranges with a
// least-squares refit of (scale, minimum) for each candidate's q.
void quantize_asymmetric_block(const float* w, int64_t n, bool search, int* q, int* best_q,
                               float* scale_out, float* minimum_out) {
  const auto [lo_it, hi_it] = std::minmax_element(w, w + n);
  const float lo = *lo_it, hi = *hi_it;
  float best_scale = (hi - lo) / 15.0f, best_minimum = lo;
  float best_error = quantize_asymmetric(w, n, best_scale, best_minimum, q);
  if (search && hi > lo) {
    std::copy(q, q + n, best_q);
    for (int c = 0; c < kCandidates; ++c) {
      const float shrink = kCandidateStep * c;  // narrow the range from both ends
      const float c_lo = lo + 0.5f * shrink * (hi - lo), c_hi = hi - 0.5f * shrink * (hi - lo);
      float scale = (c_hi - c_lo) / 15.0f, minimum = c_lo;
      quantize_asymmetric(w, n, scale, minimum, q);
      // Least squares for w ~ scale * q + minimum with q fixed.
      double sq = 0, sqq = 0, sw = 0, swq = 0;
      for (int64_t k = 0; k < n; ++k) {
        sq += q[k];
        sqq += static_cast<double>(q[k]) * q[k];
        sw += w[k];
        swq += static_cast<double>(w[k]) * q[k];
      }
      const double det = n * sqq - sq * sq;
      if (det > 0) {
        scale = static_cast<float>((n * swq - sq * sw) / det);
        minimum = static_cast<float>((sw - scale * sq) / n);
      }
      const float error = quantize_asymmetric(w, n, scale, minimum, q);
      if (error < best_error) {
        best_error = error;
        best_scale = scale;
        best_minimum = minimum;
        std::copy(q, q + n, best_q);
      }
    }
    std::copy(best_q, best_q + n, q);
  }
  *scale_out = best_scale;
  *minimum_out = best_minimum;
}

}  // namespace

void quantize_int8_row(const float* w, int64_t n, const QuantOptions& options, int8_t* q,
                       float* scale) {
  if (!options.scale_search) {
    const Range r = value_range(w, n);
    const float amax = std::max(-r.lo, r.hi);
    *scale = amax / 127.0f;
    round_levels(w, n, 0.0f, *scale, -127.0f, 127.0f, 0, reinterpret_cast<uint8_t*>(q));
    return;
  }
  thread_local std::vector<int> levels, best;
  levels.resize(n);
  best.resize(n);
  *scale = quantize_symmetric_block(w, n, -127, 127, false, options.scale_search, levels.data(),
                                    best.data());
  for (int64_t k = 0; k < n; ++k) q[k] = static_cast<int8_t>(levels[k]);
}

void quantize_int4_row(const float* w, int64_t n, int64_t group, const QuantOptions& options,
                       uint8_t* q, float* scales, float* minimums) {
  int levels[128], best[128];
  for (int64_t g = 0; g * group < n; ++g) {
    const float* wg = w + g * group;
    if (!options.scale_search) {
      const Range r = value_range(wg, group);
      if (minimums == nullptr) {  // the extreme value becomes level -8 (positive on ties)
        const float extreme = r.hi >= -r.lo ? r.hi : r.lo;
        scales[g] = extreme / -8.0f;
        round_levels(wg, group, 0.0f, scales[g], -8.0f, 7.0f, 8, q + g * group);
      } else {  // GPTQ's / AWQ's rule: a range holding 0, an integer zero point z
        const float lo = std::min(r.lo, 0.0f), hi = std::max(r.hi, 0.0f);
        const float scale = zero_point_scale((hi - lo) / 15.0f);
        const int z = std::clamp(round_int(scaled(-lo, inverse(scale), scale)), 0, 15);
        scales[g] = scale;
        minimums[g] = -static_cast<float>(z) * scale;  // exact (zero_point_scale)
        round_levels(wg, group, 0.0f, scale, static_cast<float>(-z), static_cast<float>(15 - z), z, q + g * group);
      }
      continue;
    }
    if (minimums == nullptr) {
      scales[g] = quantize_symmetric_block(wg, group, -8, 7, true, options.scale_search, levels, best);
      for (int64_t k = 0; k < group; ++k) q[g * group + k] = static_cast<uint8_t>(levels[k] + 8);
    } else {
      quantize_asymmetric_block(wg, group, options.scale_search, levels, best, &scales[g], &minimums[g]);
      for (int64_t k = 0; k < group; ++k) q[g * group + k] = static_cast<uint8_t>(levels[k]);
    }
  }
}

}  // namespace kt::cpu
