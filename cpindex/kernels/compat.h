// compat.h: the few vendor-specific pieces of the scoring kernel, for HIP (AMD) and CUDA (NVIDIA).
//
// The kernel body (score.hip) is written once against these names. Everything here is device
// code or plain types: no torch, no host runtime calls beyond the launch API.
#pragma once

#include <stdint.h>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIP__)
#define CP_HIP 1
#include <hip/hip_runtime.h>
#else
#define CP_CUDA 1
#include <cuda_runtime.h>
#endif

// ---- warp geometry -----------------------------------------------------------------------------
#if defined(CP_HIP)
// gfx9 (MI300/MI355) runs wave64. Newer clang dropped the predefined macro on some paths, so the
// compile gate defines it; wave32 AMD parts are not a target of this kernel.
#ifndef __AMDGCN_WAVEFRONT_SIZE
#define __AMDGCN_WAVEFRONT_SIZE 64
#endif
#define CP_WARP __AMDGCN_WAVEFRONT_SIZE
typedef uint64_t cp_lanemask_t;
#else
#define CP_WARP 32
typedef uint32_t cp_lanemask_t;
#endif

// The tensor-core path (mma.sync m16n8k16, sm_80+) is CUDA only; AMD builds take the MFMA path
// (CP_MFMA below). The portable path computes the same fragments with scalar fp32 FMAs: the
// fallback for other AMD GPUs, and -DCP_PORTABLE=1 forces it on CUDA so that it stays tested.
// The choice must not depend on __CUDA_ARCH__: the host pass and the device pass have to agree
// on which kernel templates exist.
#if defined(CP_CUDA) && !defined(CP_PORTABLE)
#define CP_USE_MMA 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "cpindex's tensor-core path needs sm_80 or newer (build with -DCP_PORTABLE=1 for older GPUs)"
#endif
#else
#define CP_USE_MMA 0
#endif
// The matrix-core path (MFMA, mfma.h) is what HIP builds take: CDNA3 (gfx940-942) and CDNA4
// (gfx950), wave64. -DCP_PORTABLE=1 builds the scalar path instead (other AMD GPUs; the
// launcher's build does that for them). Like CP_USE_MMA, the choice is the same in the host and
// device passes; only the device pass knows the arch, and checks it.
#if defined(CP_HIP) && !defined(CP_PORTABLE)
#define CP_MFMA 1
#if defined(__HIP_DEVICE_COMPILE__) && !defined(__gfx940__) && !defined(__gfx941__) && \
    !defined(__gfx942__) && !defined(__gfx950__)
#error "cpindex's MFMA path is for gfx942 and gfx950 (build with -DCP_PORTABLE=1 for other AMD GPUs)"
#endif
#else
#define CP_MFMA 0
#endif
// CDNA3's fp8 MFMA reads FNUZ bytes, CDNA4's OCP e4m3 (mfma.h says how fn bytes score as FNUZ).
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define CP_FP8_FNUZ 1
#else
#define CP_FP8_FNUZ 0
#endif

// Native fp8 -> f16x2 conversion (cvt.rn.f16x2.e4m3x2) exists from sm_89.
#if defined(CP_CUDA) && !defined(CP_PORTABLE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define CP_NATIVE_FP8 1
#else
#define CP_NATIVE_FP8 0
#endif

// Warp-wide integer reductions (redux.sync) exist from sm_80.
#if defined(CP_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CP_REDUX 1
#else
#define CP_REDUX 0
#endif

#define CP_DEVICE __device__ __forceinline__

// ---- runtime names used by the launcher ----------------------------------------------------------
#if defined(CP_HIP)
typedef hipStream_t cp_stream_t;
#define cp_get_last_error hipGetLastError
#define cp_occupancy hipOccupancyMaxActiveBlocksPerMultiprocessor
#define cp_get_device hipGetDevice
#define cp_func_max_dyn_smem(fn, bytes) \
  hipFuncSetAttribute((const void*)(fn), hipFuncAttributeMaxDynamicSharedMemorySize, (bytes))
