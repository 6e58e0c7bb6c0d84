#include "panel_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../isa/cpu_variant.h"

namespace kt::cpu {
namespace {

constexpr int kTileRows = 6;

// c[i, 0:width) += a[i, 0:n) panel for i < kRows: the sums in 2 ymm per row (named
// accumulators: GCC spills an array of them to the stack on every iteration).
template <int kRows>
__attribute__((target("avx2,fma"))) void tile(const float* a, int64_t lda, const float* panel, int64_t n,
                                              float* c, int64_t ldc, int64_t width) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m256 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  // Rows past kRows are never read: their pointers stay at row 0 rather than point past a.
  const float* a0 = a;
  const float* a1 = kRows > 1 ? a + lda : a;
  const float* a2 = kRows > 2 ? a + 2 * lda : a;
  const float* a3 = kRows > 3 ? a + 3 * lda : a;
  const float* a4 = kRows > 4 ? a + 4 * lda : a;
  const float* a5 = kRows > 5 ? a + 5 * lda : a;
  for (int64_t r = 0; r < n; ++r) {
    const __m256 b0 = _mm256_loadu_ps(panel + 16 * r), b1 = _mm256_loadu_ps(panel + 16 * r + 8);
    __m256 x;
#define KT_PANEL_ROW(i)                          \
  if constexpr (kRows > i) {                     \
    x = _mm256_broadcast_ss(a##i + r);           \
    c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0);   \
    c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);   \
  }
    KT_PANEL_ROW(0) KT_PANEL_ROW(1) KT_PANEL_ROW(2) KT_PANEL_ROW(3) KT_PANEL_ROW(4) KT_PANEL_ROW(5)
#undef KT_PANEL_ROW
  }
  const __m256 sums[kTileRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < kRows; ++i) {
    float* row = c + i * ldc;
    if (width == kPanelColumns) {
      _mm256_storeu_ps(row, _mm256_add_ps(_mm256_loadu_ps(row), sums[i][0]));
      _mm256_storeu_ps(row + 8, _mm256_add_ps(_mm256_loadu_ps(row + 8), sums[i][1]));
    } else {  // the last panel: only `width` columns of c exist
      alignas(32) float part[kPanelColumns];
      _mm256_store_ps(part, sums[i][0]);
      _mm256_store_ps(part + 8, sums[i][1]);
      for (int64_t j = 0; j < width; ++j) row[j] += part[j];
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// The same tile with one zmm per row (16 columns), 12 rows: the same FMA chain per element
// and the same final add, so the same bits as tile<> (each lane of an FMA is rounded alone),
// at twice the columns per instruction on the AVX-512 variants.
constexpr int kTileRows512 = 12;

template <int kRows>
__attribute__((target("avx512f"))) void tile512(const float* a, int64_t lda, const float* panel, int64_t n,
                                                float* c, int64_t ldc, int64_t width) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 c0 = zero, c1 = zero, c2 = zero, c3 = zero, c4 = zero, c5 = zero;
  __m512 c6 = zero, c7 = zero, c8 = zero, c9 = zero, c10 = zero, c11 = zero;
  const float* rows[kTileRows512];
  for (int i = 0; i < kTileRows512; ++i) rows[i] = a + (i < kRows ? i : 0) * lda;  // past kRows: never read
  const float *a0 = rows[0], *a1 = rows[1], *a2 = rows[2], *a3 = rows[3], *a4 = rows[4], *a5 = rows[5];
  const float *a6 = rows[6], *a7 = rows[7], *a8 = rows[8], *a9 = rows[9], *a10 = rows[10], *a11 = rows[11];
  for (int64_t r = 0; r < n; ++r) {
    const __m512 b = _mm512_loadu_ps(panel + 16 * r);
#define KT_PANEL512_ROW(i) \
  if constexpr (kRows > i) c##i = _mm512_fmadd_ps(_mm512_set1_ps(a##i[r]), b, c##i);
    KT_PANEL512_ROW(0) KT_PANEL512_ROW(1) KT_PANEL512_ROW(2) KT_PANEL512_ROW(3) KT_PANEL512_ROW(4)
    KT_PANEL512_ROW(5) KT_PANEL512_ROW(6) KT_PANEL512_ROW(7) KT_PANEL512_ROW(8) KT_PANEL512_ROW(9)
    KT_PANEL512_ROW(10) KT_PANEL512_ROW(11)
#undef KT_PANEL512_ROW
  }
  const __m512 sums[kTileRows512] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  const auto mask = static_cast<__mmask16>(width >= kPanelColumns ? 0xFFFF : (1u << width) - 1);
  for (int i = 0; i < kRows; ++i) {
    float* row = c + i * ldc;
    _mm512_mask_storeu_ps(row, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, row), sums[i]));
  }
}

