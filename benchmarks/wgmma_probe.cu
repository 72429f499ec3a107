// wgmma_probe.cu: checks, on an sm_90 GPU, what a warpgroup-mma path of the scoring kernel would
// rely on (docs/kernel.md, "The dot product"): one warpgroup computes 64 keys x 32 query
// vectors (T = 8 rows of 4 heads) over a 128-dim head with A (the keys) from registers and B
// (the queries) from shared memory, K-major and unswizzled, and the result is compared with a
// float64 host dot product of the same values. Two instructions:
//   e4m3  wgmma.mma_async.m64n32k32.f32.e4m3.e4m3  (4 k-steps; native fp8, sm_90a)
//   f16   wgmma.mma_async.m64n32k16.f32.f16.f16    (8 k-steps; the keys widened to f16 exactly,
//                                                   as the shipped mma.sync path does)
// and two inputs each:
//   bytes   every e4m3 byte pattern at random (bar NaN): a wrong layout shows as errors near 1
//   normal  RMS-normed keys and queries (N(0, 1) rounded to e4m3), as a cache holds them
//
//   bash benchmarks/device.sh wgmma-probe
//   (= nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_probe \
//        benchmarks/wgmma_probe.cu && /tmp/wgmma_probe)
//
// Per case it prints the largest error relative to the sum of |products| and relative to the
// row's largest |score| (the kernel tests' measure, which allows 1e-5: fp32 summation order
// only). fp8 matrix products on Hopper are reported to keep about 14 bits while accumulating;
// this measures it. Exit status 0 when every layout holds (errors < 1e-2). Last, the tensor
// throughput of the T = 8 work alone (no memory) with each instruction, 1 to 4 CTAs per SM.
//
// Layouts under test (lane = 4g + c of warp w; token = row, dim = k):
//   A, e4m3 k32: a0 = row 16w+g, dims 4c..4c+3; a1 = row 16w+g+8, same dims; a2 = row 16w+g,
//      dims 16+4c..; a3 = row 16w+g+8, dims 16+4c.. (as mma.m16n8k32)
//   A, f16 k16: a0 = row 16w+g, dims 2c, 2c+1; a1 = row 16w+g+8, same; a2 = row 16w+g, dims
//      8+2c, 9+2c; a3 = row 16w+g+8, same (as mma.m16n8k16)
//   B: a k-step's 32 vectors x 32 bytes as 8 core matrices of 8 vectors x 16 bytes (128
//      contiguous bytes, row = vector): vectors 8j..8j+7, bytes 16q..16q+15 at (2j + q) * 128:
//      leading (K) byte offset 128, stride (N) byte offset 256
//   D: d[4j], d[4j+1] = row 16w+g, vectors 8j+2c, 8j+2c+1; d[4j+2], d[4j+3] = row 16w+g+8
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

constexpr int kTokens = 64, kVecs = 32, kDim = 128, kStepBytes = 32;

// The descriptor of a no-swizzle K-major operand: address, leading (K) and stride (M/N) byte
// offsets, each in 16-byte units.
__device__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return (uint64_t)((addr >> 4) & 0x3fff) | (uint64_t)((lbo >> 4) & 0x3fff) << 16 |
         (uint64_t)((sbo >> 4) & 0x3fff) << 32;
}

__device__ void wgmma(float (&d)[16], const uint32_t (&a)[4], uint64_t desc, int accumulate,
                      bool f16) {
#define CP_WGMMA_ARGS                                                                          \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
    "+f"(d[14]), "+f"(d[15])                                                                   \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate)
  if (f16)
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,"
        "%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;}" CP_WGMMA_ARGS);
  else
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,"
        "%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;}" CP_WGMMA_ARGS);
#undef CP_WGMMA_ARGS
}

