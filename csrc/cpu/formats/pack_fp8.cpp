#include "pack_fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../engine/engine.h"
#include "fp8_layout.h"
#include "source_rows.h"

namespace kt::cpu {
namespace {

using fp8_layout::kBlockRows;
using fp8_layout::MatrixDims;

const char* matrix_name(int m) { return m == 0 ? "gate" : m == 1 ? "up" : "down"; }

bool is_nan_code(uint8_t code) { return (code & 0x7f) == 0x7f; }

// The fp32 scale of a block or row whose largest magnitude is `amax` (> 0, finite):
// amax / 448, so amax takes e4m3's largest code. Below FLT_MIN that quotient rounds
// coarsely (to 0 under ~6e-43, where every weight became the NaN code): there it is taken
// in double and rounded up, so no weight / scale exceeds 448 and tiny rows stay finite.
float block_scale(float amax) {
  const float s = amax / 448.0f;
  if (s >= std::numeric_limits<float>::min()) return s;  // (normal: unchanged bits)
  const double exact = static_cast<double>(amax) / 448.0;
  const float rounded = static_cast<float>(exact);
  return rounded < exact ? std::nextafter(rounded, std::numeric_limits<float>::infinity()) : rounded;
}

// Block `block` of matrix `m` of one expert: rows [row0, row0 + 16) of codes [rows, K]
// and scales [rows, groups] -> `out` (fp8_layout.h).
void retile_block(const uint8_t* codes, const uint8_t* scales, const MatrixDims& dims, int64_t row0,
                  uint8_t* out) {
  const int64_t K = dims.k, G = dims.groups;
  thread_local std::vector<uint8_t> nan_flags;  // [16][G]: the (row, group) holds a NaN code
  nan_flags.assign(static_cast<size_t>(kBlockRows * G), 0);
  std::memset(out, 0, dims.block_bytes());
  for (int r = 0; r < kBlockRows && row0 + r < dims.rows; ++r) {
    const uint8_t* row = codes + (row0 + r) * K;
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t code = row[k];
      out[(k / 2) * 32 + 2 * r + (k & 1)] = code;  // line order: pair, row, k within the pair
      if (is_nan_code(code)) nan_flags[r * G + k / dims.group] = 1;
    }
  }
  uint8_t* scale_out = out + dims.scales_offset();
  for (int r = 0; r < kBlockRows; ++r) {
    const bool real = row0 + r < dims.rows;
    bool row_nan = false;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = (row0 + r) * G + g;
      const bool nan = real && nan_flags[r * G + g];
      if (dims.byte_scales) {
        uint8_t e = real ? scales[at] : fp8_layout::kMxOne;
        if (e < fp8_layout::kMinMxExponent) e = fp8_layout::kMxOne;  // an all-zero group (checked before)
        if (nan) e = fp8_layout::kMxNan;
        row_nan = row_nan || e == fp8_layout::kMxNan;
        scale_out[g * kBlockRows + r] = e;
      } else {
        float s = 0.0f;
        if (real) std::memcpy(&s, scales + at * 4, 4);
        if (nan) s = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(scale_out + (g * kBlockRows + r) * 4, &s, 4);
      }
    }
    if (dims.byte_scales) {
      const float addend = row_nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      std::memcpy(out + dims.addend_offset() + r * 4, &addend, 4);
    }
  }
}

