// score.hip: the fused decode block-scoring kernel of cpindex (docs/contract.md, docs/kernel.md).
//
// One warp scores one (request, block) item: it streams the block's 128 keys once and produces
// the block score of every query vector of the request, T query tokens x H heads (the keys are
// read once and used T * H times). Items are this rank's round-robin share of each request's
// blocks (j = rank + k * world), spread over a persistent grid.
//
// Local mode writes [heads, rows, width] (or this rank's [heads, rows, ceil(width/world)]
// shard), rows = requests * T. Push mode adds the exchange inside the same launch:
//   1. CTA b < world copies this rank's query rows into rank (rank+b)%world's query buffer,
//      stores this call's identity beside them and raises its flag to the call count (release,
//      system scope);
//   2. every CTA waits (acquire, bounded) until all ranks' queries for this call have arrived and
//      checks that every rank's call identity equals its own (shape, forcing, config);
//   3. scores of head h go straight into the receive buffer of each rank that owns h;
//   4. the last CTA to finish raises this rank's score flag on every peer, waits for every
//      peer's score flag here, then advances the device-side call count.
// Counts live on the device, so a captured graph replays the handshake correctly.
#include "compat.h"
#include "launch.h"

// Measurement switches: `python benchmarks/kernel_variants.py` builds variants through
// CPINDEX_KERNEL_DEFINES and times them side by side. The defaults are what ships.
#ifndef CP_SMEM_RING  // bytes per warp of the bf16/fp8 cp.async ring (sm_80+; 0: registers)
#define CP_SMEM_RING 8192
#endif
#ifndef CP_BF16_BATCH  // bf16 tiles loaded before their math (register path)
#define CP_BF16_BATCH 2
#endif
#ifndef CP_NVFP4_BATCH  // nvfp4 tiles loaded before their math, for one query tile
#define CP_NVFP4_BATCH 8
#endif
#ifndef CP_NVFP4_BATCH_WG  // the same for the warpgroup-mma instance
#define CP_NVFP4_BATCH_WG 4
#endif
#ifndef CP_NVFP4_CVT  // nvfp4, 1 or 2 query tiles: words of a lane's 4 per token widened by cvt (0-4)
#define CP_NVFP4_CVT 2
#endif
#ifndef CP_NVFP4_CVT4  // the same for four query tiles
#define CP_NVFP4_CVT4 0
#endif
#ifndef CP_NVFP4_CVT_WG  // the same for the warpgroup-mma instances
#define CP_NVFP4_CVT_WG 2
#endif
#ifndef CP_SPLIT_PAGES  // small calls: a CTA's warps share each page (0: one warp per page)
#define CP_SPLIT_PAGES 1
#endif
#ifndef CP_GROUP_MAX  // consecutive blocks of one request a warp takes as one group (1: one each)
#define CP_GROUP_MAX 8
#endif
#ifndef CP_NT4_CTAS  // CTAs per SM the four-tile instances' registers leave room for (0: ptxas's)
#define CP_NT4_CTAS 0
#endif
#ifndef CP_WG_CTAS  // the same for the warpgroup-mma instances (0: 3 for bf16, 4 otherwise)
#define CP_WG_CTAS 0
#endif
#ifndef CP_SPLIT_CTAS  // the same for the split-page instances (0: the whole-page instances')
#define CP_SPLIT_CTAS 0
#endif
#ifndef CP_LOCAL_FAILED_CHECK  // 1: a local call checks the error word first too (measurement)
#define CP_LOCAL_FAILED_CHECK 0
#endif
// CP_PHASE_TRACE (measurement only, CUDA): in push mode, thread 0 of CTA 0 and of the last CTA
// prints the SM clock at each phase of every 128th call (benchmarks/phase_trace.py reads it).
#if defined(CP_PHASE_TRACE) && !defined(CP_HIP)
#include <cstdio>
#endif
#ifndef CP_MAX_QUERY_TILES  // query n-tiles (8 vectors each) per pass over a page: 1, 2 or 4
#define CP_MAX_QUERY_TILES 4
#endif
// CP_WGMMA (set by the build for sm_90a): the four-tile instances score with Hopper's warpgroup
// mma, the queries in shared memory, the CTA's four warps on four pages of one request.
#ifndef CP_WGMMA
#define CP_WGMMA 0
#endif
#if CP_WGMMA && (!CP_USE_MMA || (defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)))
#error "CP_WGMMA needs a CUDA sm_90a build"
#endif
// With a ring, bf16/fp8 tiles go global -> shared by cp.async (each instruction reads 512
// contiguous bytes, and loads stay in flight during the math) and reach the mma through ldmatrix.
// A format whose ring would hold fewer than two 16-token tiles stays on registers; nvfp4 always
// does (its loads read 512 contiguous bytes already in the product layout).
#define CP_SMEM_ON (CP_USE_MMA && CP_SMEM_RING > 0)
#define CP_RING_BF16 (CP_SMEM_ON && CP_SMEM_RING >= 2 * 16 * 256)
#define CP_RING_FP8 (CP_SMEM_ON && CP_SMEM_RING >= 2 * 16 * 128)

