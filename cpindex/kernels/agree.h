// agree.h: what pushed calls check beyond their identity: that every rank read the same
// block-table entries and lengths, and that replicas of a head delivered the same queries.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
//
// Each rank sums a hash over the entries it would read (every request, not only its share:
// the table is a few bytes per 128 keys) into a per-call accumulator, spread over the whole
// grid and run by the warps that are not waiting for the peers' queries, so no CTA's scan starts
// later. The last CTA publishes the sum beside its score flag; every waiting CTA compares all
// ranks' sums once the flags are in. A wrapping sum of value x odd weight(position) is
// order-free (any grid gives the same sum) and two tables that differ in one entry never
// collide (an odd weight is invertible mod 2**64).
#pragma once
#include "config.h"
#include "waits.h"

namespace cpindex {
namespace {

CP_DEVICE uint64_t agree_weight(uint64_t key) {  // splitmix64's finalizer, made odd
  key += 0x9e3779b97f4a7c15ull;
  key = (key ^ (key >> 30)) * 0xbf58476d1ce4e5b9ull;
  key = (key ^ (key >> 27)) * 0x94d049bb133111ebull;
  return (key ^ (key >> 31)) | 1ull;
}

// The part of the call's hash that threads [first, kThreads) of this CTA sum, added into
// *part (this CTA's shared sum, published by publish_agreement_part). Entry (i, j) counts where
// some row of request i reads block j's page: init_blocks <= j < n - local_blocks; lengths
// count for every request. Table padding past a request's blocks never counts. The warps that
// run it are those not waiting on the peers' queries, so on a grid that waits it costs nothing.
CP_DEVICE void agreement_hash(const ScoreParams& p, unsigned long long* part, int first) {
  const int64_t cols = p.width < p.bt_cols ? p.width : p.bt_cols;
  const int64_t entries = (int64_t)p.requests * cols;
  const int64_t stride = (int64_t)gridDim.x * (kThreads - first);
  uint64_t sum = 0;
  for (int64_t e = (int64_t)blockIdx.x * (kThreads - first) + (threadIdx.x - first); e < entries;
       e += stride) {
    const int64_t i = e / cols, j = e - i * cols;
    const int len = p.seq_lens[i];
    const int n = len > 0 ? (len + kPageTokens - 1) / kPageTokens : 0;
    if (j == 0) sum += (uint64_t)(uint32_t)len * agree_weight((uint64_t)i << 21);
    if (j >= p.init_blocks && j < n - p.local_blocks) {
      const uint32_t page = (uint32_t)p.block_table[i * p.bt_row_stride + j];
      sum += (uint64_t)page * agree_weight(((uint64_t)i << 21) | (uint64_t)(j + 1));
    }
  }
  if (sum) atomicAdd(part, (unsigned long long)sum);
}

// One thread of the CTA, after a barrier that follows agreement_hash: the CTA's part into the
// call's accumulator, ps.fp_acc[call & 1] (the ticket's release later orders it before the last
// CTA reads the sum).
CP_DEVICE void publish_agreement_part(const PushState& ps, uint64_t call,
                                      unsigned long long part) {
  if (part) atomicAdd(ps.fp_acc + (call & 1), part);
}

// Replicas (more ranks than heads: rank r holds head r % num_heads and the kernel scores head h
// from rank h's queries): every rank received every rank's queries, so each checks locally,
// and all find the same mismatch. Spread over the grid like the hash.
CP_DEVICE void check_replicas(const ScoreParams& p, const PushState& ps, uint64_t call) {
  if (p.world <= p.num_heads) return;
  const int64_t words = ps.q_bytes / 16;
  const int64_t total = (int64_t)(p.world - p.num_heads) * words;
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  for (int64_t e = (int64_t)blockIdx.x * kThreads + threadIdx.x; e < total; e += stride) {
    const int r = p.num_heads + (int)(e / words);
    const int64_t w = e - (int64_t)(r - p.num_heads) * words;
    const uint4 a = reinterpret_cast<const uint4*>(p.q + (int64_t)r * p.q_src_stride)[w];
    const uint4 b =
        reinterpret_cast<const uint4*>(p.q + (int64_t)(r % p.num_heads) * p.q_src_stride)[w];
    if (a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w) {
      report(p, kErrReplica, (uint32_t)r, call, (uint64_t)(r % p.num_heads));
      return;
    }
  }
}

// The last CTA: this call's hash, ready for publishing; its accumulator is cleared for the call
// after next (the next call sums into the other one).
CP_DEVICE uint64_t take_agreement_hash(const PushState& ps, uint64_t call) {
  const uint64_t h = atomicExch(ps.fp_acc + (call & 1), 0ull);  // read and clear: one trip
  return h | 1ull;  // never 0: a slot never written reads 0
}

// A waiting CTA, after every peer's score flag: each rank's hash equals this rank's. False
// (after reporting) when one differs.
CP_DEVICE bool hashes_agree(const ScoreParams& p, const PushState& ps, uint64_t call) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if ((int)threadIdx.x < p.world) {
    const uint64_t mine = *reinterpret_cast<volatile const uint64_t*>(ps.fps + p.rank);
    const uint64_t theirs = *reinterpret_cast<volatile const uint64_t*>(ps.fps + threadIdx.x);
    if (theirs != mine) {
      report(p, kErrAgreement, threadIdx.x, call, theirs, mine);
      ok = 0;
    }
  }
  __syncthreads();
  return ok != 0;
}

// A call whose ranks disagreed: its outputs hold NaN scores (and -1 ids), never a mix of ranks'
// data. Elements first, first + stride, ...: a pushed call's waiting CTAs each write all of them
// (the same values); a local call's grid shares them.
CP_DEVICE void poison_outputs(const ScoreParams& p, int64_t first, int64_t stride) {
  const float nan = __int_as_float(0x7fc00000);
  float* scores = p.topk > 0 ? p.scores_out : p.poison;
  for (int64_t e = first; e < p.poison_count; e += stride) {
    scores[e] = nan;
    if (p.topk > 0) p.ids_out[e] = -1;
  }
}

// ---- the collective transport's agreement (score.hip's after_local_kernel, after a local call's
// scoring, with p.trailer > 0) ----------------------------------------------------------------
// Each rank's slot of the gathered queries (p.q + r * p.q_src_stride) ends in a trailer at
// p.trailer bytes: int64 [the plan's fingerprint, the hash of the rank's queries (replicated
// heads only)], stamped by the host before the all-gather. Every CTA compares them all (2 *
// world words, from L2), so every CTA of every rank reaches the same verdict: two ranks that
// differ cannot both equal this rank.
CP_DEVICE uint64_t trailer_word(const ScoreParams& p, int r, int kind) {
  return reinterpret_cast<const uint64_t*>(p.q + (int64_t)r * p.q_src_stride + p.trailer)[kind];
}

// Whether the ranks agree: fingerprints against this rank's, then (more ranks than heads) each
// rank's query hash against its head's first owner, rank r % num_heads; the first difference in
// that order is recorded (tables explain best). CTA 0 alone counts the call and publishes the
// verdict in p.local_state = [calls, verdict], which select_blocks' merge masks with.
CP_DEVICE bool trailers_agree(const ScoreParams& p) {
  constexpr int kNone = 0x7fffffff;
  __shared__ int first;  // kind * world + rank of the first difference
  if (threadIdx.x == 0) first = kNone;
  __syncthreads();
  const int t = threadIdx.x, kinds = p.world > p.num_heads ? 2 : 1;
  if (t < kinds * p.world) {
    const int kind = t / p.world, r = t - kind * p.world;
    if (trailer_word(p, r, kind) != trailer_word(p, kind ? r % p.num_heads : p.rank, kind))
      atomicMin(&first, t);
  }
  __syncthreads();
  const int f = first;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const uint64_t call = p.local_state[0] + 1;
    p.local_state[0] = call;
    p.local_state[1] = f != kNone;
    if (f != kNone) {
      const int kind = f / p.world, r = f - kind * p.world;
      if (kind == 0)
        report(p, kErrAgreement, (uint32_t)r, call, trailer_word(p, r, 0),
               trailer_word(p, p.rank, 0));
      else
        report(p, kErrReplica, (uint32_t)r, call, (uint64_t)(r % p.num_heads));
    }
  }
  return f == kNone;
}

