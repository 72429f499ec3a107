// write.h: the fused key writer: a step's new keys, quantized to the cache's format, into their
// slots (slot = page * 128 + token). One thread per 16-element group: it reads the group's
// values, quantizes them and writes its bytes (and its nvfp4 scale), so a token's 8 groups go
// to 8 neighbouring threads and a warp writes 4 (wave64: 8) whole tokens.
// Part of the scoring kernel's one translation unit: only score.hip includes it.
#pragma once
#include "waits.h"

namespace cpindex {
namespace {

constexpr int kWriteGroup = 16;                         // elements per thread (an nvfp4 group)
constexpr int kWriteGroups = kHeadDim / kWriteGroup;    // groups per token
constexpr int kWriteThreads = 256;

// m >> s rounded to nearest, ties to even (1 <= s <= 31).
CP_DEVICE uint32_t shift_rne(uint32_t m, int s) {
  const uint32_t q = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// The e4m3 (fn) byte of x: clamped to +-448, then rounded to nearest even, subnormals down to
// 2^-9 (what PTX's cvt.rn.satfinite.e4m3x2 gives, in integer arithmetic so that every vendor
// rounds the same). The sign is x's, zeros included. NaN (keys are checked finite on the host)
// gives 448 with NaN's sign bit: never a byte outside the format.
CP_DEVICE uint32_t e4m3_rn_satfinite(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
  const uint32_t u = __float_as_uint(fminf(fabsf(x), 448.f));
  const int e = (int)(u >> 23);  // biased fp32 exponent, 0 .. 135
  const uint32_t m = (u & 0x7fffffu) | (e > 0 ? 0x800000u : 0u);
  // Normal e4m3 (|x| >= 2^-6, e >= 121): exponent field e - 120 and 3 mantissa bits; a rounding
  // carry (mantissa 16) moves into the exponent by the addition. Below: m * 2^(e - 150) in
  // units of 2^-9, i.e. m >> (141 - e).
  if (e >= 121) return sign | (((uint32_t)(e - 121) << 3) + shift_rne(m, 20));
  const int s = 141 - (e > 0 ? e : 1);
  return sign | (s > 31 ? 0u : shift_rne(m, s));
}

// The value of a positive e4m3 byte (1 .. 0x7e).
CP_DEVICE float e4m3_value(uint32_t b) {
  const uint32_t ex = b >> 3, mant = b & 7u;
  return ex ? __uint_as_float(((ex + 120u) << 23) | (mant << 20)) : (float)mant * (1.f / 512.f);
}

// The e2m1 code of q: nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code, beyond 6
// saturating; the sign bit only on a non-zero code (never -0).
CP_DEVICE uint32_t e2m1_code(float q) {
  const float a = fabsf(q);
  const uint32_t c = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) +
                     (uint32_t)(a >= 1.75f) + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) +
                     (uint32_t)(a > 5.f);
  return c != 0u && q < 0.f ? c | 8u : c;
}

// The bf16 bits of x, rounded to nearest even (NaN stays a quiet NaN).
CP_DEVICE uint32_t bf16_rn(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// The group's 16 values as fp32 (exact for every key dtype). KT: 0 fp32, 1 bf16, 2 fp16.
template <int KT>
CP_DEVICE void load_group(const uint8_t* src, float (&x)[kWriteGroup]) {
  if constexpr (KT == 0) {
    if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = reinterpret_cast<const float4*>(src)[i];
        x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWriteGroup; ++i) x[i] = reinterpret_cast<const float*>(src)[i];
    }
  } else {
    uint32_t w[8];
    if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[i];
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
      }
    } else {  // 16-bit elements: 2-byte aligned
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(src) + 2 * i;
        w[i] = (uint32_t)h[0] | ((uint32_t)h[1] << 16);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[2 * i] = KT == 1 ? cp_bf16_lo(w[i]) : cp_f16_lo(w[i]);
      x[2 * i + 1] = KT == 1 ? cp_bf16_hi(w[i]) : cp_f16_hi(w[i]);
    }
  }
}

// N 32-bit words to dst: 16-byte stores where dst allows, else 8-byte, else byte by byte (a
// cache view's strides need not keep every group aligned).
template <int N>
CP_DEVICE void store_words(uint8_t* dst, const uint32_t (&w)[N]) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if constexpr (N % 4 == 0) {
    if ((a & 15u) == 0) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i)
        reinterpret_cast<uint4*>(dst)[i] =
            make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
      return;
    }
  }
  if ((a & 7u) == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
      reinterpret_cast<uint2*>(dst)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
    return;
  }
