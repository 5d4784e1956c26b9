// Shared pieces of the all-reduce kernels: the context every kernel receives, 16-byte vectors with fp32
// accumulation, system-scope release/acquire helpers, and the per-block epoch barrier with a timeout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tpgraph {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 1024;  // more than one block per SM is allowed, up to what can be resident at once
constexpr int kThreads = 512;

// Loop unrolling: U vectors per thread in flight at once (fewer for large world sizes, whose W loads per vector
// already fill the registers).
template <int W>
constexpr int kUnroll = W <= 2 ? 4 : (W <= 4 ? 2 : 1);

enum class ArAlgo : int { Push1 = 0, Pull1 = 1, Pull2 = 2, Multicast2 = 3 };

// Written by the first kernel thread whose wait expires, read by the host after the trap.
struct TimeoutRecord {
  int fired;
  int rank;
  int algo;
  int peer;
  int block;
};

// 1shot_push tracks its buffer phase per chunk of one warp's vectors (512 bytes), not per grid: the warp that owns
// a chunk reads and advances its phase with no atomics, and calls may use different grid sizes.
constexpr int kWarpSize = 32;
constexpr size_t kPushChunkVecs = kWarpSize;

// Workspace of one rank, one cudaMalloc: [flags | block epochs | push phases | push buffers | staging].
struct WorkspaceLayout {
  static constexpr size_t kFlagsBytes = size_t(kMaxBlocks) * kMaxRanks * sizeof(uint32_t);
  static constexpr size_t kEpochsBytes = size_t(kMaxBlocks) * sizeof(uint32_t);  // per-block barrier epochs
  static constexpr int kPushPhases = 3;
  size_t push_slot_bytes = 0;  // bytes of one rank's slot in one phase
  size_t staging_bytes = 0;
  size_t channel_bytes = 0;  // the fused GEMV all-reduce's region (Python lays it out: tpgraph/kernels/lamport.py)
  int world_size = 0;

  size_t push_chunks() const { return (push_slot_bytes / 16 + kPushChunkVecs - 1) / kPushChunkVecs; }
  size_t flags_offset() const { return 0; }
  size_t epochs_offset() const { return kFlagsBytes; }
  size_t phases_offset() const { return kFlagsBytes + kEpochsBytes; }
  size_t push_offset() const { return round16(phases_offset() + push_chunks() * sizeof(uint32_t)); }
  size_t push_bytes() const { return size_t(kPushPhases) * world_size * push_slot_bytes; }
  size_t staging_offset() const { return push_offset() + push_bytes(); }
  size_t channel_offset() const { return round16(staging_offset() + staging_bytes); }
  size_t total_bytes() const { return channel_offset() + channel_bytes; }
  static constexpr size_t round16(size_t n) { return (n + 15) / 16 * 16; }
};

// Everything a kernel needs, passed by value.
struct ArParams {
  char* peer_ws[kMaxRanks];   // every rank's workspace base, mapped into this process (own one included)
  const void* peer_in[kMaxRanks];  // pull: every rank's input (staging in eager mode, registered buffers in graphs)
  int rank;
  int world_size;
  size_t push_slot_bytes;
  size_t phases_offset;
  size_t push_offset;
  uint64_t timeout_ns;
  TimeoutRecord* timeout;  // host-mapped
  const uint64_t* row;     // graph mode: this call's pointer-table row (filled after capture), else nullptr
  void* mc_staging;        // multicast mapping of the staging buffers (never set where multicast is off)
};

constexpr int kUnregisteredPeer = -1;  // TimeoutRecord::peer when a graph ran before registration

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Programmatic dependent launch (sm_90+): kernels are launched so that the next one may start while this one
// drains. pdl_wait() returns once the previous kernel in the stream has finished and its writes are visible, so
// every kernel calls it before touching memory; pdl_launch_dependents() lets the next kernel be scheduled now.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