namespace cpindex {
namespace {

constexpr int kThreads = kWarpsPerCta * CP_WARP;
constexpr int kGroups = CP_WARP / 4;             // lane groups of 4; group g holds tokens g, g+kGroups
constexpr int kTileTokens = 2 * kGroups;         // tokens per tile
constexpr int kTilesPerPage = kPageTokens / kTileTokens;
constexpr int kSplitTiles = kTilesPerPage / kWarpsPerCta;  // a warp's tiles of a split page
static_assert(kTilesPerPage % kWarpsPerCta == 0, "a split page gives each warp whole tiles");
constexpr int kVecsPerTile = 8;                  // query vectors per mma n-tile (and per portable pass)
constexpr float kForcedLocal = 1e29f;
constexpr float kForcedInit = 1e30f;
constexpr int kMaxSelect = 16;                   // select_blocks' topk the kernel fuses (larger: torch)
// W (a template argument below): the instance scores through the warpgroup mma (sm_90a builds,
// four query tiles); the launcher picks it for large batches (docs/kernel.md).

#if defined(CP_PHASE_TRACE) && !defined(CP_HIP)
// Phase i's time (after a CTA-wide sync, so it is the CTA's, not one warp's).
#define CP_PHASE(i) (__syncthreads(), trace[i] = clock64(), i == 0 ? (void)(start_ns = cp_clock_ticks()) : (void)0)
#else
#define CP_PHASE(i) ((void)0)
#endif

// ---- formats -----------------------------------------------------------------------------------
// Each lane c (= lane % 4) of a group owns 32 of a token's 128 dims, as 16 packed 16-bit pairs
// k[m] = (v[8q + elem(b, 0)], v[8q + elem(b, 1)]) with q = m / 4, b = m % 4, and
// v[8q + e] = dim (dim_base(c, q) + e). The query is paired the same way, so any pairing works.
template <int F>
struct Fmt;

template <>
struct Fmt<kBF16> {
  static constexpr int kLoads = 4;  // 16-byte loads per token per lane
  static constexpr int kBatch = CP_BF16_BATCH;
  static constexpr bool kRing = CP_RING_BF16;
  static constexpr int kTokenBytes = 256;
  static constexpr bool kBf16 = true;
  CP_DEVICE static int load_offset(int c, int l) { return 16 * (c + 4 * l); }
#if CP_RING_BF16  // ldmatrix gives lane c dims 2c, 2c+1 of every 8 (k-step s: pairs 2s, 2s+1)
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
  static constexpr int kBatch = 4;
  static constexpr bool kRing = CP_RING_FP8;
  static constexpr int kTokenBytes = 128;
  static constexpr bool kBf16 = false;
  CP_DEVICE static int load_offset(int c, int l) { return 16 * (c + 4 * l); }
#if CP_RING_FP8  // ldmatrix gives lane c bytes 4c..4c+3 of every 16
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
  static constexpr int kBatch = CP_NVFP4_BATCH;
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

// The register path's shape: a group's 4 lanes read one token's bytes; batches tile a page (a
// batch larger than a page is cut to one page).
template <int F>
constexpr bool kRegisterShapeOk =
    Fmt<F>::kLoads * 16 * 4 == Fmt<F>::kTokenBytes && Fmt<F>::kBatch >= 1 &&
    (kTilesPerPage % Fmt<F>::kBatch == 0 || Fmt<F>::kBatch % kTilesPerPage == 0);
static_assert(kRegisterShapeOk<kBF16> && kRegisterShapeOk<kFP8> && kRegisterShapeOk<kNVFP4>,
              "Fmt::kLoads or kBatch do not fit a page");

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

// nvfp4 words per token and lane that go through the e4m3 table and the conversion unit (the
// rest through the f16 byte table and the integer pipe); conversions need sm_89+. Two of four
// measured fastest with one or two query tiles and with the warpgroup mma; the mma.sync instance
// of four tiles (more mma work per word on the same warp) keeps the integer pipe only
// (docs/BENCHMARKS.md).
template <int NT, bool W>
constexpr int kNvfp4Cvt =
    CP_NATIVE_FP8 ? (W ? CP_NVFP4_CVT_WG : NT == 4 ? CP_NVFP4_CVT4 : CP_NVFP4_CVT) : 0;
static_assert(CP_NVFP4_CVT >= 0 && CP_NVFP4_CVT <= 4 && CP_NVFP4_CVT4 >= 0 && CP_NVFP4_CVT4 <= 4 &&
                  CP_NVFP4_CVT_WG >= 0 && CP_NVFP4_CVT_WG <= 4,
              "CP_NVFP4_CVT, CP_NVFP4_CVT4 and CP_NVFP4_CVT_WG must be 0..4");

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
  const int h = v % vs.heads, row = req * vs.query_len + v / vs.heads;
  const int elem = Fmt<F>::kBf16 ? 2 : 1;
  const uint8_t* base = p.q + (int64_t)(h / p.q_heads_per_src) * p.q_src_stride +
                        (int64_t)row * p.q_row_stride + (h % p.q_heads_per_src) * kHeadDim * elem;
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

// ---- the dot primitive -------------------------------------------------------------------------
// acc[u] = dots of tokens (g, g + kGroups) with vectors (8u + 2c, 8u + 2c + 1) of the pass, in the
// mma C-fragment layout: acc[u][0], acc[u][1] for token g; acc[u][2], acc[u][3] for g + kGroups.
// A pass covers NT n-tiles of 8 vectors (tensor cores) or 8 vectors (portable path, NT = 1).
#if CP_USE_MMA
template <int NT, bool W>
struct QueryFrag {
  uint32_t pairs[NT][16];  // vector 8u + g's values at this lane's dims
};

// Warpgroup mma: the pass's 32 vectors live in shared memory as the B operand, 8 KiB at `smem`.
template <int NT>
struct QueryFrag<NT, true> {
  uint32_t smem;  // shared-memory address of the B operand
};

template <int F, int NT, bool W>
CP_DEVICE void prepare_query(const ScoreParams& p, const Vecs& vs, int req, int v0, int g, int c,
                             QueryFrag<NT, W>& q, float*) {
  if constexpr (W) {
    // CTA-wide. K-step s's 16 slots x 32 vectors, K-major without swizzle: core matrix (n / 8,
    // half) holds vectors n..n+7 x slots 8 half .. +7 as 8 rows of 16 bytes, at (2 (n / 8) +
    // half) * 128 bytes from the step's 1 KiB. Slots 2c, 2c+1 hold pair 2s of lane c's values,
    // slots 8+2c, 9+2c pair 2s+1: the keys' A fragment pairs them the same way (tile_dot).
    (void)g, (void)c;
    const int n = threadIdx.x / 4, cc = threadIdx.x % 4;
    uint32_t qf[16];
    __syncthreads();  // every warp's mma of the previous pass or request has read the old B
    load_query_pairs<F>(p, vs, req, v0 + n, cc, qf);
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t at = q.smem + s * 1024 + (2 * (n / 8) + half) * 128 + (n % 8) * 16 + cc * 4;
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(at), "r"(qf[2 * s + half]) : "memory");
      }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> the mma
    __syncthreads();
  } else {
#pragma unroll
    for (int u = 0; u < NT; ++u) load_query_pairs<F>(p, vs, req, v0 + kVecsPerTile * u + g, c, q.pairs[u]);
  }
}

#if CP_WGMMA
// D (64 tokens x 32 vectors, f32) = A (64 x 16: each warp's 16 tokens from registers, laid out
// as mma.m16n8k16's A) x B (16 x 32 from shared memory, `desc`); D is accumulated when `acc`.
template <bool kBf16, int kAcc>
CP_DEVICE void wgmma_m64n32k16(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                               uint64_t desc) {
#define CP_WGMMA_OPERANDS                                                                        \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),          \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),      \
    "+f"(d[14]), "+f"(d[15])                                                                     \
  : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(kAcc)
  if constexpr (kBf16)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,"
        "%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, %21, 1, 1, 0;" CP_WGMMA_OPERANDS);
  else
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,"
        "%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, %21, 1, 1, 0;" CP_WGMMA_OPERANDS);
#undef CP_WGMMA_OPERANDS
}

// A no-swizzle K-major shared-memory operand: start address, leading (K: the two 8-slot halves,
// 128 bytes apart) and stride (N: 8-vector groups, 256 bytes apart) offsets in 16-byte units.
CP_DEVICE uint64_t wgmma_desc(uint32_t addr) {
  return (uint64_t)((addr >> 4) & 0x3fffu) | (uint64_t)(128 >> 4) << 16 | (uint64_t)(256 >> 4) << 32;
}
#endif

template <bool kBf16>
CP_DEVICE void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                        uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Slots {2c, 2c+1, 2c+8, 2c+9} of k-step s hold this lane's values {4s .. 4s+3}: the same
// permutation on both operands leaves the dot product unchanged. The keys (A) are reused by
// every n-tile.
template <int F, int NT, bool W>
CP_DEVICE void tile_dot(const uint32_t (&k0)[16], const uint32_t (&k1)[16],
                        const QueryFrag<NT, W>& q, const float*, int, float (&acc)[NT][4]) {
#if CP_WGMMA
  if constexpr (W) {  // the CTA's four warps together: 64 tokens (16 each) x 32 vectors
    constexpr bool kBf16 = Fmt<F>::kBf16;
    float d[16];
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    wgmma_m64n32k16<kBf16, 0>(d, k0[0], k1[0], k0[1], k1[1], wgmma_desc(q.smem));
#pragma unroll
    for (int s = 1; s < 8; ++s)
      wgmma_m64n32k16<kBf16, 1>(d, k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1],
                                wgmma_desc(q.smem + s * 1024));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[u][e] = d[4 * u + e];
  } else
#endif
  {
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
#pragma unroll
      for (int s = 0; s < 8; ++s)
        mma16816<Fmt<F>::kBf16>(acc[u], k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1],
                                q.pairs[u][2 * s], q.pairs[u][2 * s + 1]);
    }
  }
}
#else
template <int NT, bool W>
struct QueryFrag {};

// Portable path: each warp keeps the pass's 8 query vectors in shared memory as fp32.
template <int F, int NT, bool W>
CP_DEVICE void prepare_query(const ScoreParams& p, const Vecs& vs, int req, int v0, int g, int c,
                             QueryFrag<NT, W>&, float* q_smem) {
  cp_syncwarp();  // the previous item's values may still be in use
  if (g < kVecsPerTile) {
    uint32_t pairs[16];
    load_query_pairs<F>(p, vs, req, v0 + g, c, pairs);
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int d = Fmt<F>::dim_base(c, m >> 2);
      q_smem[g * kHeadDim + d + Fmt<F>::elem(m & 3, 0)] = lo<Fmt<F>::kBf16>(pairs[m]);
      q_smem[g * kHeadDim + d + Fmt<F>::elem(m & 3, 1)] = hi<Fmt<F>::kBf16>(pairs[m]);
    }
  }
  cp_syncwarp();
}

template <int F, int NT, bool W>
CP_DEVICE void tile_dot(const uint32_t (&k0)[16], const uint32_t (&k1)[16], const QueryFrag<NT, W>&,
                        const float* q_smem, int c, float (&acc)[NT][4]) {
  static_assert(NT == 1, "the portable path scores 8 vectors per pass");
  float part[2][kVecsPerTile];
#pragma unroll
  for (int v = 0; v < kVecsPerTile; ++v) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int d = Fmt<F>::dim_base(c, m >> 2);
      const float q0 = q_smem[v * kHeadDim + d + Fmt<F>::elem(m & 3, 0)];
      const float q1 = q_smem[v * kHeadDim + d + Fmt<F>::elem(m & 3, 1)];
      a += lo<Fmt<F>::kBf16>(k0[m]) * q0 + hi<Fmt<F>::kBf16>(k0[m]) * q1;
      b += lo<Fmt<F>::kBf16>(k1[m]) * q0 + hi<Fmt<F>::kBf16>(k1[m]) * q1;
    }
    part[0][v] = a, part[1][v] = b;
  }
  // Sum the four lanes of the group, then keep vectors (2c, 2c+1) like the mma layout does.
