// score.hip: the fused decode block-scoring kernel of cpindex (docs/contract.md, sections 3-5).
//
// One warp scores one (row, block) item: it streams the block's 128 keys once and produces the
// block score for every head (the keys are read once and used H times). Items are this rank's
// round-robin share of each row's blocks (j = rank + k * world), spread over a persistent grid.
//
// Local mode writes [heads, rows, width] (or this rank's [heads, rows, ceil(width/world)] shard).
// Push mode adds the exchange inside the same launch:
//   1. CTA b < world copies this rank's query rows into rank (rank+b)%world's query buffer and
//      raises its flag to the call count (release, system scope);
//   2. every CTA waits (acquire, bounded) until all ranks' queries for this call have arrived;
//   3. scores of head h go straight into the receive buffer of each rank that owns h;
//   4. the last CTA to finish raises this rank's score flag on every peer, waits for every
//      peer's score flag here, then advances the device-side call count.
// Counts live on the device, so a captured graph replays the handshake correctly.
#include "compat.h"
#include "launch.h"

// Measurement switches: `python benchmarks/kernel_variants.py` builds variants through
// CPINDEX_KERNEL_DEFINES and times them side by side. The defaults are what ships.
#ifndef CP_META_PREFETCH  // 1: read the next item's length and page while scoring this one
#define CP_META_PREFETCH 0
#endif
#ifndef CP_SMEM_RING  // bytes per warp of the bf16/fp8 cp.async ring (sm_80+; 0: registers)
#define CP_SMEM_RING 8192
#endif
#ifndef CP_BF16_BATCH  // bf16 tiles loaded before their math
#define CP_BF16_BATCH 2
#endif
#ifndef CP_NVFP4_BATCH  // nvfp4 tiles loaded before their math
#define CP_NVFP4_BATCH 8
#endif
#ifndef CP_MEASURE_LOADS_ONLY  // 1: the register path reads pages but skips the math (wrong
#define CP_MEASURE_LOADS_ONLY 0  // scores; a ceiling). It turns the ring off.
#endif
// With a ring, bf16/fp8 tiles go global -> shared by cp.async (each instruction reads 512
// contiguous bytes, and loads stay in flight during the math) and reach the mma through ldmatrix.
// A format whose ring would hold fewer than two 16-token tiles stays on registers; nvfp4 always
// does (its loads read 512 contiguous bytes already).
#define CP_SMEM_ON (CP_USE_MMA && CP_SMEM_RING > 0 && !CP_MEASURE_LOADS_ONLY)
#define CP_RING_BF16 (CP_SMEM_ON && CP_SMEM_RING >= 2 * 16 * 256)
#define CP_RING_FP8 (CP_SMEM_ON && CP_SMEM_RING >= 2 * 16 * 128)

