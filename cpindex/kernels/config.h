// config.h: the constants all parts of the scoring kernel share, each with why it has its value.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "compat.h"
#include "launch.h"

// CP_WGMMA (set by the build for sm_90a): the four-tile instances score with Hopper's warpgroup
// mma, the queries in shared memory, the CTA's four warps on four pages of one request.
#ifndef CP_WGMMA
#define CP_WGMMA 0
#endif
#if CP_WGMMA && (!CP_USE_MMA || (defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)))
#error "CP_WGMMA needs a CUDA sm_90a build"
#endif

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

// Tiles per warp of the cp.async ring the bf16/fp8 whole-page streams take (tensor-core builds),
// in dynamic shared memory. A ring of S tiles keeps S - 1 tiles' copies in flight while one is
// scored: 8 KiB for fp8 (2 KiB tiles), 16 KiB for bf16 (4 KiB tiles). bf16 once had 8 KiB, the
// most static shared memory allowed, so one tile in flight: a third of fp8's bytes, and slower.
// Split pages need only a warp's part of a page (page.h).
constexpr int kRingTiles = 4;

// nvfp4 tiles loaded before their math with one query tile (a whole page on 32-wide warps;
// divided by the query tiles with more, whose fragments take the registers): enough loads in
// flight to cover the memory latency. The warpgroup-mma instance keeps its queries in shared
// memory and loads 4 ahead.
constexpr int kNvfp4Batch = 8;
constexpr int kNvfp4BatchWg = 4;

// The largest group of consecutive blocks of one request a warp (or a warpgroup CTA) takes: the
// request's queries are loaded once per group and the group's pages stream back to back; the
// launch-time choice never takes a group that leaves the last round to a few warps.
constexpr int kGroupMax = 8;

// Split pages: small calls share each page among a CTA's four warps, or two where a CTA per item
// does not fit the grid at once, for every format (bf16/fp8 through the ring, a warp's part of
// the page in flight at once). The launcher picks the most warps whose CTAs all fit.
constexpr int kSplitFewestWarps = 2;

}  // namespace
}  // namespace cpindex