#pragma unroll
  for (int v = 0; v < kVecsPerTile; ++v)
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      part[s][v] += cp_shfl_xor(part[s][v], 1);
      part[s][v] += cp_shfl_xor(part[s][v], 2);
    }
#pragma unroll
  for (int v = 0; v < kVecsPerTile; v += 2)
    if (v == 2 * c) acc[0][0] = part[0][v], acc[0][1] = part[0][v + 1], acc[0][2] = part[1][v],
                    acc[0][3] = part[1][v + 1];
}
#endif

// ---- errors and waits --------------------------------------------------------------------------
CP_DEVICE void report(const ScoreParams& p, uint32_t code, uint32_t peer, uint64_t call,
                      uint64_t detail) {
  if (atomicCAS(&p.err->claim, 0u, 1u) != 0u) return;  // first error wins
  ErrorWord* words[2] = {p.err, p.err_host};
  for (ErrorWord* e : words) {
    if (e == nullptr) continue;
    e->rank = p.rank, e->peer = peer, e->call = call, e->detail = detail;
    cp_fence_sys();
    *reinterpret_cast<volatile uint32_t*>(&e->code) = code;
  }
  cp_fence_sys();
}

CP_DEVICE uint32_t error_code(const ScoreParams& p) {
  return *reinterpret_cast<volatile const uint32_t*>(&p.err->code);
}

// Any recorded error: later pushed launches exit at once (the host raises; replays don't wait on
// peers).
CP_DEVICE bool failed(const ScoreParams& p) { return error_code(p) != kErrNone; }

// The ranks are not in step (a peer late, or a call that is not the same call on every rank):
// stop waiting and signalling. A data error (bad page, short width or length) is not one: the
// call still completes its handshake.
CP_DEVICE bool handshake_failed(const ScoreParams& p) {
  const uint32_t code = error_code(p);
  return code == kErrTimeoutQueries || code == kErrTimeoutScores || code == kErrMismatch;
}

// Spins until *flag >= call. False (after reporting) when the peer is later than the timeout,
// or when another wait of this rank has already failed.
CP_DEVICE bool wait_flag(const ScoreParams& p, const uint64_t* flag, uint64_t call,
                         uint64_t timeout_ticks, uint32_t code, int peer) {
  const uint64_t start = cp_clock_ticks();
  for (uint32_t spin = 0; cp_load_acquire_sys(flag) < call; ++spin) {
    if ((spin & 63u) == 63u) {
      if (handshake_failed(p)) return false;
      if (cp_clock_ticks() - start > timeout_ticks) {
        report(p, code, (uint32_t)peer, call, cp_load_acquire_sys(flag));
        return false;
      }
      cp_backoff();
    }
  }
  return true;
}

// ---- one page ----------------------------------------------------------------------------------
// Per-lane causal cuts of a pass: vector (u, e) = pass vector 8u + 2c + e belongs to query token
// t, whose causal length is the request's minus (T - 1 - t). cut[u][e] = T - 1 - t.
template <int NT>
struct Cuts {
  int cut[NT][2];
};

// acc holds tokens tok and tok + kGroups; a token at or past its row's causal length never
// counts. limit = tokens of this page the request's last row sees; full: every row sees all 128.
// kBranch: test `full` once (it is warp-uniform) instead of folding it into every value's
// compare; measured faster for the warpgroup instance's register path only (docs/kernel.md).
template <int NT, bool kBranch>
CP_DEVICE void keep_max(float (&m)[NT][4], const float (&acc)[NT][4], int tok, int limit,
                        bool full, const Cuts<NT>& cuts) {
  if (kBranch && full) {
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) m[u][e] = fmaxf(m[u][e], acc[u][e]);
    return;
  }
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int lim = limit - cuts.cut[u][e];
      if (full || tok < lim) m[u][e] = fmaxf(m[u][e], acc[u][e]);
      if (full || tok + kGroups < lim) m[u][2 + e] = fmaxf(m[u][2 + e], acc[u][2 + e]);
    }
}

// The page's max over its tokens for this lane's vectors (2c, 2c + 1) of every n-tile, in every
// lane, scaled.
template <int NT>
CP_DEVICE void finish_page(const ScoreParams& p, const float (&m)[NT][4], float (&val)[NT][2]) {
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = fmaxf(m[u][e], m[u][2 + e]);
#pragma unroll
      for (int off = 4; off < CP_WARP; off <<= 1) v = fmaxf(v, cp_shfl_xor(v, off));
      val[u][e] = v * p.scale;
    }
}

template <int NT>
CP_DEVICE void init_max(float (&m)[NT][4]) {
  const float ninf = -__builtin_huge_valf();
#pragma unroll
  for (int u = 0; u < NT; ++u) m[u][0] = m[u][1] = m[u][2] = m[u][3] = ninf;
}

// kTiles tiles of the page from tile t_first (a whole page, or a warp's part of a split page).
template <int F, int NT, bool W, int kTiles>
CP_DEVICE void score_page(const ScoreParams& p, const uint8_t* page, const uint8_t* scale_page,
                          int limit, bool full, const Cuts<NT>& cuts, const QueryFrag<NT, W>& q,
                          const float* q_smem, const uint4* lut, const uint2* lut8, int g, int c,
                          int t_first, float (&val)[NT][2]) {
  // The scalar dot keeps 16 partial sums live: no room to batch loads there. More query tiles
  // hold more registers, so fewer tiles are loaded ahead.
  // The warpgroup instance keeps its queries in shared memory: nvfp4 loads more ahead there.
  constexpr int kWant = !CP_USE_MMA             ? 1
                        : W && kFp4<F>          ? CP_NVFP4_BATCH_WG
                        : Fmt<F>::kBatch / NT > 0 ? Fmt<F>::kBatch / NT
                                                : 1;
  constexpr int kBatch = kWant < kTiles ? kWant : kTiles;
  static_assert(kTiles % kBatch == 0, "a load batch must divide the tiles scored (tiles past "
                                      "them are another warp's or the next page's tokens)");
  float m[NT][4];
  init_max(m);
#if CP_USE_MMA
#pragma unroll
#else
#pragma unroll 1
#endif
  for (int t = 0; t < kTiles; t += kBatch) {
    const int t0 = t_first + t;
    TileRegs<F> regs[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) load_tile<F>(p, regs[b], page, scale_page, t0 + b, g, c);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      uint32_t k0[16], k1[16];
      unpack<F, kNvfp4Cvt<NT, W>>(regs[b], 0, lut, lut8, k0);
      unpack<F, kNvfp4Cvt<NT, W>>(regs[b], 1, lut, lut8, k1);
      float acc[NT][4];
      tile_dot<F, NT, W>(k0, k1, q, q_smem, c, acc);
      keep_max<NT, W>(m, acc, (t0 + b) * kTileTokens + g, limit, full, cuts);
    }
  }
  finish_page<NT>(p, m, val);
}

// A page of a stream: its key bytes, the tokens of it the request's last row sees (limit) and
// whether every row sees all 128 (full).
struct PageRef {
  const uint8_t* kv;
  const uint8_t* ks;  // nvfp4 scales (null otherwise)
  int limit;
  bool full;
};

#if CP_SMEM_ON
// A stream of m pages through a per-warp ring of kStages tiles in shared memory: tile t +
// kStages - 1 is in flight while tile t is scored, across page boundaries too, so a warp's next
// page is already arriving while it finishes the current one. A tile's 16 rows hold its tokens
// in order, 16-byte chunk x of row r stored at chunk x ^ (r % 8), so that ldmatrix's 8 rows hit
// 8 different banks. page_of(r) gives page r (a warp-wide call); done(r, val) takes its maxima.
template <int F>
constexpr int kTileBytes = kTileTokens * Fmt<F>::kTokenBytes;
template <int F>
constexpr int kStages = Fmt<F>::kRing ? CP_SMEM_RING / kTileBytes<F> : 0;