namespace cpindex {
namespace {

constexpr int kThreads = kWarpsPerCta * CP_WARP;
constexpr int kGroups = CP_WARP / 4;             // lane groups of 4; group g holds tokens g, g+kGroups
constexpr int kTileTokens = 2 * kGroups;         // tokens per tile
constexpr int kTilesPerPage = kPageTokens / kTileTokens;
constexpr float kForcedLocal = 1e29f;
constexpr float kForcedInit = 1e30f;

// ---- formats -----------------------------------------------------------------------------------
// Each lane c (= lane % 4) of a group owns 32 of a token's 128 dims, as 16 packed 16-bit pairs
// k[m] = (v[8q + elem(b, 0)], v[8q + elem(b, 1)]) with q = m / 4, b = m % 4, and
// v[8q + e] = dim (dim_base(c, q) + e). The query is paired the same way, so any pairing works.
// Loads are 16 bytes wide; the four lanes of a group read 64 contiguous bytes per instruction.
template <int F>
struct Fmt;

template <>
struct Fmt<kBF16> {
  static constexpr int kLoads = 4;  // 16-byte loads per token per lane
  static constexpr int kBatch = CP_BF16_BATCH;  // tiles loaded before their math (registers)
  static constexpr bool kRing = CP_RING_BF16;
  static constexpr int kTokenBytes = 256;
  static constexpr bool kBf16 = true;
  static constexpr float kUnit = 1.0f;
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
  static constexpr float kUnit = 1.0f;
  CP_DEVICE static int load_offset(int c, int l) { return 16 * (c + 4 * l); }
#if CP_RING_FP8  // ldmatrix gives lane c bytes 4c..4c+3 of every 16
  CP_DEVICE static int dim_base(int c, int q) { return 32 * q + 4 * c; }
  CP_DEVICE static int elem(int b, int half) { return 16 * (b >> 1) + 2 * (b & 1) + half; }
#else
  CP_DEVICE static int dim_base(int c, int q) { return 16 * (c + 4 * (q >> 1)) + 8 * (q & 1); }
  CP_DEVICE static int elem(int b, int half) { return 2 * b + half; }
#endif
};

template <>
struct Fmt<kNVFP4> {
  static constexpr int kLoads = 1;
  static constexpr int kBatch = CP_NVFP4_BATCH;
  static constexpr bool kRing = false;
  static constexpr int kTokenBytes = 64;
  static constexpr bool kBf16 = false;
  static constexpr float kUnit = CP_FP4_UNIT;  // e2m1 values arrive scaled by 2^-14
  CP_DEVICE static int load_offset(int c, int) { return 16 * c; }
  CP_DEVICE static int dim_base(int c, int q) { return 32 * c + 8 * q; }
  // cp_e2m1x8_to_f16x2x4's pairs: (0,4), (2,6), (1,5), (3,7)
  CP_DEVICE static int elem(int b, int half) { return 2 * (b & 1) + (b >> 1) + 4 * half; }
};

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
CP_DEVICE void load_tile(TileRegs<F>& t, const uint8_t* page, const uint8_t* scale_page, int tile,
                         int g, int c) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int tok = tile * kTileTokens + g + s * kGroups;
    const uint8_t* row = page + tok * Fmt<F>::kTokenBytes;
#pragma unroll
    for (int l = 0; l < Fmt<F>::kLoads; ++l) t.raw[s][l] = cp_load_stream16(row + Fmt<F>::load_offset(c, l));
    if constexpr (F == kNVFP4) t.scales[s] = *reinterpret_cast<const uint16_t*>(scale_page + tok * 8 + 2 * c);
  }
}

CP_DEVICE uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Token s of a loaded tile as 16 packed pairs (bf16x2 for bf16, f16x2 otherwise).
template <int F>
CP_DEVICE void unpack(const TileRegs<F>& t, int s, uint32_t (&k)[16]) {
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
        k[8 * l + 2 * i] = cp_e4m3x2_to_f16x2(w & 0xffffu);
        k[8 * l + 2 * i + 1] = cp_e4m3x2_to_f16x2(w >> 16);
      }
  } else {
    const uint32_t sc = cp_e4m3x2_to_f16x2(t.scales[s]);
    const uint32_t s0 = (sc & 0xffffu) * 0x10001u, s1 = (sc >> 16) * 0x10001u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t pairs[4];
      cp_e2m1x8_to_f16x2x4(word(t.raw[s][0], i), pairs);
#pragma unroll
      for (int b = 0; b < 4; ++b) k[4 * i + b] = cp_hmul2(pairs[b], i < 2 ? s0 : s1);  // 0..15: scale 0
    }
  }
}

// Loads head h's query values for this lane's dims as 16 packed pairs (zeros past num_heads).
template <int F>
CP_DEVICE void load_query_pairs(const ScoreParams& p, int row, int h, int c, uint32_t (&qf)[16]) {
  if (h >= p.num_heads) {
#pragma unroll
    for (int m = 0; m < 16; ++m) qf[m] = 0u;
    return;
  }
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
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        qf[4 * q] = v.x, qf[4 * q + 1] = v.y, qf[4 * q + 2] = v.z, qf[4 * q + 3] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
#pragma unroll
        for (int b = 0; b < 4; ++b)  // the keys' pairing (once per row: cost is immaterial)
          qf[4 * q + b] = cp_e4m3x2_to_f16x2(
              __byte_perm(v.x, v.y, Fmt<F>::elem(b, 0) | (Fmt<F>::elem(b, 1) << 4)) & 0xffffu);
      }
    }
  }
}

template <bool kBf16>
CP_DEVICE float lo(uint32_t w) { return kBf16 ? cp_bf16_lo(w) : cp_f16_lo(w); }
template <bool kBf16>
CP_DEVICE float hi(uint32_t w) { return kBf16 ? cp_bf16_hi(w) : cp_f16_hi(w); }

// ---- the dot primitive -------------------------------------------------------------------------
// acc = dots of tokens (g, g + kGroups) with heads (2c, 2c + 1), in the mma C-fragment layout:
// acc[0], acc[1] for token g; acc[2], acc[3] for token g + kGroups.
#if CP_USE_MMA
struct QueryFrag {
  uint32_t pairs[16];  // head g's values at this lane's dims
};

