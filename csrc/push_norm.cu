// 1shot_push fused with the residual add and RMSNorm that follow a row-parallel layer in Llama:
//   s = allreduce(in), residual_out = s + residual, out = weight * rmsnorm(residual_out)
// with every rounding where the unfused sequence rounds (the sum to T, the residual sum to T, the normalised row
// to T before the weight), so it equals 1shot_push followed by the add+RMSNorm kernel up to the order in which a
// row's squares are summed. One launch instead of two, and the summed row never goes back to memory before it is
// normalised.
//
// The push protocol is 1shot_push's (push.cu): the same slots, sentinels and per-chunk phases, so fused and plain
// calls interleave freely. Only the ownership differs: block b owns whole rows b, b + grid, ..., and warp w of it
// the row's chunks w, w + 16, ..., so a block holds a whole row and can reduce its squares. A row must be a whole
// number of 512-byte chunks and at most kNormMaxRowChunks of them (the Python side checks, else it runs unfused).
#include "ar_common.cuh"
#include "ar_launch.h"

namespace tpgraph {

namespace {
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kChunksPerWarp = 4;  // per row: registers hold what a thread pushed until it reduces it
}  // namespace

static_assert(kNormMaxRowChunks == kWarps * kChunksPerWarp, "a row's chunks must fit the registers");  // 32 KB

namespace {

template <typename T>
__device__ __forceinline__ uint4 add_round(const uint4& a, const uint4& b) {
  uint4 out;
#pragma unroll
  for (int e = 0; e < Vec<T>::N; ++e) Vec<T>::set(out, e, Vec<T>::get(a, e) + Vec<T>::get(b, e));
  return out;
}

// Sum of v over the block, the same order on every rank (warp shuffles, then warp 0 over the warps' partials).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? scratch[lane] : 0.0f;
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) scratch[kWarps] = v;
  }
  __syncthreads();
  const float total = scratch[kWarps];
  __syncthreads();  // scratch is reused by the next row
  return total;
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    push_1shot_add_rmsnorm_kernel(ArParams p, const uint4* in, const uint4* residual, const uint4* weight, uint4* out,
                                  uint4* residual_out, int rows, int row_chunks, float eps, float inv_hidden) {
  pdl_wait();
  pdl_launch_dependents();
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // The weight, and below each row's residual, are loaded with the input, not after the peers' vectors arrive: their
  // latency then hides in that wait instead of adding to it. (Not before pdl_wait: the caller may have just written
  // the weight, and only the wait makes the kernel before visible.)
  uint4 w_held[kChunksPerWarp];
#pragma unroll
  for (int n = 0; n < kChunksPerWarp; ++n) {
    const int k = warp + n * kWarps;
    if (k < row_chunks) w_held[n] = weight[size_t(k) * kPushChunkVecs + lane];
  }
  __shared__ float scratch[kWarps + 1];
  uint32_t* phases = reinterpret_cast<uint32_t*>(p.peer_ws[p.rank] + p.phases_offset);
  const size_t slot_vecs = p.push_slot_bytes / sizeof(uint4);
  auto slot = [&](int owner, uint32_t phase, int src) {
    return reinterpret_cast<uint4*>(p.peer_ws[owner] + p.push_offset) + (size_t(phase) * W + src) * slot_vecs;
  };
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    uint32_t phase[kChunksPerWarp];
    uint4 held[kChunksPerWarp];  // first this rank's vector, then the new residual
    uint4 res[kChunksPerWarp];   // the residual
    // Push this warp's chunks of the row into every peer's slot.
#pragma unroll
    for (int n = 0; n < kChunksPerWarp; ++n) {
      const int k = warp + n * kWarps;
      if (k >= row_chunks) break;
      const size_t c = size_t(row) * row_chunks + k;
      const size_t i = c * kPushChunkVecs + lane;
      phase[n] = phases[c];
      held[n] = avoid_sentinel<T>(in[i]);
      res[n] = residual[i];
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r != p.rank) store_volatile_v4(slot(r, phase[n], p.rank) + i, held[n]);
      }
    }
    // Reduce each in rank order as 1shot_push does, re-arm the slots, add the residual, sum the squares.
    float squares = 0.0f;
#pragma unroll
    for (int n = 0; n < kChunksPerWarp; ++n) {
      const int k = warp + n * kWarps;
      if (k >= row_chunks) break;
      const size_t i = (size_t(row) * row_chunks + k) * kPushChunkVecs + lane;
      uint4 vals[W];
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r == p.rank) {
          vals[r] = held[n];
        } else {
          const uint4* src = slot(p.rank, phase[n], r) + i;
          wait_until(p, ArAlgo::Push1, r, [&] { return !has_sentinel(vals[r] = load_volatile_v4(src)); });
        }
      }
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r != p.rank) store_volatile_v4(slot(p.rank, phase[n], r) + i, sentinel_vec());
      }
      held[n] = add_round<T>(reduce_vecs<T, W>(vals), res[n]);
      residual_out[i] = held[n];
#pragma unroll
      for (int e = 0; e < Vec<T>::N; ++e) {
        const float x = Vec<T>::get(held[n], e);
        squares = __fadd_rn(squares, __fmul_rn(x, x));  // no FMA: round as the unfused kernels do
      }
    }
    // mean, then + eps, each rounded (an FMA would round once, unlike torch and the Triton kernel)
    const float rstd = rsqrtf(__fadd_rn(__fmul_rn(block_sum(squares, scratch), inv_hidden), eps));
#pragma unroll
    for (int n = 0; n < kChunksPerWarp; ++n) {
      const int k = warp + n * kWarps;
      if (k >= row_chunks) break;
      const size_t i = (size_t(row) * row_chunks + k) * kPushChunkVecs + lane;
      const uint4& w = w_held[n];
      uint4 normed, o;
#pragma unroll
      for (int e = 0; e < Vec<T>::N; ++e) Vec<T>::set(normed, e, Vec<T>::get(held[n], e) * rstd);
#pragma unroll
      for (int e = 0; e < Vec<T>::N; ++e) Vec<T>::set(o, e, Vec<T>::get(w, e) * Vec<T>::get(normed, e));
      out[i] = o;
    }
    __syncwarp();  // every lane has read its chunks' phases
    if (lane == 0) {
#pragma unroll
      for (int n = 0; n < kChunksPerWarp; ++n) {
        const int k = warp + n * kWarps;
        if (k >= row_chunks) break;
        const uint32_t next = phase[n] + 1;
        phases[size_t(row) * row_chunks + k] = next == WorkspaceLayout::kPushPhases ? 0 : next;
      }
    }
  }
}

}  // namespace

void launch_push_1shot_add_rmsnorm(const ArParams& p, DType dtype, const NormArgs& a, const Launch& launch) {
  dispatch_kernel(dtype, p.world_size, [&](auto tag, auto w) {
    launch_ar_kernel(push_1shot_add_rmsnorm_kernel<typename decltype(tag)::type, decltype(w)::value>, launch, p,
                     static_cast<const uint4*>(a.in), static_cast<const uint4*>(a.residual),
                     static_cast<const uint4*>(a.weight), static_cast<uint4*>(a.out),
                     static_cast<uint4*>(a.residual_out), a.rows, a.row_chunks, a.eps, a.inv_hidden);
  });
}

}  // namespace tpgraph