// ---- the plan fingerprint (cpindex/fingerprint.py, plan_fingerprint: the same int64, bit for
// bit; the torch ops there stay the CPU's and the reference) ---------------------------------
// fingerprint._weights: splitmix64's finalizer in wrapping int64 with arithmetic shifts, made
// odd. The products wrap in uint64 (signed overflow is undefined); the shifts are signed.
CP_DEVICE uint64_t fp_weight(uint64_t x) {
  x *= 0x9e3779b97f4a7c15ull;
  x ^= (uint64_t)((int64_t)x >> 30);
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= (uint64_t)((int64_t)x >> 27);
  x *= 0x94d049bb133111ebull;
  x ^= (uint64_t)((int64_t)x >> 31);
  return x | 1ull;
}

// One CTA: golden * sum(table[i][j] * w(i * 2**32 + j)) over the entries a call reads
// (init_blocks <= j < ceil(len_i / 128) - local_blocks, j < cols) plus sum(len_i * w(i + 2**62)),
// all mod 2**64 (so the golden factor goes on each term). Rows outer, columns across the CTA:
// only the entries read are loaded, and no division per entry.
CP_DEVICE void plan_fingerprint_cta(const FingerprintParams& f) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0ull;
  __syncthreads();
  uint64_t sum = 0;
  for (int64_t i = 0; i < f.requests; ++i) {
    const int64_t len = f.seq_lens[i];
    const int64_t up = len + (kPageTokens - 1);  // floor division, as torch's
    int64_t end = (up >= 0 ? up / kPageTokens : -((-up + kPageTokens - 1) / kPageTokens)) -
                  f.local_blocks;
    if (end > f.cols) end = f.cols;
    const int32_t* row = f.block_table + i * f.bt_row_stride;
    for (int64_t j = f.init_blocks + threadIdx.x; j < end; j += blockDim.x)
      sum += 0x9e3779b97f4a7c15ull * fp_weight(((uint64_t)i << 32) + (uint64_t)j) *
             (uint64_t)(int64_t)row[j];
  }
  for (int64_t i = threadIdx.x; i < f.requests; i += blockDim.x)
    sum += fp_weight((uint64_t)i + (1ull << 62)) * (uint64_t)(int64_t)f.seq_lens[i];
  if (sum) atomicAdd(&total, (unsigned long long)sum);
  __syncthreads();
  if (threadIdx.x == 0) *f.out = (int64_t)total;
}

}  // namespace
}  // namespace cpindex
