// Packed gguf blobs built from GGUF bytes that already exist: memory-mapped from GGUF
// files (no copy) or copied from uint8 tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../cpu/formats/packed_header.h"

namespace kt::ops {

// The PackedShape of a gguf blob (ValueError for sizes outside [1, 2^31) or type ids
// that are not 3 values in [0, 1024); unsupported types are refused by packed_layout).
cpu::PackedShape gguf_shape(const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                            int64_t intermediate);

// A blob whose gate, up and down matrices are the file ranges [offsets[m], offsets[m] +
// bytes) of files[m], mapped copy-on-write (MAP_PRIVATE) behind a header page; the
// tensor owns the mappings (unmapped when it is freed). types are ggml type ids; gate
// and up are [E, I, H], down [E, H, I]. Raises ValueError for a file too short for its
// range (truncated) or an impossible layout, RuntimeError if a file cannot be opened.
at::Tensor map_gguf_experts(const std::vector<std::string>& files, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                            int64_t intermediate);

// A blob holding copies of gate, up and down (uint8 tensors of exactly the GGUF bytes of
// [E, I, H], [E, I, H] and [E, H, I] in their types).
at::Tensor gguf_experts_from_blocks(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                    const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                                    int64_t intermediate);

// A blob of format mxfp4 (int_layout.h) from GGUF MXFP4 rows (ggml type 39): gate and
// up uint8 [E, I, H / 32 * 17], down [E, H, I / 32 * 17] (any shape holding exactly those
// bytes). The codes and exponents are moved into the INT4-style lines, never re-quantized.
at::Tensor mxfp4_experts_from_blocks(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                     int64_t experts, int64_t hidden, int64_t intermediate);

}  // namespace kt::ops
