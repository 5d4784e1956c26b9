// 1shot_push: Lamport-style, no flags. Each rank writes its 16-byte vectors into its slot of every peer's push
// buffer, polls its own buffer until no word is the sentinel, reduces in fixed rank order (its own vectors
// straight from the input) and re-arms the slots it read; pushing runs one step ahead of reducing, so NVLink and
// local memory traffic overlap. Buffers rotate through 3 phases; the phase is kept per
// 8 KB chunk on the device and advanced by the block that owned the chunk, so the kernel is graph-safe with no
// host state, needs no atomics, and successive calls may use different grid sizes. It never reads a staged copy
// of the input: graph capture changes nothing for it.
#include "ar_common.cuh"
#include "ar_launch.h"

namespace tpgraph {

namespace {
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) push_1shot_kernel(ArParams p, const uint4* in, uint4* out, size_t nvec) {
  pdl_wait();
  pdl_launch_dependents();
  uint32_t* phases = reinterpret_cast<uint32_t*>(p.peer_ws[p.rank] + p.phases_offset);
  const size_t slot_vecs = p.push_slot_bytes / sizeof(uint4);
  auto slot = [&](int owner, uint32_t phase, int src) {
    return reinterpret_cast<uint4*>(p.peer_ws[owner] + p.push_offset) + (size_t(phase) * W + src) * slot_vecs;
  };
  const size_t nchunks = (nvec + kPushChunkVecs - 1) / kPushChunkVecs;

  // Push one chunk (this thread's vector of it) into every peer's slot.
  auto push_chunk = [&](size_t c) {
    const size_t i = c * kPushChunkVecs + threadIdx.x;
    if (i >= nvec) return;
    const uint32_t phase = phases[c] % WorkspaceLayout::kPushPhases;
    const uint4 v = avoid_sentinel<T>(in[i]);
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r != p.rank) store_volatile_v4(slot(r, phase, p.rank) + i, v);
    }
  };
  // Wait for the peers' vectors of one chunk, reduce in rank order, re-arm the slots.
  const uint64_t start = global_timer_ns();
  auto reduce_chunk = [&](size_t c) {
    const size_t i = c * kPushChunkVecs + threadIdx.x;
    if (i >= nvec) return;
    const uint32_t phase = phases[c] % WorkspaceLayout::kPushPhases;
    uint4 vals[W];
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r == p.rank) {
        vals[r] = avoid_sentinel<T>(in[i]);  // our own part straight from the input, as the peers received it
      } else {
        const uint4* src = slot(p.rank, phase, r) + i;
        wait_until(p, ArAlgo::Push1, r, start, [&] { return !has_sentinel(vals[r] = load_volatile_v4(src)); });
      }
    }
    out[i] = reduce_vecs<T, W>(vals);
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r != p.rank) store_volatile_v4(slot(p.rank, phase, r) + i, sentinel_vec());
    }
  };
  // Software pipeline, one chunk deep: push chunk k, then reduce chunk k - 1, whose data has had a step's time to
  // arrive. NVLink traffic (pushes) and local traffic (polls, reduction, re-arming) overlap instead of taking
  // turns, and the last reduction is short. (Measured on 2xH200: finer than 2 or 4 chunks per step.)
  const size_t stride = gridDim.x;
  for (size_t c = blockIdx.x; c < nchunks + stride; c += stride) {
    if (c < nchunks) push_chunk(c);
    if (c >= stride) reduce_chunk(c - stride);
  }
  __syncthreads();  // every thread of this block has read its chunks' phases
  for (size_t c = blockIdx.x + size_t(threadIdx.x) * gridDim.x; c < nchunks; c += size_t(gridDim.x) * blockDim.x) {
    phases[c] += 1;  // seen by the next call (kernel boundary)
  }
}

}  // namespace

void launch_push_1shot(const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes, const Launch& launch) {
  const size_t nvec = nbytes / sizeof(uint4);
  dispatch_kernel(dtype, p.world_size, [&](auto tag, auto w) {
    launch_ar_kernel(push_1shot_kernel<typename decltype(tag)::type, decltype(w)::value>, launch, p,
                     static_cast<const uint4*>(in), static_cast<uint4*>(out), nvec);
  });
}

}  // namespace tpgraph
