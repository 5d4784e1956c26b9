// One-row bf16 GEMV whose weights stream through a shared-memory ring filled by bulk copies (TMA, sm_90+), issued
// before the PDL wait (issue 11, experiment). Timed alone, a projection that waits for the kernel before it and
// only then reads its weights pays ~1.7-2.2 us of ramp and drain a call (bench/results/2026-12-02_h200_read_ceiling),
// which keeps o_proj (16.8 MB) and qkv (25.2 MB) under 88% of the HBM bandwidth. The weights never depend on the
// kernel before; only x does. So each CTA puts its first `stages` chunks in flight, lets the next kernel in, and only
// then waits; the ring is kept small enough (about half an SM's shared memory) that the next call's CTAs sit beside
// this call's and fill their own rings while this one drains.
//
// CTA c owns rows [c*n/grid, (c+1)*n/grid): one contiguous byte range of the row-major weight, read in chunks of
// whole rows. Thread t keeps x's 16-byte vectors t, t+T, ... in registers and dots them with the same columns of every
// row; each warp's row sums go to shared memory and are added in warp order once at the end.
#include <cuda_bf16.h>

#include <algorithm>

#include "api.h"
#include "ar_common.cuh"
#include "common.cuh"

namespace tpgraph {
namespace {

constexpr int kVectorElems = 8;  // bf16 elements in 16 bytes
constexpr int kMaxVectorsPerThread = 8;
constexpr int kBarrierBytes = 16 * 8;  // room for 16 stage barriers
constexpr int kMaxStages = 16;

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_addr(bar)) : "memory");
}

// The barrier's phase completes once `bytes` have landed (the bulk copy counts them down).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(bar)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_addr(dst)),
               "l"(src), "r"(bytes), "r"(shared_addr(bar))
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const auto* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
  const auto* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a2[i]);
    const float2 fb = __bfloat1622float2(b2[i]);
    acc = fmaf(fa.x, fb.x, acc);
    acc = fmaf(fa.y, fb.y, acc);
  }
  return acc;
}

__device__ __forceinline__ void async_copy16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_addr(dst)), "l"(src) : "memory");
}

// Bulk-copy form: one thread issues each chunk as one bulk copy counted down on the stage's barrier.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemv_ring_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                     __nv_bfloat16* __restrict__ out, int n, int k, int rows_per_chunk, int stages, int max_rows,
                     int late_let_in) {
  constexpr int kWarps = kThreads / 32;
  extern __shared__ __align__(128) unsigned char smem[];
  auto* full = reinterpret_cast<uint64_t*>(smem);
  auto* row_sums = reinterpret_cast<float*>(smem + kBarrierBytes);  // [max_rows][kWarps]
  unsigned char* ring = smem + kBarrierBytes + ((max_rows * kWarps * 4 + 127) / 128) * 128;

  const int row0 = static_cast<int>(static_cast<long long>(blockIdx.x) * n / gridDim.x);
  const int rows = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * n / gridDim.x) - row0;
  const int chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const size_t row_bytes = static_cast<size_t>(k) * sizeof(__nv_bfloat16);
  const size_t stage_bytes = rows_per_chunk * row_bytes;
  const char* slice = reinterpret_cast<const char*>(w) + row0 * row_bytes;
  auto issue = [&](int c) {
    const int s = c % stages;
    const int r = min(rows_per_chunk, rows - c * rows_per_chunk);
    bulk_load(ring + s * stage_bytes, slice + c * stage_bytes, static_cast<uint32_t>(r * row_bytes), &full[s]);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) barrier_init(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < min(stages, chunks); ++c) issue(c);
  }
  // Only x comes from the kernel before: the weights are in flight before the wait. The next kernel may start now, or
  // (late_let_in) once the weights have all landed, so that it takes no SM slots from this stream
  if (!late_let_in) pdl_launch_dependents();
  pdl_wait();
  __syncthreads();  // the barriers' initialisation is seen by every thread

  const int vectors = k / kVectorElems;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  uint4 xr[kMaxVectorsPerThread];