#pragma unroll
  for (int i = 0; i < 4 * N; ++i) dst[i] = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
}

// F: the cache format (kBF16, kFP8, kNVFP4); KT: the keys' dtype (load_group).
template <int F, int KT>
__global__ void __launch_bounds__(kWriteThreads) write_keys_kernel(const WriteParams w) {
  static_assert(kWriteGroups * kWriteGroup == kHeadDim, "a token is whole groups");
  const int64_t id = (int64_t)blockIdx.x * kWriteThreads + threadIdx.x;
  const int64_t token = id / kWriteGroups;
  const int group = (int)(id % kWriteGroups);
  if (token >= w.tokens) return;
  const int64_t slot = w.slots[token];
  if (slot < 0) return;  // padding: nothing to write
  if (slot >= w.num_pages * kPageTokens) {
    if (group == 0) report(w, kErrSlot, (uint32_t)token, 0u, (uint64_t)slot);
    return;
  }
  const int64_t page = slot / kPageTokens, t = slot % kPageTokens;
  float x[kWriteGroup];
  load_group<KT>(w.keys + token * w.key_row_stride + group * kWriteGroup * (KT == 0 ? 4 : 2), x);
  uint8_t* row = w.kv + page * w.kv_page_stride + t * w.kv_token_stride;
  if constexpr (F == kBF16) {
    uint32_t out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = bf16_rn(x[2 * i]) | (bf16_rn(x[2 * i + 1]) << 16);
    store_words(row + group * kWriteGroup * 2, out);
  } else if constexpr (F == kFP8) {
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      out[i] = e4m3_rn_satfinite(x[4 * i]) | (e4m3_rn_satfinite(x[4 * i + 1]) << 8) |
               (e4m3_rn_satfinite(x[4 * i + 2]) << 16) | (e4m3_rn_satfinite(x[4 * i + 3]) << 24);
    store_words(row + group * kWriteGroup, out);
  } else {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kWriteGroup; ++i) amax = fmaxf(amax, fabsf(x[i]));
    // max(scale, 2^-9): positive e4m3 bytes order as their values, so the smallest subnormal is
    // byte 1. A group of zeros (amax 0) gets it too, and its codes stay 0.
    uint32_t sb = e4m3_rn_satfinite(cp_fdiv_rn(fmaxf(amax, 1e-12f), 6.f));
    sb = sb > 1u ? sb : 1u;
    const float scale = e4m3_value(sb);
    uint32_t out[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < kWriteGroup; ++i)
      out[i / 8] |= e2m1_code(cp_fdiv_rn(x[i], scale)) << (4 * (i % 8));  // element 2j: low nibble
    store_words(row + group * (kWriteGroup / 2), out);
    w.ks[page * w.ks_page_stride + t * w.ks_token_stride + group] = (uint8_t)sb;
  }
}

template <int F>
int launch_write_format(const WriteParams& w, int blocks, cp_stream_t stream) {
  switch (w.key_dtype) {
    case 0: write_keys_kernel<F, 0><<<blocks, kWriteThreads, 0, stream>>>(w); break;
    case 1: write_keys_kernel<F, 1><<<blocks, kWriteThreads, 0, stream>>>(w); break;
    case 2: write_keys_kernel<F, 2><<<blocks, kWriteThreads, 0, stream>>>(w); break;
    default: return -1;
  }
  return (int)cp_get_last_error();
}

}  // namespace

int launch_write_keys(const WriteParams& w, void* stream) {
  if (w.tokens <= 0) return 0;
  const int64_t blocks = (w.tokens * kWriteGroups + kWriteThreads - 1) / kWriteThreads;
  if (blocks > 0x7fffffff) return -1;
  const auto s = (cp_stream_t)stream;
  switch (w.format) {
    case kBF16: return launch_write_format<kBF16>(w, (int)blocks, s);
    case kFP8: return launch_write_format<kFP8>(w, (int)blocks, s);
    case kNVFP4: return launch_write_format<kNVFP4>(w, (int)blocks, s);
    default: return -1;
  }
}

}  // namespace cpindex
