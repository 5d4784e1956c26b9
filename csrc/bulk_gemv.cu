// Small-M projection out[m, n] = sum_k x[m, k] * w[n, k] whose weights stream through shared memory by bulk
// asynchronous copies (sm_90+: cp.async.bulk, one thread issues them, an mbarrier per stage says when one landed).
//
// Why another kernel beside gemv.py's Triton one: a projection waits for its input row (the kernel before writes
// it), and a kernel that starts its weight reads only after that wait pays launch, ramp and drain, 1.7-2.2 us a call
// (bench/results/2026-12-02_h200_read_ceiling). The weights do not depend on the kernel before, so here each block
// issues its first `stages` chunks of weights into shared memory before griddepcontrol.wait and reads x after it.
//
// Each block owns a contiguous run of weight rows (no split-K, so no reduction across blocks); a chunk is
// rows_per_chunk whole rows; the block's 8 warps split a chunk's rows between them, kWarps / rows_per_chunk warps a
// row, and each lane keeps its columns of x in registers for the whole kernel. Per chunk: each warp's sums are
// reduced by shuffles, and one thread per (row, m) adds the row's warps in warp order: the same shape gives the same
// bits every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "api.h"
#include "ar_launch.h"
#include "common.cuh"

namespace tpgraph {
namespace {

constexpr int kBulkWarps = 8;
constexpr int kBulkThreads = kBulkWarps * 32;
constexpr int kVecBytes = 16;  // one lane's load from a chunk
constexpr int kMaxBulkStages = 8;
constexpr int kMaxBulkRows = 4;  // rows of x (decode batch) one launch takes

struct BulkGemvParams {
  const void* x;  // [m, k], row stride k
  const void* w;  // [n, k], row-major
  void* out;      // [m, n], row stride n
  int n;
  int k;
  int rows_per_chunk;
  int stages;
  int trigger;  // BulkTrigger
  bool evict_first;
};

enum BulkTrigger : int { kTriggerStart = 0, kTriggerIssued = 1, kTriggerExit = 2 };

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}

// One chunk of global memory into shared memory; `bar` completes its phase when all of its bytes landed.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          bool evict_first) {
  const uint32_t b = shared_address(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  if (evict_first) {  // each weight is read once a step: keep L2 for what is read again
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"(shared_address(dst)),
        "l"(src), "r"(bytes), "r"(b), "l"(policy)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     shared_address(dst)),
                 "l"(src), "r"(bytes), "r"(b)
                 : "memory");
  }
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
#endif

__device__ __forceinline__ float2 to_float2(uint32_t packed, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
}
__device__ __forceinline__ float2 to_float2(uint32_t packed, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&packed));
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// acc + sum of the 8 products of one 16-byte vector of weights and of x
template <typename T>
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
  const uint32_t xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = to_float2(wv[j], T{});
    const float2 b = to_float2(xv[j], T{});
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

// VPT: 16-byte vectors of a row each lane reads per chunk (K / 8 / (32 * warps a row), rounded up).
template <typename T, int M, int VPT>
__global__ void __launch_bounds__(kBulkThreads) bulk_gemv_kernel(BulkGemvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t landed[kMaxBulkStages];
  __shared__ float warp_sums[2][kBulkWarps][M];  // by chunk parity: a chunk's sums are read while the next is made

  constexpr int kElems = kVecBytes / sizeof(T);
  const int row0 = static_cast<int>(static_cast<long long>(blockIdx.x) * p.n / gridDim.x);
  const int rows = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * p.n / gridDim.x) - row0;
  const int per_chunk = p.rows_per_chunk;
  const int chunks = (rows + per_chunk - 1) / per_chunk;
  const uint32_t row_bytes = static_cast<uint32_t>(p.k) * sizeof(T);
  const uint32_t slot_bytes = row_bytes * per_chunk;
  const T* weights = static_cast<const T*>(p.w) + static_cast<size_t>(row0) * p.k;

  auto issue = [&](int c) {
    const int slot = c % p.stages;
    const uint32_t n_rows = min(per_chunk, rows - c * per_chunk);
    bulk_copy(ring + slot * slot_bytes, weights + static_cast<size_t>(c) * per_chunk * p.k, n_rows * row_bytes,
              &landed[slot], p.evict_first);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) barrier_init(&landed[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // the weights do not depend on the kernel before: the first chunks go out before waiting for it
  const int ahead = min(p.stages, chunks);
  if (threadIdx.x == 0) {
    for (int c = 0; c < ahead; ++c) issue(c);
  }
  if (p.trigger == kTriggerStart || (p.trigger == kTriggerIssued && chunks <= p.stages)) launch_dependents();
  wait_for_prerequisite();  // x is the kernel before's output

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warps_a_row = kBulkWarps / per_chunk;
  const int chunk_row = warp / warps_a_row;  // which row of a chunk this warp adds up
  const int part = warp % warps_a_row;       // which of that row's warps
  const int vectors = p.k / kElems;
  uint4 xs[M][VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = lane + 32 * (part + warps_a_row * i);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      xs[m][i] = v < vectors ? __ldcg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) +
                                                                     static_cast<size_t>(m) * p.k) + v)
                             : make_uint4(0, 0, 0, 0);
    }
  }

  for (int c = 0; c < chunks; ++c) {
    const int slot = c % p.stages;
    barrier_wait(&landed[slot], (c / p.stages) & 1);
    const int n_rows = min(per_chunk, rows - c * per_chunk);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    if (chunk_row < n_rows) {
      const uint4* tile = reinterpret_cast<const uint4*>(ring + slot * slot_bytes + chunk_row * row_bytes);
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = lane + 32 * (part + warps_a_row * i);
        if (v < vectors) {
          const uint4 wv = tile[v];
#pragma unroll
          for (int m = 0; m < M; ++m) acc[m] = dot8<T>(wv, xs[m][i], acc[m]);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
    }
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) warp_sums[c & 1][warp][m] = acc[m];
    }
    __syncthreads();  // the slot is read and the warps' sums are in
    if (threadIdx.x == 0 && c + p.stages < chunks) {
      // the slot was read through the generic proxy; the bulk copy writes it through the async proxy
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(c + p.stages);
    }
    if (p.trigger == kTriggerIssued && c + p.stages == chunks - 1) launch_dependents();
    if (threadIdx.x < n_rows * M) {
      const int row = threadIdx.x / M;
      const int m = threadIdx.x % M;
      float sum = 0.f;
      for (int g = 0; g < warps_a_row; ++g) sum += warp_sums[c & 1][row * warps_a_row + g][m];
      store(static_cast<T*>(p.out) + static_cast<size_t>(m) * p.n + row0 + c * per_chunk + row, sum);
    }
  }
