// 2shot_multicast (NVLS): two_shot_kernel (two_shot.cuh) over MulticastOps, which reduces with one
// multimem.ld_reduce per vector on the multicast mapping of the staging buffers and stores with one multimem.st
// that lands in every rank at once. The same kernel over UnicastOps is the unicast emulation, and that is the
// only one that runs where multicast is off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
// NVSHMEM_DISABLE_NVLS=1 or TPGRAPH_DISABLE_MULTICAST=1): this build never creates a multicast object.
// Always staged: the multicast mapping covers the workspace, so it cannot be zero-copy.
#include "api.h"
#include "ar_launch.h"
#include "two_shot.cuh"

namespace tpgraph {

namespace {
// multimem.ld_reduce of one 16-byte vector of T, accumulated in fp32 for the 16-bit types.
template <typename T>
__device__ __forceinline__ uint4 multimem_ld_reduce(const void* a) {
  uint4 v;
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
  } else {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a) : "memory");
  }
  return v;
}

__device__ __forceinline__ void multimem_st(void* a, const uint4& v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(a), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

struct MulticastOps {
  template <typename T, int W>
  static __device__ __forceinline__ void reduce_and_broadcast(const ArParams& p, size_t first, size_t end,
                                                              size_t stride) {
    auto* mc = static_cast<uint4*>(p.mc_staging);
    for (size_t i = first; i < end; i += stride) multimem_st(mc + i, multimem_ld_reduce<T>(mc + i));
  }
};
}  // namespace

void launch_multicast_2shot(const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes,
                            const Launch& launch) {
  if (p.mc_staging == nullptr) {  // no multicast mapping (never made where multicast is gated): the emulation
    launch_pull(ArAlgo::Multicast2, p, dtype, in, out, nbytes, launch);
    return;
  }
  TPG_CHECK(multicast_env_allowed(), "2shot_multicast: multicast is disabled by the environment");
  const size_t nvec = nbytes / sizeof(uint4);
  dispatch_kernel(dtype, p.world_size, [&](auto tag, auto w) {
    launch_ar_kernel(two_shot_kernel<typename decltype(tag)::type, decltype(w)::value, MulticastOps>, launch, p,
                     ArAlgo::Multicast2, static_cast<const uint4*>(in), static_cast<uint4*>(out), nvec);
  });
}

}  // namespace tpgraph
