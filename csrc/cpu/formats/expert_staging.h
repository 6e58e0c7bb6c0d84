// [NOTE] One expert of a packed layer back in checkpoint rows, in the element types of
// kt-kernel's GPU staging layouts (write_weight_scale_to_buffer; kt_ops/staging.py has
// the per-rank table and slices these rows). Codes are moved, never widened:
//   bf16            gate/up [I][H] bf16, down [H][I] bf16; no scales
//   fp8             e4m3 bytes; scales fp32 per row and 128-k group [rows][ceil(K/128)]
//   fp8_perchannel  e4m3 bytes; scales fp32 per row [rows]
//   mxfp8           e4m3 bytes; scales ue8m0 bytes [rows][K/32]
//   int4            nibbles [rows][K/2] (element 2j low, 2j + 1 high; q + 8, i.e. the
//                   stored level); scales bf16 [rows][K/G], the fp32 scales truncated
//   gguf (MXFP4 x3) e2m1 nibbles [rows][K/2] in the same order; scales bf16 2^(e - 127)
//                   (e = 0: 2^-127, e = 255: NaN)
//   int8            int8 q [rows][K] (not a kt-kernel layout: kt_ops' GPU prefill only);
//                   scales fp32 per row [rows]
//   int4 with int4_fp32_scales: scales fp32 [rows][K/G]; int4_asym (only with it): nibbles
//                   q (w = scale q + minimum), (scale, minimum) fp32 pairs [rows][K/G][2]
// K is the real row length (padding dropped). Other formats throw std::invalid_argument.
#pragma once

#include <cstddef>
#include <cstdint>

#include "packed_header.h"

namespace kt::cpu {

struct StagingRows {
  uint8_t* gate = nullptr;        // [I][gate row bytes]
  uint8_t* up = nullptr;          // [I][gate row bytes]
  uint8_t* down = nullptr;        // [H][down row bytes]
  uint8_t* gate_scale = nullptr;  // per row, as above (nullptr for bf16)
  uint8_t* up_scale = nullptr;
  uint8_t* down_scale = nullptr;
  bool int4_fp32_scales = false;  // int4: the scales as fp32, not truncated (kt_ops' GPU prefill)
};

// Bytes per row of each output for a layer: gate/up rows (I of each), down rows (H).
struct StagingSizes {
  int64_t intermediate = 0, hidden = 0;
  size_t gate_up_row = 0, gate_up_scale_row = 0;  // scale rows 0: no scales
  size_t down_row = 0, down_scale_row = 0;
};

// Throws std::invalid_argument for a layer with no staging layout (int4_asym, GGUF
// types other than MXFP4 x 3).
StagingSizes staging_sizes(const PackedLayout& layout, bool int4_fp32_scales = false);

// Writes expert `expert` of the packed blob (`blob_bytes` long) into `out` (buffers of
// staging_sizes), on the engine's threads.
void stage_expert_rows(const uint8_t* blob, size_t blob_bytes, int64_t expert, const StagingRows& out);

}  // namespace kt::cpu
