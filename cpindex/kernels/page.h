// page.h: scoring one page: causal cuts, masks and maxima, from registers or
// through the cp.async ring.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "dot.h"

namespace cpindex {
namespace {

#if CP_MFMA
// Per-lane causal cuts of a pass: the lane's vector of each N-tile (mfma.h, pass_cuts).
template <int NT>
struct Cuts {
  int cut[1][mfma::kNTiles<NT>];
};

template <int NT>
CP_DEVICE Cuts<NT> pass_cuts(const ScoreParams& p, int v0, int lane) {
  Cuts<NT> cuts;
  const DeviceWave w{lane};
  mfma::pass_cuts<NT>(w, v0, p.query_len, [&](int v) { return div_small(v, p.heads_magic); },
                      cuts.cut);
  return cuts;
}
#else
// Per-lane causal cuts of a pass: vector (u, e) = pass vector 8u + 2c + e belongs to query token
// t, whose causal length is the request's minus (T - 1 - t). cut[u][e] = T - 1 - t.
template <int NT>
struct Cuts {
  int cut[NT][2];
};

template <int NT>
CP_DEVICE Cuts<NT> pass_cuts(const ScoreParams& p, int v0, int lane) {
  const int c = lane & 3;
  Cuts<NT> cuts;
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      cuts.cut[u][e] = p.query_len - 1 - div_small(v0 + kVecsPerTile * u + 2 * c + e, p.heads_magic);
  return cuts;
}
#endif

// acc holds tokens tok and tok + kGroups; a token at or past its row's causal length never
// counts. limit = tokens of this page the request's last row sees; full: every row sees all 128.
// kBranch: test `full` once (it is warp-uniform) instead of folding it into every value's
// compare: the warpgroup instance's register path gains from the branch; the other paths are
// faster with the compare folded in (docs/kernel.md).
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

#if CP_MFMA
// kTiles tiles of the page from tile t_first (a whole page, or a warp's part of a split page)
// through the matrix cores: mfma.h's score_tiles, with this lane as the wave.
template <int F, int NT, bool W, int kTiles>
CP_DEVICE void score_page(const ScoreParams& p, const uint8_t* page, const uint8_t* scale_page,
                          int limit, bool full, const Cuts<NT>& cuts, const QueryFrag<NT, W>& q,
                          const float*, const uint4*, const uint2* lut8, int g, int c, int t_first,
                          float (&val)[NT][2]) {
  static_assert(kTileTokens == 2 * mfma::kTileM, "a tile is two MFMA tiles (the emulator's too)");
  DeviceWave w{4 * g + c};
  const int64_t stride = kFp4<F> ? p.kv_token_stride : Fmt<F>::kTokenBytes;
  float v[1][NT][2];
  mfma::score_tiles<F, CP_FP8_FNUZ, NT, kTiles * kTileTokens / mfma::kTileM>(
      w, page, stride, scale_page, p.ks_token_stride, reinterpret_cast<const uint32_t*>(lut8), q.b,
      t_first * kTileTokens, limit, full, cuts.cut, p.scale, v);
#pragma unroll
  for (int u = 0; u < NT; ++u) val[u][0] = v[0][u][0], val[u][1] = v[0][u][1];
}
#else
// kTiles tiles of the page from tile t_first (a whole page, or a warp's part of a split page).
template <int F, int NT, bool W, int kTiles>
CP_DEVICE void score_page(const ScoreParams& p, const uint8_t* page, const uint8_t* scale_page,
                          int limit, bool full, const Cuts<NT>& cuts, const QueryFrag<NT, W>& q,
                          const float* q_smem, const uint4* lut, const uint2* lut8, int g, int c,
                          int t_first, float (&val)[NT][2]) {
  // The scalar dot keeps 16 partial sums live: no room to batch loads there. On tensor cores
  // only nvfp4 comes here (bf16 and fp8 take the ring); more query tiles hold more registers, so
  // fewer tiles are loaded ahead, and the warpgroup instance's queries are in shared memory.
  static_assert(!CP_USE_MMA || kFp4<F>, "bf16 and fp8 keys reach the tensor cores by the ring");
  constexpr int kWant = !CP_USE_MMA ? 1 : W ? kNvfp4BatchWg : kNvfp4Batch / NT;
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
#endif

// A page of a stream: its key bytes, the tokens of it the request's last row sees (limit) and
// whether every row sees all 128 (full).
struct PageRef {
  const uint8_t* kv;
  const uint8_t* ks;  // nvfp4 scales (null otherwise)
  int limit;
  bool full;
};

#if CP_USE_MMA
// bf16 and fp8 keys reach the mma through a per-warp ring of kStages tiles in shared memory. A
// tile's 16 rows hold its tokens in order, 16-byte chunk x of row r stored at chunk x ^ (r % 8),
// so that ldmatrix's 8 rows hit 8 different banks.
template <int F>
constexpr int kTileBytes = kTileTokens * Fmt<F>::kTokenBytes;
template <int F>
constexpr int kStages = Fmt<F>::kRing ? kRingTiles : 0;
// A warp's ring in instance S (0: whole pages, else the split-page instances, where it holds a
// warp's part of a page, kSplitTiles tiles, all in flight at once).
template <int F, int S>
constexpr int kWarpRingBytes = (S ? kSplitTiles : kStages<F>) * kTileBytes<F>;

// Tile t of a page into a ring slot: 512 contiguous bytes per instruction.
template <int F>
CP_DEVICE void issue_tile(uint32_t slot, const uint8_t* page, int t, int lane) {
  constexpr int kRow = Fmt<F>::kTokenBytes, kChunks = kRow / 16;
#pragma unroll
  for (int i = 0; i < kTileBytes<F> / (16 * CP_WARP); ++i) {
    const int id = lane + CP_WARP * i, r = id / kChunks, x = id % kChunks;
    cp_async16(slot + r * kRow + ((x ^ (r & 7)) << 4), page + t * kTileBytes<F> + id * 16);
  }
}

// A tile's keys from its ring slot, paired as the mma takes them. ldmatrix rows: lanes 0-7 and
// 16-23 read tokens 0-7, lanes 8-15 and 24-31 tokens 8-15; lanes 16-31 read the chunk after
// lanes 0-15's.
template <int F>
CP_DEVICE void read_tile(uint32_t slot, int lane, uint32_t (&k0)[16], uint32_t (&k1)[16]) {
  constexpr int kRow = Fmt<F>::kTokenBytes, kChunks = kRow / 16;
  const int r = (lane & 7) + (lane & 8), hi = lane >> 4;
  const uint32_t row = slot + r * kRow;
#pragma unroll
  for (int u = 0; u < kChunks / 2; ++u) {  // chunks 2u, 2u + 1 of tokens 0-15
    uint32_t x[4];
    cp_ldmatrix_x4(row + (((2 * u + hi) ^ (r & 7)) << 4), x);
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
}

// A stream of m pages through the ring: tile t + kStages - 1 is in flight while tile t is
// scored, across page boundaries too, so a warp's next page is already arriving while it
// finishes the current one. page_of(r) gives page r (a warp-wide call); done(r, val) takes its
// maxima.
template <int F, int NT, bool W, typename PageOf, typename Done>
CP_DEVICE void score_pages_smem(const ScoreParams& p, int m, PageOf page_of, const Cuts<NT>& cuts,
                                const QueryFrag<NT, W>& q, int g, int c, uint8_t* ring, Done done) {
  constexpr int S = kStages<F>;
  // A page's tiles fill whole turns of the ring, so tile t of any page sits in slot t % S.
  static_assert(S >= 2 && kTilesPerPage % S == 0, "the ring must divide a page");
  const int lane = 4 * g + c;
  const uint32_t ring_addr = cp_smem_addr(ring);
  auto issue = [&](const uint8_t* page, int t) {
    issue_tile<F>(ring_addr + (t % S) * kTileBytes<F>, page, t, lane);
  };
  PageRef cur = page_of(0);
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    issue(cur.kv, t);
    cp_async_commit();
  }
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
      uint32_t k0[16], k1[16];
      read_tile<F>(ring_addr + (t % S) * kTileBytes<F>, lane, k0, k1);
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

// kTiles tiles of a page from tile t_first: a warp's part of a split page. The part fits the
// ring, so all its tiles are in flight at once (a split call has few pages: what it waits for is
// their round trip, not their bytes).
template <int F, int NT, bool W, int kTiles, typename Q>
CP_DEVICE void score_part_smem(const ScoreParams& p, const PageRef& pr, const Cuts<NT>& cuts,
                               const Q& q, int g, int c, uint8_t* ring, int t_first,
                               float (&val)[NT][2]) {
  static_assert(kTiles <= kSplitTiles, "a split page's part fits the ring");
  const int lane = 4 * g + c;
  const uint32_t ring_addr = cp_smem_addr(ring);
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
    issue_tile<F>(ring_addr + t * kTileBytes<F>, pr.kv, t_first + t, lane);
  cp_async_commit();
  cp_async_wait<0>();
  cp_syncwarp();  // every lane's copies are visible to every lane
  float m[NT][4];
  init_max(m);
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    uint32_t k0[16], k1[16];
    read_tile<F>(ring_addr + t * kTileBytes<F>, lane, k0, k1);
    float acc[NT][4];
    tile_dot<F, NT, W>(k0, k1, q, nullptr, c, acc);
    keep_max<NT, false>(m, acc, (t_first + t) * kTileTokens + g, pr.limit, pr.full, cuts);
  }
  cp_syncwarp();  // the ring is read before this warp's next part refills it
  finish_page<NT>(p, m, val);
}
#endif

}  // namespace
}  // namespace cpindex
