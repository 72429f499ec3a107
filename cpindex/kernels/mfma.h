// mfma.h: the AMD matrix-core (MFMA) path's fragment arithmetic: which lane loads which key and
// query bytes, how they become MFMA operands, which lane and register holds which result, the
// causal masks and the maxima over tokens and lanes.
//
// Written once for the device and the host: score.hip runs it with a wave of one lane per thread
// (DeviceWave, page.h); tests/amd/harness.cpp runs the same functions for all 64 lanes of a wave
// at once through host models of the MFMA instructions and the cross-lane reads
// (tests/test_amd_emulation.py). So this header includes no HIP header: the device-only pieces
// (loads, the MFMA builtins, shuffles) are the wave's members.
//
// Instructions (CDNA3 gfx942 and CDNA4 gfx950, wave64, the same encodings and layouts on both):
//   fp8 and nvfp4: v_mfma_f32_16x16x32_fp8_fp8, A and B 8 bytes a lane, C/D 4 floats;
//   bf16:          v_mfma_f32_16x16x16_bf16 (LLVM's ..._16x16x16bf16_1k), 4 bf16 a lane.
// Layouts (ISA guides' matrix chapters; AMD's matrix instruction calculator), 16x16 tiles:
//   A[m][k]: lane 16 * (k / kK) + m, item k % kK   (kK = 8 fp8 bytes or 4 bf16 a lane)
//   B[k][n]: lane 16 * (k / kK) + n, item k % kK
//   D[m][n]: lane 16 * (m / 4) + n, item m % 4
// Keys are A (m = the tile's 16 tokens), queries B (n = 16 query vectors): a lane's 4 results
// are 4 tokens of one vector, so the max over a page's tokens is a max in registers and then
// over the 4 lanes n, n + 16, n + 32, n + 48.
// A dot product sums over K, so any order of the 128 dims works if keys and queries share it:
// lane group G = lane / 16 feeds dims 32G .. 32G + 31 of its token (and its vector) in K-steps
// of kK, from contiguous bytes it loads itself.
// The dense 16x16 shapes waste most of the tile at T = 1 (4 vectors of 16): MFMA time is a few
// percent of a page's HBM time even so, and one shape keeps one code path for every T. gfx950's
// 16x16x32 bf16 is twice as fast as the shared 16x16x16 bf16 but exists on gfx950 only; bf16
// is far from compute-bound here, so both archs take the common instruction.
//
// fp8 encodings: gfx950's fp8 MFMA takes OCP e4m3 (the model's e4m3fn), gfx942's takes FNUZ
// (bias 8, 0x80 = NaN). Every finite e4m3fn byte read as FNUZ is exactly half its e4m3fn value
// (normals: 2^(e-8) against 2^(e-7); subnormals: 2^-7 against 2^-6), except 0x80 (-0 in fn,
// NaN in FNUZ), which becomes 0x00 (fnuz_from_fn). So gfx942 scores fn bytes as FNUZ, gets
// q.k / 4 exactly (every product and partial sum is scaled by a power of two), and the page
// maximum is multiplied by 4 (exact) before sm_scale. No conversion of values, one AND-style
// fix-up per 4 bytes.
#pragma once
#include <stdint.h>

#include "launch.h"

#if defined(__HIP__) || defined(__CUDACC__)
#define CP_HOST_DEVICE __host__ __device__ inline __attribute__((always_inline))
#else
#define CP_HOST_DEVICE inline
#endif

