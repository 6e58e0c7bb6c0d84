// Packs FP8 experts (fp8, fp8_perchannel, mxfp8; fp8_layout.h): re-tiles a checkpoint's
// e4m3 codes and scales in place (no widening), or quantizes bf16 / fp16 / fp32 weights
// to e4m3 first (the format table's packer).
#pragma once

#include <cstdint>
#include <cstring>

#include "../isa/element_type.h"
#include "packed_header.h"
#include "quantize.h"

namespace kt::cpu {

// e4m3 (float8_e4m3fn) code of `value`: round to nearest even, saturating to +-448;
// NaN -> 0x7f. Inline: the packer calls it once per weight.
inline uint8_t e4m3_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>(bits >> 24 & 0x80);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return 0x7f;                // NaN
  if (bits >= 0x43e00000u) return sign | 0x7e;        // >= 448: saturate (RNE would reach 480 = NaN)
  if (bits < 0x3c800000u) {                           // below 2^-6: subnormal codes m * 2^-9
    float scaled;                                     // a * 512 (exact), rounded to an integer,
    std::memcpy(&scaled, &bits, sizeof(scaled));      // ties to even by the 2^23 trick
    const float q = (scaled * 512.0f + 8388608.0f) - 8388608.0f;
    return sign | static_cast<uint8_t>(q);            // 8 = 2^-6, the smallest normal code
  }
  // Round the 23-bit mantissa to 3 bits, ties to even (a carry moves the exponent up).
  const uint32_t rounded = bits + 0x7ffffu + (bits >> 20 & 1);
  return sign | static_cast<uint8_t>(((rounded >> 23) - 120) << 3 | (rounded >> 20 & 7));
}

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
