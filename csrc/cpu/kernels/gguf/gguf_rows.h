// [NOTE] GGUF weight rows against activation rows, the row-level kernels of the GGUF
// format policy (gguf_format.h): a matrix view (GgufMatrix), the row job size of the
// streaming paths, rows decoded once (gguf_decode.h) and dotted with every token of an
// expert (gguf_dot.h), rows read in place (AVX-512: gguf_q4k_avx512.h,
// gguf_q6k_avx512.h, gguf_q23k_avx512.h, gguf_block32_avx512.h; repacked for experts
// with many tokens: gguf_kquant_tile_avx512.h, gguf_block32_tile_avx512.h; AVX2:
// gguf_block32_avx2.h, gguf_kquant_avx2.h), and rows decoded to bf16 for AMX tiles (gguf_amx.h). Include only from a variant translation unit, after its target pragma.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "../../formats/gguf_types.h"
#include "../../formats/packed_header.h"
#include "../moe_driver_common.h"
#include "gguf_act.h"
#include "gguf_block32_avx2.h"
#include "gguf_block32_avx512.h"
#include "gguf_block32_tile_avx512.h"
#include "gguf_decode.h"
#include "gguf_dot.h"
#include "gguf_kquant_avx2.h"
#include "gguf_kquant_tile_avx512.h"
#include "gguf_q23k_avx512.h"
#include "gguf_q4k_avx512.h"
#include "gguf_q6k_avx512.h"

namespace kt::cpu {
namespace {  // ISA header: each variant translation unit owns its copy

constexpr int kGgufRows = 4;             // weight rows decoded and dotted together
constexpr int64_t kGgufJobRows = 64;      // rows per job of the tile path (kTileBlocks blocks of 16)
// Rows per job of the row (decode) paths: up to 1024, 16-aligned, at least 4 jobs per
// thread over `rows` (active experts x rows per expert). Each job's four row streams
// start cold, so longer jobs stream faster: 1-token S1 Q4_K 1130-1150 us with 64-row
// jobs, 1000-1030 with 192-256 (Q8_0 1790-1850 -> 1580-1640; Zen 5); 256 -> 1024 with
// MXFP4 1056-1105 -> 933-1009 us, Q4_0 830 -> 773 (Zen 3, avx2, with the int16 pair sums).
inline int64_t streaming_job_rows(int64_t rows, int threads) {
  return 16 * streaming_job_blocks(rows / 16, threads, kGgufJobRows / 16, 64, 1);
}

constexpr int kGgufQ4kActs = 257;  // activation format code of Q4_K's and Q5_K's direct path
constexpr int kGgufQ6kActs = 258;  // of Q6_K's, Q2_K's, Q3_K's: 256-value blocks with int16 sums of 16
constexpr int kGgufQuad32Acts = 259;  // of the block-32 types': 32-value blocks in quad order
constexpr int kGgufDirectTokens = 4;  // activation rows per pass of the in-place kernels (registers)
// Average tokens per active expert from which a tile unit runs the call of a layer with a
// float-type matrix (tests mirror it).
constexpr int64_t kGgufTileMinPairs = 8;

constexpr int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// One matrix (gate, up or down) of every expert in the blob.
struct GgufMatrix {
  const uint8_t* first_expert;
  uint64_t expert_bytes;
  uint64_t row_bytes;
  GgmlType type;
  bool is_float;
  GgufDecodeRowFn decode;  // quantized types
  bool direct;             // dotted from its bytes (gguf_direct_rows), not decoded (gguf_types.h's gguf_in_place)
  int64_t k, kp;  // row length and its padded length (multiple of 256)