#else
  __trap();  // built for an arch without bulk copies; the launcher refuses those devices first
#endif
}

template <typename T, int M, int VPT>
void launch_bulk_gemv(const BulkGemvParams& p, int blocks, bool pdl, cudaStream_t stream) {
  auto kernel = bulk_gemv_kernel<T, M, VPT>;
  const int smem = p.stages * p.rows_per_chunk * p.k * static_cast<int>(sizeof(T));
  TPG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kBulkThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  TPG_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <typename T, int M>
void dispatch_vectors(const BulkGemvParams& p, int vpt, int blocks, bool pdl, cudaStream_t stream) {
  switch (vpt) {
    case 2: return launch_bulk_gemv<T, M, 2>(p, blocks, pdl, stream);
    case 4: return launch_bulk_gemv<T, M, 4>(p, blocks, pdl, stream);
    case 8: return launch_bulk_gemv<T, M, 8>(p, blocks, pdl, stream);
  }
  TPG_CHECK(false, "bulk_gemv: " << vpt << " vectors a lane has no kernel");
}

template <typename T>
void dispatch_rows(const BulkGemvParams& p, int m, int vpt, int blocks, bool pdl, cudaStream_t stream) {
  switch (m) {
    case 1: return dispatch_vectors<T, 1>(p, vpt, blocks, pdl, stream);
    case 2: return dispatch_vectors<T, 2>(p, vpt, blocks, pdl, stream);
    case 3: return dispatch_vectors<T, 3>(p, vpt, blocks, pdl, stream);
    case 4: return dispatch_vectors<T, 4>(p, vpt, blocks, pdl, stream);
  }
  TPG_CHECK(false, "bulk_gemv: " << m << " rows of x (1-" << kMaxBulkRows << " are taken)");
}

}  // namespace

void bulk_gemv(uintptr_t x, uintptr_t w, uintptr_t out, int m, int n, int k, int dtype, int blocks,
               int rows_per_chunk, int stages, int trigger, bool evict_first, bool pdl, uintptr_t stream) {
  TPG_CHECK(dtype == static_cast<int>(DType::kBFloat16) || dtype == static_cast<int>(DType::kFloat16),
            "bulk_gemv takes bfloat16 or float16, got dtype code " << dtype);
  TPG_CHECK(m >= 1 && m <= kMaxBulkRows, "bulk_gemv: " << m << " rows of x (1-" << kMaxBulkRows << " are taken)");
  TPG_CHECK(n >= 1 && k >= 1, "bulk_gemv: empty weight [" << n << ", " << k << "]");
  const int elems = kVecBytes / 2;
  TPG_CHECK(k % elems == 0, "bulk_gemv: K = " << k << " is not a multiple of " << elems);
  TPG_CHECK(rows_per_chunk == 1 || rows_per_chunk == 2 || rows_per_chunk == 4 || rows_per_chunk == 8,
            "bulk_gemv: rows_per_chunk must be 1, 2, 4 or 8 (it divides the block's " << kBulkWarps
                                                                                   << " warps), got " << rows_per_chunk);
  TPG_CHECK(stages >= 1 && stages <= kMaxBulkStages,
            "bulk_gemv: stages must be 1-" << kMaxBulkStages << ", got " << stages);
  TPG_CHECK(trigger >= kTriggerStart && trigger <= kTriggerExit, "bulk_gemv: unknown trigger " << trigger);
  TPG_CHECK(blocks >= 1 && blocks <= n, "bulk_gemv: " << blocks << " blocks for " << n << " rows");
  TPG_CHECK(x % kVecBytes == 0 && w % kVecBytes == 0,
            "bulk_gemv: x and w must be " << kVecBytes << "-byte aligned");
  const int warps_a_row = kBulkWarps / rows_per_chunk;
  const int lanes = 32 * warps_a_row;
  int vpt = 2;
  while (vpt * lanes < k / elems) vpt *= 2;
  TPG_CHECK(vpt <= 8, "bulk_gemv: K = " << k << " needs " << vpt << " vectors a lane at " << rows_per_chunk
                                        << " rows a chunk (at most 8): take fewer rows a chunk");
  const BulkGemvParams p{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(w),
                         reinterpret_cast<void*>(out), n, k, rows_per_chunk, stages, trigger, evict_first};
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (dtype == static_cast<int>(DType::kBFloat16)) {
    dispatch_rows<__nv_bfloat16>(p, m, vpt, blocks, pdl, s);
  } else {
    dispatch_rows<__half>(p, m, vpt, blocks, pdl, s);
  }
}

}  // namespace tpgraph
