// 2shot_multicast (NVLS): reduce-scatter with multimem.ld_reduce on the multicast mapping of the staging
// buffers, then one multimem.st per reduced vector that lands in every rank at once. The kernel is written once
// over its memory operations: MulticastOps issues the multimem instructions on the multicast address;
// UnicastEmulation performs the same loads, sums and stores through every peer's unicast mapping. Only the
// emulation runs where multicast is off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
// NVSHMEM_DISABLE_NVLS=1 or TPGRAPH_DISABLE_MULTICAST=1): this build never creates a multicast object.
// Always staged: the multicast mapping covers the workspace, so it cannot be zero-copy.
#include "api.h"
#include "ar_common.cuh"
#include "ar_launch.h"

namespace tpgraph {

namespace {
struct UnicastEmulation {
  template <typename T, int W>
  static __device__ __forceinline__ uint4 load_reduce(const ArParams& p, size_t i) {
    uint4 vals[W];
#pragma unroll
    for (int r = 0; r < W; ++r) vals[r] = static_cast<const uint4*>(p.peer_in[r])[i];
    return reduce_vecs<T, W>(vals);
  }
  template <int W>
  static __device__ __forceinline__ void store(const ArParams& p, size_t i, uint4 v) {
#pragma unroll
    for (int r = 0; r < W; ++r) const_cast<uint4*>(static_cast<const uint4*>(p.peer_in[r]))[i] = v;
  }
};

template <typename T>
struct MultimemPtx;

template <>
struct MultimemPtx<float> {
  static __device__ __forceinline__ uint4 ld_reduce(const void* a) {
    uint4 v;
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
    return v;
  }
};

template <>
struct MultimemPtx<__nv_bfloat16> {
  static __device__ __forceinline__ uint4 ld_reduce(const void* a) {
    uint4 v;
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
    return v;
  }
};

template <>
struct MultimemPtx<__half> {
  static __device__ __forceinline__ uint4 ld_reduce(const void* a) {
    uint4 v;
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
    return v;
  }
};

struct MulticastOps {
  template <typename T, int W>
  static __device__ __forceinline__ uint4 load_reduce(const ArParams& p, size_t i) {
    return MultimemPtx<T>::ld_reduce(static_cast<const uint4*>(p.mc_staging) + i);
  }
  template <int W>
  static __device__ __forceinline__ void store(const ArParams& p, size_t i, uint4 v) {
    asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(
                     static_cast<uint4*>(p.mc_staging) + i),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
};

template <typename T, int W, typename Ops>
__global__ void __launch_bounds__(kThreads) multicast_2shot_kernel(ArParams p, uint4* out, size_t nvec) {
  uint32_t* epoch_counter = counters_of(p) + blockIdx.x;
  uint32_t epoch = *epoch_counter;
  block_barrier(p, ArAlgo::Multicast2, epoch);  // every rank's input is staged
  const size_t shard = (nvec + W - 1) / W;
  const size_t begin = shard * p.rank;
  const size_t end = begin + shard < nvec ? begin + shard : nvec;
  for (size_t i = begin + size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += size_t(gridDim.x) * blockDim.x) {
    Ops::template store<W>(p, i, Ops::template load_reduce<T, W>(p, i));
  }
  block_barrier(p, ArAlgo::Multicast2, epoch);  // every shard has landed everywhere
  const uint4* mine = static_cast<const uint4*>(p.peer_in[p.rank]);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += size_t(gridDim.x) * blockDim.x) {
    out[i] = mine[i];
  }
  if (threadIdx.x == 0) *epoch_counter = epoch;
}
}  // namespace

void launch_multicast_2shot(const ArParams& p, DType dtype, void* out, size_t nbytes, int blocks, bool emulate,
                            cudaStream_t stream) {
  if (!emulate) {
    TPG_CHECK(multicast_env_allowed(), "2shot_multicast: multicast is disabled by the environment");
    TPG_CHECK(p.mc_staging != nullptr, "2shot_multicast: no multicast mapping (run the unicast emulation)");
  }
  const size_t nvec = nbytes / sizeof(uint4);
  auto out4 = static_cast<uint4*>(out);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_world_size(p.world_size, [&](auto w) {
      constexpr int W = decltype(w)::value;
      if (emulate) {
        multicast_2shot_kernel<T, W, UnicastEmulation><<<blocks, kThreads, 0, stream>>>(p, out4, nvec);
      } else {
        multicast_2shot_kernel<T, W, MulticastOps><<<blocks, kThreads, 0, stream>>>(p, out4, nvec);
      }
    });
  });
  TPG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tpgraph