template <int F>
CP_DEVICE void prepare_query(const ScoreParams& p, int row, int g, int c, QueryFrag& q, float*) {
  load_query_pairs<F>(p, row, g, c, q.pairs);
}

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
// permutation on both operands leaves the dot product unchanged.
template <bool kBf16>
CP_DEVICE void tile_dot(const uint32_t (&k0)[16], const uint32_t (&k1)[16], const QueryFrag& q,
                        const float*, int, float (&acc)[4]) {
  acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
  for (int s = 0; s < 8; ++s)
    mma16816<kBf16>(acc, k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1], q.pairs[2 * s],
                    q.pairs[2 * s + 1]);
}
#else
struct QueryFrag {};

// Portable path: each warp keeps its row's queries for all heads in shared memory as fp32.
template <int F>
CP_DEVICE void prepare_query(const ScoreParams& p, int row, int g, int c, QueryFrag&,
                             float* q_smem) {
  cp_syncwarp();  // the previous row's values may still be in use
  if (g < kMaxHeads) {
    uint32_t pairs[16];
    load_query_pairs<F>(p, row, g, c, pairs);
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int d = Fmt<F>::dim_base(c, m >> 2);
      q_smem[g * kHeadDim + d + Fmt<F>::elem(m & 3, 0)] = lo<Fmt<F>::kBf16>(pairs[m]);
      q_smem[g * kHeadDim + d + Fmt<F>::elem(m & 3, 1)] = hi<Fmt<F>::kBf16>(pairs[m]);
    }
  }
  cp_syncwarp();
}

template <int F>
CP_DEVICE void tile_dot_portable(const uint32_t (&k0)[16], const uint32_t (&k1)[16],
                                 const float* q_smem, int c, float (&acc)[4]) {
  float part[2][kMaxHeads];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int d = Fmt<F>::dim_base(c, m >> 2);
      const float q0 = q_smem[h * kHeadDim + d + Fmt<F>::elem(m & 3, 0)];
      const float q1 = q_smem[h * kHeadDim + d + Fmt<F>::elem(m & 3, 1)];
      a += lo<Fmt<F>::kBf16>(k0[m]) * q0 + hi<Fmt<F>::kBf16>(k0[m]) * q1;
      b += lo<Fmt<F>::kBf16>(k1[m]) * q0 + hi<Fmt<F>::kBf16>(k1[m]) * q1;
    }
    part[0][h] = a, part[1][h] = b;
  }
  // Sum the four lanes of the group, then keep heads (2c, 2c+1) like the mma layout does.
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h)
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      part[s][h] += cp_shfl_xor(part[s][h], 1);
      part[s][h] += cp_shfl_xor(part[s][h], 2);
    }
#pragma unroll
  for (int h = 0; h < kMaxHeads; h += 2)
    if (h == 2 * c) acc[0] = part[0][h], acc[1] = part[0][h + 1], acc[2] = part[1][h],
                    acc[3] = part[1][h + 1];
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

// Any recorded error: later launches exit at once (the host raises; replays don't stall).
CP_DEVICE bool failed(const ScoreParams& p) { return error_code(p) != kErrNone; }

