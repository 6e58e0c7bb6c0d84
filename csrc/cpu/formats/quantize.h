// Weight quantizers for the INT8 and INT4 formats (int_layout.h): one row of fp32
// weights at a time, round-to-nearest, with an optional scale search that keeps the
// candidate with the smallest squared error.
#pragma once

#include <cstdint>

namespace kt::cpu {

struct QuantOptions {
  bool scale_search = false;  // try candidate scales per row / group, keep the best
};

// w[0, n) -> q[0, n) in [-127, 127] with w ~ scale * q (symmetric, one scale per row).
void quantize_int8_row(const float* w, int64_t n, const QuantOptions& options, int8_t* q,
                       float* scale);

// w[0, n) in groups of `group` -> q[0, n) in [0, 15], per group g:
//   symmetric (minimums == nullptr): w ~ scales[g] * (q - 8)
//   asymmetric:                      w ~ scales[g] * q + minimums[g]
//     round-to-nearest (no scale search) as GPTQ and AWQ quantize: the range extended to
//     hold 0, minimums[g] = -z * scales[g] for an integer zero point z in [0, 15] (exact:
//     the scale keeps 20 significant bits), so the packed blob gets the integer-zero flag
//     (PackedShape::integer_zeros); the scale search fits any minimum.
void quantize_int4_row(const float* w, int64_t n, int64_t group, const QuantOptions& options,
                       uint8_t* q, float* scales, float* minimums);

}  // namespace kt::cpu
