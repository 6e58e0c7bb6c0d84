// Hugging Face expert weights into the INT8 / INT4 / MXFP4 layouts (int_layout.h):
// quantized from float weights, or copied from an INT4 or MXFP4 checkpoint's codes.
#pragma once

#include <cstdint>

#include "../isa/element_type.h"
#include "packed_header.h"
#include "quantize.h"

namespace kt::cpu {

// gate, up: [E, I, H] row-major of `type`; down: [E, H, I]. Writes the header and all
// blocks of `layout` (format int8, int4 or int4_asym) into blob[0, layout.total_bytes).
// One job per (matrix, expert, 16-row block) on the Engine.
void pack_int_experts(const void* gate, const void* up, const void* down, ElementType type,
                      const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

// The same for format mxfp4 (H and I multiples of 32): each row quantized per 32 weights
// as ggml quantizes MXFP4 (mxfp4_block.h: exponent from max|w|, nearest code), then laid
// out as int_layout.h says. `options` is unused (no scale search).
void pack_mxfp4_experts(const void* gate, const void* up, const void* down, ElementType type,
                        const PackedLayout& layout, const QuantOptions& options, uint8_t* blob);

// GGUF MXFP4 rows (ggml type 39: 17 bytes per 32 weights, mxfp4_block.h) into `layout`
// (format mxfp4): blocks[0..2] are gate, up [E, I, H / 32 * 17] and down
// [E, H, I / 32 * 17]. Codes and exponents are moved, never re-quantized.
void pack_mxfp4_blocks(const uint8_t* const blocks[3], const PackedLayout& layout, uint8_t* blob);

// One already-quantized INT4 matrix [E, N, K] (a checkpoint's RAWINT4/GPTQ/AWQ
// weights, normalized): nibbles [E, N, K / 2], element k of a row in byte k / 2, the
// low nibble for even k, values 0..15; scales and (int4_asym only) minimums fp32
// [E, N, K / G] with w = scale * (q - 8) (int4) or w = scale * q + minimum (int4_asym).
struct Int4Source {
  const uint8_t* nibbles = nullptr;
  const float* scales = nullptr;
  const float* minimums = nullptr;
};

// gate, up, down (sources[0..2], N = I, I, H; K = H, H, I) into `layout` (format int4 or
// int4_asym, group size G): the levels, scales and minimums are copied, nothing is
// re-quantized. One job per (matrix, expert, 16-row block) on the Engine.
void pack_int4_sources(const Int4Source sources[3], const PackedLayout& layout, uint8_t* blob);

// One already-quantized INT8 matrix [E, N, K] (kt-kernel's converted AMXINT8 weights):
// levels int8 in [-128, 127] [E, N, K], scales fp32 [E, N], w = scale * q.
struct Int8Source {
  const int8_t* levels = nullptr;
  const float* scales = nullptr;
};

// gate, up, down (sources[0..2], N = I, I, H; K = H, H, I) into `layout` (format int8):
// the levels and scales are copied, nothing is re-quantized. One job per (matrix, expert,
// 16-row block) on the Engine.
void pack_int8_sources(const Int8Source sources[3], const PackedLayout& layout, uint8_t* blob);

// An int4_asym blob packed from `layout`: if every minimum is -z * scale for an integer z
// in [0, kMaxIntegerZero] (exactly; a zero scale with a zero minimum), rewrites the header
// with PackedShape::integer_zeros set and returns true. The packers call it last.
bool mark_integer_zeros(const PackedLayout& layout, uint8_t* blob);

}  // namespace kt::cpu
