// keys.h: how each cache format's keys are laid out, loaded and decoded, and the
// queries paired the same way.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "config.h"
#if CP_MFMA
#include "mfma.h"
#endif

namespace cpindex {
namespace {

// Each lane c (= lane % 4) of a group owns 32 of a token's 128 dims, as 16 packed 16-bit pairs
// k[m] = (v[8q + elem(b, 0)], v[8q + elem(b, 1)]) with q = m / 4, b = m % 4, and
// v[8q + e] = dim (dim_base(c, q) + e). The query is paired the same way, so any pairing works.
template <int F>
struct Fmt;

// bf16 and fp8 keys go through the cp.async ring wherever there are tensor cores (kRing), and
// through registers on the portable path.
template <>
struct Fmt<kBF16> {
  static constexpr int kLoads = 4;  // 16-byte loads per token per lane
  static constexpr bool kRing = CP_USE_MMA;
  static constexpr int kTokenBytes = 256;
  static constexpr bool kBf16 = true;
  CP_DEVICE static int load_offset(int c, int l) { return 16 * (c + 4 * l); }
#if CP_USE_MMA  // ldmatrix gives lane c dims 2c, 2c+1 of every 8 (k-step s: pairs 2s, 2s+1)
  CP_DEVICE static int dim_base(int c, int q) { return 32 * q + 2 * c; }
  CP_DEVICE static int elem(int b, int half) { return 16 * (b >> 1) + 8 * (b & 1) + half; }
#else
  CP_DEVICE static int dim_base(int c, int q) { return 8 * (c + 4 * q); }
  CP_DEVICE static int elem(int b, int half) { return 2 * b + half; }
#endif
};

template <>
struct Fmt<kFP8> {
  static constexpr int kLoads = 2;
  static constexpr bool kRing = CP_USE_MMA;
  static constexpr int kTokenBytes = 128;
  static constexpr bool kBf16 = false;
  CP_DEVICE static int load_offset(int c, int l) { return 16 * (c + 4 * l); }
#if CP_USE_MMA  // ldmatrix gives lane c bytes 4c..4c+3 of every 16
  CP_DEVICE static int dim_base(int c, int q) { return 32 * q + 4 * c; }
  CP_DEVICE static int elem(int b, int half) { return 16 * (b >> 1) + 2 * (b & 1) + half; }
#else
  CP_DEVICE static int dim_base(int c, int q) { return 16 * (c + 4 * (q >> 1)) + 8 * (q & 1); }
  CP_DEVICE static int elem(int b, int half) { return 2 * b + half; }
#endif
};

// nvfp4: lane c reads its token's 16 value bytes 16c..16c+15 (dims 32c..32c+31: word q holds
// dims 32c+8q..+7) and the token's scale bytes 2c, 2c+1 (groups of words 0-1 and 2-3). Values
// become f16 pairs of e4m3_rn_satfinite(e2m1 * scale) through the per-scale byte table.
template <>
struct Fmt<kNVFP4> {
  static constexpr int kLoads = 1;
  static constexpr bool kRing = false;
  static constexpr int kTokenBytes = 64;  // value bytes of a token (its stride may be larger)
  static constexpr bool kBf16 = false;
  CP_DEVICE static int load_offset(int c, int) { return 16 * c; }
  CP_DEVICE static int dim_base(int c, int q) { return 32 * c + 8 * q; }
  CP_DEVICE static int elem(int b, int half) { return 2 * b + half; }
};

template <>
struct Fmt<kNVFP4Narrow> : Fmt<kNVFP4> {};

template <int F>
constexpr bool kFp4 = F == kNVFP4 || F == kNVFP4Narrow;

// The register path's shape: a group's 4 lanes read one token's bytes.
template <int F>
constexpr bool kRegisterShapeOk = Fmt<F>::kLoads * 16 * 4 == Fmt<F>::kTokenBytes;
static_assert(kRegisterShapeOk<kBF16> && kRegisterShapeOk<kFP8> && kRegisterShapeOk<kNVFP4>,
              "Fmt::kLoads does not fit a token");

template <int F>
struct TileRegs {
  uint4 raw[2][Fmt<F>::kLoads];
  uint32_t scales[2];  // nvfp4: this lane's two e4m3 group scales per token
};

template <int F>
CP_DEVICE void load_tile(const ScoreParams& p, TileRegs<F>& t, const uint8_t* page,
                         const uint8_t* scale_page, int tile, int g, int c) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int tok = tile * kTileTokens + g + s * kGroups;
    if constexpr (kFp4<F>) {
      const uint8_t* src = page + tok * p.kv_token_stride + 16 * c;
      if constexpr (F == kNVFP4) {
        t.raw[s][0] = cp_load_stream16(src);
      } else {  // vLLM's 72-byte tokens: 8-byte aligned
        const uint2 a = cp_load_stream8(src), b = cp_load_stream8(src + 8);
        t.raw[s][0] = make_uint4(a.x, a.y, b.x, b.y);
      }
      t.scales[s] = cp_load_stream2(scale_page + tok * p.ks_token_stride + 2 * c);
    } else {
      const uint8_t* row = page + tok * Fmt<F>::kTokenBytes;
#pragma unroll
      for (int l = 0; l < Fmt<F>::kLoads; ++l)
        t.raw[s][l] = cp_load_stream16(row + Fmt<F>::load_offset(c, l));
    }
  }
}

CP_DEVICE uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// nvfp4 words per token and lane (of 4) that go through the e4m3 table and the conversion unit,
// the rest through the f16 byte table and the integer pipe; conversions need sm_89+. Half and
// half keeps both pipes busy with one or two query tiles and with the warpgroup mma. The
// mma.sync instance of four tiles does four times the mma work per decoded word on the same
// warp; there the integer pipe alone is faster.
template <int NT, bool W>
constexpr int kNvfp4Cvt = CP_NATIVE_FP8 && (W || NT < 4) ? 2 : 0;

