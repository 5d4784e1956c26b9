// Kernel launchers shared between the algorithm files and the context (ar_context.cu).
#pragma once

#include <cuda_runtime.h>

#include "ar_common.cuh"
#include "common.cuh"

namespace tpgraph {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

void launch_push_1shot(const ArParams& p, DType dtype, const void* in, void* out, size_t nbytes, int blocks,
                       cudaStream_t stream);
void launch_pull(ArAlgo algo, const ArParams& p, DType dtype, void* out, size_t nbytes, int blocks,
                 cudaStream_t stream);

}  // namespace tpgraph
