// Packs FP8 experts (fp8, fp8_perchannel, mxfp8; fp8_layout.h): re-tiles a checkpoint's
// e4m3 codes and scales in place (no widening), or quantizes bf16 / fp16 / fp32 weights
// to e4m3 first (the format table's packer).
#pragma once

#include <cstdint>

#include "../isa/element_type.h"
#include "packed_header.h"
#include "quantize.h"

namespace kt::cpu {

// e4m3 (float8_e4m3fn) code of `value`: round to nearest even, saturating to +-448;
// NaN -> 0x7f.
uint8_t e4m3_from_float(float value);

// One matrix of a checkpoint in FP8: codes [E, rows, K] (e4m3 bytes, row-major) and its
// scales per row and group [E, rows, groups] (fp32; mxfp8: ue8m0 bytes), where groups =
// fp8_layout::MatrixDims::groups (fp8: ceil(K / 128); fp8_perchannel: 1; mxfp8: ceil(K / 32)).
struct Fp8Source {
  const uint8_t* codes;
  const void* scales;
};

// Re-tiles gate, up, down (in that order) into `layout` (an fp8 format) at blob[0,
// layout.total_bytes) and writes the header. NaN codes set their (row, group) scale to NaN
// (mxfp8: exponent 255). Throws std::invalid_argument for an mxfp8 exponent code in
// (fp8_layout::kMaxMxExponent, 255) before writing anything.
void pack_fp8_sources(const Fp8Source sources[3], const PackedLayout& layout, uint8_t* blob);

// The table's packer: gate, up [E, I, H], down [E, H, I] of `source` quantized to e4m3
// (fp8: scale = max|w| / 448 per 128 x 128 block; fp8_perchannel: per row; mxfp8: the
// smallest power of two >= max|w| / 448 per 32 weights, so nothing saturates), then
// pack_fp8_sources. NaN and infinite weights get the NaN code (and are left out of the
// scales' max|w|).
void pack_fp8_experts(const void* gate, const void* up, const void* down, ElementType source,
                      const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

}  // namespace kt::cpu