  // wide: the variant has the AVX-512 in-place kernels. The choice depends on the
  // matrix's type and the variant only, never on the call's tokens (batch invariance).
  GgufMatrix(const uint8_t* blob, const PackedLayout& layout, int m, int64_t rows, int64_t k_, bool wide)
      : first_expert(blob + layout.matrix_offset[m]),
        expert_bytes(layout.matrix_expert_bytes[m]),
        row_bytes(layout.matrix_expert_bytes[m] / rows),
        type(ggml_type_info(layout.shape.gguf_types[m]).type),
        is_float(ggml_type_info(layout.shape.gguf_types[m]).is_float),
        decode(gguf_decoder(type)),
        direct(gguf_in_place(ggml_type_info(layout.shape.gguf_types[m]), wide)),
        k(k_),
        kp(round_up(k_, kGgufSuper)) {}
  const uint8_t* row(int64_t expert, int64_t n) const {
    return first_expert + expert * expert_bytes + n * row_bytes;
  }
  // The activation format: 0 fp32, 32, 256, kGgufQ4kActs (256 in kGgufQ4kOrder),
  // kGgufQ6kActs (256 with sums of 16) or kGgufQuad32Acts (32 in quad order).
  int act_block() const {
    if (is_float) return 0;
    if (direct && (type == GgmlType::kQ4_K || type == GgmlType::kQ5_K)) return kGgufQ4kActs;
    if (direct && (type == GgmlType::kQ6_K || type == GgmlType::kQ2_K || type == GgmlType::kQ3_K))
      return kGgufQ6kActs;
    if (direct && ggml_type_info(static_cast<uint32_t>(type)).block_elems == 32) return kGgufQuad32Acts;
    return static_cast<int>(ggml_type_info(static_cast<uint32_t>(type)).block_elems);
  }
};

// A float-type row (F32 / F16 / BF16) as fp32, zero past k up to kp.
template <class V>
void gguf_float_row(GgmlType type, const uint8_t* row, int64_t k, int64_t kp, float* out) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  if (type == GgmlType::kF32) {
    std::memcpy(out, row, k * sizeof(float));
    i = k;
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
    const bool bf16 = type == GgmlType::kBf16;
    for (; i + W <= k; i += W) V::store(out + i, bf16 ? V::load_bf16(h + i) : V::load_f16(h + i));
    for (; i < k; ++i) {
      uint16_t bits;
      std::memcpy(&bits, h + i, 2);
      out[i] = bf16 ? bf16_to_float(bits) : f16_to_float(bits);
    }
  }
  std::fill(out + k, out + kp, 0.0f);
}

template <class Ops, int NR>
void gguf_dot_group(const GgufMatrix& m, const void* decoded, const GgufActs& acts, int64_t a, float* out) {
  using V = typename Ops::Vec;
  const int64_t units = m.kp / kGgufSuper;
  if (m.is_float) {
    const float* rows[NR];
    for (int i = 0; i < NR; ++i) rows[i] = static_cast<const float*>(decoded) + i * m.kp;
    return gguf_dot_rows_float<V, NR>(rows, acts.f + a * m.kp, m.kp, out);
  }
  const GgufDecoded* rows[NR];
  for (int i = 0; i < NR; ++i) rows[i] = static_cast<const GgufDecoded*>(decoded) + i * units;
  const int8_t* q = acts.q + a * m.kp;
  const float* s = acts.scale + a * (m.kp / 4);
  const float* sums = acts.sum16 + a * (m.kp / 16);
  const int32_t* bias4 = acts.bias4 + a * (m.kp / 4);
  if (m.type == GgmlType::kQ8_0)
    gguf_dot_rows<Ops, true, false, NR>(rows, q, s, sums, bias4, units, out);
  else if (m.act_block() == kGgufSuper)
    gguf_dot_rows<Ops, false, true, NR>(rows, q, s, sums, bias4, units, out);
  else
    gguf_dot_rows<Ops, false, false, NR>(rows, q, s, sums, bias4, units, out);
}

// run(mode) with `levels` as a compile-time constant (std::integral_constant).
template <class Run>
void in_kept_mode(KeptLevels levels, Run&& run) {
  switch (levels) {
    case KeptLevels::kKeep: return run(std::integral_constant<KeptLevels, KeptLevels::kKeep>{});
    case KeptLevels::kLoad: return run(std::integral_constant<KeptLevels, KeptLevels::kLoad>{});
    default: return run(std::integral_constant<KeptLevels, KeptLevels::kExtract>{});
  }
}

// The AVX2 block-32 kernel of kType in the mode `levels` (gguf_block32_avx2.h).
template <class Ops, GgmlType kType, int M>
void gguf_block32_keeping(KeptLevels levels, const uint8_t* const* rows, int64_t k, const int8_t* const* q,
                          const float* const* scale4, const int32_t* const* bias4, const float* const* block_min,
                          bool prefetch, float* out, uint8_t* cache) {
  in_kept_mode(levels, [&](auto mode) {
    gguf_block32_dot_rows4_avx2<Ops, kType, M, decltype(mode)::value>(rows, k, q, scale4, bias4, block_min, prefetch,
                                                                      out, cache);
  });
}

// The AVX2 K-quant kernel of kType in the mode `levels` (gguf_kquant_avx2.h).
template <class Ops, GgmlType kType, int M>
void gguf_kquant_keeping(KeptLevels levels, const uint8_t* const* rows, const int8_t* const* q,
                         const float* const* scale4, const int16_t* const* level_sums, int64_t units, bool prefetch,
                         float* out, uint8_t* cache) {
  in_kept_mode(levels, [&](auto mode) {
    constexpr KeptLevels kLevels = decltype(mode)::value;
    if constexpr (kType == GgmlType::kQ4_K || kType == GgmlType::kQ5_K)
      gguf_q4k_dot_rows4_avx2<Ops, M, kType == GgmlType::kQ5_K, kLevels>(rows, q, scale4, level_sums, units,
                                                                          prefetch, out, cache);
    else
      gguf_group16_dot_rows4_avx2<Ops, kType, M, kLevels>(rows, q, scale4, level_sums, units, prefetch, out, cache);
  });
}

// Bytes the AVX2 passes over four rows of `type` (k weights each) keep (0: none kept):
// every quantized type keeps the levels its first pass extracts when more passes follow.
// Block-32 types, paired A/B on Zen 3 (avx2, 2026-11-26) against extracting in every
// pass: 512 tokens 0.66-0.79x the time (S1 Q4_0, Q4_1, Q8_0, MXFP4; S2 Q4_0), 64 tokens
// 0.82-0.95x, 1 token unchanged (one pass); Q5_0 / Q5_1 (before: decoded rows) 0.81-0.86x
// at 512 tokens, 0.75-0.79x at 64, 0.56-0.70x at 1.
inline int64_t gguf_kept_bytes(GgmlType type, int64_t k) {
  switch (type) {
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: return (k / 256) * kQ4kKeptUnit;
    case GgmlType::kQ6_K:
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K: return (k / 256) * 4 * kGroup16Kept;
    default: return ggml_block_elems(type) == 32 ? ((k / 32 + 3) / 4) * kBlock32CacheStep<GgmlType::kQ5_1> : 0;
  }
}

// Whether kType is a K-quant (256-weight super-blocks; the other in-place types have 32-weight blocks).
constexpr bool gguf_is_kquant(GgmlType type) { return ggml_block_elems(type) == 256; }
static_assert(gguf_is_kquant(GgmlType::kQ2_K) && gguf_is_kquant(GgmlType::kQ6_K) && !gguf_is_kquant(GgmlType::kQ8_0) &&
                  !gguf_is_kquant(GgmlType::kMxfp4),
              "K-quants are the 256-element types of kGgmlTypes");

// run(type) with the in-place type `type` (gguf_in_place) as a compile-time constant
// (std::integral_constant<GgmlType, T>): gguf_direct_rows' loop over the groups of four
// rows is compiled per type and calls that type's kernel directly. Against a switch on
// the type in every group's call, paired A/B on Zen 3 (avx2, 2026-12-02), 1 / 8 tokens:
// S1 Q4_0 0.88 / 0.86 the time, GGUF_MXFP4 0.87 / 0.94, Q8_0 0.95 / 0.92, Q4_K 0.94 /
// 0.89 (one round of five 1.05-1.20), Q6_K 1.00 / 1.00.
template <class Run>
void in_direct_type(GgmlType type, Run&& run) {
  using T = GgmlType;
  switch (type) {
    case T::kQ4_K: return run(std::integral_constant<T, T::kQ4_K>{});
    case T::kQ5_K: return run(std::integral_constant<T, T::kQ5_K>{});
    case T::kQ6_K: return run(std::integral_constant<T, T::kQ6_K>{});
    case T::kQ2_K: return run(std::integral_constant<T, T::kQ2_K>{});
    case T::kQ3_K: return run(std::integral_constant<T, T::kQ3_K>{});
    case T::kQ8_0: return run(std::integral_constant<T, T::kQ8_0>{});
    case T::kQ4_0: return run(std::integral_constant<T, T::kQ4_0>{});
    case T::kQ5_0: return run(std::integral_constant<T, T::kQ5_0>{});
    case T::kQ5_1: return run(std::integral_constant<T, T::kQ5_1>{});
    case T::kMxfp4: return run(std::integral_constant<T, T::kMxfp4>{});
    default: return run(std::integral_constant<T, T::kQ4_1>{});  // kQ4_1, the last in-place type
  }
}

// One in-place kernel call: `rows` (4 rows of m, type kType) dotted with activation rows
// act_row(p) for the M pairs p = p0 .. p0 + M - 1, out[4 * j + i] (row i, pair p0 + j).
// AVX2 (gguf_kept_bytes): `levels` says whether this pass extracts the rows' levels, also
// keeps them in `cache` for the next passes, or takes the kept ones.
template <class Ops, GgmlType kType, int M>
void gguf_direct_block(const GgufMatrix& m, const uint8_t* const* rows, const GgufActs& acts,
                       const int32_t* act_rows, int64_t p0, bool prefetch, float* out,
                       KeptLevels levels = KeptLevels::kExtract, uint8_t* cache = nullptr) {
  const int8_t* q[M];
  const float* scale4[M];
  [[maybe_unused]] const int32_t* bias4[M];
  [[maybe_unused]] const int16_t* level_sums[M];
  [[maybe_unused]] const float* block_min[M];
  for (int j = 0; j < M; ++j) {
    const int64_t a = act_rows != nullptr ? act_rows[p0 + j] : p0 + j;
    q[j] = acts.q + a * m.kp;
    scale4[j] = acts.scale + a * (m.kp / 4);
    bias4[j] = acts.bias4 + a * (m.kp / 4);
    level_sums[j] = acts.level_sums + a * (m.kp / 16);
    block_min[j] = acts.block_min_sums + a * (m.kp / 4);
  }
  [[maybe_unused]] const int64_t units = m.kp / kGgufSuper;
  if constexpr (Ops::kRegsPerLine != 1) {  // AVX2 / AVX-VNNI: the avx2_in_place types
    if constexpr (gguf_is_kquant(kType)) {
      gguf_kquant_keeping<Ops, kType, M>(levels, rows, q, scale4, level_sums, units, prefetch, out, cache);
    } else {
      static_assert(M <= kBlock32Avx2Tokens);  // gguf_direct_tokens
      gguf_block32_keeping<Ops, kType, M>(levels, rows, m.k, q, scale4, bias4, block_min, prefetch, out, cache);
    }
  } else {  // AVX-512: every quantized type
    if constexpr (kType == GgmlType::kQ4_K || kType == GgmlType::kQ5_K)
      gguf_q4k_dot_rows4<Ops, M, kType == GgmlType::kQ5_K>(rows, q, scale4, level_sums, units, prefetch, out);
    else if constexpr (kType == GgmlType::kQ6_K)
      gguf_q6k_dot_rows4<Ops, M>(rows, q, scale4, level_sums, units, prefetch, out);
    else if constexpr (kType == GgmlType::kQ2_K || kType == GgmlType::kQ3_K)
      gguf_q23k_dot_rows4<Ops, kType, M>(rows, q, scale4, level_sums, units, prefetch, out);
    else
      gguf_block32_dot_rows4<Ops, kType, M>(rows, m.k, q, scale4, bias4, block_min, prefetch, out);
  }
}

// Activation rows per pass of the in-place kernels (the rows' extraction is shared by
// them; registers bound it): 4 on AVX-512, 4 for the K-quants on AVX2, 2 for AVX2's
// block-32 types. AVX2 K-quants, paired A/B on Zen 3 (avx2, 2026-11-26; Q4_K, Q5_K and
// Q6_K measured, Q2_K and Q3_K take the same): passes of 4 against 8 took 0.88-0.93 of
// the time at 512 tokens (S1 Q4_K/Q5_K/Q6_K, S2 Q4_K) and the same at 64; passes of 8
// against 2 0.89-1.06 at 512, 0.91-0.97 at 64.
constexpr int kKquantAvx2Tokens = 4;
static_assert(kKquantAvx2Tokens <= kGgufDirectTokens);  // gguf_direct_rows' result buffer
template <class Ops, GgmlType kType>
constexpr int gguf_direct_tokens() {
  if constexpr (Ops::kRegsPerLine == 1) return kGgufDirectTokens;
  return gguf_is_kquant(kType) ? kKquantAvx2Tokens : kBlock32Avx2Tokens;
}

// Rows [n0, n1) of an in-place type (gguf_in_place) dotted from their bytes: four rows
// a quarter of the range apart at a time, so four memory streams are in flight (1-token
// S1 Q4_K: 7.5 -> 16 GB/s), each group of four dotted with the pairs in blocks of
// gguf_direct_tokens (one extraction of the rows per block, no decoded copy). Compiled per
// type (in_direct_type), so each group's kernel call is a direct one.
template <class Ops, GgmlType kType>
void gguf_direct_rows_of(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
                         const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  const int64_t stride = (n1 - n0 + 3) / 4;
  // The kernels prefetch kGgufPrefetchBytes ahead; the first bytes of each stream are
  // requested here, all at once, instead of one stream after the other.
  for (int i = 0; i < 4; ++i) {
    const uint8_t* first = m.row(expert, std::min(n0 + i * stride, n1 - 1));
    for (int line = 0; line < kGgufPrefetchBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + line), _MM_HINT_T0);
  }
  constexpr int tokens = gguf_direct_tokens<Ops, kType>();
  // AVX2, more than one pass: the group's levels kept by its first pass.
  struct alignas(64) Line {
    uint8_t bytes[64];
  };
  thread_local std::vector<Line> kept;
  bool keep = false;
  if constexpr (Ops::kRegsPerLine != 1) {
    // K-quants from 3 passes on (with 2, keeping took 1.02-1.06x the time at 64 tokens).
    const int64_t bytes = gguf_kept_bytes(kType, m.kp);
    keep = bytes > 0 && p1 - p0 > (tokens == kKquantAvx2Tokens ? 2 * tokens : tokens);
    if (keep) kept.resize(static_cast<size_t>((bytes + sizeof(Line) - 1) / sizeof(Line)));
  }
  uint8_t* kept_at = reinterpret_cast<uint8_t*>(kept.data());
  for (int64_t j = 0; j < stride; ++j) {
    int64_t n[4];
    const uint8_t* rows[4];
    for (int i = 0; i < 4; ++i) {
      n[i] = std::min(n0 + j + i * stride, n1 - 1);  // past the end: repeat the last row
      rows[i] = m.row(expert, n[i]);
    }
    for (int64_t p = p0; p < p1; p += tokens) {
      float result[4 * kGgufDirectTokens];
      const int64_t count = std::min<int64_t>(tokens, p1 - p);
      const bool prefetch = p == p0;  // later blocks find the rows in the cache
      if constexpr (Ops::kRegsPerLine == 1) {  // AVX-512
        static_assert(kGgufDirectTokens == 4);
        switch (count) {
          case 4: gguf_direct_block<Ops, kType, 4>(m, rows, acts, act_rows, p, prefetch, result); break;
          case 3: gguf_direct_block<Ops, kType, 3>(m, rows, acts, act_rows, p, prefetch, result); break;
          case 2: gguf_direct_block<Ops, kType, 2>(m, rows, acts, act_rows, p, prefetch, result); break;
          default: gguf_direct_block<Ops, kType, 1>(m, rows, acts, act_rows, p, prefetch, result); break;
        }
      } else {  // AVX2: passes of 4 (the K-quants only), 2 and 1 activation rows
        static_assert(kKquantAvx2Tokens == 4 && kBlock32Avx2Tokens == 2);
        for (int64_t done = 0; done < count;) {
          const int64_t left = count - done;
          float* r = result + 4 * done;
          const bool first = prefetch && done == 0;
          // More than one pass: the first keeps the levels, the others read them.
          const KeptLevels levels = !keep ? KeptLevels::kExtract
                                       : p == p0 && done == 0 ? KeptLevels::kKeep
                                                              : KeptLevels::kLoad;
          if (tokens >= 4 && left >= 4) {
            if constexpr (tokens >= 4)
              gguf_direct_block<Ops, kType, 4>(m, rows, acts, act_rows, p + done, first, r, levels, kept_at);
            done += 4;
          } else if (left >= 2) {
            gguf_direct_block<Ops, kType, 2>(m, rows, acts, act_rows, p + done, first, r, levels, kept_at);
            done += 2;
          } else {
            gguf_direct_block<Ops, kType, 1>(m, rows, acts, act_rows, p + done, first, r, levels, kept_at);
            done += 1;
          }
        }
      }
      for (int64_t t = 0; t < count; ++t)
        for (int i = 0; i < 4; ++i) out[(p + t) * ldo + n[i]] = result[4 * t + i];
    }
  }
}

