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
//
// The parts, in the order they build on each other: config.h (shared constants),
// keys.h (formats), dot.h (tile dot products), waits.h (error word, bounded waits), page.h
// (one page), select.h (select_blocks' selection), write.h (the key writer, its own kernel); this
// file holds the scoring kernel and its launcher. AMD builds score pages with the matrix cores
// through mfma.h (its fragment code also compiles for the host: tests/test_amd_emulation.py).
#include <atomic>
#include <type_traits>

#include "config.h"
#include "keys.h"
#include "dot.h"
#include "waits.h"
#include "agree.h"
#include "page.h"
#include "select.h"
#include "write.h"

namespace cpindex {
namespace {

// What one lane writes of each item of a pass: vector v's head, output row and causal cut
// (computed once per pass, not per item).
struct VecOut {
  bool on;  // a vector of this pass
  int h, row, cut;
};

[[maybe_unused]]  // as write_score: no scoring instance uses it in the base module
CP_DEVICE VecOut vec_out(const ScoreParams& p, const Vecs& vs, int req, int v, bool on) {
  const int t = div_small(v, p.heads_magic);
  return {on && v < vs.count, v - t * vs.heads, req * vs.query_len + t, vs.query_len - 1 - t};
}

// Item (request, block j) of one pass, one vector per lane: the lane's row's value with the row's
// own causal length and the contract's forcing order. col is j (full layout) or the rank's shard
// column k.
[[maybe_unused]]  // the base module (CP_FORMATS 0, kernels/build.py) has no scoring instance
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

// Dynamic shared memory of an instance: its warps' cp.async rings (none without them).
template <int F, int S>
constexpr int kDynSmem =
#if CP_USE_MMA
    Fmt<F>::kRing ? kWarpsPerCta * kWarpRingBytes<F, S> : 0;
#else
    0;
#endif

// bf16 quarter pages with four query tiles keep the pass's queries in shared memory (QuerySmem,
// dot.h) instead of 64 registers: 4 CTAs per SM instead of 2. With one or two tiles registers do
// not limit them (docs/kernel.md, "Tried and not shipped").
template <int F, int NT, int S>
constexpr bool kQuerySmem = CP_USE_MMA && F == kBF16 && S == kWarpsPerCta && NT == 4;

// CTAs per SM the register allocation must leave room for (CUDA): ptxas otherwise spends
// registers where they buy nothing, and a step down in occupancy costs more than a little
// scheduling freedom. The tile count per pass sets how much each warp must hold; the split-page
// instances (S) take their whole-page instance's target.
// Four query tiles with mma.sync: 0 leaves ptxas its own choice (255 registers, 2 CTAs); a
// 3-CTA cap spills a little, which costs small batches more than it gains large ones. The
// quarters that keep their queries in shared memory are built for 3: ptxas takes 122 registers
// (4 CTAs fit), where a 4-CTA cap (128) spills inside the page loop. fp8's four-tile halves are
// built for 2: left to itself ptxas took 168 registers and spilled around each group, which cost
// the small calls that split (docs/kernel.md, "Registers").
template <int F, int NT, bool W, int S>
constexpr int kMinCtas = kQuerySmem<F, NT, S> ? 3
                         : W                  ? (F == kBF16 ? 3 : 4)
                         : NT == 4            ? (F == kFP8 && S == 2 ? 2 : 0)
                         : NT == 2            ? (F == kBF16 ? 3 : 4)
                                              : (F == kFP8 ? 5 : 4);
#if CP_USE_MMA  // the tensor-core instances; the portable path keeps ptxas's choice
#define CP_BOUNDS __launch_bounds__(kThreads, (kMinCtas<F, NT, W, S>))
#else
#define CP_BOUNDS __launch_bounds__(kThreads)
#endif

// The largest group of consecutive blocks a warp takes. The ring formats gain from groups only
// with four query tiles (two CTAs per SM, where a page's start and the query loads are not hidden
// by other warps); with fewer tiles more CTAs share an SM and hide them, and single blocks are
// faster.
template <int F, int NT>
constexpr int kGroupMaxOf = Fmt<F>::kRing && NT < 4 ? 1 : kGroupMax;

// ---- the kernel ---------------------------------------------------------------------------------
// NT: query n-tiles per pass (tensor cores; 1 on the portable path). A request with more than
// 8 * NT vectors takes several passes over a page; the later passes find it in L2. W: the
// warpgroup-mma instance (CP_WGMMA builds, NT = 4), whose unit of work is the CTA. S: the
// split-page instances (S = 4 or 2 warps per page, 0 for whole pages), whose unit of work is
// the S warps that share a page.
template <int F, int NT, bool W, int S>
__global__ void CP_BOUNDS score_kernel(const ScoreParams p, const PushState ps) {
  static_assert(!W || (CP_WGMMA && NT == 4), "the warpgroup mma takes four query tiles, sm_90a");
  static_assert(!S || !W, "split pages: without the wgmma");
  static_assert(S == 0 || S == 2 || S == kWarpsPerCta, "split pages over 2 or 4 warps");
  const int lane = threadIdx.x % CP_WARP, warp = threadIdx.x / CP_WARP;
  const int g = lane >> 2, c = lane & 3;
  const bool push = ps.calls != nullptr;
#if CP_USE_MMA || CP_MFMA
  float* q_smem = nullptr;
#else
  __shared__ float q_all[kWarpsPerCta][kVecsPerTile * kHeadDim];
  float* q_smem = q_all[warp];
#endif
#if CP_USE_MMA
  extern __shared__ __align__(128) uint8_t ring_all[];  // the warps' rings (kDynSmem bytes)
  uint8_t* ring = ring_all + warp * kWarpRingBytes<F, S>;
#endif
  __shared__ uint4 lut[kLut16<F> ? 256 : 1];
  __shared__ uint2 lut8[kLut8<F, NT, W> ? 256 : 1];
  // A group's maxima until it is written: per warp, or per CTA where the warps share a group.
  // A split page's warp keeps a row per part it scored (two where two warps share a page).
  constexpr int kStashRows = kGroupMax > 2 ? kGroupMax : 2;  // per warp
  __shared__ float stash_all[kWarpsPerCta * kStashRows][kVecsPerTile * NT];
  float(*stash)[kVecsPerTile * NT] = stash_all + (W ? 0 : warp * kStashRows);
#if CP_USE_MMA
  // B operand (warpgroup mma), or the queries of quarter pages (QuerySmem)
  __shared__ __align__(128) uint8_t q_b[W ? 8 * 1024 : kQuerySmem<F, NT, S> ? NT * 2048 : 16];
#endif
  __shared__ int cta_failed;
  __shared__ int is_last;
  __shared__ unsigned long long hash_part;  // this CTA's part of the agreement hash (agree.h)
  uint64_t call = 0;

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
      if constexpr (kLut16<F>) lut_ld[r] = reinterpret_cast<const uint4*>(p.fp4_lut)[i];
      if constexpr (kLut8<F, NT, W>) lut8_ld[r] = reinterpret_cast<const uint2*>(p.fp4_lut + 4096)[i];
    }
  }
  // An earlier call failed and the host raises at its next check. A pushed call stops here so
  // that replays do not wait on peers; a local call has nothing to wait for, and the check's
  // round trip would come before its first key byte.
  if (push && failed(p)) return;
#pragma unroll
  for (int r = 0; r < kLutLoads; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (i < 256) {
      if constexpr (kLut16<F>) lut[i] = lut_ld[r];
      if constexpr (kLut8<F, NT, W>) lut8[i] = lut8_ld[r];
    }
  }
  if (threadIdx.x == 0) cta_failed = 0, hash_part = 0ull;
  __syncthreads();

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
        *reinterpret_cast<volatile uint64_t*>(ps.peer_q_tag[dest]) = p.tag;
        cp_store_release_sys(ps.peer_q_flag[dest], call);
      }
    }
    // Warp 0 waits for the peers' queries; meanwhile the other warps sum the agreement hash.
    if (warp > 0) {
      if (p.agree) agreement_hash(p, &hash_part, CP_WARP);
    } else if ((int)threadIdx.x < p.world) {
      if (!wait_flag(p, ps.q_flags + threadIdx.x, call, ps.timeout_ticks, kErrTimeoutQueries,
                     threadIdx.x)) {
        cta_failed = 1;
      } else {  // the peer's call must be this call: same shape, forcing and configuration
        const uint64_t theirs = *reinterpret_cast<volatile const uint64_t*>(ps.q_idents + threadIdx.x);
        const uint64_t tag = *reinterpret_cast<volatile const uint64_t*>(ps.q_tags + threadIdx.x);
        if (theirs != p.ident) {
          report(p, kErrMismatch, threadIdx.x, call, theirs);
          cta_failed = 1;
        } else if (tag != p.tag) {  // the same call shape, but not the call the caller tagged
          report(p, kErrTag, threadIdx.x, call, tag, p.tag);
          cta_failed = 1;
        }
      }
    }
    __syncthreads();
    if (p.agree && threadIdx.x == 0) publish_agreement_part(ps, call, hash_part);
    if (p.agree && !cta_failed) check_replicas(p, ps, call);
  }

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
    // once): ks warps take one item at a time and score a part of the page each (a quarter, or
    // half where a CTA per item would not fit), combining their maxima through the stash. A
    // call of few pages then has two or four times the warps loading and decoding. A CTA holds
    // 4 / ks such units; their loops run in step (same trip counts), since a CTA's barriers
    // wait for all four warps. Its own instance, so that the whole-page loops keep their
    // register allocation.
    constexpr int kSpan = W ? kWarpsPerCta : 1;  // warps that share a group
    constexpr bool split = S > 0;
    constexpr int ks = split ? S : kWarpsPerCta;                            // warps per split page
    constexpr int per_cta = W ? 1 : split ? kWarpsPerCta / ks : kWarpsPerCta;  // units of work
    constexpr int parts = kWarpsPerCta / ks;  // split: a warp's parts of a page, kSplitTiles each
    const int sharer = ks < kWarpsPerCta ? warp % ks : warp;  // index among a page's warps
    const int64_t units = (int64_t)gridDim.x * per_cta;
    int group = 1;
    if (!split && (vs.count <= per_pass || W)) {
      const int most = vs.count <= per_pass ? kSpan * kGroupMaxOf<F, NT> : kSpan;
      int64_t best = -1;
      for (int gs = 1; gs <= most; ++gs) {
        const int64_t rounds = ((int64_t)p.requests * ((kw + gs - 1) / gs) + units - 1) / units;
        const int64_t cost = rounds * ((gs + kSpan - 1) / kSpan);
        if (best < 0 || cost <= best) best = cost, group = gs;
      }
    }
    const int per_req = (kw + group - 1) / group;
    const int64_t groups = (int64_t)p.requests * per_req;