// A peer was late: the handshake of this call is broken, so stop waiting and signalling. A data
// error (bad page, short width) is not one: the call still completes its handshake.
CP_DEVICE bool handshake_failed(const ScoreParams& p) {
  const uint32_t code = error_code(p);
  return code == kErrTimeoutQueries || code == kErrTimeoutScores;
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

// ---- one item --------------------------------------------------------------------------------
// acc holds tokens tok and tok + kGroups (heads 2c, 2c + 1); tokens at or past seq_len never count.
CP_DEVICE void keep_max(float (&m)[4], const float (&acc)[4], int tok, int tok_limit) {
  if (tok < tok_limit) m[0] = fmaxf(m[0], acc[0]), m[1] = fmaxf(m[1], acc[1]);
  if (tok + kGroups < tok_limit) m[2] = fmaxf(m[2], acc[2]), m[3] = fmaxf(m[3], acc[3]);
}

// The page's max over its tokens for heads (2c, 2c + 1), in every lane, scaled.
template <int F>
CP_DEVICE void finish_page(const ScoreParams& p, const float (&m)[4], float& v0, float& v1) {
  v0 = fmaxf(m[0], m[2]);
  v1 = fmaxf(m[1], m[3]);
#pragma unroll
  for (int off = 4; off < CP_WARP; off <<= 1) {
    v0 = fmaxf(v0, cp_shfl_xor(v0, off));
    v1 = fmaxf(v1, cp_shfl_xor(v1, off));
  }
  const float scale = p.scale / Fmt<F>::kUnit;
  v0 *= scale;
  v1 *= scale;
}

template <int F>
CP_DEVICE void score_page(const ScoreParams& p, const uint8_t* page, const uint8_t* scale_page,
                          int tok_limit, const QueryFrag& q, const float* q_smem, int g, int c,
                          float& v0, float& v1) {
  // The scalar dot keeps 16 partial sums live: no room to batch loads there.
  constexpr int kWant = CP_USE_MMA ? Fmt<F>::kBatch : 1;
  constexpr int kBatch = kWant < kTilesPerPage ? kWant : kTilesPerPage;
  const float ninf = -__builtin_huge_valf();
  float m[4] = {ninf, ninf, ninf, ninf};
#if CP_USE_MMA
#pragma unroll
#else
#pragma unroll 1
#endif
  for (int t0 = 0; t0 < kTilesPerPage; t0 += kBatch) {
    TileRegs<F> regs[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) load_tile<F>(regs[b], page, scale_page, t0 + b, g, c);
#if CP_MEASURE_LOADS_ONLY
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t x = F == kNVFP4 ? regs[b].scales[s] : 0u;
#pragma unroll
        for (int l = 0; l < Fmt<F>::kLoads; ++l)
          x ^= regs[b].raw[s][l].x ^ regs[b].raw[s][l].y ^ regs[b].raw[s][l].z ^
               regs[b].raw[s][l].w;
        m[s] = fmaxf(m[s], __uint_as_float(x & 0x3fffffffu));  // keeps the loads alive
      }
    continue;
#endif
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      uint32_t k0[16], k1[16];
      unpack<F>(regs[b], 0, k0);
      unpack<F>(regs[b], 1, k1);
      float acc[4];
#if CP_USE_MMA
      tile_dot<Fmt<F>::kBf16>(k0, k1, q, q_smem, c, acc);
#else
      tile_dot_portable<F>(k0, k1, q_smem, c, acc);
#endif
      keep_max(m, acc, (t0 + b) * kTileTokens + g, tok_limit);
    }
  }
  finish_page<F>(p, m, v0, v1);
}

#if CP_SMEM_ON
// The same page through a per-warp ring of kStages tiles in shared memory: tile t + kStages - 1
// is in flight while tile t is scored. A tile's 16 rows hold its tokens in order, 16-byte chunk
// x of row r stored at chunk x ^ (r % 8), so that ldmatrix's 8 rows hit 8 different banks.
template <int F>
constexpr int kTileBytes = kTileTokens * Fmt<F>::kTokenBytes;
template <int F>
constexpr int kStages = Fmt<F>::kRing ? CP_SMEM_RING / kTileBytes<F> : 0;

template <int F>
CP_DEVICE void score_page_smem(const ScoreParams& p, const uint8_t* page, int tok_limit,
                               const QueryFrag& q, int g, int c, uint8_t* ring, float& v0,
                               float& v1) {
  constexpr int S = kStages<F>, kRow = Fmt<F>::kTokenBytes, kChunks = kRow / 16;
  const int lane = 4 * g + c;
  const uint32_t ring_addr = cp_smem_addr(ring);
  auto issue = [&](int t) {  // tile t: 512 contiguous bytes per instruction
    const uint32_t slot = ring_addr + (t % S) * kTileBytes<F>;
#pragma unroll
    for (int i = 0; i < kTileBytes<F> / (16 * CP_WARP); ++i) {
      const int id = lane + CP_WARP * i, r = id / kChunks, x = id % kChunks;
      cp_async16(slot + r * kRow + ((x ^ (r & 7)) << 4), page + t * kTileBytes<F> + id * 16);
    }
  };
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    issue(t);
    cp_async_commit();
  }
  const float ninf = -__builtin_huge_valf();
  float m[4] = {ninf, ninf, ninf, ninf};
  // ldmatrix rows: lanes 0-7 and 16-23 read tokens 0-7, lanes 8-15 and 24-31 tokens 8-15;
  // lanes 16-31 read the chunk after lanes 0-15's.
  const int r = (lane & 7) + (lane & 8), hi = lane >> 4;
