// select.h: select_blocks' fused selection: a warp's top k, the local top k of a
// rank's share and the merge of the ranks' candidates.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "waits.h"

namespace cpindex {
namespace {

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
// Up to two keys per lane (a (row, head)'s local share up to 64 blocks on 32-wide warps, the
// merge of 4 ranks' 16 candidates) are ranked by counting, more by rounds.
template <typename Key, typename Use>
CP_DEVICE void warp_topk(int n, int k, int lane, Key key, Use use) {
  if (n <= CP_WARP) use(warp_pick_by_rank<1>(n, lane, key));
  else if (n <= 2 * CP_WARP) use(warp_pick_by_rank<2>(n, lane, key));
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
// place is the number of picked keys with a lower id, counted like the ranks. A warp per item
// over the grid: score_kernel lets only CTAs with an item (b * kWarpsPerCta < items) wait for
// the peers, so a change to this distribution changes that test too.
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

}  // namespace
}  // namespace cpindex