#if CP_USE_MMA
    using Query = std::conditional_t<kQuerySmem<F, NT, S>, QuerySmem<NT>, QueryFrag<NT, W>>;
    Query q;
    if constexpr (W) q.smem = cp_smem_addr(q_b);
    if constexpr (kQuerySmem<F, NT, S>) q.smem = cp_smem_addr(q_b) + lane * 8;
#else
    QueryFrag<NT, W> q;
#endif
    int cur_req = -1, cur_v0 = -1;
    const int64_t first = W || split ? (int64_t)blockIdx.x * per_cta
                                     : (int64_t)blockIdx.x * kWarpsPerCta + warp;
    for (int64_t gi0 = first; gi0 < groups; gi0 += units) {
      // A split CTA's units take groups gi0, gi0 + 1, ...; one past the last group has no items
      // and only meets the CTA's barriers.
      const int64_t gi = per_cta > 1 && split ? gi0 + warp / ks : gi0;
      const bool idle = per_cta > 1 && split && gi >= groups;
      const int64_t gq = idle ? groups - 1 : gi;
      const int i = (int)(gq / per_req), k0 = (int)(gq - (int64_t)i * per_req) * group;
      const int count = idle ? 0 : kw - k0 < group ? kw - k0 : group;
      // Lane l < count looks at item k0 + l, block j. Its page id, the request's length and (one
      // pass, warps on their own) its queries are loaded before any of them is used, so their
      // round trips overlap instead of following one another; a page id past the request's
      // length is loaded for nothing (the table has bt_cols columns, so it is in bounds).
      const int j = p.rank + (k0 + lane) * p.world;
      const int64_t pg_ld =
          lane < count && j < p.bt_cols ? p.block_table[(int64_t)i * p.bt_row_stride + j] : -1;
      const int len = p.seq_lens[i];
      if constexpr (!W) {
        if (vs.count <= per_pass && i != cur_req && !idle) {
          prepare_query<F, NT, W>(p, vs, i, 0, g, c, q, q_smem);
          cur_req = i, cur_v0 = 0;
        }
      }
      const int n = len > 0 ? (len + kPageTokens - 1) / kPageTokens : 0;  // the last row's blocks
      const bool reporter = (!W && !split) || sharer == 0;  // warps sharing a group: once
      if (k0 == 0 && lane == 0 && reporter && !idle) {  // checked once per request
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
        const Cuts<NT> cuts = pass_cuts<NT>(p, v0, lane);
        if (reads > 0) {
          if (i != cur_req || v0 != cur_v0) {
            prepare_query<F, NT, W>(p, vs, i, v0, g, c, q, q_smem);
            cur_req = i, cur_v0 = v0;
          }
          // Maxima wait in shared memory until the group is scored: writing them from inside
          // the stream would keep every row's output address live across it.
          auto keep = [&](int row, const float (&val)[NT][2]) {
            if (g == 0)
#pragma unroll
              for (int u = 0; u < NT; ++u)
#pragma unroll
                for (int e = 0; e < 2; ++e) stash[row][kVecsPerTile * u + 2 * c + e] = val[u][e];
          };
          auto done = [&](int x, const float (&val)[NT][2]) {
            const int r = read_index(x);
            if (W && r >= reads) return;
            keep(cp_shfl_int(mine, r), val);
          };
#if CP_USE_MMA
          if constexpr (Fmt<F>::kRing && !split) {
            score_pages_smem<F, NT, W>(p, streamed, page_of, cuts, q, g, c, ring, done);
          } else
#endif
          {
            for (int x = 0; x < streamed; ++x) {
              const PageRef pr = page_of(x);
              float val[NT][2];
              if constexpr (split) {  // parts of kSplitTiles tiles, each's maxima in a stash row
                const int first_part = sharer * parts;
#pragma unroll 1
                for (int h = 0; h < parts; ++h) {
                  const int t0 = (first_part + h) * kSplitTiles;
#if CP_USE_MMA
                  if constexpr (Fmt<F>::kRing)
                    score_part_smem<F, NT, W, kSplitTiles>(p, pr, cuts, q, g, c, ring, t0, val);
                  else
#endif
                    score_page<F, NT, W, kSplitTiles>(p, pr.kv, pr.ks, pr.limit, pr.full, cuts,
                                                      q, q_smem, lut, lut8, g, c, t0, val);
                  keep(h, val);  // a split CTA's unit has one item
                }
              } else {
                score_page<F, NT, W, kTilesPerPage>(p, pr.kv, pr.ks, pr.limit, pr.full, cuts, q,
                                                    q_smem, lut, lut8, g, c, 0, val);
                done(x, val);
              }
            }
          }
          cp_syncwarp();
        }
        if constexpr (W || split) __syncthreads();  // every warp's maxima are in the stash
        // Every item, read or not: lane x of slice y writes pass vector x of the y-th item of
        // each round (a slice per item: all of a warp's lanes store at once).
        constexpr int kSlices = CP_WARP / (kVecsPerTile * NT);
        const int xv = lane % per_pass, slice = lane / per_pass;
        const VecOut o = vec_out(p, vs, i, v0 + xv, slice < kSlices);
        const bool writer = !split || sharer == 0;  // a split page's item is written once
        for (int l0 = W ? warp : 0; writer && l0 < count; l0 += kSpan * kSlices) {
          const int l = l0 + kSpan * slice, src = l < count ? l : 0;
          const bool rd = cp_shfl_int(read, src), bd = cp_shfl_int(bad, src);
          if (l < count) {
            float val = rd ? stash[l][xv] : 0.f;
            if (split && rd)  // every part: warp w's rows start kStashRows rows on, l is 0
              for (int r = 1; r < kWarpsPerCta; ++r)
                val = fmaxf(val, stash[r / parts * kStashRows + r % parts][xv]);
            write_score(p, o, p.rank + (k0 + l) * p.world, k0 + l, len, bd, val);
          }
        }
        if constexpr (W || split) __syncthreads();  // the stash is refilled by the next pass/group
        else cp_syncwarp();
      }
    }
  }

  if (!push) return;
  const bool select = p.topk > 0;
  if (select) {  // every CTA's shard columns are written before any CTA selects from them
    cp_fence_gpu();  // the shard is this GPU's memory: device scope orders it
    if (!grid_barrier(p, ps, call)) cta_failed = 1;
    if (!cta_failed) select_local(p);
  }
  // Completion: the last CTA to finish signals every peer; it (and, when selecting, every CTA
  // with candidates to merge) waits for every peer's signal.
  cp_fence_sys();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(ps.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  // merge_candidates' items, a warp each over the grid: the CTAs past them have none to wait for
  const int64_t merges = (int64_t)p.requests * p.query_len * p.heads_per_rank;
  const bool merger = select && (int64_t)blockIdx.x * kWarpsPerCta < merges;
  if (!is_last && !merger) return;
  if (is_last) cp_fence_sys();  // every CTA's writes (seen through the ticket) before the release
  __shared__ uint64_t fp_mine;
  if (is_last && p.agree && threadIdx.x == 0) fp_mine = take_agreement_hash(ps, call);
  __syncthreads();
  if (!handshake_failed(p)) {
    if (is_last && (int)threadIdx.x < p.world) {
      // the hash goes out with the score flag; the release orders it before the flag
      if (p.agree) *reinterpret_cast<volatile uint64_t*>(ps.peer_fp[threadIdx.x]) = fp_mine;
      cp_store_release_sys(ps.peer_s_flag[threadIdx.x], call);
    }
    if ((int)threadIdx.x < p.world &&
        !wait_flag(p, ps.s_flags + threadIdx.x, call, ps.timeout_ticks, kErrTimeoutScores,
                   threadIdx.x))
      cta_failed = 1;
  }
  __syncthreads();
  // Every rank's hash is in (or the handshake failed): compare, and poison this rank's outputs
  // when the ranks disagreed, so that no mix of their data is ever read as a result.
  __shared__ int agree_check, poisoned;
  if (threadIdx.x == 0) agree_check = p.agree && !cta_failed && !handshake_failed(p);
  __syncthreads();
  // This CTA's own comparison decides (another CTA may hold the error word's claim and not
  // have written its code yet); the code adds a replica mismatch found while scoring.
  const bool agreed = agree_check ? hashes_agree(p, ps, call) : true;
  if (threadIdx.x == 0) {
    const uint32_t code = error_code(p);
    poisoned = p.agree && (!agreed || code == kErrAgreement || code == kErrReplica);
  }
  __syncthreads();
  if (poisoned) poison_outputs(p, threadIdx.x, kThreads);
  else if (merger && !cta_failed && !handshake_failed(p)) merge_candidates(p);
  if (is_last && threadIdx.x == 0) {
    *ps.ticket = 0u;
    *ps.barrier = 0u;
    *ps.calls = call;
  }
}