template <int F, int NT, bool W, typename PageOf, typename Done>
CP_DEVICE void score_pages_smem(const ScoreParams& p, int m, PageOf page_of, const Cuts<NT>& cuts,
                                const QueryFrag<NT, W>& q, int g, int c, uint8_t* ring, Done done) {
  constexpr int S = kStages<F>, kRow = Fmt<F>::kTokenBytes, kChunks = kRow / 16;
  // A page's tiles fill whole turns of the ring, so tile t of any page sits in slot t % S.
  static_assert(S >= 2 && kTilesPerPage % S == 0, "the ring must divide a page");
  const int lane = 4 * g + c;
  const uint32_t ring_addr = cp_smem_addr(ring);
  auto issue = [&](const uint8_t* page, int t) {  // tile t: 512 contiguous bytes per instruction
    const uint32_t slot = ring_addr + (t % S) * kTileBytes<F>;
#pragma unroll
    for (int i = 0; i < kTileBytes<F> / (16 * CP_WARP); ++i) {
      const int id = lane + CP_WARP * i, r = id / kChunks, x = id % kChunks;
      cp_async16(slot + r * kRow + ((x ^ (r & 7)) << 4), page + t * kTileBytes<F> + id * 16);
    }
  };
  PageRef cur = page_of(0);
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    issue(cur.kv, t);
    cp_async_commit();
  }
  // ldmatrix rows: lanes 0-7 and 16-23 read tokens 0-7, lanes 8-15 and 24-31 tokens 8-15;
  // lanes 16-31 read the chunk after lanes 0-15's.
  const int r = (lane & 7) + (lane & 8), hi = lane >> 4;
  for (int pg = 0; pg < m; ++pg) {
    const PageRef next = pg + 1 < m ? page_of(pg + 1) : PageRef{nullptr, nullptr, 0, false};
    float mx[NT][4];
    init_max(mx);
#pragma unroll
    for (int t = 0; t < kTilesPerPage; ++t) {
      if (t + S - 1 < kTilesPerPage) issue(cur.kv, t + S - 1);
      else if (next.kv != nullptr) issue(next.kv, t + S - 1 - kTilesPerPage);
      cp_async_commit();  // possibly empty: keeps "S - 1 groups after tile t" true
      cp_async_wait<S - 1>();
      cp_syncwarp();  // every lane's copies of tile t are visible to every lane
      const uint32_t slot = ring_addr + (t % S) * kTileBytes<F> + r * kRow;
      uint32_t k0[16], k1[16];
#pragma unroll
      for (int u = 0; u < kChunks / 2; ++u) {  // chunks 2u, 2u + 1 of tokens 0-15
        uint32_t x[4];
        cp_ldmatrix_x4(slot + (((2 * u + hi) ^ (r & 7)) << 4), x);
        if constexpr (Fmt<F>::kBf16) {  // one k-step: pairs 2u, 2u + 1
          k0[2 * u] = x[0], k1[2 * u] = x[1], k0[2 * u + 1] = x[2], k1[2 * u + 1] = x[3];
        } else {  // two k-steps: pairs 4u .. 4u + 3, each word four e4m3 values
#pragma unroll
          for (int w = 0; w < 4; ++w) {  // x[w]: tokens 0-7 (k0) or 8-15 (k1), chunk 2u + w / 2
            uint32_t(&k)[16] = (w & 1) ? k1 : k0;
            cp_e4m3x4_to_f16x2x2(x[w], k[4 * u + 2 * (w >> 1)], k[4 * u + 2 * (w >> 1) + 1]);
          }
        }
      }
      cp_syncwarp();  // slot t % S is read before a later tile refills it
      float acc[NT][4];
      tile_dot<F, NT, W>(k0, k1, q, nullptr, c, acc);
      keep_max<NT, false>(mx, acc, t * kTileTokens + g, cur.limit, cur.full, cuts);
    }
    float val[NT][2];
    finish_page<NT>(p, mx, val);
    done(pg, val);
    cur = next;
  }
}
#endif

// ---- selection (select_blocks) ------------------------------------------------------------------
// A candidate is one int64 key: the score's float bits made order-preserving in the high 32 bits,
// 0xFFFFFFFF - block id in the low 32 (the same keys as cpindex/selection.py), so comparing keys
// compares scores and breaks ties towards the lower block id. INT64_MIN fills empty slots.
constexpr int64_t kFiller = -0x7fffffffffffffffLL - 1;
constexpr int32_t kOrderedNegInf = (int32_t)(0xff800000u ^ 0x7fffffffu);  // keys at or below: -inf

CP_DEVICE int64_t make_key(float score, int block) {
  const int32_t bits = __float_as_int(score == 0.f ? 0.f : score);  // -0 ties with +0
  const int32_t ordered = bits < 0 ? bits ^ 0x7fffffff : bits;
  return (int64_t)ordered * 4294967296LL + (int64_t)(0xffffffffu - (uint32_t)block);
}

#if !CP_REDUX
CP_DEVICE int64_t shfl_xor64(int64_t v, int mask) {
  const float lo = __int_as_float((int32_t)(uint32_t)v), hi = __int_as_float((int32_t)(v >> 32));
  const uint32_t l = (uint32_t)__float_as_int(cp_shfl_xor(lo, mask));
  const int32_t h = __float_as_int(cp_shfl_xor(hi, mask));
  return (int64_t)h * 4294967296LL + (int64_t)l;
}
#endif

// The warp's largest key, in every lane. CUDA (sm_80+): two integer reductions (the high words,
// then the low words of the lanes holding the top high word); elsewhere a shuffle butterfly.
CP_DEVICE int64_t warp_max64(int64_t v) {
#if CP_REDUX
  const int32_t hi = (int32_t)(v >> 32);
  const int32_t top = __reduce_max_sync(0xffffffffu, hi);
  const uint32_t lo = __reduce_max_sync(0xffffffffu, hi == top ? (uint32_t)v : 0u);
  return (int64_t)top * 4294967296LL + (int64_t)lo;
#else
#pragma unroll
  for (int off = 1; off < CP_WARP; off <<= 1) {
    const int64_t o = shfl_xor64(v, off);
    v = o > v ? o : v;
  }
  return v;
#endif
}

CP_DEVICE int64_t cp_shfl64(int64_t v, int src) {
  const int lo = cp_shfl_int((int32_t)(uint32_t)v, src), hi = cp_shfl_int((int32_t)(v >> 32), src);
  return (int64_t)hi * 4294967296LL + (int64_t)(uint32_t)lo;
}

// A warp's top k of n keys, as each lane's share: up to KP keys, each with its rank (0 = the
// largest) and whether it is among the top k. `real` (the same in every lane) counts the keys
// that are not kFiller, so slots from min(real, k) to k get none.
template <int KP>
struct Picks {
  int64_t key[KP];
  int rank[KP];
  int real;
  CP_DEVICE bool in(int j, int k) const { return key[j] != kFiller && rank[j] < k; }
};

// n <= KP * CP_WARP: every key's rank is the number of keys above it, counted against all n
// through shuffles that do not wait on one another (keys are unique, so the ranks are too).
template <int KP, typename Key>
CP_DEVICE Picks<KP> warp_pick_by_rank(int n, int lane, Key key) {
  Picks<KP> out;
#pragma unroll
  for (int j = 0; j < KP; ++j) {
    const int e = j * CP_WARP + lane;
    out.key[j] = e < n ? key(e) : kFiller;
    out.rank[j] = 0;
  }
  out.real = 0;
#pragma unroll 4
  for (int s = 0; s < CP_WARP; ++s) {
#pragma unroll
    for (int j = 0; j < KP; ++j) {
      const int64_t o = cp_shfl64(out.key[j], s);
      out.real += o != kFiller;
#pragma unroll
      for (int i = 0; i < KP; ++i) out.rank[i] += o > out.key[i];
    }
  }
  return out;
}

// Any n: each lane keeps its kMaxSelect best in registers, then k rounds take the warp's best
// head (each round waits on two reductions). Lane r < k holds the r-th largest. A lane reads
// kSelectBatch keys before inserting any, so their loads (from L2: the shard or the candidates
// were just written) overlap instead of following one another.
constexpr int kSelectBatch = 4;

