// The 2-shot all-reduce, written once over its memory operations: rank r reduces shard r of every rank's input and
// stores the result into shard r of every rank's buffer (reduce-scatter and all-gather in one pass); after a
// barrier each rank copies its whole buffer out. `Ops` is UnicastOps (loads from and stores to every peer's
// mapping: 2shot_pull, and the unicast emulation of 2shot_multicast) or MulticastOps (multimem instructions on
// the multicast mapping, multicast.cu).
#pragma once

#include "ar_common.cuh"

namespace tpgraph {

// dst[i] = src[i] for i = first, first + stride, ... < end.
template <int U>
__device__ __forceinline__ void copy_strided(uint4* dst, const uint4* src, size_t first, size_t end, size_t stride) {
  size_t i = first;
  for (; i + (U - 1) * stride < end; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < end; i += stride) dst[i] = src[i];
}

// sink(i, sum over ranks of peer_in[r][i]) for i = first, first + stride, ... < end.
template <typename T, int W, typename Sink>
__device__ __forceinline__ void reduce_strided(const ArParams& p, size_t first, size_t end, size_t stride, Sink sink) {
  constexpr int U = kUnroll<W>;
  size_t i = first;
  for (; i + (U - 1) * stride < end; i += U * stride) {
    uint4 vals[U][W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < W; ++r) vals[u][r] = static_cast<const uint4*>(p.peer_in[r])[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) sink(i + u * stride, reduce_vecs<T, W>(vals[u]));
  }
  for (; i < end; i += stride) {
    uint4 vals[W];
#pragma unroll
    for (int r = 0; r < W; ++r) vals[r] = static_cast<const uint4*>(p.peer_in[r])[i];
    sink(i, reduce_vecs<T, W>(vals));
  }
}

// Graph mode: the inputs are the ranks' original buffers, read from this call's pointer-table row at run time
// (filled after capture); an empty row means the graph was replayed before registration. Returns whether the
// call is staged (eager: p.peer_in are the staging buffers).
template <int W>
__device__ __forceinline__ bool resolve_inputs(ArParams& p, ArAlgo algo) {
  if (p.row == nullptr) return true;
#pragma unroll
  for (int r = 0; r < W; ++r) {
    p.peer_in[r] = reinterpret_cast<const void*>(p.row[r]);
    if (p.peer_in[r] == nullptr) record_and_trap(p, algo, kUnregisteredPeer);
  }
  return false;
}

// Loads and stores through every rank's unicast mapping.
struct UnicastOps {
  template <typename T, int W>
  static __device__ __forceinline__ void reduce_and_broadcast(const ArParams& p, size_t first, size_t end,
                                                              size_t stride) {
    reduce_strided<T, W>(p, first, end, stride, [&](size_t i, const uint4& v) {
#pragma unroll
      for (int r = 0; r < W; ++r) const_cast<uint4*>(static_cast<const uint4*>(p.peer_in[r]))[i] = v;
    });
  }
};

// Block b touches the same offsets inside every shard on every rank, so block b's barriers order all the data
// it reads: a block never waits on memory another block wrote.
template <typename T, int W, typename Ops>
__global__ void __launch_bounds__(kThreads) two_shot_kernel(ArParams p, ArAlgo algo, const uint4* in, uint4* out,
                                                            size_t nvec) {
  pdl_wait();
  pdl_launch_dependents();
  const bool staged = resolve_inputs<W>(p, algo);
  uint32_t* epoch_counter = epochs_of(p) + blockIdx.x;
  uint32_t epoch = *epoch_counter;
  uint4* mine = const_cast<uint4*>(static_cast<const uint4*>(p.peer_in[p.rank]));
  const size_t shard = (nvec + W - 1) / W;
  const size_t offset = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  auto shard_end = [&](int s) { return (size_t(s) + 1) * shard < nvec ? (size_t(s) + 1) * shard : nvec; };
  if (staged && in != mine) {
    for (int s = 0; s < W; ++s) copy_strided<kUnroll<W>>(mine, in, s * shard + offset, shard_end(s), stride);
  }
  block_barrier(p, algo, epoch);  // every rank's input is in place
  Ops::template reduce_and_broadcast<T, W>(p, p.rank * shard + offset, shard_end(p.rank), stride);
  block_barrier(p, algo, epoch);  // every shard has landed everywhere
  if (out != mine) {
    for (int s = 0; s < W; ++s) copy_strided<kUnroll<W>>(out, mine, s * shard + offset, shard_end(s), stride);
  }
  if (threadIdx.x == 0) *epoch_counter = epoch;
}

}  // namespace tpgraph