// The collective transport's work around its all-to-all (transports/collective.py), kernels of
// their own so that the scoring instances keep their tuned register allocation.
// after_local_kernel runs right after a local call's scoring (launch_score, when p.trailer > 0 or
// p.topk > 0): the agreement (agree.h) and, for select_blocks, the shard's top k per (row, head)
// as keys into the all-to-all's send buffer (select_local, cand_dst). Where the ranks disagree,
// score_push's shard is overwritten with NaN; select_blocks sends nothing new, and its merge
// (merge_kernel, launch_merge, after the all-to-all) writes NaN scores and -1 ids instead.
constexpr int kAgreeCtas = 16;  // the agreement alone: a few words, and a poisoning to share
constexpr int kMaxWarpGrid = 4096;

// CTAs for `items` warp items (select_local, merge_candidates loop over the grid).
int warp_grid(int64_t items) {
  const int64_t ctas = (items + kWarpsPerCta - 1) / kWarpsPerCta;
  return ctas < 1 ? 1 : ctas > kMaxWarpGrid ? kMaxWarpGrid : (int)ctas;
}

__global__ void __launch_bounds__(kThreads) after_local_kernel(const ScoreParams p) {
  const bool agreed = p.trailer <= 0 || trailers_agree(p);
  if (p.topk > 0) {
    if (agreed) select_local(p);
    // A world of one whose candidates land where its merge reads them (the local path below
    // the CP gate): each warp merges the items it has just selected (merge_candidates walks
    // the same (row, head) items over the same grid), so no merge launch follows.
    if (agreed && p.world == 1 && p.cand == p.cand_dst[0]) {
      cp_syncwarp();  // the warp's candidate stores before its lanes read them
      merge_candidates(p);
    }
  } else if (!agreed) {
    poison_outputs(p, (int64_t)blockIdx.x * kThreads + threadIdx.x, (int64_t)gridDim.x * kThreads);
  }
}

