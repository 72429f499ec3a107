// config.h: the scoring kernel's build switches and the constants all its parts share.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
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
// small calls split bf16/fp8 pages too, over four warps or (calls a CTA per item does not fit)
// two (0: whole pages; 1: four warps only)
#ifndef CP_SPLIT_RING
#define CP_SPLIT_RING 2
#endif
#ifndef CP_SPLIT_PAIRS  // calls too large for a CTA per item: two warps a page (0: only four)
#define CP_SPLIT_PAIRS 1
#endif
#ifndef CP_SPLIT_CTAS  // the same for the split-page instances (0: the whole-page instances')
#define CP_SPLIT_CTAS 0
#endif
#ifndef CP_SELECT_WAIT_ALL  // 1: every CTA of a selecting call waits for the peers (0: mergers only)
#define CP_SELECT_WAIT_ALL 0
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

}  // namespace
}  // namespace cpindex