#else
typedef cudaStream_t cp_stream_t;
#define cp_get_last_error cudaGetLastError
#define cp_occupancy cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define cp_get_device cudaGetDevice
#define cp_func_max_dyn_smem(fn, bytes) \
  cudaFuncSetAttribute((fn), cudaFuncAttributeMaxDynamicSharedMemorySize, (bytes))
#endif

// ---- shuffles ----------------------------------------------------------------------------------
CP_DEVICE float cp_shfl_xor(float v, int mask) {
#if defined(CP_HIP)
  return __shfl_xor(v, mask, CP_WARP);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, CP_WARP);
#endif
}

CP_DEVICE float cp_shfl(float v, int src) {
#if defined(CP_HIP)
  return __shfl(v, src, CP_WARP);
#else
  return __shfl_sync(0xffffffffu, v, src, CP_WARP);
#endif
}

CP_DEVICE int cp_shfl_int(int v, int src) {
  return __float_as_int(cp_shfl(__int_as_float(v), src));
}

CP_DEVICE void cp_syncwarp() {
#if defined(CP_HIP)
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
#else
  __syncwarp();
#endif
}

// ---- loads -------------------------------------------------------------------------------------
#if defined(CP_HIP)
// p as a global-memory pointer: clang 19 (gfx942) keeps a generic pointer's loads as flat_load,
// which also count as LDS accesses, so every wait for them waits for the LDS reads too.
template <typename T>
CP_DEVICE const __attribute__((address_space(1))) T* cp_global(const void* p) {
  return (const __attribute__((address_space(1))) T*)p;
}
#endif

// Key pages are streamed once per call: read-only, no reuse, 16 bytes per lane.
CP_DEVICE uint4 cp_load_stream16(const void* p) {
#if defined(CP_HIP)
  typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));
  const u32x4 v = __builtin_nontemporal_load(cp_global<u32x4>(p));
  return make_uint4(v.x, v.y, v.z, v.w);
#else
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}

// ---- shared-memory staging (sm_80+, the tensor-core path only) --------------------------------
#if CP_USE_MMA
CP_DEVICE uint32_t cp_smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared without a register round trip, cached in L2 only (read once).
CP_DEVICE void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
}
CP_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
CP_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 16-bit matrices; lanes 8m..8m+7 give matrix m's row addresses, and lane l receives
// row l/4, elements 2(l%4) and 2(l%4)+1 of each matrix: the mma A-fragment layout.
CP_DEVICE void cp_ldmatrix_x4(uint32_t smem, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem)
               : "memory");
}
#endif

// ---- system-scope synchronisation (flags live in peer-mapped memory) ---------------------------
CP_DEVICE uint64_t cp_load_acquire_sys(const uint64_t* p) {
#if defined(CP_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

CP_DEVICE void cp_store_release_sys(uint64_t* p, uint64_t v) {
#if defined(CP_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

CP_DEVICE uint32_t cp_load_relaxed_sys(const uint32_t* p) {
#if defined(CP_HIP)
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

CP_DEVICE void cp_fence_sys() { __threadfence_system(); }
// Orders this GPU's own memory only (cheaper: no wait for peer or host visibility).
CP_DEVICE void cp_fence_gpu() { __threadfence(); }

// Nanosecond-ish wall clock for timeouts. CUDA: %globaltimer (ns). AMD: the constant-rate
// realtime counter (100 MHz on gfx942/gfx950); the host converts the timeout into these ticks.
CP_DEVICE uint64_t cp_clock_ticks() {
#if defined(CP_HIP)
  return wall_clock64();
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

CP_DEVICE void cp_backoff() {
#if defined(CP_HIP)
  __builtin_amdgcn_s_sleep(2);
#else
  __nanosleep(64);
#endif
}

// ---- packed 16-bit math ------------------------------------------------------------------------
// f16x2 and bf16x2 travel as raw 32-bit words; only these helpers look inside them.
CP_DEVICE float cp_f16_lo(uint32_t w) {
#if defined(CP_HIP)
  _Float16 h = __builtin_bit_cast(_Float16, (uint16_t)(w & 0xffffu));
  return (float)h;
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w & 0xffffu)));
  return f;
#endif
}
CP_DEVICE float cp_f16_hi(uint32_t w) {
#if defined(CP_HIP)
  _Float16 h = __builtin_bit_cast(_Float16, (uint16_t)(w >> 16));
  return (float)h;
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w >> 16)));
  return f;
