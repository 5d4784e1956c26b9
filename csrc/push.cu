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
  // U chunks per step, their loads issued together: the volatile stores and polls are compiler barriers, so a
  // loop over one chunk at a time would wait out a memory latency per chunk.
  constexpr int U = kUnroll<W>;
  uint32_t* phases = reinterpret_cast<uint32_t*>(p.peer_ws[p.rank] + p.phases_offset);
  const size_t slot_vecs = p.push_slot_bytes / sizeof(uint4);
  auto slot = [&](int owner, uint32_t phase, int src) {
    return reinterpret_cast<uint4*>(p.peer_ws[owner] + p.push_offset) + (size_t(phase) * W + src) * slot_vecs;
  };
  const size_t nchunks = (nvec + kPushChunkVecs - 1) / kPushChunkVecs;
  const size_t cstride = gridDim.x;
  auto vec_of = [&](size_t c) { return c * kPushChunkVecs + threadIdx.x; };
  auto live = [&](size_t c) { return c < nchunks && vec_of(c) < nvec; };

  // Push the U chunks of one step into every peer's slot.
  auto push_step = [&](size_t c0) {
    uint4 v[U];
    uint32_t phase[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t c = c0 + u * cstride;
      if (live(c)) {
        v[u] = avoid_sentinel<T>(in[vec_of(c)]);
        phase[u] = phases[c] % WorkspaceLayout::kPushPhases;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t c = c0 + u * cstride;
      if (!live(c)) break;
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r != p.rank) store_volatile_v4(slot(r, phase[u], p.rank) + vec_of(c), v[u]);
      }
    }
  };
  // Wait for the peers' vectors of one step's chunks, reduce in rank order, re-arm the slots.
  const uint64_t start = global_timer_ns();
  auto reduce_step = [&](size_t c0) {
    uint4 vals[U][W];
    uint32_t phase[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // first look at every slot of the U chunks at once
      const size_t c = c0 + u * cstride;
      if (live(c)) {
        phase[u] = phases[c] % WorkspaceLayout::kPushPhases;
#pragma unroll
        for (int r = 0; r < W; ++r) {  // our own part straight from the input, as the peers received it
          vals[u][r] = r == p.rank ? avoid_sentinel<T>(in[vec_of(c)])
                                   : load_volatile_v4(slot(p.rank, phase[u], r) + vec_of(c));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t c = c0 + u * cstride;
      if (!live(c)) break;
      const size_t i = vec_of(c);
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r == p.rank) continue;
        const uint4* src = slot(p.rank, phase[u], r) + i;
        wait_until(p, ArAlgo::Push1, r, start, [&] {
          return !has_sentinel(vals[u][r]) || !has_sentinel(vals[u][r] = load_volatile_v4(src));
        });
      }
      out[i] = reduce_vecs<T, W>(vals[u]);
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r != p.rank) store_volatile_v4(slot(p.rank, phase[u], r) + i, sentinel_vec());
      }
    }
  };
  // Software pipeline, one step deep: push step k, then reduce step k - 1, whose data has had a step's time to
  // arrive. NVLink traffic (pushes) and local traffic (polls, reduction, re-arming) then overlap instead of
  // taking turns.
  const size_t step = size_t(U) * cstride;
  for (size_t c0 = blockIdx.x; c0 < nchunks + step; c0 += step) {
    if (c0 < nchunks) push_step(c0);
    if (c0 >= step) reduce_step(c0 - step);
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
