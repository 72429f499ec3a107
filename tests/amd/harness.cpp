// The MFMA path's emulator: the kernel's own fragment code (cpindex/kernels/mfma.h, score_tiles
// and prepare_operands, the functions score.hip runs) for one wave of 64 lanes, on the host,
// through host models of what a wave does that C++ cannot: the matrix instructions and the
// cross-lane reads. Built by tests/test_amd_emulation.py (g++ -O2 -shared) and called through
// ctypes; tests/test_mfma_model.py checks the models' layouts against AMD's tables.
//
// The models, from the CDNA3 and CDNA4 ISA guides (matrix arithmetic instructions):
// - v_mfma_f32_16x16x32_fp8_fp8 and v_mfma_f32_16x16x16_bf16: D = A x B + C on 16 x 16 tiles,
//   A[m][k] in lane 16 (k / kK) + m, item k % kK; B[k][n] in lane 16 (k / kK) + n, item k % kK;
//   D[m][n] in lane 16 (m / 4) + n, item m % 4 (kK = 8 bytes for fp8, 4 bf16 elements). The fp8
//   operands are FNUZ e4m3 on CDNA3 (bias 8, 0x80 = NaN) and OCP e4m3 on CDNA4 (bias 7, 0x7f and
//   0xff = NaN). Products are exact in fp32; the sum over K is formed in double here (the
//   hardware's order is unspecified, so the test allows fp32 summation error).
// - ds_bpermute_b32 (HIP's __shfl and __shfl_xor): lane l reads lane (addr_l / 4) % 64.
#include <math.h>
#include <string.h>

#include "mfma.h"

namespace {
using namespace cpindex;
using namespace cpindex::mfma;

float e4m3(uint8_t b, bool fnuz) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (fnuz ? b == 0x80 : (b & 0x7f) == 0x7f) return NAN;
  const int bias = fnuz ? 8 : 7;
  const float mag = e == 0 ? ldexpf((float)m / 8.f, 1 - bias) : ldexpf(1.f + (float)m / 8.f, e - bias);
  return s ? -mag : mag;
}

float bf16(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Element `item` of a lane's 64-bit operand.
float elem(uint64_t v, int item, bool fp8, bool fnuz) {
  if (fp8) return e4m3((uint8_t)(v >> (8 * item)), fnuz);
  return bf16((uint16_t)(v >> (16 * item)));
}

}  // namespace

// The layouts the models use: operand 0 = A (row m, k), 1 = B (k, col n), 2 = D (row m, col n)
// of lane `lane`, item `item`; kk = items a lane holds of A and B (8 fp8, 4 bf16).
extern "C" void cp_mfma_layout(int kk, int operand, int lane, int item, int* i, int* j) {
  if (operand == 0) *i = lane % 16, *j = kk * (lane / 16) + item;
  else if (operand == 1) *i = kk * (lane / 16) + item, *j = lane % 16;
  else *i = 4 * (lane / 16) + item, *j = lane % 16;
}