template <typename Key>
CP_DEVICE Picks<1> warp_pick_by_rounds(int n, int k, int lane, Key key) {
  int64_t best[kMaxSelect];
#pragma unroll
  for (int s = 0; s < kMaxSelect; ++s) best[s] = kFiller;
  for (int base = 0; base < n; base += kSelectBatch * CP_WARP) {
    int64_t xs[kSelectBatch];
#pragma unroll
    for (int b = 0; b < kSelectBatch; ++b) {
      const int e = base + b * CP_WARP + lane;
      xs[b] = e < n ? key(e) : kFiller;
    }
#pragma unroll
    for (int b = 0; b < kSelectBatch; ++b) {
      int64_t x = xs[b];
      if (x <= best[kMaxSelect - 1]) continue;
#pragma unroll
      for (int s = 0; s < kMaxSelect; ++s) {  // insertion into the descending list
        const int64_t hi = x > best[s] ? x : best[s];
        x = x > best[s] ? best[s] : x;
        best[s] = hi;
      }
    }
  }
  Picks<1> out{{kFiller}, {lane}, 0};
  for (int r = 0; r < k; ++r) {
    const int64_t top = warp_max64(best[0]);
    if (top == kFiller) break;  // fewer than k keys
    ++out.real;
    if (lane == r) out.key[0] = top;
    if (best[0] == top) {  // keys are unique: one lane pops its head
#pragma unroll
      for (int s = 0; s + 1 < kMaxSelect; ++s) best[s] = best[s + 1];
      best[kMaxSelect - 1] = kFiller;
    }
  }
  return out;
}

// The warp's top k of n keys (key(e) for e < n), handed to use(picks) as the lanes' shares.
// Up to CP_SELECT_RANK_KEYS keys per lane (2: a (row, head)'s local share up to 64 blocks on
// 32-wide warps, the merge of 4 ranks' 16 candidates) are ranked by counting, more by rounds.
// 0 takes the rounds always (a measurement and test switch, docs/kernel.md).
#ifndef CP_SELECT_RANK_KEYS
#define CP_SELECT_RANK_KEYS 2
#endif
static_assert(CP_SELECT_RANK_KEYS >= 0 && CP_SELECT_RANK_KEYS <= 2, "CP_SELECT_RANK_KEYS: 0, 1 or 2");

template <typename Key, typename Use>
CP_DEVICE void warp_topk(int n, int k, int lane, Key key, Use use) {
  if (CP_SELECT_RANK_KEYS >= 1 && n <= CP_WARP) use(warp_pick_by_rank<1>(n, lane, key));
  else if (CP_SELECT_RANK_KEYS >= 2 && n <= 2 * CP_WARP) use(warp_pick_by_rank<2>(n, lane, key));
  else use(warp_pick_by_rounds(n, k, lane, key));
}

// Phase 1: this rank's top k of its share per (row, head), from the local shard, to each owner.
CP_DEVICE void select_local(const ScoreParams& p) {
  const int lane = threadIdx.x % CP_WARP, warp = threadIdx.x / CP_WARP;
  const int rows = p.requests * p.query_len, k = p.topk;
  const int kw = p.width > p.rank ? (p.width - p.rank + p.world - 1) / p.world : 0;
  const int64_t items = (int64_t)rows * p.num_heads;
  for (int64_t it = (int64_t)blockIdx.x * kWarpsPerCta + warp; it < items;
       it += (int64_t)gridDim.x * kWarpsPerCta) {
    const int row = (int)(it / p.num_heads), h = (int)(it % p.num_heads);
    const float* shard = p.dst[h] + (int64_t)row * p.out_row_stride;
    const auto key = [&](int c) { return make_key(shard[c], p.rank + c * p.world); };
    warp_topk(kw, k, lane, key, [&](const auto& picks) {
      for (int c = 0; c < p.cand_copies; ++c) {
        int64_t* dst = p.cand_dst[h * p.cand_copies + c] + (int64_t)row * k;
#pragma unroll
        for (int j = 0; j < (int)(sizeof(picks.key) / sizeof(picks.key[0])); ++j)
          if (picks.in(j, k)) dst[picks.rank[j]] = picks.key[j];
        if (lane >= picks.real && lane < k) dst[lane] = kFiller;  // fewer than k columns
      }
    });
  }
}

// Phase 2, on each owner once every rank's candidates are here: the top k of the W * k per
// (row, own head), as block ids ascending (-1 after them) and their scores. A picked key's
// place is the number of picked keys with a lower id, counted like the ranks.
CP_DEVICE void merge_candidates(const ScoreParams& p) {
  const int lane = threadIdx.x % CP_WARP, warp = threadIdx.x / CP_WARP;
  const int rows = p.requests * p.query_len, k = p.topk;
  const int64_t items = (int64_t)rows * p.heads_per_rank;
  for (int64_t it = (int64_t)blockIdx.x * kWarpsPerCta + warp; it < items;
       it += (int64_t)gridDim.x * kWarpsPerCta) {
    const int row = (int)(it / p.heads_per_rank), slot = (int)(it % p.heads_per_rank);
    const auto key = [&](int e) {
      const int src = e / k, i = e - src * k;
      return *reinterpret_cast<volatile const int64_t*>(
          p.cand + ((int64_t)(src * p.heads_per_rank + slot) * rows + row) * k + i);
    };
    warp_topk(p.world * k, k, lane, key, [&](const auto& picks) {
      constexpr int KP = sizeof(picks.key) / sizeof(picks.key[0]);
      int id[KP], pos[KP];
      int picked = 0;  // picked keys with a score above -inf
#pragma unroll
      for (int j = 0; j < KP; ++j) {
        const bool valid = picks.in(j, k) && (int32_t)(picks.key[j] >> 32) > kOrderedNegInf;
        id[j] = valid ? (int)(0xffffffffu - (uint32_t)picks.key[j]) : 0x7fffffff;
        pos[j] = 0;
      }
      for (int s = 0; s < CP_WARP; ++s) {
#pragma unroll
        for (int j = 0; j < KP; ++j) {
          const int other = cp_shfl_int(id[j], s);
          picked += other != 0x7fffffff;
#pragma unroll
          for (int i = 0; i < KP; ++i) pos[i] += other < id[i];
        }
      }
      const int64_t base = ((int64_t)slot * rows + row) * k;
#pragma unroll
      for (int j = 0; j < KP; ++j) {
        if (id[j] == 0x7fffffff) continue;
        const int32_t hi = (int32_t)(picks.key[j] >> 32);
        p.ids_out[base + pos[j]] = id[j];
        p.scores_out[base + pos[j]] = __int_as_float(hi < 0 ? hi ^ 0x7fffffff : hi);
      }
      if (lane >= picked && lane < k) {  // fewer than k blocks above -inf
        p.ids_out[base + lane] = -1;
        p.scores_out[base + lane] = -__builtin_huge_valf();
      }
    });
  }
}

// Every CTA of this rank's grid (all resident: push grids are sized so) has arrived (the
// barrier word and what it orders are this GPU's memory, so device-scope fences do). Bounded
// like the peer waits; false when this call's handshake already failed or the wait ran out.
CP_DEVICE bool grid_barrier(const ScoreParams& p, const PushState& ps, uint64_t call) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    ok = 1;
    atomicAdd(ps.barrier, 1u);
    const uint64_t start = cp_clock_ticks();
    for (uint32_t spin = 0; cp_load_relaxed_sys(ps.barrier) < gridDim.x; ++spin) {
      if ((spin & 63u) == 63u) {
        if (handshake_failed(p)) { ok = 0; break; }
        if (cp_clock_ticks() - start > ps.timeout_ticks) {
          report(p, kErrTimeoutScores, (uint32_t)p.rank, call, cp_load_relaxed_sys(ps.barrier));
          ok = 0;
          break;
        }
        cp_backoff();
      }
    }
    cp_fence_gpu();
  }
  __syncthreads();
  return ok != 0;
}

// What one lane writes of each item of a pass: vector v's head, output row and causal cut
// (computed once per pass, not per item).
struct VecOut {
  bool on;  // a vector of this pass
  int h, row, cut;
};

CP_DEVICE VecOut vec_out(const Vecs& vs, int req, int v, bool on) {
  const int t = v / vs.heads;
  return {on && v < vs.count, v - t * vs.heads, req * vs.query_len + t, vs.query_len - 1 - t};
}