// gguf_direct_rows_of for m's type.
template <class Ops>
void gguf_direct_rows(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
                      const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  in_direct_type(m.type, [&](auto type) {
    gguf_direct_rows_of<Ops, decltype(type)::value>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
  });
}

// out[p * ldo + n] = dot(row n of `expert`, activation row act_row(p)) for rows [n0, n1)
// and pairs [p0, p1); act_rows == nullptr means activation row p.
template <class Ops>
void gguf_rows(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, const GgufActs& acts,
               const int32_t* act_rows, int64_t p0, int64_t p1, float* out, int64_t ldo) {
  using V = typename Ops::Vec;
  if constexpr (Ops::kRegsPerLine == 1) {  // AVX-512: experts with many tokens repack their
    if (m.direct && p1 - p0 >= kKquantTileMinPairs) {  // rows (same bits as the in-place kernels)
      if (m.type == GgmlType::kQ4_K)
        return kquant_tile_rows<Ops, KquantTile::kQ4k>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
      if (m.type == GgmlType::kQ5_K)
        return kquant_tile_rows<Ops, KquantTile::kQ5k>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
      if (m.type == GgmlType::kQ6_K)
        return kquant_tile_rows<Ops, KquantTile::kQ6k>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
      if (m.type == GgmlType::kQ2_K)
        return kquant_tile_rows<Ops, KquantTile::kQ2k>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
      if (m.type == GgmlType::kQ3_K)
        return kquant_tile_rows<Ops, KquantTile::kQ3k>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
      switch (m.type) {  // the block-32 types (gguf_block32_tile_avx512.h)
        case GgmlType::kQ8_0: return block32_tile_rows<Ops, GgmlType::kQ8_0>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
        case GgmlType::kQ4_0: return block32_tile_rows<Ops, GgmlType::kQ4_0>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
        case GgmlType::kQ4_1: return block32_tile_rows<Ops, GgmlType::kQ4_1>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
        case GgmlType::kQ5_0: return block32_tile_rows<Ops, GgmlType::kQ5_0>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
        case GgmlType::kQ5_1: return block32_tile_rows<Ops, GgmlType::kQ5_1>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
        case GgmlType::kMxfp4: return block32_tile_rows<Ops, GgmlType::kMxfp4>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
        default: break;
      }
    }
  }
  if (m.direct) return gguf_direct_rows<Ops>(m, expert, n0, n1, acts, act_rows, p0, p1, out, ldo);
  const int64_t units = m.kp / kGgufSuper;
  thread_local std::vector<GgufDecoded> decoded_units;
  thread_local std::vector<float> decoded_floats;
  void* decoded;
  if (m.is_float) {
    decoded_floats.resize(kGgufRows * m.kp);
    decoded = decoded_floats.data();
  } else {
    decoded_units.resize(kGgufRows * units);
    decoded = decoded_units.data();
  }
  // Groups of kGgufRows rows a quarter of the range apart: four memory streams.
  const int64_t stride = (n1 - n0 + kGgufRows - 1) / kGgufRows;
  for (int64_t j = 0; j < stride; ++j) {
    int64_t n[kGgufRows];
    int nr = 0;
    for (int i = 0; i < kGgufRows; ++i)
      if (n0 + j + i * stride < n1) n[nr++] = n0 + j + i * stride;
    for (int i = 0; i < nr; ++i) {
      const uint8_t* row = m.row(expert, n[i]);
      if (m.is_float)
        gguf_float_row<V>(m.type, row, m.k, m.kp, decoded_floats.data() + i * m.kp);
      else
        m.decode(row, m.k, decoded_units.data() + i * units);
    }
    float result[kGgufRows];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t a = act_rows != nullptr ? act_rows[p] : p;
      switch (nr) {
        case 4: gguf_dot_group<Ops, 4>(m, decoded, acts, a, result); break;
        case 3: gguf_dot_group<Ops, 3>(m, decoded, acts, a, result); break;
        case 2: gguf_dot_group<Ops, 2>(m, decoded, acts, a, result); break;
        default: gguf_dot_group<Ops, 1>(m, decoded, acts, a, result); break;
      }
      for (int i = 0; i < nr; ++i) out[p * ldo + n[i]] = result[i];
    }
  }
}

