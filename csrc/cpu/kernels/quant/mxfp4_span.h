// [NOTE] MXFP4's spans: the order in which every kernel adds up a row's groups.
//
// An output lane n of an MXFP4 matrix is sum_g half_scale(e[g][n]) * S_g, where S_g is
// the exact int32 sum of one group (32 k) of int8 activations times the doubled e2m1
// levels (|level| <= 12). Every kernel adds the groups of each span of
// kMxfp4SpanGroups groups (512 k, counted from k = 0) into a partial of its own (from +0,
// one FMA per group in group order), and adds that partial to the output once, at the
// span's end.
//
// Why: the half-scales are powers of two. If a lane's span has exponents within
// kMxfp4MaxShift of each other (and in range, below), every term is an integer multiple
// of the smallest half-scale h and the partial's magnitude stays under 2^24 h
// (16 groups x 32 x 128 x 12 x 2^3 < 2^23), so the partial is exact, equal to
//   h * sum_g (S_g << (e[g] - e_min)) = h * (one int32 sum over the span's 512 k
//   of the activations times the levels shifted left by e[g] - e_min),
// and a shifted level still fits in int8 (12 << 3 = 96). AMX tiles (quant_gemm_amx.h)
// compute that one sum with one full-width tdpbssd per 64 k and 16 x 16 tile instead of
// two half-width ones and one flush per span instead of 16, and give the vector path's bits
// (tests/test_invariants.py compares them exactly). Spans whose exponents spread further
// (or hold a NaN, subnormal or huge half-scale) take the tiles' group-by-group route,
// which performs the vector path's operations in its order.
//
// In range: the bf16 half-scale's exponent field lies in [1, kMxfp4MaxField] (scale
// exponents e in [2, 201]; the partial's magnitude then stays far below fp32's largest
// value and its steps are normal numbers), or the whole span of the lane has half-scale 0
// (padding rows of a block: their terms are all 0).
#pragma once

#include <cstdint>

namespace kt::cpu {

// Groups per span (512 k): one span per k block of the vector GEMM (kQuantKBlock), so its
// prefill adds a partial to the output as often as it loaded the output before; spans of
// 4 groups cost it up to 1.2x the time (docs/formats.md, "MXFP4 spans").
constexpr int64_t kMxfp4SpanGroups = 16;
constexpr int kMxfp4MaxShift = 3;        // 12 << 3 = 96 fits int8
constexpr int kMxfp4MaxField = 200;      // largest bf16 exponent field a merged span takes

}  // namespace kt::cpu
