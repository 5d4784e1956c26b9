// 1shot_pull and 2shot_pull. Every rank reads the inputs of all ranks through the pointers in ArParams::peer_in
// (its staged copy in eager mode; in graphs the registered original buffers). Per-block epoch barriers order
// the phases; system-scope release/acquire is used only on the barrier flags that publish data.
#include "ar_common.cuh"
#include "ar_launch.h"

namespace tpgraph {

namespace {
// Reads all ranks' vectors i, reduces in rank order. Inputs are published by the barrier, so plain loads suffice.
template <typename T, int W>
__device__ __forceinline__ uint4 reduce_at(const ArParams& p, size_t i) {
  uint4 vals[W];
#pragma unroll
  for (int r = 0; r < W; ++r) vals[r] = static_cast<const uint4*>(p.peer_in[r])[i];
  return reduce_vecs<T, W>(vals);
}

// Graph mode: the inputs are the peers' original buffers, read from this call's pointer-table row at run time
// (the row is filled after capture). An empty row means the graph was replayed before registration.
template <int W>
__device__ __forceinline__ void resolve_inputs(ArParams& p, ArAlgo algo) {
  if (p.row == nullptr) return;
#pragma unroll
  for (int r = 0; r < W; ++r) {
    p.peer_in[r] = reinterpret_cast<const void*>(p.row[r]);
    if (p.peer_in[r] == nullptr) timeout_trap(p, algo, kUnregisteredPeer);
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) pull_1shot_kernel(ArParams p, uint4* out, size_t nvec) {
  resolve_inputs<W>(p, ArAlgo::Pull1);
  uint32_t* epoch_counter = counters_of(p) + blockIdx.x;
  uint32_t epoch = *epoch_counter;
  block_barrier(p, ArAlgo::Pull1, epoch);  // every rank's input is ready
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += size_t(gridDim.x) * blockDim.x) {
    out[i] = reduce_at<T, W>(p, i);
  }
  block_barrier(p, ArAlgo::Pull1, epoch);  // every rank is done reading my input
  if (threadIdx.x == 0) *epoch_counter = epoch;
}

// Reduce-scatter (rank r reduces shard r and writes it into shard r of every rank's buffer), barrier,
// then each rank copies the whole reduced buffer out of its own memory.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) pull_2shot_kernel(ArParams p, uint4* out, size_t nvec) {
  resolve_inputs<W>(p, ArAlgo::Pull2);
  uint32_t* epoch_counter = counters_of(p) + blockIdx.x;
  uint32_t epoch = *epoch_counter;
  block_barrier(p, ArAlgo::Pull2, epoch);
  const size_t shard = (nvec + W - 1) / W;
  const size_t begin = shard * p.rank;
  const size_t end = begin + shard < nvec ? begin + shard : nvec;
  for (size_t i = begin + size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = reduce_at<T, W>(p, i);
#pragma unroll
    for (int r = 0; r < W; ++r) const_cast<uint4*>(static_cast<const uint4*>(p.peer_in[r]))[i] = v;
  }
  block_barrier(p, ArAlgo::Pull2, epoch);  // every shard is everywhere
  const uint4* mine = static_cast<const uint4*>(p.peer_in[p.rank]);
  if (out != mine) {
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += size_t(gridDim.x) * blockDim.x) {
      out[i] = mine[i];
    }
  }
  if (threadIdx.x == 0) *epoch_counter = epoch;
}

}  // namespace

void launch_pull(ArAlgo algo, const ArParams& p, DType dtype, void* out, size_t nbytes, int blocks,
                 cudaStream_t stream) {
  const size_t nvec = nbytes / sizeof(uint4);
  auto out4 = static_cast<uint4*>(out);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_world_size(p.world_size, [&](auto w) {
      constexpr int W = decltype(w)::value;
      if (algo == ArAlgo::Pull1) {
        pull_1shot_kernel<T, W><<<blocks, kThreads, 0, stream>>>(p, out4, nvec);
      } else {
        pull_2shot_kernel<T, W><<<blocks, kThreads, 0, stream>>>(p, out4, nvec);
      }
    });
  });
  TPG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tpgraph