#endif
}
CP_DEVICE float cp_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
CP_DEVICE float cp_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// a / b correctly rounded (to nearest even) whatever the build's division flags. HIP-clang's
// float division is correctly rounded by default.
CP_DEVICE float cp_fdiv_rn(float a, float b) {
#if defined(CP_HIP)
  return a / b;
#else
  return __fdiv_rn(a, b);
#endif
}

// Elementwise product of two f16x2 words (exact for the fp4 x fp8-scale products we form).
CP_DEVICE uint32_t cp_hmul2(uint32_t a, uint32_t b) {
#if defined(CP_HIP)
  typedef _Float16 h2 __attribute__((ext_vector_type(2)));
  h2 x = __builtin_bit_cast(h2, a), y = __builtin_bit_cast(h2, b);
  return __builtin_bit_cast(uint32_t, x * y);
#else
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#endif
}

// ---- fp8 (e4m3) and fp4 (e2m1) to f16 ----------------------------------------------------------
// Two e4m3 bytes (low byte = first element) -> f16x2, exactly.
#if CP_NATIVE_FP8
CP_DEVICE uint32_t cp_e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t d;
  asm("{.reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t;}" : "=r"(d) : "r"(two_bytes));
  return d;
}
// Four e4m3 bytes -> two f16x2 (bytes 0-1, bytes 2-3). The halves go to the conversion as they
// are (no mask or shift to isolate them first: ptxas reads a register's high half directly).
CP_DEVICE void cp_e4m3x4_to_f16x2x2(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 a, b;\n\t"
      "mov.b32 {a, b}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, a;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, b;}"
      : "=r"(lo), "=r"(hi)
      : "r"(four_bytes));
}
#else
// Portable: put the 7 magnitude bits of e4m3 into f16's exponent/mantissa at bits 7..13. That is
// the same number times 2^-8 for normals and subnormals alike (both formats' subnormal steps line
// up); one exact f16x2 multiply by 256 (0x5C00) restores it. Never NaN: the cache holds finite
// values only (quantize rejects non-finite input).
CP_DEVICE uint32_t cp_e4m3x2_to_f16x2(uint32_t two_bytes) {
  const uint32_t x = (two_bytes & 0xffu) | ((two_bytes & 0xff00u) << 8);
  return cp_hmul2(((x & 0x00800080u) << 8) | ((x & 0x007f007fu) << 7), 0x5c005c00u);
}
CP_DEVICE void cp_e4m3x4_to_f16x2x2(uint32_t four_bytes, uint32_t& lo, uint32_t& hi) {
  lo = cp_e4m3x2_to_f16x2(four_bytes & 0xffffu);
  hi = cp_e4m3x2_to_f16x2(four_bytes >> 16);
}
#endif

// The byte-table lookups of eight e2m1 nibbles (element 0 in the low nibble): the 4-byte
// selectors of elements 0-3 and 4-7 (magnitude codes, bit 3 clear) and, for the same bytes, the
// nibbles' sign bits at each byte's bit 7.
struct E2m1x8Sel {
  uint32_t mag03, mag47, sign03, sign47;
};
CP_DEVICE E2m1x8Sel cp_e2m1x8_select(uint32_t w) {
  const uint32_t mag = w & 0x77777777u;
  const uint32_t shifted = w << 4;  // even elements' sign bits at each byte's bit 7
  return {mag, mag >> 16, __byte_perm(shifted, w, 0x5140u) & 0x80808080u,
          __byte_perm(shifted, w, 0x7362u) & 0x80808080u};
}