constexpr TileFn kTiles512[kTileRows512 + 1] = {nullptr,      tile512<1>,  tile512<2>,  tile512<3>, tile512<4>,
                                                tile512<5>,   tile512<6>,  tile512<7>,  tile512<8>, tile512<9>,
                                                tile512<10>,  tile512<11>, tile512<12>};

}  // namespace

__attribute__((target("avx2,fma"))) void pack_panel_rows(const float* src, int64_t ld, int64_t count,
                                                          int64_t cols, float* panel, int64_t rows,
                                                          int64_t row_offset) {
  // Panel by panel, so the writes run in `count` x 64-byte stretches.
  const int64_t full = cols / kPanelColumns;
  for (int64_t j = 0; j < full; ++j) {
    float* out = panel + (j * rows + row_offset) * kPanelColumns;
    const float* in = src + j * kPanelColumns;
    for (int64_t r = 0; r < count; ++r, out += kPanelColumns, in += ld) {
      _mm256_storeu_ps(out, _mm256_loadu_ps(in));
      _mm256_storeu_ps(out + 8, _mm256_loadu_ps(in + 8));
    }
  }
  if (const int64_t rest = cols - full * kPanelColumns; rest > 0) {
    float* out = panel + (full * rows + row_offset) * kPanelColumns;
    for (int64_t r = 0; r < count; ++r, out += kPanelColumns) {
      std::memcpy(out, src + r * ld + full * kPanelColumns, rest * sizeof(float));
      std::memset(out + rest, 0, (kPanelColumns - rest) * sizeof(float));
    }
  }
}

void pack_panel_transposed(const float* src, int64_t ld, int64_t rows, int64_t cols, float* panel) {
  // 16 x 16 blocks: the block's 16 source rows are read in 64-byte stretches while its
  // panel rows are written whole.
  const int64_t panels = (cols + kPanelColumns - 1) / kPanelColumns;
  for (int64_t j = 0; j < panels; ++j) {
    const int64_t width = std::min(kPanelColumns, cols - j * kPanelColumns);
    float* out = panel + j * rows * kPanelColumns;
    for (int64_t r0 = 0; r0 < rows; r0 += kPanelColumns) {
      const int64_t height = std::min(kPanelColumns, rows - r0);
      for (int64_t c = 0; c < width; ++c) {
        const float* in = src + (j * kPanelColumns + c) * ld + r0;
        for (int64_t r = 0; r < height; ++r) out[(r0 + r) * kPanelColumns + c] = in[r];
      }
      for (int64_t r = 0; r < height; ++r)
        std::fill(out + (r0 + r) * kPanelColumns + width, out + (r0 + r + 1) * kPanelColumns, 0.0f);
    }
  }
}

void panel_gemm_add(const float* a, int64_t lda, int64_t m, const float* panel, int64_t n, int64_t k, float* c,
                    int64_t ldc) {
  const int64_t panels = (k + kPanelColumns - 1) / kPanelColumns;
  // The AVX-512 variants take the zmm tile (the same bits: see tile512).
  const bool wide = active_cpu_variant() >= CpuVariant::kAvx512;
  const int64_t tile_rows = wide ? kTileRows512 : kTileRows;
  const TileFn* tiles = wide ? kTiles512 : kTiles;
  // Panel-major: a panel (n x 64 bytes) stays in L1 while every tile of rows reads it.
  for (int64_t j = 0; j < panels; ++j) {
    const float* b = panel + j * n * kPanelColumns;
    const int64_t width = std::min(kPanelColumns, k - j * kPanelColumns);
    for (int64_t i = 0; i < m; i += tile_rows) {
      const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m - i));
      tiles[rows](a + i * lda, lda, b, n, c + i * ldc + j * kPanelColumns, ldc, width);
    }
  }
}

}  // namespace kt::cpu