#pragma unroll
  for (int t = 0; t < kTilesPerPage; ++t) {
    if (t + S - 1 < kTilesPerPage) issue(t + S - 1);
    cp_async_commit();  // empty near the end: keeps "S - 1 groups after tile t" true
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
          k[4 * u + 2 * (w >> 1)] = cp_e4m3x2_to_f16x2(x[w] & 0xffffu);
          k[4 * u + 2 * (w >> 1) + 1] = cp_e4m3x2_to_f16x2(x[w] >> 16);
        }
      }
    }
    cp_syncwarp();  // slot t % S is read before the next iteration refills it
    float acc[4];
    tile_dot<Fmt<F>::kBf16>(k0, k1, q, nullptr, c, acc);
    keep_max(m, acc, t * kTileTokens + g, tok_limit);
  }
  finish_page<F>(p, m, v0, v1);
}
#endif

// An item's row length and page id. Both loads are independent of each other (the page id is
// read even for blocks the row does not reach; it is only used for blocks it does).
struct ItemMeta {
  int len;
  int64_t page;
};

CP_DEVICE ItemMeta load_meta(const ScoreParams& p, int64_t it, int64_t items, int kw) {
  ItemMeta m = {0, -1};
  if (it >= items) return m;
  const int i = (int)(it / kw), j = p.rank + (int)(it - (int64_t)i * kw) * p.world;
  m.len = p.seq_lens[i];
  if (j < p.bt_cols) m.page = p.block_table[(int64_t)i * p.bt_row_stride + j];
  return m;
}

#if defined(CP_MIN_CTAS) && !defined(CP_HIP)  // measurement: cap registers for this many CTAs/SM
#define CP_BOUNDS __launch_bounds__(kThreads, CP_MIN_CTAS)
#else
#define CP_BOUNDS __launch_bounds__(kThreads)
#endif