__device__ __forceinline__ void store_release_sys(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint4 load_volatile_v4(const void* addr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile_v4(void* addr, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Record what failed (the peer waited for, or kUnregisteredPeer), then trap: the host turns the record into an
// error naming rank, algorithm and peer.
static __device__ __noinline__ void record_and_trap(const ArParams& p, ArAlgo algo, int peer) {
  if (atomicCAS_system(&p.timeout->fired, 0, 1) == 0) {
    p.timeout->rank = p.rank;
    p.timeout->algo = int(algo);
    p.timeout->peer = peer;
    p.timeout->block = blockIdx.x;
    __threadfence_system();
  }
  __trap();
}

// Spin until pred() holds. The clock is first read after 256 failed polls and then every 256 polls, so a wait
// that succeeds quickly (the common case) never reads it; the timeout counts from that first reading. A timeout of
// 0 never traps.
template <typename Pred>
__device__ __forceinline__ void wait_until(const ArParams& p, ArAlgo algo, int peer, Pred pred) {
  uint64_t start = 0;
  for (uint32_t polls = 1; !pred(); ++polls) {
    if ((polls & 255) != 0 || p.timeout_ns == 0) continue;  // timeout 0: wait forever (for debuggers)
    const uint64_t now = global_timer_ns();
    if (start == 0) {
      start = now;
    } else if (now - start > p.timeout_ns) {
      record_and_trap(p, algo, peer);
    }
  }
}

__device__ __forceinline__ uint32_t* flags_of(const ArParams& p, int rank) {
  return reinterpret_cast<uint32_t*>(p.peer_ws[rank]);
}

__device__ __forceinline__ uint32_t* epochs_of(const ArParams& p) {
  return reinterpret_cast<uint32_t*>(p.peer_ws[p.rank] + WorkspaceLayout::kFlagsBytes);
}

// Per-block barrier across ranks. Epochs only grow (compared with wrap-around arithmetic), so flags are never
// reset and a peer one barrier ahead is not mistaken for a stale one. Thread t < world_size talks to rank t.
__device__ __forceinline__ void block_barrier(const ArParams& p, ArAlgo algo, uint32_t& epoch) {
  __syncthreads();
  epoch += 1;
  const int t = threadIdx.x;
  if (t < p.world_size) {
    store_release_sys(flags_of(p, t) + blockIdx.x * kMaxRanks + p.rank, epoch);
    const uint32_t* mine = flags_of(p, p.rank) + blockIdx.x * kMaxRanks + t;
    const uint32_t want = epoch;
    wait_until(p, algo, t, [&] { return int32_t(load_acquire_sys(mine) - want) >= 0; });
  }
  __syncthreads();
}

// ---- 16-byte vectors of T, accumulated in fp32 ----------------------------------------------------------
template <typename T>
struct Vec;  // defined below: float, then the 16-bit types

template <>
struct Vec<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ float get(const uint4& v, int i) { return __uint_as_float((&v.x)[i]); }
  static __device__ __forceinline__ void set(uint4& v, int i, float f) { (&v.x)[i] = __float_as_uint(f); }
  static constexpr int kElemsPerWord = 1;
};

// bf16 and fp16: eight per vector; their float conversions round to nearest even.
template <typename T>
struct Vec {
  static constexpr int N = 8;
  static __device__ __forceinline__ float get(const uint4& v, int i) { return float(reinterpret_cast<const T*>(&v)[i]); }
  static __device__ __forceinline__ void set(uint4& v, int i, float f) { reinterpret_cast<T*>(&v)[i] = T(f); }
  static constexpr int kElemsPerWord = 2;
};

// "Not arrived" marker, one per 32-bit word, the same for every dtype: 0x80008000 (two 16-bit -0.0, or one fp32
// denormal). Real data never contains it: avoid_sentinel rewrites 16-bit -0.0 as +0.0 and that fp32 denormal as
// -0.0 (a flush of one denormal bit pattern). One pattern means a buffer re-armed by a bf16 call is still
// correctly armed for an fp32 call.
constexpr uint32_t kSentinelWord = 0x80008000u;

__device__ __forceinline__ uint4 sentinel_vec() { return make_uint4(kSentinelWord, kSentinelWord, kSentinelWord,
                                                                    kSentinelWord); }

__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return v.x == kSentinelWord || v.y == kSentinelWord || v.z == kSentinelWord || v.w == kSentinelWord;
}

template <typename T>
__device__ __forceinline__ uint4 avoid_sentinel(uint4 v) {
  uint32_t* w = &v.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Vec<T>::kElemsPerWord == 1) {
      if (w[i] == kSentinelWord) w[i] = 0x80000000u;
    } else {
      if ((w[i] & 0xffffu) == 0x8000u) w[i] &= 0xffff0000u;
      if ((w[i] >> 16) == 0x8000u) w[i] &= 0x0000ffffu;
    }
  }
  return v;
}

// out = sum over ranks in fixed order 0..W-1, in fp32: identical bits on every rank.
template <typename T, int W>
__device__ __forceinline__ uint4 reduce_vecs(const uint4 (&vals)[W]) {
  float acc[Vec<T>::N];
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) acc[i] = Vec<T>::get(vals[0], i);
#pragma unroll
  for (int r = 1; r < W; ++r) {
#pragma unroll
    for (int i = 0; i < Vec<T>::N; ++i) acc[i] += Vec<T>::get(vals[r], i);
  }
  uint4 out;
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) Vec<T>::set(out, i, acc[i]);
  return out;
}

}  // namespace tpgraph
