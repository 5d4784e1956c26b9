// Kernel launchers shared between the algorithm files and the context (ar_context.cu).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>
#include <utility>

#include "ar_common.cuh"
#include "common.cuh"

namespace tpgraph {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

template <typename T>
struct TypeTag {
  using type = T;
};

// fn(TypeTag<T>{}) for the element type behind a dtype code.
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(TypeTag<float>{}); return;
    case DType::kBFloat16: fn(TypeTag<__nv_bfloat16>{}); return;
    case DType::kFloat16: fn(TypeTag<__half>{}); return;
  }
  TPG_CHECK(false, "unsupported dtype code " << int(dtype));
}

// fn(std::integral_constant<int, W>{}) for world sizes 2..kMaxRanks: kernels are specialised per world size.
template <typename Fn>
void dispatch_world_size(int world_size, Fn&& fn) {
  switch (world_size) {
    case 2: fn(std::integral_constant<int, 2>{}); return;
    case 3: fn(std::integral_constant<int, 3>{}); return;
    case 4: fn(std::integral_constant<int, 4>{}); return;
    case 5: fn(std::integral_constant<int, 5>{}); return;
    case 6: fn(std::integral_constant<int, 6>{}); return;
    case 7: fn(std::integral_constant<int, 7>{}); return;
    case 8: fn(std::integral_constant<int, 8>{}); return;
  }
  TPG_CHECK(false, "unsupported world size " << world_size);
}

// How one call is launched: grid size (policy, from Python), programmatic dependent launch, stream.
struct Launch {
  int blocks = 1;
  bool pdl = true;
  cudaStream_t stream = nullptr;
  int sm_count = 0;  // of this device
};

// Blocks of kThreads threads of `kernel` that one SM keeps resident (queried once per kernel).
int resident_blocks_per_sm(const void* kernel);

// cudaLaunchKernelEx with kThreads threads per block; with launch.pdl the kernel may be scheduled while the
// previous kernel in the stream drains (every all-reduce kernel starts with pdl_wait()).
template <typename... Params, typename... Args>
void launch_ar_kernel(void (*kernel)(Params...), const Launch& launch, Args&&... args) {
  if (launch.blocks > launch.sm_count) {
    // Blocks wait on the same block index of other ranks, so every block must be resident at once.
    const int per_sm = resident_blocks_per_sm(reinterpret_cast<const void*>(kernel));
    TPG_CHECK(launch.blocks <= per_sm * launch.sm_count,
              "grid of " << launch.blocks << " blocks exceeds the " << per_sm * launch.sm_count
                         << " this kernel can keep resident (" << per_sm << " per SM)");
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(launch.blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = launch.stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = launch.pdl ? 1 : 0;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  TPG_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// fn(TypeTag<T>{}, std::integral_constant<int, W>{}): one kernel instance per element type and world size.
template <typename Fn>
void dispatch_kernel(DType dtype, int world_size, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto tag) { dispatch_world_size(world_size, [&](auto w) { fn(tag, w); }); });
}

// `in` is this rank's input. Pull and multicast kernels copy it into the staging buffer themselves when
// p.row is null (eager); with a graph row they read every rank's original buffer instead.
void launch_push_1shot(const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes, const Launch& launch);

// 1shot_push + residual add + RMSNorm over [rows, hidden] (push_norm.cu).
struct NormArgs {
  const void* in;
  const void* residual;
  const void* weight;
  void* out;
  void* residual_out;
  int rows;
  int row_chunks;  // 512-byte chunks per row
  float eps;
  float inv_hidden;  // fl(1 / hidden): the mean as torch computes it on CUDA
};
constexpr int kNormMaxRowChunks = 64;  // 16 warps x 4 chunks of registers
void launch_push_1shot_add_rmsnorm(const ArParams& p, DType dtype, const NormArgs& args, const Launch& launch);
void launch_pull(ArAlgo algo, const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes,
                 const Launch& launch);
// Runs over the multicast mapping when the context has one, else as its unicast emulation.
void launch_multicast_2shot(const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes,
                            const Launch& launch);

}  // namespace tpgraph