namespace {

template <bool kFnuz>
struct HostWave {
  static constexpr int kN = 64;
  int lane(int k) const { return k; }
  template <int F>
  void load_key(const uint8_t* p, uint32_t (&w)[Frag<F>::kWords]) { memcpy(w, p, sizeof w); }
  uint32_t load2(const uint8_t* p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
  template <int kWords>
  void load_query(const uint8_t* p, uint32_t (&w)[kWords]) { memcpy(w, p, sizeof w); }
  template <bool kFp8>
  void mma(const uint64_t (&a)[64], const uint64_t (&b)[64], float (&d)[64][4]) {
    const int kk = kFp8 ? 8 : 4, K = 4 * kk;  // 4 lane groups of kk
    float A[16][32], B[32][16];
    for (int lane = 0; lane < 64; ++lane)
      for (int item = 0; item < kk; ++item) {
        int i, j;
        cp_mfma_layout(kk, 0, lane, item, &i, &j);
        A[i][j] = elem(a[lane], item, kFp8, kFnuz);
        cp_mfma_layout(kk, 1, lane, item, &i, &j);
        B[i][j] = elem(b[lane], item, kFp8, kFnuz);
      }
    float D[16][16];
    for (int lane = 0; lane < 64; ++lane)
      for (int item = 0; item < 4; ++item) {
        int i, j;
        cp_mfma_layout(kk, 2, lane, item, &i, &j);
        D[i][j] = d[lane][item];
      }
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        double s = D[m][n];
        for (int k = 0; k < K; ++k) s += (double)A[m][k] * (double)B[k][n];
        D[m][n] = (float)s;
      }
    for (int lane = 0; lane < 64; ++lane)
      for (int item = 0; item < 4; ++item) {
        int i, j;
        cp_mfma_layout(kk, 2, lane, item, &i, &j);
        d[lane][item] = D[i][j];
      }
  }
  static void bpermute(const float (&x)[64], const int (&addr)[64], float (&y)[64]) {
    for (int l = 0; l < 64; ++l) y[l] = x[(addr[l] >> 2) & 63];
  }
  void shfl_xor(const float (&x)[64], int mask, float (&y)[64]) {
    int addr[64];
    for (int l = 0; l < 64; ++l) addr[l] = (l ^ mask) << 2;
    bpermute(x, addr, y);
  }
  void shfl(const float (&x)[64], const int (&src)[64], float (&y)[64]) {
    int addr[64];
    for (int l = 0; l < 64; ++l) addr[l] = src[l] << 2;
    bpermute(x, addr, y);
  }
};

struct Args {
  const uint8_t* page;  // the page's token 0
  int64_t token_stride;
  const uint8_t* scales;  // nvfp4: token 0's scale bytes
  int64_t scale_stride;
  const uint8_t* lut8;  // 2048 bytes: e4m3 of the 8 magnitudes per scale byte
  const uint8_t* q;     // query vector v at q + v * q_stride (bytes)
  int64_t q_stride;
  int count, heads, query_len, v0;
  int limit, full, t_first, tiles;
  float scale;
};

template <int F, bool kFnuz, int NT, int kMTiles>
void run(const Args& a, float* out) {
  HostWave<kFnuz> w;
  static uint64_t qb[64][kNTiles<NT>][kMaxSteps];
  static int cut[64][kNTiles<NT>];
  static float val[64][NT][2];
  auto row = [&](int v) -> const uint8_t* { return v < a.count ? a.q + v * a.q_stride : nullptr; };
  prepare_operands<F, kFnuz, NT>(w, a.v0, row, qb);
  pass_cuts<NT>(w, a.v0, a.query_len, [&](int v) { return v / a.heads; }, cut);
  score_tiles<F, kFnuz, NT, kMTiles>(w, a.page, a.token_stride, a.scales, a.scale_stride,
                                     reinterpret_cast<const uint32_t*>(a.lut8), qb,
                                     a.t_first * 32, a.limit, a.full != 0, cut, a.scale, val);
  // What the kernel keeps (score.hip, keep): lanes 0-3 (g = 0) write pass vector
  // 8u + 2c + e from val[u][e]; every other lane must hold the same values.
  for (int lane = 0; lane < 64; ++lane)
    for (int u = 0; u < NT; ++u)
      for (int e = 0; e < 2; ++e) {
        const int n = pass_vector(u, e, lane & 3);
        if (lane < 4) out[n] = val[lane][u][e];
        else if (memcmp(&out[n], &val[lane][u][e], 4) != 0) out[n] = NAN;
      }
}

template <int F, bool kFnuz, int NT>
int run_tiles(const Args& a, float* out) {
  if (a.tiles == 4) return run<F, kFnuz, NT, 8>(a, out), 0;  // a whole page (32-token tiles)
  if (a.tiles == 1) return run<F, kFnuz, NT, 2>(a, out), 0;  // a split page's part
  return -1;
}

template <int F, bool kFnuz>
int run_nt(int nt, const Args& a, float* out) {
  switch (nt) {
    case 1: return run_tiles<F, kFnuz, 1>(a, out);
    case 2: return run_tiles<F, kFnuz, 2>(a, out);
    case 4: return run_tiles<F, kFnuz, 4>(a, out);
    default: return -1;
  }
}

template <int F>
int run_arch(int fnuz, int nt, const Args& a, float* out) {
  return fnuz ? run_nt<F, true>(nt, a, out) : run_nt<F, false>(nt, a, out);
}

}  // namespace

// One wave's pass over a page (or a split page's part): the maxima of the pass's 8 * nt vectors
// v0 .. v0 + 8 nt - 1 (out), as the kernel's lanes 0-3 store them. Returns 0, or -1 for an
// unknown format, nt or tile count.
extern "C" int cp_emulate_page(int fmt, int fnuz, int nt, const uint8_t* page, int64_t token_stride,
                               const uint8_t* scales, int64_t scale_stride, const uint8_t* lut8,
                               const uint8_t* q, int64_t q_stride, int count, int heads,
                               int query_len, int v0, int limit, int full, int t_first, int tiles,
                               float scale, float* out) {
  const Args a{page, token_stride, scales, scale_stride, lut8, q, q_stride, count, heads,
               query_len, v0, limit, full, t_first, tiles, scale};
  switch (fmt) {
    case kBF16: return run_arch<kBF16>(fnuz, nt, a, out);
    case kFP8: return run_arch<kFP8>(fnuz, nt, a, out);
    case kNVFP4: return run_arch<kNVFP4>(fnuz, nt, a, out);
    case kNVFP4Narrow: return run_arch<kNVFP4Narrow>(fnuz, nt, a, out);
    default: return -1;
  }
}

// The fp8 operand fix-up gfx942 runs (mfma.h), for the exhaustive byte test.
extern "C" uint32_t cp_fnuz_from_fn(uint32_t w) { return fnuz_from_fn(w); }
// The host model's e4m3 decoding (fnuz: CDNA3's operands).
extern "C" float cp_e4m3(uint32_t b, int fnuz) { return e4m3((uint8_t)b, fnuz != 0); }

// One MFMA of the model on a wave's registers: a, b [64] (8 fp8 bytes or 4 bf16 a lane), d
// [64][4] in place (D = A x B + D).
extern "C" void cp_mfma_model(int fp8, int fnuz, const uint64_t* a, const uint64_t* b, float* d) {
  uint64_t aa[64], bb[64];
  float dd[64][4];
  memcpy(aa, a, sizeof aa), memcpy(bb, b, sizeof bb), memcpy(dd, d, sizeof dd);
  if (!fp8) HostWave<false>().mma<false>(aa, bb, dd);
  else if (fnuz) HostWave<true>().mma<true>(aa, bb, dd);
  else HostWave<false>().mma<true>(aa, bb, dd);
  memcpy(d, dd, sizeof dd);
}
