// 1shot_push: Lamport-style, no flags. Each rank writes its 16-byte vectors into its slot of every peer's push
// buffer, polls its own buffer until no word is the sentinel, reduces in fixed rank order (its own vectors
// straight from the input) and re-arms the slots it read; pushing runs one step ahead of reducing, so NVLink and
// local memory traffic overlap. Buffers rotate through 3 phases; the phase is kept per 512-byte chunk (one warp's
// vectors) on the device and advanced by the warp that owned the chunk, so the kernel is graph-safe with no host
// state, needs no atomics, and successive calls may use different grid sizes. Consecutive chunks go to different
// blocks, so a small message is spread over several SMs instead of queueing in one. It never reads a staged copy
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
  auto push_chunk = [&](uint32_t phase, size_t i) {
    const Held h{phase, avoid_sentinel<T>(in[i])};
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r != p.rank) store_volatile_v4(slot(r, h.phase, p.rank) + i, h.own);
    }
    return h;
  };
  // Wait for the peers' vectors of one chunk, reduce in rank order (our own part as the peers received it),
  // re-arm the slots.
  auto reduce_chunk = [&](size_t i, const Held& h) {
    uint4 vals[W];
#pragma unroll
    for (int r = 0; r < W; ++r) {
      if (r == p.rank) {
        vals[r] = h.own;
      } else {
        const uint4* src = slot(p.rank, h.phase, r) + i;
        wait_until(p, ArAlgo::Push1, r, [&] { return !has_sentinel(vals[r] = load_volatile_v4(src)); });
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
  // Warp w of block b is chunk group w * gridDim.x + b and owns chunks group, group + groups, ...
  const int lane = threadIdx.x % kWarpSize;
  const size_t groups = size_t(gridDim.x) * (blockDim.x / kWarpSize);
  const size_t group = size_t(threadIdx.x / kWarpSize) * gridDim.x + blockIdx.x;
  Held held{};
  size_t held_i = nvec;  // nvec: nothing held
  // The phase of this warp's turn-th chunk, as read by lane turn: the phase advance at the end writes it back
  // without reloading it (a dependent load there would delay the kernel's exit, which the next kernel waits for).
  uint32_t phase_of_my_turn = 0;
  size_t turn = 0;
  for (size_t c = group; c < nchunks + groups; c += groups, ++turn) {
    const size_t i = c * kPushChunkVecs + lane;
    const bool push = c < nchunks && i < nvec;
    const uint32_t phase = c < nchunks ? phases[c] : 0;
    if (turn == size_t(lane)) phase_of_my_turn = phase;
    const Held next = push ? push_chunk(phase, i) : Held{};
    if (held_i < nvec) reduce_chunk(held_i, held);
    held = next;
    held_i = push ? i : nvec;
  }
  __syncwarp();  // every lane of this warp has read its chunks' phases
  // Lane t advances the phase of the warp's turns t, t + 32, ...; only the first is in a register (a warp owns
  // more than 32 chunks only when a message is large for its grid).
  for (size_t t = lane, c = group + t * groups; c < nchunks; t += kWarpSize, c += kWarpSize * groups) {
    const uint32_t phase = t == size_t(lane) ? phase_of_my_turn : phases[c];
    // Kept in 0..2, never a growing count: 2^32 is not a multiple of 3, so a wrapping count would repeat a phase.
    phases[c] = phase + 1 == WorkspaceLayout::kPushPhases ? 0 : phase + 1;  // next call (kernel boundary)
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