// Item (request, block j) of one pass, one vector per lane: the lane's row's value with the row's
// own causal length and the contract's forcing order. col is j (full layout) or the rank's shard
// column k.
CP_DEVICE void write_score(const ScoreParams& p, const VecOut& o, int j, int k, int len, bool bad,
                           float val) {
  if (!o.on) return;
  const int col = p.shard_columns ? k : j;
  const int len_row = len - o.cut;
  const int n_row = len_row > 0 ? (len_row + kPageTokens - 1) / kPageTokens : 0;
  float out;
  if (bad) out = __builtin_nanf("");
  else if (j >= n_row) out = -__builtin_huge_valf();
  else if (j >= n_row - p.local_blocks) out = kForcedLocal;
  else if (j < p.init_blocks) out = kForcedInit;
  else out = val;
  for (int cp = 0; cp < p.dst_copies; ++cp)
    p.dst[o.h * p.dst_copies + cp][(int64_t)o.row * p.out_row_stride + col] = out;
}

// CTAs per SM the register allocation must leave room for (CUDA): ptxas otherwise spends
// registers where they buy nothing, and a step down in occupancy costs more than a little
// scheduling freedom. The tile count per pass sets how much each warp must hold.
// 0 leaves ptxas its own choice for four query tiles (255 registers, 2 CTAs): a 3-CTA target
// (CP_NT4_CTAS=3) spills a little and trades small batches for large ones (docs/BENCHMARKS.md).
// The split-page instances take the same targets (CP_SPLIT_CTAS=N: N CTAs per SM; 4 for four
// query tiles, which would split larger calls, spills and measured slower, docs/kernel.md).
template <int F, int NT, bool W, bool S>
constexpr int kMinCtas = S && CP_SPLIT_CTAS ? CP_SPLIT_CTAS
                         : W       ? (CP_WG_CTAS ? CP_WG_CTAS : F == kBF16 ? 3 : 4)
                         : NT == 4 ? CP_NT4_CTAS
                         : NT == 2 ? (F == kBF16 ? 3 : 4)
                                   : (F == kFP8 ? 5 : 4);
#if defined(CP_MIN_CTAS) && !defined(CP_HIP)  // measurement: one cap for every instance
#define CP_BOUNDS __launch_bounds__(kThreads, CP_MIN_CTAS)
#elif CP_USE_MMA  // the tensor-core instances; the portable path keeps ptxas's choice
#define CP_BOUNDS __launch_bounds__(kThreads, (kMinCtas<F, NT, W, S>))
#else
#define CP_BOUNDS __launch_bounds__(kThreads)
#endif

// The largest group of consecutive blocks a warp takes. The ring formats gain from groups only
// with four query tiles (two CTAs per SM, where a page's start and the query loads are not hidden
// by other warps); with fewer tiles single blocks measured faster (docs/BENCHMARKS.md).
template <int F, int NT>
constexpr int kGroupMax = Fmt<F>::kRing && NT < 4 ? 1 : CP_GROUP_MAX;

// Whether the build has split-page instances (S below) for a format: where a page's loop is
// bound by its math (nvfp4's decode, the portable path's scalar dots). The ring formats stream
// whole pages: split, they measured slower (docs/BENCHMARKS.md).
template <int F>
constexpr bool kSplits = CP_SPLIT_PAGES && !Fmt<F>::kRing;

