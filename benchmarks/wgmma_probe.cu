// wgmma_probe.cu: checks, on an sm_90 GPU, the operand layouts a native e4m3 path of the scoring
// kernel would rely on (docs/kernel.md, "What would get there"): one warpgroup issues
// wgmma.mma_async.m64n32k32.f32.e4m3.e4m3 with A (64 keys x 32 dims) from registers and B (32
// query vectors x 32 dims, K-major, no swizzle: T = 8 rows of 4 heads) from shared memory, over
// the 4 k-steps of a 128-dim head, and the result is compared with a host dot product of the
// same e4m3 values.
//
//   bash benchmarks/device.sh wgmma-probe
//   (= nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_probe \
//        benchmarks/wgmma_probe.cu && /tmp/wgmma_probe)
//
// It prints the largest error relative to the sum of |products|: about 1e-7 means fp32
// accumulation; far larger (but < 1e-2) means the layouts hold and the tensor core accumulates
// with fewer bits, which the kernel's 1e-5 tolerance would not accept (fp8 matrix products on
// Hopper are reported to keep about 14 bits while accumulating); near 1 means a layout is
// wrong. Exit status 0 when the layouts hold.
//
// Layouts under test (lane = 4g + c of warp w; token = row, dim = k):
//   A: a0 = row 16w+g, dims 4c..4c+3 of the k-step; a1 = row 16w+g+8, same dims;
//      a2 = row 16w+g, dims 16+4c..; a3 = row 16w+g+8, dims 16+4c..  (as mma.m16n8k32)
//   B: a k-step's 32 x 32 bytes as 8 x 16-byte core matrices of 128 contiguous bytes each (row
//      = vector): vectors 8j..8j+7, dims 16q..16q+15 at (2j + q) * 128: leading (K) byte
//      offset 128, stride (N) byte offset 256
//   D: d[4j], d[4j+1] = row 16w+g, vectors 8j+2c, 8j+2c+1; d[4j+2], d[4j+3] = row 16w+g+8
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int kTokens = 64, kVecs = 32, kDim = 128, kSteps = kDim / 32;

// The descriptor of a no-swizzle K-major operand: address, leading (K) and stride (M/N) byte
// offsets, each in 16-byte units.
__device__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return (uint64_t)((addr >> 4) & 0x3fff) | (uint64_t)((lbo >> 4) & 0x3fff) << 16 |
         (uint64_t)((sbo >> 4) & 0x3fff) << 32;
}

__global__ void probe(const uint8_t* keys, const uint8_t* queries, float* out) {
  // [k-step][vectors / 8][dims / 16 of the k-step][vector % 8][dim % 16]
  __shared__ __align__(128) uint8_t b[kSteps][kVecs / 8][2][8][16];
  const int t = threadIdx.x, w = t / 32, lane = t % 32, g = lane / 4, c = lane % 4;
  for (int i = t; i < kVecs * kDim; i += blockDim.x) {  // query n, dim d -> its core matrix
    const int n = i / kDim, d = i % kDim;
    b[d / 32][n / 8][(d % 32) / 16][n % 8][d % 16] = queries[i];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> async proxy
  __syncthreads();
  float d[16] = {};
  for (int s = 0; s < kSteps; ++s) {
    auto word = [&](int row, int dim) {
      return *reinterpret_cast<const uint32_t*>(keys + row * kDim + 32 * s + dim);
    };
    const int r0 = 16 * w + g, r1 = r0 + 8;
    const uint32_t a0 = word(r0, 4 * c), a1 = word(r1, 4 * c), a2 = word(r0, 16 + 4 * c),
                   a3 = word(r1, 16 + 4 * c);
    const uint64_t desc = smem_desc(&b[s][0][0][0][0], 128, 256);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,"
        "%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(s));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  const int r0 = 16 * w + g, r1 = r0 + 8;
  for (int j = 0; j < kVecs / 8; ++j) {
    float* o0 = out + r0 * kVecs + 8 * j + 2 * c;
    float* o1 = out + r1 * kVecs + 8 * j + 2 * c;
    o0[0] = d[4 * j], o0[1] = d[4 * j + 1], o1[0] = d[4 * j + 2], o1[1] = d[4 * j + 3];
  }
}

// e4m3 (bias 7, no infinities) to float, for the host check.
static float e4m3(uint8_t x) {
  const int s = x >> 7, e = (x >> 3) & 15, m = x & 7;
  const float v = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

int main() {
  std::vector<uint8_t> keys(kTokens * kDim), queries(kVecs * kDim);
  srand(1);
  for (auto* v : {&keys, &queries})
    for (auto& x : *v) {
      x = (uint8_t)(rand() & 0xff);
      if ((x & 0x7f) == 0x7f) x ^= 1;  // 0x7f / 0xff are NaN in e4m3: not in a cache
    }
  uint8_t *dk, *dq;
  float* dout;
  cudaMalloc(&dk, keys.size());
  cudaMalloc(&dq, queries.size());
  cudaMalloc(&dout, kTokens * kVecs * sizeof(float));
  cudaMemcpy(dk, keys.data(), keys.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dq, queries.data(), queries.size(), cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xff, kTokens * kVecs * sizeof(float));  // NaN: an unwritten value fails
  probe<<<1, 128>>>(dk, dq, dout);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("FAIL: %s\n", cudaGetErrorString(err));
    return 1;
  }
  std::vector<float> out(kTokens * kVecs);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  double worst = 0;
  int shown = 0;
  for (int r = 0; r < kTokens; ++r)
    for (int n = 0; n < kVecs; ++n) {
      double ref = 0, mag = 0;
      for (int k = 0; k < kDim; ++k) {
        const double p = (double)e4m3(keys[r * kDim + k]) * e4m3(queries[n * kDim + k]);
        ref += p, mag += std::fabs(p);
      }
      const float got = out[r * kVecs + n];
      const double rel = std::isfinite(got) ? std::fabs(got - ref) / mag : INFINITY;
      if (rel > 1e-2 && shown++ < 8)
        printf("token %d vector %d: got %g, expected %g\n", r, n, got, ref);
      worst = rel > worst ? rel : worst;
    }
  const bool layouts = worst < 1e-2;
  printf("%s: largest error / sum|products| = %.3g (%s the kernel's 1e-5)\n",
         layouts ? "PASS (layouts)" : "FAIL (layouts)", worst, worst <= 1e-5 ? "within" : "beyond");
  return layouts ? 0 : 1;
}
