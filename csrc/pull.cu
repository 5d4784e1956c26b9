// 1shot_pull and 2shot_pull. Every rank reads the inputs of all ranks through ArParams::peer_in: the staging
// buffers in eager mode (each kernel first copies its own input there), the registered original buffers in
// graphs. Per-block epoch barriers order the phases; system-scope release/acquire is used only on the barrier
// flags that publish data. 2shot_pull is the unicast instance of two_shot_kernel (two_shot.cuh), which is also
// the unicast emulation of 2shot_multicast.
#include "ar_launch.h"
#include "two_shot.cuh"

namespace tpgraph {

namespace {
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) pull_1shot_kernel(ArParams p, const uint4* in, uint4* out, size_t nvec) {
  pdl_wait();
  pdl_launch_dependents();
  const bool staged = resolve_inputs<W>(p, ArAlgo::Pull1);
  uint32_t* epoch_counter = epochs_of(p) + blockIdx.x;
  uint32_t epoch = *epoch_counter;
  uint4* mine = const_cast<uint4*>(static_cast<const uint4*>(p.peer_in[p.rank]));
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  if (staged && in != mine) copy_strided<kUnroll<W>>(mine, in, first, nvec, stride);
  block_barrier(p, ArAlgo::Pull1, epoch);  // every rank's input is in place
  reduce_strided<T, W>(p, first, nvec, stride, [&](size_t i, const uint4& v) { out[i] = v; });
  block_barrier(p, ArAlgo::Pull1, epoch);  // every rank is done reading my input
  if (threadIdx.x == 0) *epoch_counter = epoch;
}

}  // namespace

void launch_pull(ArAlgo algo, const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes,
                 const Launch& launch) {
  const size_t nvec = nbytes / sizeof(uint4);
  auto in4 = static_cast<const uint4*>(in);
  auto out4 = static_cast<uint4*>(out);
  dispatch_kernel(dtype, p.world_size, [&](auto tag, auto w) {
    using T = typename decltype(tag)::type;
    constexpr int W = decltype(w)::value;
    if (algo == ArAlgo::Pull1) {
      launch_ar_kernel(pull_1shot_kernel<T, W>, launch, p, in4, out4, nvec);
    } else {  // Pull2, or Multicast2 emulated
      launch_ar_kernel(two_shot_kernel<T, W, UnicastOps>, launch, p, algo, in4, out4, nvec);
    }
  });
}

}  // namespace tpgraph