// Rows [n0, n1) of `expert` as bf16 [round_up(n1 - n0, 16)][kp], rows past n1 zero (Tile::gemm's A).
template <class Tile, class V>
void gguf_rows_bf16(const GgufMatrix& m, int64_t expert, int64_t n0, int64_t n1, uint16_t* out) {
  thread_local std::vector<GgufDecoded> decoded;
  thread_local std::vector<float> floats;
  const int64_t units = m.kp / kGgufSuper, rows = n1 - n0, stride = (rows + 3) / 4;
  // Four rows a quarter of the range apart at a time: four memory streams.
  for (int64_t r = 0; r < 4 * stride; ++r) {
    const int64_t n = n0 + r / 4 + (r % 4) * stride;
    if (n >= n1) continue;
    uint16_t* row = out + (n - n0) * m.kp;
    if (Tile::row_to_bf16(m.type, m.row(expert, n), m.k, m.kp, row)) continue;
    if (m.is_float) {
      floats.resize(m.kp);
      gguf_float_row<V>(m.type, m.row(expert, n), m.k, m.kp, floats.data());
      Tile::floats_to_bf16(floats.data(), m.kp, row);
    } else {
      decoded.resize(units);
      m.decode(m.row(expert, n), m.k, decoded.data());
      for (int64_t u = 0; u < units; ++u)
        Tile::unit_to_bf16(decoded[u], m.type == GgmlType::kQ8_0, row + u * kGgufSuper);
    }
  }
  std::fill(out + (n1 - n0) * m.kp, out + round_up(n1 - n0, 16) * m.kp, uint16_t{0});
}

// Rows [n0, n1) of one matrix for the tile path, written to out[p * ldo + n].
struct GgufTileRows {
  const GgufMatrix* m;
  int64_t n0, n1;
  float* out;
};

// The tile path of one job: each range's rows decoded to bf16, then multiplied with the
// expert's `pairs` B chunks `b`. (Prefetching the next range during a multiply measured
// no gain: S1 512 tokens Q4_K 75-78 ms either way.)
template <class Tile, class V>
void gguf_tile_rows(std::initializer_list<GgufTileRows> ranges, int64_t expert, const uint16_t* b, int64_t pairs,
                    int64_t ldo) {
  thread_local std::vector<uint16_t> w;
  for (const GgufTileRows& r : ranges) {
    w.resize(kGgufJobRows * r.m->kp);
    gguf_rows_bf16<Tile, V>(*r.m, expert, r.n0, r.n1, w.data());
    Tile::gemm(w.data(), r.n1 - r.n0, r.m->kp, b, pairs, r.out + r.n0, ldo);
  }
}

}  // namespace
}  // namespace kt::cpu
