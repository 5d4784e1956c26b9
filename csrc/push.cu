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

  // What a thread keeps of a chunk between pushing it and reducing it: the slot phase and its own vector, so the
  // reduction starts polling at once instead of reloading them.
  struct Held {
    uint32_t phase;
    uint4 own;
  };
  // Push one chunk (this thread's vector of it) into every peer's slot.
  auto push_chunk = [&](size_t c, size_t i) {
    const Held h{phases[c], avoid_sentinel<T>(in[i])};
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r != p.rank) store_volatile_v4(slot(r, h.phase, p.rank) + i, h.own);
    }
    return h;
  };
  // Wait for the peers' vectors of one chunk, reduce in rank order (our own part as the peers received it),
  // re-arm the slots.
  const uint64_t start = global_timer_ns();
  auto reduce_chunk = [&](size_t i, const Held& h) {
    uint4 vals[W];
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r == p.rank) {
        vals[r] = h.own;
      } else {
        const uint4* src = slot(p.rank, h.phase, r) + i;
        wait_until(p, ArAlgo::Push1, r, start, [&] { return !has_sentinel(vals[r] = load_volatile_v4(src)); });
      }
    }
    out[i] = reduce_vecs<T, W>(vals);
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r != p.rank) store_volatile_v4(slot(p.rank, h.phase, r) + i, sentinel_vec());
    }
  };
  // Software pipeline, one chunk deep: push chunk k, then reduce chunk k - 1, whose data has had a step's time to
  // arrive. NVLink traffic (pushes) and local traffic (polls, reduction, re-arming) overlap instead of taking
  // turns, and the last reduction is short. (Measured on 2xH200: faster than 2 or 4 chunks per step.)
  const size_t stride = gridDim.x;
  Held held{};
  size_t held_i = nvec;  // nvec: nothing held
  for (size_t c = blockIdx.x; c < nchunks + stride; c += stride) {
    const size_t i = c * kPushChunkVecs + threadIdx.x;
    const bool push = c < nchunks && i < nvec;
    const Held next = push ? push_chunk(c, i) : Held{};
    if (held_i < nvec) reduce_chunk(held_i, held);
    held = next;
    held_i = push ? i : nvec;
  }
  __syncthreads();  // every thread of this block has read its chunks' phases
  for (size_t c = blockIdx.x + size_t(threadIdx.x) * gridDim.x; c < nchunks; c += size_t(gridDim.x) * blockDim.x) {
    // Kept in 0..2, never a growing count: 2^32 is not a multiple of 3, so a wrapping count would repeat a phase.
    phases[c] = phases[c] + 1 == WorkspaceLayout::kPushPhases ? 0 : phases[c] + 1;  // next call (kernel boundary)
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