#pragma unroll
  for (int j = 0; j < kMaxVectorsPerThread; ++j) {
    const int v = threadIdx.x + j * kThreads;
    xr[j] = v < vectors ? xv[v] : make_uint4(0, 0, 0, 0);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = 0; c < chunks; ++c) {
    const int s = c % stages;
    barrier_wait(&full[s], (c / stages) & 1);
    const auto* tile = reinterpret_cast<const uint4*>(ring + s * stage_bytes);
    const int in_chunk = min(rows_per_chunk, rows - c * rows_per_chunk);
    for (int r = 0; r < in_chunk; ++r) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kMaxVectorsPerThread; ++j) {
        const int v = threadIdx.x + j * kThreads;
        if (v < vectors) acc += dot8(tile[r * vectors + v], xr[j]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) row_sums[(c * rows_per_chunk + r) * kWarps + warp] = acc;
    }
    __syncthreads();  // every warp is done with stage s before a bulk copy refills it
    if (threadIdx.x == 0 && c + stages < chunks) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(c + stages);
    }
  }
  if (late_let_in) pdl_launch_dependents();
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) sum += row_sums[r * kWarps + i];
    out[row0 + r] = __float2bfloat16(sum);
  }
}

// Per-thread form: every thread copies 16-byte pieces of each chunk (cp.async) and has the stage's barrier (one
// arrival a thread) count its arrival once they have landed. At chunk c all threads meet once (so every thread is done
// with chunk c-1), refill chunk c-1's stage with chunk c+stages-1, wait for chunk c's barrier, and dot it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    gemv_ring_async_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                           __nv_bfloat16* __restrict__ out, int n, int k, int rows_per_chunk, int stages,
                           int max_rows, int late_let_in) {
  constexpr int kWarps = kThreads / 32;
  extern __shared__ __align__(128) unsigned char smem[];
  auto* full = reinterpret_cast<uint64_t*>(smem);
  auto* row_sums = reinterpret_cast<float*>(smem + kBarrierBytes);  // [max_rows][kWarps]
  unsigned char* ring = smem + kBarrierBytes + ((max_rows * kWarps * 4 + 127) / 128) * 128;

  const int row0 = static_cast<int>(static_cast<long long>(blockIdx.x) * n / gridDim.x);
  const int rows = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * n / gridDim.x) - row0;
  const int chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const size_t row_bytes = static_cast<size_t>(k) * sizeof(__nv_bfloat16);
  const size_t stage_bytes = rows_per_chunk * row_bytes;
  const char* slice = reinterpret_cast<const char*>(w) + row0 * row_bytes;
  auto issue = [&](int c) {
    if (c >= chunks) return;
    const int s = c % stages;
    const int pieces = static_cast<int>(min(rows_per_chunk, rows - c * rows_per_chunk) * row_bytes / 16);
    unsigned char* dst = ring + s * stage_bytes;
    const char* src = slice + c * stage_bytes;
    for (int i = threadIdx.x; i < pieces; i += kThreads) async_copy16(dst + i * 16, src + i * 16);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(shared_addr(&full[s])) : "memory");
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(&full[s])), "r"(kThreads) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  for (int c = 0; c < stages - 1; ++c) issue(c);
  // Only x comes from the kernel before: the weights are in flight before the wait. The next kernel may start now, or
  // (late_let_in) once the weights have all landed, so that it takes no SM slots from this stream
  if (!late_let_in) pdl_launch_dependents();
  pdl_wait();

  const int vectors = k / kVectorElems;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  uint4 xr[kMaxVectorsPerThread];