__global__ void __launch_bounds__(kThreads) merge_kernel(const ScoreParams p) {
  if (p.trailer > 0 && p.local_state[1] != 0)  // this call's verdict (after_local_kernel)
    poison_outputs(p, (int64_t)blockIdx.x * kThreads + threadIdx.x, (int64_t)gridDim.x * kThreads);
  else
    merge_candidates(p);
}

// One CTA of 1024 threads: a decode step's table is at most a few hundred thousand entries.
constexpr int kFingerprintThreads = 1024;

__global__ void __launch_bounds__(kFingerprintThreads)
    plan_fingerprint_kernel(const FingerprintParams f) {
  plan_fingerprint_cta(f);
}

// Allows instance (F, NT, W, S) its dynamic shared memory beyond the default 48 KiB, once per
// device of this process (the limit is a per-device attribute of the function).
template <int F, int NT, bool W, int S>
int allow_smem() {
  constexpr int bytes = kDynSmem<F, S>;
  if constexpr (bytes <= 48 * 1024) {
    return 0;
  } else {
    static std::atomic<uint64_t> done{0};
    int dev = 0;
    int rc = (int)cp_get_device(&dev);
    if (rc != 0) return rc;
    const uint64_t bit = dev < 64 ? 1ull << dev : 0ull;
    if (bit && (done.load(std::memory_order_relaxed) & bit)) return 0;
    const auto kernel = score_kernel<F, NT, W, S>;
    rc = (int)cp_func_max_dyn_smem(kernel, bytes);
    if (rc == 0) done.fetch_or(bit, std::memory_order_relaxed);
    return rc;
  }
}

