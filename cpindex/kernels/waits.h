// waits.h: the error word and the bounded waits (peer flags, the grid barrier).
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "config.h"

namespace cpindex {
namespace {

// Records an error in the device word p.err and its host-mapped mirror p.err_host (may be null):
// the fields first, the code last, so a reader that sees the code sees the rest. P: ScoreParams
// or WriteParams.
template <typename P>
CP_DEVICE void report(const P& p, uint32_t code, uint32_t peer, uint64_t call, uint64_t detail,
                      uint64_t mine = 0) {
  if (atomicCAS(&p.err->claim, 0u, 1u) != 0u) return;  // first error wins
  ErrorWord* words[2] = {p.err, p.err_host};
  for (ErrorWord* e : words) {
    if (e == nullptr) continue;
    e->rank = p.rank, e->peer = peer, e->call = call, e->detail = detail, e->mine = mine;
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
  return code == kErrTimeoutQueries || code == kErrTimeoutScores || code == kErrMismatch ||
         code == kErrTag;
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

}  // namespace
}  // namespace cpindex