// mxfp8: every exponent code in [kMinMxExponent, kMaxMxExponent] or 255, or below with
// only zero codes in its group; std::invalid_argument naming the first that is not.
void check_mx_exponents(int m, const Fp8Source& source, int64_t experts, const MatrixDims& dims) {
  const auto* exponents = static_cast<const uint8_t*>(source.scales);
  for (int64_t i = 0; i < experts * dims.rows * dims.groups; ++i) {
    const int e = exponents[i];
    if (e == fp8_layout::kMxNan || (e >= fp8_layout::kMinMxExponent && e <= fp8_layout::kMaxMxExponent)) continue;
    const int64_t row = i / dims.groups, g = i % dims.groups;
    const std::string where = std::string("mxfp8 ") + matrix_name(m) + " scale of expert " +
                              std::to_string(row / dims.rows) + ", row " + std::to_string(row % dims.rows) +
                              ", group " + std::to_string(g) + ": exponent code " + std::to_string(e) + " (2^" +
                              std::to_string(e - 127) + ")";
    if (e > fp8_layout::kMaxMxExponent)
      throw std::invalid_argument(where + " is above the largest the kernels take (" +
                                  std::to_string(fp8_layout::kMaxMxExponent) + ")");
    const uint8_t* codes = source.codes + row * dims.k;
    for (int64_t k = g * dims.group; k < std::min(dims.k, (g + 1) * dims.group); ++k)
      if ((codes[k] & 0x7f) != 0)
        throw std::invalid_argument(where + " scales nonzero weights below 2^-117 * 2^-9; the kernels take codes >= " +
                                    std::to_string(fp8_layout::kMinMxExponent));
  }
}

}  // namespace

void pack_fp8_sources(const Fp8Source sources[3], const PackedLayout& layout, uint8_t* blob) {
  const PackedShape& shape = layout.shape;
  const fp8_layout::Dims dims(shape);
  const int64_t E = shape.num_experts;
  const MatrixDims* matrix_dims[3] = {&dims.gate_up, &dims.gate_up, &dims.down};
  if (shape.format == PackedFormat::kMxfp8)
    for (int m = 0; m < 3; ++m) check_mx_exponents(m, sources[m], E, *matrix_dims[m]);
  write_packed_header(layout, blob);
  const int64_t gate_up_jobs = E * dims.gate_up.blocks, down_jobs = E * dims.down.blocks;
  Engine::instance().parallel_for(gate_up_jobs + down_jobs, [&](int64_t job) {
    const bool gate_up = job < gate_up_jobs;
    const MatrixDims& md = gate_up ? dims.gate_up : dims.down;
    const int64_t local = gate_up ? job : job - gate_up_jobs;
    const int64_t expert = local / md.blocks, block = local % md.blocks;
    // gate_up block 2b: gate rows [16b, 16b + 16); block 2b + 1: the same rows of up.
    const int m = gate_up ? static_cast<int>(block % 2) : 2;
    const int64_t row0 = (gate_up ? block / 2 : block) * kBlockRows;
    const size_t scale_size = md.byte_scales ? 1 : 4;
    const uint8_t* codes = sources[m].codes + expert * md.rows * md.k;
    const uint8_t* scales = static_cast<const uint8_t*>(sources[m].scales) + expert * md.rows * md.groups * scale_size;
    uint8_t* out = blob + (gate_up ? layout.gate_up_offset + expert * layout.gate_up_expert_bytes
                                   : layout.down_offset + expert * layout.down_expert_bytes) +
                   block * md.block_bytes();
    retile_block(codes, scales, md, row0, out);
  });
}