// ---- the kernel ---------------------------------------------------------------------------------
// NT: query n-tiles per pass (tensor cores; 1 on the portable path). A request with more than
// 8 * NT vectors takes several passes over a page; the later passes find it in L2. W: the
// warpgroup-mma instance (CP_WGMMA builds, NT = 4), whose unit of work is the CTA. S: the
// split-page instance (kSplits formats), whose unit of work is the CTA too.
template <int F, int NT, bool W, bool S>
__global__ void CP_BOUNDS score_kernel(const ScoreParams p, const PushState ps) {
  static_assert(!W || (CP_WGMMA && NT == 4), "the warpgroup mma takes four query tiles, sm_90a");
  static_assert(!S || (!W && kSplits<F>), "split pages: a kSplits format, without the wgmma");
  const int lane = threadIdx.x % CP_WARP, warp = threadIdx.x / CP_WARP;
  const int g = lane >> 2, c = lane & 3;
  const bool push = ps.calls != nullptr;
#if CP_USE_MMA
  float* q_smem = nullptr;
#else
  __shared__ float q_all[kWarpsPerCta][kVecsPerTile * kHeadDim];
  float* q_smem = q_all[warp];
#endif
#if CP_SMEM_ON
  constexpr int kRing = kStages<F> > 0 ? kStages<F> * kTileBytes<F> : 16;
  __shared__ __align__(128) uint8_t ring_all[kWarpsPerCta][kRing];
  uint8_t* ring = ring_all[warp];
#endif
  __shared__ uint4 lut[kFp4<F> ? 256 : 1];
  __shared__ uint2 lut8[kFp4<F> && kNvfp4Cvt<NT, W> > 0 ? 256 : 1];
  // A group's maxima until it is written: per warp, or per CTA where the warps share a group.
  __shared__ float stash_all[kWarpsPerCta * CP_GROUP_MAX][kVecsPerTile * NT];
  float(*stash)[kVecsPerTile * NT] = stash_all + (W ? 0 : warp * CP_GROUP_MAX);
#if CP_USE_MMA
  __shared__ __align__(128) uint8_t q_b[W ? 8 * 1024 : 16];  // B operand (warpgroup mma)
#endif
  __shared__ int cta_failed;
  __shared__ int is_last;
  uint64_t call = 0;
#if defined(CP_PHASE_TRACE) && !defined(CP_HIP)
  long long trace[8] = {};
  uint64_t start_ns = 0;
  // Every 128th call: the clock at each phase the CTA passed, from its start, and when it ended
  // (globaltimer, to line ranks up).
  auto print_trace = [&] {
    if (threadIdx.x != 0 || !(blockIdx.x == 0 || is_last) || call % 128 != 64) return;
    long long d[8];
    for (int i = 0; i < 8; ++i) d[i] = trace[i] ? trace[i] - trace[0] : -1;
    printf("cp-trace rank %d call %llu cta %d last %d select %d start_ns %llu end_ns %llu cycles "
           "%lld %lld %lld %lld %lld %lld %lld %lld\n", p.rank, (unsigned long long)call,
           (int)blockIdx.x, is_last, p.topk > 0, (unsigned long long)start_ns,
           (unsigned long long)cp_clock_ticks(), (long long)clock64() - trace[0],
           d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
  };
#endif

  // nvfp4's tables (4 KiB of f16 bytes, then 2 KiB of e4m3 bytes) are loaded before the error
  // word is checked, so that the two round trips overlap: at small batches they are a good part
  // of a call.
  constexpr int kLutLoads = kFp4<F> ? (256 + kThreads - 1) / kThreads : 0;
  uint4 lut_ld[kLutLoads > 0 ? kLutLoads : 1];
  uint2 lut8_ld[kLutLoads > 0 ? kLutLoads : 1];
#pragma unroll
  for (int r = 0; r < kLutLoads; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (i < 256) {
      lut_ld[r] = reinterpret_cast<const uint4*>(p.fp4_lut)[i];
      if constexpr (kNvfp4Cvt<NT, W> > 0) lut8_ld[r] = reinterpret_cast<const uint2*>(p.fp4_lut + 4096)[i];
    }
  }
  // An earlier call failed and the host raises at its next check. A pushed call stops here so
  // that replays do not wait on peers; a local call has nothing to wait for, and the check's
  // round trip would come before its first key byte.
  if ((push || CP_LOCAL_FAILED_CHECK) && failed(p)) return;
#pragma unroll
  for (int r = 0; r < kLutLoads; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (i < 256) {
      lut[i] = lut_ld[r];
      if constexpr (kNvfp4Cvt<NT, W> > 0) lut8[i] = lut8_ld[r];
    }
  }
  if (threadIdx.x == 0) cta_failed = 0;
  __syncthreads();
  CP_PHASE(0);

  if (push) {
    call = *ps.calls + 1;
    if ((int)blockIdx.x < p.world) {  // deliver my queries to rank (rank + blockIdx.x) % world
      const int dest = (p.rank + (int)blockIdx.x) % p.world;
      const uint4* src = reinterpret_cast<const uint4*>(ps.q_src);
      uint4* dst = reinterpret_cast<uint4*>(ps.peer_q_slot[dest]);
      for (int64_t i = threadIdx.x; i < ps.q_bytes / 16; i += kThreads) dst[i] = src[i];
      cp_fence_sys();
      __syncthreads();
      if (threadIdx.x == 0) {
        *reinterpret_cast<volatile uint64_t*>(ps.peer_q_ident[dest]) = p.ident;
        cp_store_release_sys(ps.peer_q_flag[dest], call);
      }
    }
    if ((int)threadIdx.x < p.world) {
      if (!wait_flag(p, ps.q_flags + threadIdx.x, call, ps.timeout_ticks, kErrTimeoutQueries,
                     threadIdx.x)) {
        cta_failed = 1;
      } else {  // the peer's call must be this call: same shape, forcing and configuration
        const uint64_t theirs = *reinterpret_cast<volatile const uint64_t*>(ps.q_idents + threadIdx.x);
        if (theirs != p.ident) {
          report(p, kErrMismatch, threadIdx.x, call, theirs);
          cta_failed = 1;
        }
      }
    }
    __syncthreads();
  }
  CP_PHASE(1);

  if (!cta_failed) {
    const Vecs vs = {p.query_len * p.num_heads, p.num_heads, p.query_len};
    const int kw = p.width > p.rank ? (p.width - p.rank + p.world - 1) / p.world : 0;
    const int per_pass = kVecsPerTile * NT;
    // Work comes in groups of consecutive blocks of one request: the warp loads the request's
    // queries once per group and streams the group's pages back to back. Groups go round-robin
    // over the warps, which keeps ragged batches balanced. The group size is the largest that
    // keeps the busiest warp's page count at its minimum (a larger group must not leave the
    // last round to a few warps). Several passes re-read each page from L2 right away, so they
    // keep groups of one block.
    // Warpgroup-mma instances deal groups to CTAs instead: the four warps score the group's
    // pages four at a time (page r of the group on warp r % 4), so the cost of a group of gs
    // pages is ceil(gs / 4) page times.
    // Split pages (S; the launcher picks it when the busiest rank's items all fit the grid at
    // once, each with a CTA): a CTA takes one item at a time and its warps score a quarter of
    // the page each, combining their maxima through the stash. A call of few pages then has four
    // times the warps loading and decoding instead of one warp per page. Its own instance, so
    // that the whole-page loops keep their register allocation.
    constexpr int kSpan = W ? kWarpsPerCta : 1;  // warps that share a group
    constexpr bool split = S;
    const int64_t units = W || split ? (int64_t)gridDim.x : (int64_t)gridDim.x * kWarpsPerCta;
    int group = 1;
    if (!split && (vs.count <= per_pass || W)) {
      const int most = vs.count <= per_pass ? kSpan * kGroupMax<F, NT> : kSpan;
      int64_t best = -1;
      for (int gs = 1; gs <= most; ++gs) {
        const int64_t rounds = ((int64_t)p.requests * ((kw + gs - 1) / gs) + units - 1) / units;
        const int64_t cost = rounds * ((gs + kSpan - 1) / kSpan);
        if (best < 0 || cost <= best) best = cost, group = gs;
      }
    }
    const int per_req = (kw + group - 1) / group;
    const int64_t groups = (int64_t)p.requests * per_req;
    QueryFrag<NT, W> q;
#if CP_USE_MMA
    if constexpr (W) q.smem = cp_smem_addr(q_b);
#endif
    int cur_req = -1, cur_v0 = -1;
    const int64_t first =
        W || split ? (int64_t)blockIdx.x : (int64_t)blockIdx.x * kWarpsPerCta + warp;
    for (int64_t gi = first; gi < groups; gi += units) {
      const int i = (int)(gi / per_req), k0 = (int)(gi - (int64_t)i * per_req) * group;
      const int count = kw - k0 < group ? kw - k0 : group;
      // Lane l < count looks at item k0 + l, block j. Its page id, the request's length and (one
      // pass, warps on their own) its queries are loaded before any of them is used, so their
      // round trips overlap instead of following one another; a page id past the request's
      // length is loaded for nothing (the table has bt_cols columns, so it is in bounds).
      const int j = p.rank + (k0 + lane) * p.world;
      const int64_t pg_ld =
          lane < count && j < p.bt_cols ? p.block_table[(int64_t)i * p.bt_row_stride + j] : -1;
      const int len = p.seq_lens[i];
      if constexpr (!W) {
        if (vs.count <= per_pass && i != cur_req) {
          prepare_query<F, NT, W>(p, vs, i, 0, g, c, q, q_smem);
          cur_req = i, cur_v0 = 0;
        }
      }
      const int n = len > 0 ? (len + kPageTokens - 1) / kPageTokens : 0;  // the last row's blocks
      const bool reporter = (!W && !split) || warp == 0;  // warps sharing a group report once
      if (k0 == 0 && lane == 0 && reporter) {  // checked once per request
        if (len < p.query_len) report(p, kErrLength, (uint32_t)i, call, (uint64_t)(int64_t)len);
        else if (n > p.width || n > p.bt_cols) report(p, kErrWidth, (uint32_t)i, call, (uint64_t)n);
      }
      // Item k0 + l's page is read when some row of the request scans block j (the last row sees
      // most).
      const bool short_len = len < p.query_len;
      bool read = false, bad = short_len;
      int page = 0;
      if (lane < count) {
        read = !short_len && j >= p.init_blocks && j < n - p.local_blocks;
        if (read) {
          const int64_t pg = pg_ld;
          if (pg < 0 || pg >= p.num_pages) {  // past max_blocks (reported above) or bad page
            if (reporter) report(p, kErrBadPage, (uint32_t)i, call, (uint64_t)j);
            read = false, bad = true;
          } else {
            page = (int)pg;
          }
        }
      }
      int reads = 0, mine = 0;  // lane r holds the item of the group's r-th page read
      for (int l = 0; l < count; ++l)
        if (cp_shfl_int(read, l)) {
          if (lane == reads) mine = l;
          ++reads;
        }
      // This warp's pages: every read page, or (warps sharing a group) reads r = warp + 4x. The
      // warpgroup mma needs all four warps in step, so each streams the same number of pages; a
      // warp short of pages streams page 0 of the cache and keeps nothing of it.
      const int streamed = W ? (reads + kSpan - 1) / kSpan : reads;
      auto read_index = [&](int x) { return W ? warp + kSpan * x : x; };
      auto page_of = [&](int x) {
        const int r = read_index(x);
        if (W && r >= reads) return PageRef{p.kv, p.ks, 0, false};
        const int l = cp_shfl_int(mine, r), pg = cp_shfl_int(page, l);
        const int limit = len - (p.rank + (k0 + l) * p.world) * kPageTokens;
        return PageRef{p.kv + pg * p.kv_page_stride, kFp4<F> ? p.ks + pg * p.ks_page_stride : nullptr,
                       limit, limit - (p.query_len - 1) >= kPageTokens};
      };
      for (int v0 = 0; v0 < vs.count; v0 += per_pass) {
        Cuts<NT> cuts;
#pragma unroll
        for (int u = 0; u < NT; ++u)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            cuts.cut[u][e] = p.query_len - 1 - (v0 + kVecsPerTile * u + 2 * c + e) / vs.heads;
        if (reads > 0) {
          if (i != cur_req || v0 != cur_v0) {
            prepare_query<F, NT, W>(p, vs, i, v0, g, c, q, q_smem);
            cur_req = i, cur_v0 = v0;
          }
          // Maxima wait in shared memory until the group is scored: writing them from inside
          // the stream would keep every row's output address live across it.
          auto done = [&](int x, const float (&val)[NT][2]) {
            const int r = read_index(x);
            if (W && r >= reads) return;
            const int l = cp_shfl_int(mine, r);
            if (g == 0)
#pragma unroll
              for (int u = 0; u < NT; ++u)
#pragma unroll
                for (int e = 0; e < 2; ++e) stash[l][kVecsPerTile * u + 2 * c + e] = val[u][e];
          };
#if CP_SMEM_ON
          if constexpr (kStages<F> > 0) {
            score_pages_smem<F, NT, W>(p, streamed, page_of, cuts, q, g, c, ring, done);
          } else
#endif
          {
            for (int x = 0; x < streamed; ++x) {
              const PageRef pr = page_of(x);
              float val[NT][2];
              if constexpr (split)
                score_page<F, NT, W, kSplitTiles>(p, pr.kv, pr.ks, pr.limit, pr.full, cuts, q,
                                                  q_smem, lut, lut8, g, c, warp * kSplitTiles, val);
              else
                score_page<F, NT, W, kTilesPerPage>(p, pr.kv, pr.ks, pr.limit, pr.full, cuts, q,
                                                    q_smem, lut, lut8, g, c, 0, val);
              done(x, val);
            }
          }
          cp_syncwarp();
        }
        if constexpr (W || split) __syncthreads();  // every warp's maxima are in the stash
        // Every item, read or not: lane x of slice y writes pass vector x of the y-th item of
        // each round (a slice per item: all of a warp's lanes store at once).
        constexpr int kSlices = CP_WARP / (kVecsPerTile * NT);
        const int xv = lane % per_pass, slice = lane / per_pass;
        const VecOut o = vec_out(vs, i, v0 + xv, slice < kSlices);
        const bool writer = !split || warp == 0;  // a split page's item is written once
        for (int l0 = W ? warp : 0; writer && l0 < count; l0 += kSpan * kSlices) {
          const int l = l0 + kSpan * slice, src = l < count ? l : 0;
          const bool rd = cp_shfl_int(read, src), bd = cp_shfl_int(bad, src);
          if (l < count) {
            float val = rd ? stash[l][xv] : 0.f;
            if (split && rd)  // the other warps' parts (warp w's stash: CP_GROUP_MAX rows on)
              for (int w = 1; w < kWarpsPerCta; ++w)
                val = fmaxf(val, stash[w * CP_GROUP_MAX + l][xv]);
            write_score(p, o, p.rank + (k0 + l) * p.world, k0 + l, len, bd, val);
          }
        }
        if constexpr (W || split) __syncthreads();  // the stash is refilled by the next pass/group
        else cp_syncwarp();
      }
    }
  }

  if (!push) return;
  CP_PHASE(2);
  const bool select = p.topk > 0;
  if (select) {  // every CTA's shard columns are written before any CTA selects from them
    cp_fence_gpu();  // the shard is this GPU's memory: device scope orders it
    if (!grid_barrier(p, ps, call)) cta_failed = 1;
    CP_PHASE(3);
    if (!cta_failed) select_local(p);
    CP_PHASE(4);
  }
  // Completion: the last CTA to finish signals every peer; it (or, when selecting, every CTA,
  // which then merges) waits for every peer's signal.
  cp_fence_sys();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(ps.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  CP_PHASE(5);
#if defined(CP_PHASE_TRACE) && !defined(CP_HIP)
  if (!is_last && !select) print_trace();
#endif
  if (!is_last && !select) return;
  if (is_last) cp_fence_sys();  // every CTA's writes (seen through the ticket) before the release
  if (!handshake_failed(p)) {
    if (is_last && (int)threadIdx.x < p.world)
      cp_store_release_sys(ps.peer_s_flag[threadIdx.x], call);
    if ((int)threadIdx.x < p.world &&
        !wait_flag(p, ps.s_flags + threadIdx.x, call, ps.timeout_ticks, kErrTimeoutScores,
                   threadIdx.x))
      cta_failed = 1;
  }
  __syncthreads();
  CP_PHASE(6);
  if (select && !cta_failed && !handshake_failed(p)) merge_candidates(p);
  CP_PHASE(7);
#if defined(CP_PHASE_TRACE) && !defined(CP_HIP)
  print_trace();
#endif
  if (is_last && threadIdx.x == 0) {
    *ps.ticket = 0u;
    *ps.barrier = 0u;
    *ps.calls = call;
  }
}

// Query n-tiles per pass for `vectors` = T * H query vectors: registers hold every tile's query
// fragment, so more than 4 tiles take several passes instead.
int query_tiles(int vectors) {
#if CP_USE_MMA
  static_assert(CP_MAX_QUERY_TILES == 1 || CP_MAX_QUERY_TILES == 2 || CP_MAX_QUERY_TILES == 4,
                "CP_MAX_QUERY_TILES must be 1, 2 or 4");
  const int tiles = vectors <= 8 ? 1 : vectors <= 16 ? 2 : 4;
  return tiles < CP_MAX_QUERY_TILES ? tiles : CP_MAX_QUERY_TILES;
#else
  (void)vectors;
  return 1;
#endif
}

// The whole-page (or warpgroup) instance, or with split the split-page one where F has it.
template <int F, int NT, bool W>
int launch_nt(const ScoreParams& p, const PushState* push, bool split, int grid, void* stream) {
  const PushState none = {};
  const auto stream_ = (cp_stream_t)stream;
  if constexpr (!W && kSplits<F>) {
    if (split) {
      score_kernel<F, NT, false, true><<<grid, kThreads, 0, stream_>>>(p, push ? *push : none);
      return (int)cp_get_last_error();
    }
  }
  score_kernel<F, NT, W, false><<<grid, kThreads, 0, stream_>>>(p, push ? *push : none);
  return (int)cp_get_last_error();
}

template <int F>
int launch_format(const ScoreParams& p, const PushState* push, bool wgmma, bool split, int grid,
                  void* stream) {
  switch (query_tiles(p.query_len * p.num_heads)) {
    case 1: return launch_nt<F, 1, false>(p, push, split, grid, stream);
#if CP_USE_MMA
    case 2: return launch_nt<F, 2, false>(p, push, split, grid, stream);
#if CP_WGMMA
    case 4: return wgmma ? launch_nt<F, 4, true>(p, push, false, grid, stream)
                         : launch_nt<F, 4, false>(p, push, split, grid, stream);
#else
    case 4: return (void)wgmma, launch_nt<F, 4, false>(p, push, split, grid, stream);
#endif
#endif
    default: return -1;
  }
}

// CTAs per SM of the instance launch_nt runs for the same arguments (a push grid must be
// resident at once, so each instance's grid is sized on its own occupancy).
template <int F, int NT, bool W>
int occupancy_nt(bool split, int* ctas) {
  if constexpr (!W && kSplits<F>) {
    if (split) return (int)cp_occupancy(ctas, score_kernel<F, NT, false, true>, kThreads, 0);
  }
  return (int)cp_occupancy(ctas, score_kernel<F, NT, W, false>, kThreads, 0);
}

template <int F>
int occupancy_format(int vectors, bool wgmma, bool split, int* ctas) {
  switch (query_tiles(vectors)) {
    case 1: return occupancy_nt<F, 1, false>(split, ctas);
#if CP_USE_MMA
    case 2: return occupancy_nt<F, 2, false>(split, ctas);
#if CP_WGMMA
    case 4: return wgmma ? occupancy_nt<F, 4, true>(false, ctas)
                         : occupancy_nt<F, 4, false>(split, ctas);
#else
    case 4: return (void)wgmma, occupancy_nt<F, 4, false>(split, ctas);
#endif
#endif
    default: return -1;
  }
}

}  // namespace

int launch_score(const ScoreParams& p, const PushState* push, int format, bool wgmma, bool split,
                 int grid, void* stream) {
  switch (format) {
    case kBF16: return launch_format<kBF16>(p, push, wgmma, split, grid, stream);
    case kFP8: return launch_format<kFP8>(p, push, wgmma, split, grid, stream);
    case kNVFP4: return launch_format<kNVFP4>(p, push, wgmma, split, grid, stream);
    case kNVFP4Narrow: return launch_format<kNVFP4Narrow>(p, push, wgmma, split, grid, stream);
    default: return -1;
  }
}

int score_occupancy(int format, int vectors, bool wgmma, bool split, int* ctas_per_sm) {
  switch (format) {
    case kBF16: return occupancy_format<kBF16>(vectors, wgmma, split, ctas_per_sm);
    case kFP8: return occupancy_format<kFP8>(vectors, wgmma, split, ctas_per_sm);
    case kNVFP4: return occupancy_format<kNVFP4>(vectors, wgmma, split, ctas_per_sm);
    case kNVFP4Narrow: return occupancy_format<kNVFP4Narrow>(vectors, wgmma, split, ctas_per_sm);
    default: return -1;
  }
}

bool score_has_wgmma(int vectors) { return CP_WGMMA && query_tiles(vectors) == 4; }

bool score_splits_pages(int format) {
  switch (format) {
    case kBF16: return kSplits<kBF16>;
    case kFP8: return kSplits<kFP8>;
    case kNVFP4: return kSplits<kNVFP4>;
    case kNVFP4Narrow: return kSplits<kNVFP4Narrow>;
    default: return false;
  }
}

}  // namespace cpindex
