// Which vector sum reproduces AMX tdpbf16ps bit for bit? (docs/formats.md, "Batch invariance")
// Needs a CPU with AMX-BF16 and AVX512_BF16 (Linux >= 5.16 for the tile permission):
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16 scripts/amx_bf16_order_probe.cpp -o /tmp/probe && /tmp/probe
// Compares 16-row and 1-row tile products (K = 512) with vdpbf16ps, pair-swapped
// vdpbf16ps, fp32 FMAs in both pair orders, exact pairs rounded once, and a double sum.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

struct alignas(64) Cfg { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static float fl(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; memcpy(&f, &u, 4); return f; }

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX permission"); return 1; }
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int K = 512;  // k values (256 pairs) in 16 tile steps of 32
  alignas(64) uint16_t A[16][K];          // 16 rows
  alignas(64) uint16_t B[K / 2][32];      // VNNI: pair row p holds (k=2p, k=2p+1) for 16 columns
  alignas(64) float C[16][16], C1[16];
  long match[8] = {0}, total = 0;
  for (int trial = 0; trial < 200; ++trial) {
    float scale = trial % 2 ? 1.0f : 1e-3f;
    for (auto& row : A) for (auto& v : row) v = bf(nd(rng));
    for (auto& row : B) for (auto& v : row) v = bf(nd(rng) * scale);
    Cfg cfg{}; cfg.palette = 1;
    cfg.rows[0] = 16; cfg.colsb[0] = 64;  // C
    cfg.rows[1] = 16; cfg.colsb[1] = 64;  // A
    cfg.rows[2] = 16; cfg.colsb[2] = 64;  // B
    cfg.rows[3] = 1; cfg.colsb[3] = 64;   // C, one row
    cfg.rows[4] = 1; cfg.colsb[4] = 64;   // A, one row
    _tile_loadconfig(&cfg);
    _tile_zero(0); _tile_zero(3);
    for (int s = 0; s < K / 32; ++s) {
      _tile_loadd(1, &A[0][s * 32], K * 2);
      _tile_loadd(2, &B[s * 16][0], 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(4, &A[0][s * 32], K * 2);
      _tile_dpbf16ps(3, 4, 2);
    }
    _tile_stored(0, C, 64);
    _tile_stored(3, C1, 64);
    _tile_release();
    for (int m = 0; m < 16; ++m) {
      // vdpbf16ps in k order: broadcast the pair of row m, dot with B's pair row
      __m512 acc = _mm512_setzero_ps(), accsw = _mm512_setzero_ps();
      for (int p = 0; p < K / 2; ++p) {
        uint32_t pair; memcpy(&pair, &A[m][2 * p], 4);
        __m512i b = _mm512_load_si512(&B[p][0]);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)b);
        __m512i bs = _mm512_rol_epi32(b, 16);
        accsw = _mm512_dpbf16_ps(accsw, (__m512bh)_mm512_set1_epi32((pair << 16) | (pair >> 16)), (__m512bh)bs);
      }
      float v[16], vs[16]; _mm512_storeu_ps(v, acc); _mm512_storeu_ps(vs, accsw);
      for (int n = 0; n < 16; ++n) {
        float e0 = 0, o0 = 0; double dp = 0; float pr = 0;
        for (int p = 0; p < K / 2; ++p) {
          float a0 = fl(A[m][2 * p]), a1 = fl(A[m][2 * p + 1]), b0 = fl(B[p][2 * n]), b1 = fl(B[p][2 * n + 1]);
          e0 = __builtin_fmaf(a1, b1, __builtin_fmaf(a0, b0, e0));  // even then odd, fused
          o0 = __builtin_fmaf(a0, b0, __builtin_fmaf(a1, b1, o0));  // odd then even
          pr = float(double(pr) + (double(a0) * b0 + double(a1) * b1));  // pair exact, one rounding
          dp += double(a0) * b0 + double(a1) * b1;
        }
        float c = C[m][n];
        uint32_t cu, x;
        memcpy(&cu, &c, 4);
        auto same = [&](float y) { memcpy(&x, &y, 4); return x == cu; };
        match[0] += same(v[n]); match[1] += same(vs[n]); match[2] += same(e0); match[3] += same(o0);
        match[4] += same(pr); match[5] += same(float(dp));
        if (m == 0) match[6] += same(C1[n]);
        ++total;
      }
    }
  }
  printf("outputs %ld (K=%d): tile==vdpbf16ps %ld, ==vdpbf16ps pair-swapped %ld, ==fma even,odd %ld, "
         "==fma odd,even %ld, ==pair exact+round %ld, ==double sum %ld; 1-row tile==16-row tile row 0: %ld of %ld\n",
         total, K, match[0], match[1], match[2], match[3], match[4], match[5], match[6], total / 16);
  return 0;
}