void pack_fp8_experts(const void* gate, const void* up, const void* down, ElementType type,
                      const PackedLayout& layout, const QuantOptions& /*options*/, uint8_t* blob) {
  const PackedShape& shape = layout.shape;
  const fp8_layout::Dims dims(shape);
  const int64_t E = shape.num_experts, H = dims.hidden, I = dims.intermediate;
  const void* weights[3] = {gate, up, down};
  const MatrixDims* matrix_dims[3] = {&dims.gate_up, &dims.gate_up, &dims.down};
  const int64_t rows[3] = {I, I, H};
  const size_t element = type == ElementType::kF32 ? 4 : 2;
  const bool mx = shape.format == PackedFormat::kMxfp8, block_scales = shape.format == PackedFormat::kFp8;
  std::vector<uint8_t> codes[3], scales[3];
  for (int m = 0; m < 3; ++m) {
    codes[m].resize(static_cast<size_t>(E * rows[m] * matrix_dims[m]->k));
    scales[m].resize(static_cast<size_t>(E * rows[m] * matrix_dims[m]->groups * (mx ? 1 : 4)));
  }
  // Jobs: (matrix, expert, 128 output rows): one fp8 scale block of rows.
  constexpr int64_t kChunk = fp8_layout::kBlockGroup;
  int64_t chunks[3], first_job[4] = {0, 0, 0, 0};
  for (int m = 0; m < 3; ++m) {
    chunks[m] = (rows[m] + kChunk - 1) / kChunk;
    first_job[m + 1] = first_job[m] + E * chunks[m];
  }
  Engine::instance().parallel_for(first_job[3], [&](int64_t job) {
    const int m = job < first_job[1] ? 0 : job < first_job[2] ? 1 : 2;
    const MatrixDims& md = *matrix_dims[m];
    const int64_t expert = (job - first_job[m]) / chunks[m], chunk = (job - first_job[m]) % chunks[m];
    const int64_t K = md.k, G = md.groups, r0 = chunk * kChunk, r1 = std::min(rows[m], r0 + kChunk);
    thread_local std::vector<float> rows_buffer;
    rows_buffer.resize(static_cast<size_t>((r1 - r0) * K));
    float* const w = rows_buffer.data();  // a plain pointer in the loops (not the thread_local)
    const auto* matrix = static_cast<const uint8_t*>(weights[m]) + expert * rows[m] * K * element;
    for (int64_t r = r0; r < r1; ++r) load_row(matrix, type, r, K, w + (r - r0) * K);
    auto amax = [&](int64_t ra, int64_t rb, int64_t k0, int64_t k1) {
      float a = 0.0f;
      for (int64_t r = ra; r < rb; ++r)
        for (int64_t k = k0; k < k1; ++k) {
          const float v = std::fabs(w[(r - r0) * K + k]);
          if (std::isfinite(v)) a = std::max(a, v);  // NaN and inf get the NaN code below
        }
      return a;
    };
    // A non-finite weight (NaN, +-inf) gets the NaN code: its rows' outputs are NaN, as they
    // are NaN or infinite with the weight itself.
    auto encode = [](float v) -> uint8_t { return std::isfinite(v) ? e4m3_from_float(v) : 0x7f; };
    uint8_t* out_codes = codes[m].data() + (expert * rows[m]) * K;
    uint8_t* out_scales = scales[m].data() + (expert * rows[m]) * G * (mx ? 1 : 4);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * md.group, k1 = std::min(K, k0 + md.group);
      const float block_max = block_scales ? amax(r0, r1, k0, k1) : 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        if (mx) {
          const float a = amax(r, r + 1, k0, k1);
          int exponent = 0;
          if (a > 0.0f) {
            int e2 = 0;
            const double f = std::frexp(static_cast<double>(a) / 448.0, &e2);  // a / 448 = f 2^e2
            // the smallest 2^e >= a / 448, at least the kernels' smallest scale
            exponent = std::max(fp8_layout::kMinMxExponent - 127, f == 0.5 ? e2 - 1 : e2);
          }
          if (exponent + 127 > fp8_layout::kMaxMxExponent)
            throw std::invalid_argument(std::string("mxfp8: ") + matrix_name(m) + " weights up to " +
                                        std::to_string(a) + " need a scale above 2^" +
                                        std::to_string(fp8_layout::kMaxMxExponent - 127));
          out_scales[r * G + g] = static_cast<uint8_t>(exponent + 127);
          const float inverse = std::ldexp(1.0f, -exponent);  // 2^-e, a normal float for e in [-117, 119]
          for (int64_t k = k0; k < k1; ++k)  // exact: a power of two
            out_codes[r * K + k] = encode(w[(r - r0) * K + k] * inverse);
        } else {
          const float a = block_scales ? block_max : amax(r, r + 1, 0, K);
          const float s = a > 0.0f && std::isfinite(a) ? block_scale(a) : 1.0f;
          std::memcpy(out_scales + (r * G + g) * 4, &s, 4);
          for (int64_t k = k0; k < k1; ++k) out_codes[r * K + k] = encode(w[(r - r0) * K + k] / s);
        }
      }
    }
  });
  const Fp8Source sources[3] = {{codes[0].data(), scales[0].data()},
                                {codes[1].data(), scales[1].data()},
                                {codes[2].data(), scales[2].data()}};
  pack_fp8_sources(sources, layout, blob);
}

}  // namespace kt::cpu