// keys [64][128] and queries [32][128] of `elem`-byte values (1: e4m3, 2: f16).
__global__ void probe(const uint8_t* keys, const uint8_t* queries, float* out, int elem) {
  constexpr int kSteps = kDim / 16;  // at most (f16); e4m3 uses the first 4
  // [k-step][vectors / 8][16-byte halves of the step][vector % 8][16 bytes]
  __shared__ __align__(128) uint8_t b[kSteps][kVecs / 8][2][8][16];
  const int t = threadIdx.x, w = t / 32, lane = t % 32, g = lane / 4, c = lane % 4;
  const int row_bytes = kDim * elem, steps = row_bytes / kStepBytes;
  for (int i = t; i < kVecs * row_bytes; i += blockDim.x) {  // query byte -> its core matrix
    const int n = i / row_bytes, x = i % row_bytes;
    b[x / 32][n / 8][(x % 32) / 16][n % 8][x % 16] = queries[i];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> async proxy
  __syncthreads();
  float d[16] = {};
  const int r0 = 16 * w + g, r1 = r0 + 8;
  for (int s = 0; s < steps; ++s) {
    auto word = [&](int row, int byte) {  // 4 bytes of the step: 4 e4m3 or 2 f16 values
      return *reinterpret_cast<const uint32_t*>(keys + row * row_bytes + kStepBytes * s + byte);
    };
    const int lo = 4 * c, hi = 16 + 4 * c;  // e4m3: dims 4c.., 16+4c..; f16: 2c.., 8+2c..
    const uint32_t a[4] = {word(r0, lo), word(r1, lo), word(r0, hi), word(r1, hi)};
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    wgmma(d, a, smem_desc(&b[s][0][0][0][0], 128, 256), s, elem == 2);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  for (int j = 0; j < kVecs / 8; ++j) {
    float* o0 = out + r0 * kVecs + 8 * j + 2 * c;
    float* o1 = out + r1 * kVecs + 8 * j + 2 * c;
    o0[0] = d[4 * j], o0[1] = d[4 * j + 1], o1[0] = d[4 * j + 2], o1[1] = d[4 * j + 3];
  }
}

// e4m3 (bias 7, no infinities) to float.
static float e4m3(uint8_t x) {
  const int s = x >> 7, e = (x >> 3) & 15, m = x & 7;
  const float v = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

// The nearest e4m3 byte (ties to even, saturating), by search: the host side needs no speed.
static uint8_t to_e4m3(float v) {
  uint8_t best = 0;
  for (int x = 0; x < 256; ++x) {
    if ((x & 0x7f) == 0x7f) continue;
    const float d = std::fabs(e4m3((uint8_t)x) - v), bd = std::fabs(e4m3(best) - v);
    if (d < bd || (d == bd && (x & 1) == 0 && (best & 1) == 1)) best = (uint8_t)x;
  }
  return best;
}

// One case: returns false when the layouts fail.
static bool run(const char* name, bool f16, bool normal, std::mt19937& rng) {
  std::vector<uint8_t> kb(kTokens * kDim), qb(kVecs * kDim);  // e4m3 bytes
  std::normal_distribution<float> gauss;
  for (auto* v : {&kb, &qb})
    for (auto& x : *v) {
      x = normal ? to_e4m3(gauss(rng)) : (uint8_t)(rng() & 0xff);
      if ((x & 0x7f) == 0x7f) x ^= 1;  // 0x7f / 0xff are NaN in e4m3: not in a cache
    }
  const int elem = f16 ? 2 : 1;
  auto widen = [&](const std::vector<uint8_t>& v) {  // the device's operand bytes
    if (!f16) return v;
    std::vector<uint8_t> o(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
      const __half h = __float2half(e4m3(v[i]));  // exact: every e4m3 value is an f16
      memcpy(&o[2 * i], &h, 2);
    }
    return o;
  };
  const std::vector<uint8_t> dk_host = widen(kb), dq_host = widen(qb);
  uint8_t *dk, *dq;
  float* dout;
  cudaMalloc(&dk, dk_host.size());
  cudaMalloc(&dq, dq_host.size());
  cudaMalloc(&dout, kTokens * kVecs * sizeof(float));
  cudaMemcpy(dk, dk_host.data(), dk_host.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dq, dq_host.data(), dq_host.size(), cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xff, kTokens * kVecs * sizeof(float));  // NaN: an unwritten value fails
  probe<<<1, 128>>>(dk, dq, dout, elem);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("%-14s FAIL: %s\n", name, cudaGetErrorString(err));
    return false;
  }
  std::vector<float> out(kTokens * kVecs);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dk), cudaFree(dq), cudaFree(dout);
  std::vector<double> ref(kTokens * kVecs), mag(kTokens * kVecs);
  for (int r = 0; r < kTokens; ++r)
    for (int n = 0; n < kVecs; ++n)
      for (int k = 0; k < kDim; ++k) {
        const double p = (double)e4m3(kb[r * kDim + k]) * e4m3(qb[n * kDim + k]);
        ref[r * kVecs + n] += p, mag[r * kVecs + n] += std::fabs(p);
      }
  double worst_sum = 0, worst_row = 0;
  int shown = 0;
  for (int n = 0; n < kVecs; ++n) {  // a "row" of the kernel's output: one vector, all tokens
    double row_max = 0;
    for (int r = 0; r < kTokens; ++r) row_max = std::fmax(row_max, std::fabs(ref[r * kVecs + n]));
    for (int r = 0; r < kTokens; ++r) {
      const int i = r * kVecs + n;
      const double e = std::isfinite(out[i]) ? std::fabs(out[i] - ref[i]) : INFINITY;
      if (e / mag[i] > 1e-2 && shown++ < 4)
        printf("  token %d vector %d: got %g, expected %g\n", r, n, out[i], ref[i]);
      worst_sum = std::fmax(worst_sum, e / mag[i]);
      worst_row = std::fmax(worst_row, e / row_max);
    }
  }
  const bool ok = worst_sum < 1e-2;
  printf("%-14s %s: error / sum|products| %.3g, error / row max|score| %.3g (%s 1e-5)\n", name,
         ok ? "PASS (layouts)" : "FAIL (layouts)", worst_sum, worst_row,
         worst_row <= 1e-5 ? "within" : "beyond");
  return ok;
}

// ---- Throughput: the T = 8 tensor work alone (32 vectors x 128 dims per 16 keys), no memory ----
// Each warp runs `iters` tiles of 16 keys, the way the scoring kernel's four-tile instance does
// (mma: 4 n-tiles x 8 k-steps of mma.sync.m16n8k16 per warp, query fragments in 64 registers),
// or each warpgroup runs `iters` / 4 tiles of 64 keys (wgmma: 8 k-steps of m64n32k16, queries
// in shared memory). The scores are folded into a running max, as the kernel does.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__global__ void tput_mma(float* sink, int iters) {
  uint32_t q[8][4][2], a[8][4];
  const uint32_t seed = 0x3c003c00u ^ (threadIdx.x * 0x00010001u);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int n = 0; n < 4; ++n) q[k][n][0] = seed + k * 4 + n, q[k][n][1] = seed ^ (k + n);