namespace cpindex {
namespace mfma {

constexpr int kLanes = 64;
constexpr int kTileM = 16;  // tokens per MFMA (A rows, D rows)
constexpr int kTileN = 16;  // query vectors per MFMA (B columns, D columns)
constexpr int kMaxSteps = 8;  // K-steps of the formats' query operands (bf16's; fp8 uses 4)

// v_perm_b32 with selector bytes 0-7: byte i of the result is byte sel.byte[i] of {hi, lo}
// (lo = bytes 0-3). The host model covers only those selectors, the only ones used here.
CP_HOST_DEVICE uint32_t perm(uint32_t hi, uint32_t lo, uint32_t sel) {
#if defined(__HIP_DEVICE_COMPILE__)
  return __builtin_amdgcn_perm(hi, lo, sel);
#else
  const uint64_t x = (uint64_t)hi << 32 | lo;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((x >> (8 * ((sel >> (8 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
#endif
}

// Four e4m3fn bytes as the FNUZ bytes of half their values: bytes whose low 7 bits are 0
// (+0 and -0) become +0. Per byte, bit 7 of nz: its low 7 bits m are not all zero (the add
// cannot carry into the next byte); w & nz keeps that sign bit, and its low bits, m & (m + 0x7f),
// lie within m, so OR-ing m back restores them (one v_and_or_b32).
CP_HOST_DEVICE uint32_t fnuz_from_fn(uint32_t w) {
  const uint32_t m = w & 0x7f7f7f7fu, nz = m + 0x7f7f7f7fu;
#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx942__)
  // The compiler would fold it back to w & (nz | 0x7f7f7f7f): an OR and an AND.
  uint32_t r;
  asm("v_and_or_b32 %0, %1, %2, %3" : "=v"(r) : "v"(w), "v"(nz), "v"(m));
  return r;
#else
  return (w & nz) | m;
#endif
}

// Per format: K-steps per 128 dims, the raw words a lane loads per token, where they are.
template <int F>
struct Frag;

template <>
struct Frag<kFP8> {
  static constexpr int kSteps = 4;  // 16x16x32: 8 bytes a lane a step
  static constexpr int kWords = 8;  // the lane's 32 bytes: dims 32G .. 32G + 31
  static constexpr int kLoads = 2;  // 16-byte loads
  static constexpr bool kFp8 = true;
  // M-tiles loaded before their math: 8 KiB a wave in flight (32 words a lane), far above what
  // an HBM channel's latency needs at 3 or more waves a SIMD, which these register counts allow
  // (the batch of a whole page took some 200 registers, so 2 waves).
  static constexpr int kBatch = 4;
  CP_HOST_DEVICE static int key_byte(int G) { return 32 * G; }
};

template <>
struct Frag<kBF16> {
  static constexpr int kSteps = 8;   // 16x16x16: 4 bf16 a lane a step
  static constexpr int kWords = 16;  // the lane's 64 bytes: dims 32G .. 32G + 31
  static constexpr int kLoads = 4;
  static constexpr bool kFp8 = false;
  static constexpr int kBatch = 2;  // 8 KiB a wave, as fp8
  CP_HOST_DEVICE static int key_byte(int G) { return 64 * G; }
};

// nvfp4: the lane's 16 code bytes (dims 32G .. 32G + 31, word s = dims 32G + 8s .. + 7, element
// j in nibble j) and scale bytes 2G, 2G + 1 (words 0-1 and 2-3). Each word becomes the e4m3
// bytes of its 8 values, even elements then odd (nvfp4_operand): the queries are paired alike.
template <>
struct Frag<kNVFP4> {
  static constexpr int kSteps = 4;
  static constexpr int kWords = 4;
  static constexpr int kLoads = 1;
  static constexpr bool kFp8 = true;
  static constexpr int kBatch = 4;  // 4.5 KiB a wave with the scales
  CP_HOST_DEVICE static int key_byte(int G) { return 16 * G; }
  CP_HOST_DEVICE static int scale_byte(int G) { return 2 * G; }
};
template <>
struct Frag<kNVFP4Narrow> : Frag<kNVFP4> {};

template <int F>
constexpr bool kFp4 = F == kNVFP4 || F == kNVFP4Narrow;

// Query bytes per lane: fp8 queries (fp8 and nvfp4 caches) as fp8 keys, bf16 as bf16 keys.
template <int F>
using QFrag = Frag<F == kBF16 ? kBF16 : kFP8>;

// Eight e2m1 codes (element j in nibble j) of one scale as e4m3 bytes: elements 0, 2, 4, 6 in
// the low word, 1, 3, 5, 7 in the high one. tab_lo, tab_hi: the e4m3 bytes of the 8 magnitudes
// times the scale (the CTA's table, cpindex.kernels.launcher.nvfp4_lut); a code's sign bit is
// XORed into its byte's (a negative scale's entries carry their own sign).
CP_HOST_DEVICE uint64_t nvfp4_operand(uint32_t w, uint32_t tab_lo, uint32_t tab_hi) {
  const uint32_t even = perm(tab_hi, tab_lo, w & 0x07070707u) ^ ((w << 4) & 0x80808080u);
  const uint32_t odd = perm(tab_hi, tab_lo, (w >> 4) & 0x07070707u) ^ (w & 0x80808080u);
  return (uint64_t)odd << 32 | even;
}

// The A operand of K-step s from a lane's raw words of one token (nvfp4: its scale bytes, lut8
// the table: entry b at words 2b, 2b + 1).
template <int F, bool kFnuz>
CP_HOST_DEVICE uint64_t key_operand(const uint32_t (&raw)[Frag<F>::kWords], uint32_t scales,
                                    const uint32_t* lut8, int s) {
  uint32_t lo, hi;
  if constexpr (kFp4<F>) {
    const uint32_t sc = s < 2 ? scales & 0xffu : (scales >> 8) & 0xffu;
    const uint64_t v = nvfp4_operand(raw[s], lut8[2 * sc], lut8[2 * sc + 1]);
    lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
  } else {
    lo = raw[2 * s], hi = raw[2 * s + 1];
  }
  if constexpr (Frag<F>::kFp8 && kFnuz) lo = fnuz_from_fn(lo), hi = fnuz_from_fn(hi);
  return (uint64_t)hi << 32 | lo;
}

// The B operand of K-step s from a lane's query words (QFrag<F>: the same dims as its keys),
// in the keys' order (nvfp4: even bytes, then odd).
template <int F, bool kFnuz>
CP_HOST_DEVICE uint64_t query_operand(const uint32_t (&raw)[QFrag<F>::kWords], int s) {
  uint32_t lo = raw[2 * s], hi = raw[2 * s + 1];
  if constexpr (kFp4<F>) {
    const uint32_t even = perm(hi, lo, 0x06040200u), odd = perm(hi, lo, 0x07050301u);
    lo = even, hi = odd;
  }
  if constexpr (Frag<F>::kFp8 && kFnuz) lo = fnuz_from_fn(lo), hi = fnuz_from_fn(hi);
  return (uint64_t)hi << 32 | lo;
}

// N-tiles of a pass of 8 * NT vectors (the kernel's passes; NT = 1 uses half a tile).
template <int NT>
constexpr int kNTiles = (8 * NT + kTileN - 1) / kTileN;

// A pass vector n's results: N-tile n / 16, lanes n % 16 + 16 j. After the reduction every such
// lane holds the page's max; the kernel's layout wants vector 8u + 2c + e in lane 4g + c
// (val[u][e]), read from lane n % 16.
CP_HOST_DEVICE int pass_vector(int u, int e, int c) { return 8 * u + 2 * c + e; }

// Running max of one MFMA tile: D item i of lane l is token tok + 4 (l / 16) + i of vector
// (N-tile) column l % 16. kMasked: a token counts only before its row's causal length,
// limit - cut (cut = T - 1 - the vector's query token); without it (a page every row sees
// whole) all count, and the maxima pair up as 3-input maxes.
template <int NB, bool kMasked>
CP_HOST_DEVICE void keep_max(float (&m)[NB], const float (&d)[NB][4], int lane, int tok,
                             int limit, const int (&cut)[NB]) {
  for (int nb = 0; nb < NB; ++nb) {
    if constexpr (kMasked) {
      const int t0 = tok + 4 * (lane >> 4);
      for (int i = 0; i < 4; ++i)
        if (t0 + i < limit - cut[nb]) m[nb] = __builtin_fmaxf(m[nb], d[nb][i]);
    } else {
      m[nb] = __builtin_fmaxf(__builtin_fmaxf(m[nb], d[nb][0]), d[nb][1]);
      m[nb] = __builtin_fmaxf(__builtin_fmaxf(m[nb], d[nb][2]), d[nb][3]);
    }
  }
}

// The running maxima m over kMTiles MFMA tiles from token tok0 (score_tiles' arguments).
template <int F, bool kFnuz, int NT, int kMTiles, bool kMasked, class W>
CP_HOST_DEVICE void tile_maxima(W& w, const uint8_t* page, int64_t token_stride,
                                const uint8_t* scales, int64_t scale_stride, const uint32_t* lut8,
                                const uint64_t (&qb)[W::kN][kNTiles<NT>][kMaxSteps], int tok0,
                                int limit, const int (&cut)[W::kN][kNTiles<NT>],
                                float (&m)[W::kN][kNTiles<NT>]) {
  using Fr = Frag<F>;
  constexpr int NB = kNTiles<NT>;
  constexpr int kN = W::kN;
  constexpr int kBatch = Fr::kBatch < kMTiles ? Fr::kBatch : kMTiles;
  static_assert(kMTiles % kBatch == 0, "whole batches");
  // Each lane's first token's bytes: a tile's are a wave-uniform step on (scalar arithmetic),
  // not a 64-bit multiply per lane and load.
  const uint8_t* kp[kN];
  const uint8_t* sp[kN];
  for (int k = 0; k < kN; ++k) {
    const int lane = w.lane(k), tok = tok0 + (lane & 15), G = lane >> 4;
    kp[k] = page + tok * token_stride + Fr::key_byte(G);
    sp[k] = nullptr;
    if constexpr (kFp4<F>) sp[k] = scales + tok * scale_stride + Fr::scale_byte(G);
  }
#pragma unroll 1
  for (int t = 0; t < kMTiles; t += kBatch) {
    uint32_t raw[kN][kBatch][Fr::kWords];
    uint32_t sc[kN][kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t row = (t + b) * kTileM;
      for (int k = 0; k < kN; ++k) {
        w.template load_key<F>(kp[k] + row * token_stride, raw[k][b]);
        sc[k][b] = 0;
        if constexpr (kFp4<F>) sc[k][b] = w.load2(sp[k] + row * scale_stride);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      float d[kN][NB][4];
      for (int k = 0; k < kN; ++k)
        for (int nb = 0; nb < NB; ++nb) d[k][nb][0] = d[k][nb][1] = d[k][nb][2] = d[k][nb][3] = 0.f;
#pragma unroll
      for (int s = 0; s < Fr::kSteps; ++s) {
        uint64_t a[kN];
        for (int k = 0; k < kN; ++k) a[k] = key_operand<F, kFnuz>(raw[k][b], sc[k][b], lut8, s);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          uint64_t bq[kN];
          float dd[kN][4];
          for (int k = 0; k < kN; ++k) {
            bq[k] = qb[k][nb][s];
            for (int i = 0; i < 4; ++i) dd[k][i] = d[k][nb][i];
          }
          w.template mma<Fr::kFp8>(a, bq, dd);
          for (int k = 0; k < kN; ++k)
            for (int i = 0; i < 4; ++i) d[k][nb][i] = dd[k][i];
        }
      }
      for (int k = 0; k < kN; ++k)
        keep_max<NB, kMasked>(m[k], d[k], w.lane(k), tok0 + (t + b) * kTileM, limit, cut[k]);
    }
  }
}

// One wave's maxima over kMTiles MFMA tiles of a page from token tok0 (the whole page: 8 tiles;
// a split page's part: fewer), for the pass's NB N-tiles, scaled: val[u][e] = vector
// pass_vector(u, e, c) of lane 4g + c, as the kernel's other paths give it. qb: the pass's B
// operands (prepare_operands). W: the wave (DeviceWave on the GPU, the emulator's host wave):
// it runs kN lanes (1 on the GPU), and its loads, MFMA and cross-lane reads. Every per-lane
// value is an array over those kN lanes.
template <int F, bool kFnuz, int NT, int kMTiles, class W>
CP_HOST_DEVICE void score_tiles(W& w, const uint8_t* page, int64_t token_stride,
                                const uint8_t* scales, int64_t scale_stride, const uint32_t* lut8,
                                const uint64_t (&qb)[W::kN][kNTiles<NT>][kMaxSteps],
                                int tok0, int limit, bool full, const int (&cut)[W::kN][kNTiles<NT>],
                                float scale, float (&val)[W::kN][NT][2]) {
  using Fr = Frag<F>;
  constexpr int NB = kNTiles<NT>;
  constexpr int kN = W::kN;
  float m[kN][NB];
  for (int k = 0; k < kN; ++k)
    for (int nb = 0; nb < NB; ++nb) m[k][nb] = -__builtin_huge_valf();
  // full is the same in every lane (one page): only a request's last pages take the masks.
  if (full)
    tile_maxima<F, kFnuz, NT, kMTiles, false>(w, page, token_stride, scales, scale_stride, lut8,
                                              qb, tok0, limit, cut, m);
  else
    tile_maxima<F, kFnuz, NT, kMTiles, true>(w, page, token_stride, scales, scale_stride, lut8,
                                             qb, tok0, limit, cut, m);
  // The 4 lanes of a column (n, n + 16, n + 32, n + 48), then each lane's vectors from lane n.
  float col[NB][kN];
  for (int nb = 0; nb < NB; ++nb) {
    float x[kN], y[kN];
    for (int k = 0; k < kN; ++k) x[k] = m[k][nb];
    w.shfl_xor(x, 16, y);
    for (int k = 0; k < kN; ++k) x[k] = __builtin_fmaxf(x[k], y[k]);
    w.shfl_xor(x, 32, y);
    for (int k = 0; k < kN; ++k) col[nb][k] = __builtin_fmaxf(x[k], y[k]);
  }
  const float unit = kFnuz && Fr::kFp8 ? 4.f : 1.f;  // FNUZ operands score q.k / 4
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      int src[kN];
      for (int k = 0; k < kN; ++k) src[k] = pass_vector(u, e, w.lane(k) & 3) % kTileN;
      float y[kN];
      w.shfl(col[pass_vector(u, e, 0) / kTileN], src, y);
      for (int k = 0; k < kN; ++k) val[k][u][e] = y[k] * unit * scale;
    }
}

// The pass's B operands for vectors v0 .. v0 + 8 NT - 1: lane l holds vector v0 + 16 nb + l % 16
// (zeros for none: row(v) == nullptr), its dims 32G .. 32G + 31 from the vector's row bytes.
template <int F, bool kFnuz, int NT, class W, class Row>
CP_HOST_DEVICE void prepare_operands(W& w, int v0, Row row,
                                     uint64_t (&qb)[W::kN][kNTiles<NT>][kMaxSteps]) {
  using Q = QFrag<F>;
  for (int k = 0; k < W::kN; ++k) {
    const int lane = w.lane(k);
#pragma unroll
    for (int nb = 0; nb < kNTiles<NT>; ++nb) {
      const int n = kTileN * nb + (lane & 15);
      const uint8_t* src = n < 8 * NT ? row(v0 + n) : nullptr;
      uint32_t raw[Q::kWords];
      if (src != nullptr) {
        w.template load_query<Q::kWords>(src + Q::key_byte(lane >> 4), raw);
      } else {
        for (int i = 0; i < Q::kWords; ++i) raw[i] = 0u;
      }
#pragma unroll
      for (int s = 0; s < Frag<F>::kSteps; ++s) qb[k][nb][s] = query_operand<F, kFnuz>(raw, s);
    }
  }
}

// Causal cuts of a pass: the lane's vector of each N-tile belongs to query token t, whose causal
// length is the request's minus cut = T - 1 - t. tok_of(v) is vector v's query token.
template <int NT, class W, class TokOf>
CP_HOST_DEVICE void pass_cuts(const W& w, int v0, int query_len, TokOf tok_of,
                              int (&cut)[W::kN][kNTiles<NT>]) {
  for (int k = 0; k < W::kN; ++k)
    for (int nb = 0; nb < kNTiles<NT>; ++nb)
      cut[k][nb] = query_len - 1 - tok_of(v0 + kTileN * nb + (w.lane(k) & 15));
}

}  // namespace mfma
}  // namespace cpindex