template <int F, int NT, bool W, int S>
int launch_instance(const ScoreParams& p, const PushState* push, int grid, cp_stream_t stream) {
  const int rc = allow_smem<F, NT, W, S>();
  if (rc != 0) return rc;
  const PushState none = {};
  score_kernel<F, NT, W, S><<<grid, kThreads, kDynSmem<F, S>, stream>>>(p, push ? *push : none);
  return (int)cp_get_last_error();
}

// CTAs per SM of an instance (a push grid must be resident at once, so each instance's grid is
// sized on its own occupancy).
template <int F, int NT, bool W, int S>
int occupancy_instance(int* ctas) {
  const int rc = allow_smem<F, NT, W, S>();
  if (rc != 0) return rc;
  return (int)cp_occupancy(ctas, score_kernel<F, NT, W, S>, kThreads, kDynSmem<F, S>);
}

// The instances a module holds (kernels/variants.py's instances() states the same list; the
// build checks that they agree): for its formats (CP_FORMATS), whole pages and both splits of
// one query tile, and of two and four on the tensor-core and matrix-core paths; the four-tile
// warpgroup-mma instance on sm_90a. Each split is its own instance: a runtime split count would
// cost the four-warp instance registers and code in its page loop.
template <int F, int NT, bool W, int S>
constexpr bool kBuilt = format_built(F) &&
                        (NT == 1 || ((CP_USE_MMA || CP_MFMA) && (NT == 2 || NT == 4))) &&
                        (W ? CP_WGMMA && NT == 4 && S == 0 : S == 0 || S == 2 || S == kWarpsPerCta);