#pragma unroll
    for (int i = 0; i < 4; ++i) a[k][i] = seed + 16 * k + i;
  }
  float m = -INFINITY;
  for (int it = 0; it < iters; ++it) {
    float d[4][4] = {};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      uint32_t ak[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) ak[i] = a[k][i] ^ (uint32_t)(it & 1);  // a new tile's keys
#pragma unroll
      for (int n = 0; n < 4; ++n) mma16816(d[n], ak, q[k][n][0], q[k][n][1]);
    }
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) m = fmaxf(m, d[n][e]);
  }
  if (m == 1.2345f) sink[threadIdx.x] = m;  // keeps the work
}

__global__ void tput_wgmma(float* sink, int iters) {
  __shared__ __align__(128) uint8_t b[8][4][2][8][16];
  for (int i = threadIdx.x; i < (int)sizeof(b); i += blockDim.x)
    (&b[0][0][0][0][0])[i] = (uint8_t)(i * 7 + 0x3c);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  uint32_t a[8][4];
  const uint32_t seed = 0x3c003c00u ^ (threadIdx.x * 0x00010001u);
#pragma unroll
  for (int k = 0; k < 8; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[k][i] = seed + 16 * k + i;
  float m = -INFINITY;
  for (int it = 0; it < iters / 4; ++it) {
    float d[16];
    uint32_t ak[8][4];  // the tile's A operands are ready before the group (as converted keys)
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
      for (int i = 0; i < 4; ++i) ak[k][i] = a[k][i] ^ (uint32_t)(it & 1);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 8; ++k) wgmma(d, ak[k], smem_desc(&b[k][0][0][0][0], 128, 256), k, true);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int e = 0; e < 16; ++e) m = fmaxf(m, d[e]);
  }
  if (m == 1.2345f) sink[threadIdx.x] = m;
}

// TFLOP/s of each form at 1 to 4 CTAs (of 4 warps) per SM.
static void throughput() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  cudaMalloc(&sink, 128 * sizeof(float));
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0), cudaEventCreate(&t1);
  const int iters = 4096;
  for (int wg = 0; wg < 2; ++wg)
    for (int per_sm = 1; per_sm <= 4; ++per_sm) {
      const int grid = sms * per_sm;
      float best = 1e30f;
      for (int rep = 0; rep < 3; ++rep) {
        cudaEventRecord(t0);
        if (wg) tput_wgmma<<<grid, 128>>>(sink, iters);
        else tput_mma<<<grid, 128>>>(sink, iters);
        cudaEventRecord(t1);
        cudaEventSynchronize(t1);
        float ms = 0;
        cudaEventElapsedTime(&ms, t0, t1);
        best = std::fmin(best, ms);
      }
      // mma: each warp scores iters tiles of 16 keys; wgmma: each CTA iters / 4 tiles of 64
      const double tokens = (double)grid * (wg ? iters / 4 * 64 : 4 * iters * 16);
      const double flops = tokens * 32 * 128 * 2;
      printf("throughput %-6s %d CTAs/SM: %7.1f TFLOP/s (%s)\n", wg ? "wgmma" : "mma", per_sm,
             flops / (best * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
    }
  cudaFree(sink);
}

int main() {
  std::mt19937 rng(1);
  bool ok = true;
  ok &= run("e4m3 bytes", false, false, rng);
  ok &= run("e4m3 normal", false, true, rng);
  ok &= run("f16 bytes", true, false, rng);
  ok &= run("f16 normal", true, true, rng);
  throughput();
  return ok ? 0 : 1;
}
