// 1shot_push: Lamport-style, no flags. Each rank writes its 16-byte vectors into its slot of every rank's push
// buffer, then polls its own buffer until no word is the sentinel, reduces in fixed rank order, and re-arms the
// slots it read. The phase (3 buffers) lives on the device, one for the whole grid (the last block to finish
// advances it), so calls may use different grid sizes and the kernel is graph-safe with no host state. It never
// reads a staged copy of the input: graph capture changes nothing for it.
#include "ar_common.cuh"
#include "ar_launch.h"

namespace tpgraph {

namespace {
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) push_1shot_kernel(ArParams p, const uint4* __restrict__ in, uint4* out,
                                                               size_t nvec) {
  // counters_of(p)[kMaxBlocks]: the phase; [kMaxBlocks + 1]: blocks finished in this call.
  uint32_t* phase_counter = counters_of(p) + kMaxBlocks;
  uint32_t* finished = phase_counter + 1;
  const uint32_t phase = *phase_counter % WorkspaceLayout::kPushPhases;
  const size_t slot_vecs = p.push_slot_bytes / sizeof(uint4);
  auto slot = [&](int owner, int src) {
    return reinterpret_cast<uint4*>(p.peer_ws[owner] + WorkspaceLayout::kFlagsBytes + WorkspaceLayout::kCountersBytes) +
           (size_t(phase) * W + src) * slot_vecs;
  };
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;

  for (size_t i = first; i < nvec; i += stride) {
    const uint4 v = avoid_sentinel<T>(in[i]);
#pragma unroll
    for (int r = 0; r < W; ++r) store_volatile_v4(slot(r, p.rank) + i, v);
  }
  const uint64_t start = global_timer_ns();
  for (size_t i = first; i < nvec; i += stride) {
    uint4 vals[W];
#pragma unroll
    for (int r = 0; r < W; ++r) {
      const uint4* src = slot(p.rank, r) + i;
      wait_until(p, ArAlgo::Push1, r, start, [&] { return !has_sentinel(vals[r] = load_volatile_v4(src)); });
    }
    out[i] = reduce_vecs<T, W>(vals);
#pragma unroll
    for (int r = 0; r < W; ++r) store_volatile_v4(slot(p.rank, r) + i, sentinel_vec());
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // every block has read the phase before the last one advances it
    if (atomicAdd(finished, 1u) == gridDim.x - 1) {
      *finished = 0;
      *phase_counter += 1;  // seen by the next launch (kernel boundary)
    }
  }
}

}  // namespace

void launch_push_1shot(const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes, int blocks,
                       cudaStream_t stream) {
  const size_t nvec = nbytes / sizeof(uint4);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_world_size(p.world_size, [&](auto w) {
      push_1shot_kernel<T, decltype(w)::value><<<blocks, kThreads, 0, stream>>>(
          p, static_cast<const uint4*>(in), static_cast<uint4*>(out), nvec);
    });
  });
  TPG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tpgraph