template <int F_, int NT_, bool W_, int S_>
struct Instance {
  static constexpr int F = F_, NT = NT_, S = S_;
  static constexpr bool W = W_;
};

// fn(Instance<F, NT, W, S>{}) for the instance the launcher chose (kernels/variants.py decides;
// this only maps its fields onto the template), -1 where this module has no such instance.
template <int F, int NT, bool W, int S, class Fn>
int visit(Fn& fn) {
  if constexpr (kBuilt<F, NT, W, S>) return fn(Instance<F, NT, W, S>{});
  else return -1;
}

template <int F, int NT, class Fn>
int with_split(bool wgmma, int split, Fn& fn) {
  static_assert(kSplitFewestWarps == 2, "split instances: four warps a page and two");
  if (wgmma) return split == 0 ? visit<F, NT, true, 0>(fn) : -1;
  switch (split) {
    case kWarpsPerCta: return visit<F, NT, false, kWarpsPerCta>(fn);
    case 2: return visit<F, NT, false, 2>(fn);
    case 0: return visit<F, NT, false, 0>(fn);
    default: return -1;
  }
}

template <int F, class Fn>
int with_tiles(int tiles, bool wgmma, int split, Fn& fn) {
  switch (tiles) {
    case 1: return with_split<F, 1>(wgmma, split, fn);
    case 2: return with_split<F, 2>(wgmma, split, fn);
    case 4: return with_split<F, 4>(wgmma, split, fn);
    default: return -1;
  }
}

