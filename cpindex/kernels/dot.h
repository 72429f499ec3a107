// dot.h: the dot products of a 16-token tile with a pass's query vectors (mma.sync,
// the warpgroup mma, or scalar FMAs on the portable path), and the AMD matrix-core path's wave
// and query operands (its page loop is mfma.h's).
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "keys.h"

namespace cpindex {
namespace {

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

// Quarter pages (a CTA's four warps on one item, so every warp of the CTA calls prepare_query
// together): the pass's query fragments once per CTA in shared memory, read per k-step, so that
// the registers they would hold fit more CTAs per SM (score.hip, kQuerySmem). Pair words (2s,
// 2s + 1) of n-tile u for lane l sit at ((u * 8 + s) * 32 + l) * 8: a warp's read of one k-step
// is 256 contiguous bytes.
template <int NT>
struct QuerySmem {
  uint32_t smem;  // this lane's pair of n-tile 0, k-step 0
};

template <int F, int NT, bool W>
CP_DEVICE void prepare_query(const ScoreParams& p, const Vecs& vs, int req, int v0, int g, int c,
                             QuerySmem<NT>& q, float*) {
  const int warp = threadIdx.x / CP_WARP;  // warp u writes n-tile u
  static_assert(NT <= kWarpsPerCta, "a warp per n-tile");
  __syncthreads();  // every warp has read the previous pass's fragments
  if (warp < NT) {
    uint32_t qf[16];
    load_query_pairs<F>(p, vs, req, v0 + kVecsPerTile * warp + g, c, qf);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint32_t at = q.smem + warp * 8 * CP_WARP * 8 + s * CP_WARP * 8;
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(at), "r"(qf[2 * s]), "r"(qf[2 * s + 1])
                   : "memory");
    }
  }
  __syncthreads();
}

template <int F, int NT, bool W>
CP_DEVICE void tile_dot(const uint32_t (&k0)[16], const uint32_t (&k1)[16], const QuerySmem<NT>& q,
                        const float*, int, float (&acc)[NT][4]) {
#pragma unroll
  for (int u = 0; u < NT; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      uint32_t b0, b1;
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                   : "=r"(b0), "=r"(b1)
                   : "r"(q.smem + (u * 8 + s) * CP_WARP * 8));
      mma16816<Fmt<F>::kBf16>(acc[u], k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1], b0, b1);
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
#elif CP_MFMA
// The MFMA path (mfma.h): one lane of the wave per thread; its loads, matrix instructions and
// cross-lane reads. The emulator (tests/amd/harness.cpp) has a host wave with the same members.
struct DeviceWave {
  static constexpr int kN = 1;
  int lane_;
  CP_DEVICE int lane(int) const { return lane_; }
  template <int F>
  CP_DEVICE void load_key(const uint8_t* p, uint32_t (&w)[mfma::Frag<F>::kWords]) {
    if constexpr (F == kNVFP4Narrow) {  // vLLM's 72-byte tokens: 8-byte aligned
      const uint2 a = cp_load_stream8(p), b = cp_load_stream8(p + 8);
      w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
    } else {
#pragma unroll
      for (int l = 0; l < mfma::Frag<F>::kLoads; ++l) {
        const uint4 v = cp_load_stream16(p + 16 * l);
        w[4 * l] = v.x, w[4 * l + 1] = v.y, w[4 * l + 2] = v.z, w[4 * l + 3] = v.w;
      }
    }
  }
  CP_DEVICE uint32_t load2(const uint8_t* p) { return cp_load_stream2(p); }
  template <int kWords>  // query rows: 8-byte aligned loads, once per item
  CP_DEVICE void load_query(const uint8_t* p, uint32_t (&w)[kWords]) {
#pragma unroll
    for (int i = 0; i < kWords / 2; ++i) {
      typedef uint32_t u32x2 __attribute__((ext_vector_type(2)));
      const u32x2 v = *cp_global<u32x2>(p + 8 * i);
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  }
  // d += a x b: v_mfma_f32_16x16x32_fp8_fp8 (fp8) or v_mfma_f32_16x16x16_bf16
  template <bool kFp8>
  CP_DEVICE void mma(const uint64_t (&a)[1], const uint64_t (&b)[1], float (&d)[1][4]) {
    typedef float v4f __attribute__((ext_vector_type(4)));
    typedef short v4s __attribute__((ext_vector_type(4)));
    v4f acc = {d[0][0], d[0][1], d[0][2], d[0][3]};
    if constexpr (kFp8)
      acc = __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8((long)a[0], (long)b[0], acc, 0, 0, 0);
    else
      acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(v4s, a[0]),
                                                      __builtin_bit_cast(v4s, b[0]), acc, 0, 0, 0);
    d[0][0] = acc[0], d[0][1] = acc[1], d[0][2] = acc[2], d[0][3] = acc[3];
  }
  CP_DEVICE void shfl_xor(const float (&x)[1], int mask, float (&y)[1]) {
    y[0] = cp_shfl_xor(x[0], mask);
  }
  CP_DEVICE void shfl(const float (&x)[1], const int (&src)[1], float (&y)[1]) {
    y[0] = cp_shfl(x[0], src[0]);
  }
};

// The pass's B operands: lane l holds vectors v0 + 16 nb + l % 16 (mfma.h, prepare_operands).
template <int NT, bool W>
struct QueryFrag {
  uint64_t b[1][mfma::kNTiles<NT>][mfma::kMaxSteps];
};

template <int F, int NT, bool W>
CP_DEVICE void prepare_query(const ScoreParams& p, const Vecs& vs, int req, int v0, int g, int c,
                             QueryFrag<NT, W>& q, float*) {
  DeviceWave w{4 * g + c};
  auto row = [&](int v) -> const uint8_t* {
    if (v >= vs.count) return nullptr;
    const int t = div_small(v, p.heads_magic), h = v - t * vs.heads;
    const int src = div_small(h, p.q_src_magic), in_src = h - src * p.q_heads_per_src;
    return p.q + (int64_t)src * p.q_src_stride + (int64_t)(req * vs.query_len + t) * p.q_row_stride +
           in_src * kHeadDim * (Fmt<F>::kBf16 ? 2 : 1);
  };
  mfma::prepare_operands<F, CP_FP8_FNUZ, NT>(w, v0, row, q.b);
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

}  // namespace
}  // namespace cpindex