// Which nvfp4 tables a CTA holds in shared memory: the f16 bytes (every path but the MFMA one)
// and the e4m3 bytes (the MFMA path, and the words kNvfp4Cvt sends through the conversion unit).
template <int F>
constexpr bool kLut16 = kFp4<F> && !CP_MFMA;
template <int F, int NT, bool W>
constexpr bool kLut8 = kFp4<F> && (CP_MFMA || kNvfp4Cvt<NT, W> > 0);

// Token s of a loaded tile as 16 packed pairs (bf16x2 for bf16, f16x2 otherwise). For nvfp4,
// lut and lut8 are the CTA's tables: entry s of lut holds the f16 high and low bytes of the 8
// magnitudes of scale byte s, entry s of lut8 their e4m3 bytes
// (cpindex.kernels.launcher.nvfp4_lut). kCvt: nvfp4 words through lut8 (kNvfp4Cvt).
template <int F, int kCvt>
CP_DEVICE void unpack(const TileRegs<F>& t, int s, const uint4* lut, const uint2* lut8,
                       uint32_t (&k)[16]) {
  if constexpr (F == kBF16) {
#pragma unroll
    for (int l = 0; l < 4; ++l)
#pragma unroll
      for (int i = 0; i < 4; ++i) k[4 * l + i] = word(t.raw[s][l], i);
  } else if constexpr (F == kFP8) {
#pragma unroll
    for (int l = 0; l < 2; ++l)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t w = word(t.raw[s][l], i);
        cp_e4m3x4_to_f16x2x2(w, k[8 * l + 2 * i], k[8 * l + 2 * i + 1]);
      }
  } else {
    const uint32_t s0 = t.scales[s] & 0xffu, s1 = t.scales[s] >> 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t sc = i < 2 ? s0 : s1;  // words 0-1 share a scale, words 2-3 the other
      uint32_t pairs[4];
      if (i >= 4 - kCvt) {
#if CP_NATIVE_FP8
        cp_e2m1x8_lut_e4m3_f16x2x4(word(t.raw[s][0], i), lut8[sc], pairs);
#endif
      } else {
        const uint4 e = lut[sc];
        cp_e2m1x8_lut_f16x2x4(word(t.raw[s][0], i), make_uint2(e.x, e.y), make_uint2(e.z, e.w),
                              pairs);
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) k[4 * i + b] = pairs[b];
    }
  }
}

// x / d as (x * m) >> 16 with m = ceil(2^16 / d) (ScoreParams' magic numbers, made by the
// launcher): exact for x >= 0 and x * (d - 1) < 2^16, here vector indices under 128 over at most
// 16 heads. A warp divides vector indices by the head count before its first page request and
// again to write its scores; a division took some 25 dependent instructions.
CP_DEVICE int div_small(int x, uint32_t m) { return (int)(((uint32_t)x * m) >> 16); }

// The query vectors of one item: vector v = t * H + h (token t of the request, head h).
struct Vecs {
  int count;      // T * H
  int heads;      // H
  int query_len;  // T
};

// Loads vector v's query values for this lane's dims as 16 packed pairs (zeros past the end).
template <int F>
CP_DEVICE void load_query_pairs(const ScoreParams& p, const Vecs& vs, int req, int v, int c,
                                uint32_t (&qf)[16]) {
  if (v >= vs.count) {
#pragma unroll
    for (int m = 0; m < 16; ++m) qf[m] = 0u;
    return;
  }
  const int t = div_small(v, p.heads_magic), h = v - t * vs.heads;
  const int src = div_small(h, p.q_src_magic), in_src = h - src * p.q_heads_per_src;
  const int elem = Fmt<F>::kBf16 ? 2 : 1;
  const uint8_t* base = p.q + (int64_t)src * p.q_src_stride +
                        (int64_t)(req * vs.query_len + t) * p.q_row_stride +
                        in_src * kHeadDim * elem;
  if constexpr (Fmt<F>::kRing) {  // the ring's pairs are adjacent dims, one word or half-word each
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const uint8_t* src = base + (Fmt<F>::dim_base(c, m >> 2) + Fmt<F>::elem(m & 3, 0)) * elem;
      qf[m] = Fmt<F>::kBf16 ? *reinterpret_cast<const uint32_t*>(src)
                            : cp_e4m3x2_to_f16x2(*reinterpret_cast<const uint16_t*>(src));
    }
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint8_t* src = base + Fmt<F>::dim_base(c, q) * elem;
      if constexpr (Fmt<F>::kBf16) {
        const uint4 v4 = *reinterpret_cast<const uint4*>(src);
        qf[4 * q] = v4.x, qf[4 * q + 1] = v4.y, qf[4 * q + 2] = v4.z, qf[4 * q + 3] = v4.w;
      } else {
        const uint2 v2 = *reinterpret_cast<const uint2*>(src);
#pragma unroll
        for (int b = 0; b < 4; ++b)  // the keys' pairing (once per item: cost is immaterial)
          qf[4 * q + b] = cp_e4m3x2_to_f16x2(
              __byte_perm(v2.x, v2.y, Fmt<F>::elem(b, 0) | (Fmt<F>::elem(b, 1) << 4)) & 0xffffu);
      }
    }
  }
}

template <bool kBf16>
CP_DEVICE float lo(uint32_t w) { return kBf16 ? cp_bf16_lo(w) : cp_f16_lo(w); }
template <bool kBf16>
CP_DEVICE float hi(uint32_t w) { return kBf16 ? cp_bf16_hi(w) : cp_f16_hi(w); }

}  // namespace
}  // namespace cpindex