template <int F, bool kPush>
__global__ void CP_BOUNDS score_kernel(const ScoreParams p, const PushState ps) {
  const int lane = threadIdx.x % CP_WARP, warp = threadIdx.x / CP_WARP;
  const int g = lane >> 2, c = lane & 3;
#if CP_USE_MMA
  float* q_smem = nullptr;
#else
  __shared__ float q_all[kWarpsPerCta][kMaxHeads * kHeadDim];
  float* q_smem = q_all[warp];
#endif
#if CP_SMEM_ON
  constexpr int kRing = kStages<F> > 0 ? kStages<F> * kTileBytes<F> : 16;
  __shared__ __align__(128) uint8_t ring_all[kWarpsPerCta][kRing];
  uint8_t* ring = ring_all[warp];
#endif
  __shared__ int cta_failed;
  __shared__ int is_last;
  uint64_t call = 0;

  if (failed(p)) return;  // an earlier call failed: the host raises; don't stall every replay
  // This warp's items: this rank's round-robin share of each row's blocks, row-major.
  const int kw = p.width > p.rank ? (p.width - p.rank + p.world - 1) / p.world : 0;
  const int64_t items = (int64_t)p.rows * kw;
  const int64_t stride = (int64_t)gridDim.x * kWarpsPerCta;
  int64_t it = (int64_t)blockIdx.x * kWarpsPerCta + warp;
#if CP_META_PREFETCH
  ItemMeta meta = load_meta(p, it, items, kw);  // its latency overlaps the handshake's wait
#endif
  if (kPush) {
    call = *ps.calls + 1;
    if (threadIdx.x == 0) cta_failed = 0;
    if ((int)blockIdx.x < p.world) {  // deliver my queries to rank (rank + blockIdx.x) % world
      const int dest = (p.rank + (int)blockIdx.x) % p.world;
      const uint4* src = reinterpret_cast<const uint4*>(ps.q_src);
      uint4* dst = reinterpret_cast<uint4*>(ps.peer_q_slot[dest]);
      for (int64_t i = threadIdx.x; i < ps.q_bytes / 16; i += kThreads) dst[i] = src[i];
      cp_fence_sys();
      __syncthreads();
      if (threadIdx.x == 0) cp_store_release_sys(ps.peer_q_flag[dest], call);
    }
    if ((int)threadIdx.x < p.world &&
        !wait_flag(p, ps.q_flags + threadIdx.x, call, ps.timeout_ticks, kErrTimeoutQueries,
                   threadIdx.x))
      cta_failed = 1;
    __syncthreads();
  }

  if (!kPush || !cta_failed) {
    const float ninf = -__builtin_huge_valf();
    QueryFrag q;
    int cur_row = -1;
    for (; it < items; it += stride) {
      // The next item's length and page go out now, so their latency hides behind this page.
#if CP_META_PREFETCH
      const ItemMeta cur = meta;
      meta = load_meta(p, it + stride, items, kw);
#else
      const ItemMeta cur = load_meta(p, it, items, kw);
#endif
      const int i = (int)(it / kw), k = (int)(it - (int64_t)i * kw);
      const int j = p.rank + k * p.world;
      const int len = cur.len;
      const int n = len > 0 ? (len + kPageTokens - 1) / kPageTokens : 0;
      if (k == 0 && lane == 0 && (n > p.width || n > p.bt_cols))  // checked once per row
        report(p, kErrWidth, (uint32_t)i, call, (uint64_t)n);
      float v0, v1;
      if (j >= n) {
        v0 = v1 = ninf;
      } else if (j >= n - p.local_blocks) {
        v0 = v1 = kForcedLocal;
      } else if (j < p.init_blocks) {
        v0 = v1 = kForcedInit;
      } else {
        const int64_t page = cur.page;
        if (page < 0 || page >= p.num_pages) {
          if (lane == 0) report(p, kErrBadPage, (uint32_t)i, call, (uint64_t)j);
          v0 = v1 = __builtin_nanf("");
        } else {
          if (i != cur_row) {
            prepare_query<F>(p, i, g, c, q, q_smem);
            cur_row = i;
          }
#if CP_SMEM_ON
          if constexpr (kStages<F> > 0)
            score_page_smem<F>(p, p.kv + page * p.kv_page_stride, len - j * kPageTokens, q, g,
                               c, ring, v0, v1);
          else
#endif
            score_page<F>(p, p.kv + page * p.kv_page_stride,
                          F == kNVFP4 ? p.ks + page * p.ks_page_stride : nullptr,
                          len - j * kPageTokens, q, q_smem, g, c, v0, v1);
        }
      }
      if (g == 0) {  // lanes 0..3 hold heads (2c, 2c+1)
        const int col = p.shard_columns ? k : j;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = 2 * c + e;
          if (h >= p.num_heads) break;
          for (int cp = 0; cp < p.dst_copies; ++cp)
            p.dst[h * p.dst_copies + cp][(int64_t)i * p.out_row_stride + col] = e ? v1 : v0;
        }
      }
    }
  }

  if (!kPush) return;
  // Completion: the last CTA to finish signals every peer and waits for every peer's scores.
  cp_fence_sys();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(ps.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  cp_fence_sys();
  if (!handshake_failed(p)) {
    if ((int)threadIdx.x < p.world) cp_store_release_sys(ps.peer_s_flag[threadIdx.x], call);
    if ((int)threadIdx.x < p.world)
      wait_flag(p, ps.s_flags + threadIdx.x, call, ps.timeout_ticks, kErrTimeoutScores,
                threadIdx.x);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *ps.ticket = 0u;
    *ps.calls = call;
  }
}

template <int F>
int launch_format(const ScoreParams& p, const PushState* push, int grid, void* stream) {
  const PushState none = {};
  if (push != nullptr)
    score_kernel<F, true><<<grid, kThreads, 0, (cp_stream_t)stream>>>(p, *push);
  else
    score_kernel<F, false><<<grid, kThreads, 0, (cp_stream_t)stream>>>(p, none);
  return (int)cp_get_last_error();
}

template <int F>
int occupancy_format(bool push, int* ctas) {
  return push ? (int)cp_occupancy(ctas, score_kernel<F, true>,
                                                                   kThreads, 0)
              : (int)cp_occupancy(ctas, score_kernel<F, false>,
                                                                   kThreads, 0);
}

}  // namespace

int launch_score(const ScoreParams& p, const PushState* push, int format, int grid, void* stream) {
  switch (format) {
    case kBF16: return launch_format<kBF16>(p, push, grid, stream);
    case kFP8: return launch_format<kFP8>(p, push, grid, stream);
    case kNVFP4: return launch_format<kNVFP4>(p, push, grid, stream);
    default: return -1;
  }
}

int score_occupancy(int format, bool push, int* ctas_per_sm) {
  switch (format) {
    case kBF16: return occupancy_format<kBF16>(push, ctas_per_sm);
    case kFP8: return occupancy_format<kFP8>(push, ctas_per_sm);
    case kNVFP4: return occupancy_format<kNVFP4>(push, ctas_per_sm);
    default: return -1;
  }
}

}  // namespace cpindex