#pragma unroll
  for (int j = 0; j < kMaxVectorsPerThread; ++j) {
    const int v = threadIdx.x + j * kThreads;
    xr[j] = v < vectors ? xv[v] : make_uint4(0, 0, 0, 0);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = 0; c < chunks; ++c) {
    __syncthreads();  // every thread is done with chunk c-1: its stage takes chunk c+stages-1
    issue(c + stages - 1);
    barrier_wait(&full[c % stages], (c / stages) & 1);
    const auto* tile = reinterpret_cast<const uint4*>(ring + (c % stages) * stage_bytes);
    const int in_chunk = min(rows_per_chunk, rows - c * rows_per_chunk);
    for (int r = 0; r < in_chunk; ++r) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kMaxVectorsPerThread; ++j) {
        const int v = threadIdx.x + j * kThreads;
        if (v < vectors) acc += dot8(tile[r * vectors + v], xr[j]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) row_sums[(c * rows_per_chunk + r) * kWarps + warp] = acc;
    }
  }
  if (late_let_in) pdl_launch_dependents();
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) sum += row_sums[r * kWarps + i];
    out[row0 + r] = __float2bfloat16(sum);
  }
}

template <int kThreads>
void launch(const GemvRingArgs& a) {
  const int vectors = a.k / kVectorElems;
  TPG_CHECK(vectors <= kMaxVectorsPerThread * kThreads, "gemv_ring: k=" << a.k << " exceeds what " << kThreads
                                                                        << " threads keep of x ("
                                                                        << kMaxVectorsPerThread * kThreads * 8 << ")");
  const int max_rows = (a.n + a.grid - 1) / a.grid;
  const size_t row_bytes = static_cast<size_t>(a.k) * 2;
  const size_t smem = kBarrierBytes + ((max_rows * (kThreads / 32) * 4 + 127) / 128) * 128 +
                      static_cast<size_t>(a.stages) * a.rows_per_chunk * row_bytes;
  auto* kernel = a.per_thread_copies ? gemv_ring_async_kernel<kThreads> : gemv_ring_kernel<kThreads>;
  TPG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(a.grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = reinterpret_cast<cudaStream_t>(a.stream);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = a.pdl ? 1 : 0;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  TPG_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, reinterpret_cast<const __nv_bfloat16*>(a.x),
                                    reinterpret_cast<const __nv_bfloat16*>(a.w), reinterpret_cast<__nv_bfloat16*>(a.out),
                                    a.n, a.k, a.rows_per_chunk, a.stages, max_rows,
                                    a.late_let_in ? 1 : 0));
}

}  // namespace

size_t gemv_ring_smem_bytes(int n, int k, int grid, int threads, int rows_per_chunk, int stages) {
  const int max_rows = (n + grid - 1) / grid;
  return kBarrierBytes + ((max_rows * (threads / 32) * 4 + 127) / 128) * 128 +
         static_cast<size_t>(stages) * rows_per_chunk * k * 2;
}

void gemv_ring(const GemvRingArgs& a) {
  TPG_CHECK(a.x && a.w && a.out, "gemv_ring: null pointer");
  TPG_CHECK(a.x % 16 == 0 && a.w % 16 == 0, "gemv_ring: x and w must be 16-byte aligned (bulk copies)");
  TPG_CHECK(a.n > 0 && a.k > 0 && a.k % kVectorElems == 0, "gemv_ring: k must be a positive multiple of 8, got "
                                                                  << a.k);
  TPG_CHECK(a.grid > 0 && a.grid <= a.n, "gemv_ring: grid must be in [1, n], got " << a.grid);
  TPG_CHECK(a.stages >= 1 && a.stages <= kMaxStages, "gemv_ring: stages must be in [1, " << kMaxStages << "]");
  TPG_CHECK(a.rows_per_chunk >= 1, "gemv_ring: rows_per_chunk must be >= 1");
  switch (a.threads) {
    case 128: return launch<128>(a);
    case 256: return launch<256>(a);
    case 512: return launch<512>(a);
    default: TPG_CHECK(false, "gemv_ring: threads must be 128, 256 or 512, got " << a.threads);
  }
}

}  // namespace tpgraph