// Eight e2m1 nibbles (one word, element 0 in the low nibble) -> four f16x2 words holding
// elements (0,1), (2,3), (4,5), (6,7), through a per-scale table: hi and lo hold, for the 8 e2m1
// magnitudes m (bytes 0..7), the high and low byte of the f16 bits of
// e4m3_rn_satfinite(m * scale). One byte permute looks up four high (or low) bytes at once; the
// nibbles' sign bits are gathered to each byte's bit 7 and XORed into the high bytes (a negative
// scale's entries carry their own sign, so signs combine like the product's); four permutes
// interleave low and high bytes into f16 pairs. 15 integer ops, no conversion instruction.
// Selector nibbles keep bit 3 clear: PTX prmt would read it as "replicate the sign", HIP not.
CP_DEVICE void cp_e2m1x8_lut_f16x2x4(uint32_t w, uint2 hi, uint2 lo, uint32_t (&out)[4]) {
  const E2m1x8Sel x = cp_e2m1x8_select(w);
  const uint32_t h03 = __byte_perm(hi.x, hi.y, x.mag03) ^ x.sign03;
  const uint32_t h47 = __byte_perm(hi.x, hi.y, x.mag47) ^ x.sign47;
  const uint32_t l03 = __byte_perm(lo.x, lo.y, x.mag03), l47 = __byte_perm(lo.x, lo.y, x.mag47);
  out[0] = __byte_perm(l03, h03, 0x5140u);  // lo0, hi0, lo1, hi1: elements 0, 1
  out[1] = __byte_perm(l03, h03, 0x7362u);  // elements 2, 3
  out[2] = __byte_perm(l47, h47, 0x5140u);  // elements 4, 5
  out[3] = __byte_perm(l47, h47, 0x7362u);  // elements 6, 7
}

#if CP_NATIVE_FP8
// The same eight values through the other table and the conversion unit: e8 holds the e4m3
// bytes of the 8 magnitudes (bytes 0..7); one permute per four values looks them up, the
// gathered sign bits are XORed into each byte's bit 7, and cvt.rn.f16x2.e4m3x2 widens pairs.
// 7 integer ops and 4 conversions against 15 integer ops: the kernel sends some of a token's
// words this way so that the integer pipe and the conversion unit share the work.
CP_DEVICE void cp_e2m1x8_lut_e4m3_f16x2x4(uint32_t w, uint2 e8, uint32_t (&out)[4]) {
  const E2m1x8Sel x = cp_e2m1x8_select(w);
  const uint32_t e03 = __byte_perm(e8.x, e8.y, x.mag03) ^ x.sign03;
  const uint32_t e47 = __byte_perm(e8.x, e8.y, x.mag47) ^ x.sign47;
  asm("{.reg .b16 a, b, c, d;\n\t"
      "mov.b32 {a, b}, %4;\n\t"
      "mov.b32 {c, d}, %5;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, a;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n\t"
      "cvt.rn.f16x2.e4m3x2 %2, c;\n\t"
      "cvt.rn.f16x2.e4m3x2 %3, d;}"
      : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
      : "r"(e03), "r"(e47));
}
#endif

// 2 bytes (a token's pair of nvfp4 scales), read once, no reuse. Explicitly global: a generic
// load may alias the shared memory the warpgroup mma reads, and ptxas then keeps it behind each
// tile's mma instead of issuing it with the batch's other loads.
CP_DEVICE uint32_t cp_load_stream2(const void* p) {
#if defined(CP_HIP)
  return __builtin_nontemporal_load(cp_global<uint16_t>(p));
#else
  uint16_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
#endif
}

// 8 bytes, read once, no reuse (nvfp4 tokens whose stride is not a multiple of 16, e.g. vLLM's
// 72-byte layout, are only 8-byte aligned).
CP_DEVICE uint2 cp_load_stream8(const void* p) {
#if defined(CP_HIP)
  typedef uint32_t u32x2 __attribute__((ext_vector_type(2)));
  const u32x2 v = __builtin_nontemporal_load(cp_global<u32x2>(p));
  return make_uint2(v.x, v.y);
#else
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
#endif
}