template <class Fn>
int with_instance(int format, int tiles, bool wgmma, int split, Fn&& fn) {
  switch (format) {
    case kBF16: return with_tiles<kBF16>(tiles, wgmma, split, fn);
    case kFP8: return with_tiles<kFP8>(tiles, wgmma, split, fn);
    case kNVFP4: return with_tiles<kNVFP4>(tiles, wgmma, split, fn);
    case kNVFP4Narrow: return with_tiles<kNVFP4Narrow>(tiles, wgmma, split, fn);
    default: return -1;
  }
}

}  // namespace

int launch_score(const ScoreParams& p, const PushState* push, int format, int tiles, bool wgmma,
                 int split, int grid, void* stream) {
  const auto stream_ = (cp_stream_t)stream;
  const int rc = with_instance(format, tiles, wgmma, split, [&](auto i) {
    using I = decltype(i);
    return launch_instance<I::F, I::NT, I::W, I::S>(p, push, grid, stream_);
  });
  if (rc != 0 || push != nullptr || (p.trailer <= 0 && p.topk <= 0)) return rc;
  const int ctas = p.topk > 0 ? warp_grid((int64_t)p.requests * p.query_len * p.num_heads)
                              : kAgreeCtas;
  after_local_kernel<<<ctas, kThreads, 0, stream_>>>(p);
  return (int)cp_get_last_error();
}

int launch_merge(const ScoreParams& p, void* stream) {
  const int64_t items = (int64_t)p.requests * p.query_len * p.heads_per_rank;
  merge_kernel<<<warp_grid(items), kThreads, 0, (cp_stream_t)stream>>>(p);
  return (int)cp_get_last_error();
}

int launch_plan_fingerprint(const FingerprintParams& f, void* stream) {
  plan_fingerprint_kernel<<<1, kFingerprintThreads, 0, (cp_stream_t)stream>>>(f);
  return (int)cp_get_last_error();
}

int score_occupancy(int format, int tiles, bool wgmma, int split, int* ctas_per_sm) {
  return with_instance(format, tiles, wgmma, split, [&](auto i) {
    using I = decltype(i);
    return occupancy_instance<I::F, I::NT, I::W, I::S>(ctas_per_sm);
  });
}

bool score_has_instance(int format, int tiles, bool wgmma, int split) {
  return with_instance(format, tiles, wgmma, split, [](auto) { return 0; }) == 0;
}

}  // namespace cpindex
