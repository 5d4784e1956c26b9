// The extension's C++ surface, free of CUDA headers so bindings.cpp builds with the host compiler.
// Device pointers and streams cross as uintptr_t; nothing here knows about torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tpgraph {

struct DeviceProperties {
  std::string name;
  int major = 0;
  int minor = 0;
  int sm_count = 0;
  size_t total_memory = 0;
  std::string pci_bus_id;
  std::string uuid;  // "GPU-xxxxxxxx-..." as nvidia-smi prints it; stable physical identity
};

struct BuildInfo {
  std::string archs;  // the gencode targets this library holds, e.g. "90a;100a"
  int nvcc_major = 0;
  int nvcc_minor = 0;
  int runtime_version = 0;
};

// device.cu
int current_device();
DeviceProperties device_properties(int device);
int driver_version();
BuildInfo build_info();
void memcpy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream);
void stream_synchronize(uintptr_t stream);
void fill_u32(uintptr_t ptr, uint32_t value, size_t count, uintptr_t stream);

// ipc.cu: CUDA IPC handles, with a per-process cache of opened peer mappings.
// A handle names a whole allocation: peers map its base, so callers ship (handle, ptr - base).
struct AllocationRange {
  uintptr_t base = 0;
  size_t size = 0;
};
AllocationRange allocation_range(uintptr_t ptr);
std::string ipc_get_handle(uintptr_t ptr);
uintptr_t ipc_open_handle(const std::string& handle);
void ipc_close_handle(const std::string& handle);
size_t ipc_open_count();

// ar_context.cu: the kernels' fixed sizes and codes, for the Python policy (one source of truth).
struct KernelLimits {
  int vector_bytes = 0;
  int threads_per_block = 0;
  int push_chunk_vectors = 0;
  int max_blocks = 0;
  int max_ranks = 0;
  int norm_max_row_chunks = 0;
};
KernelLimits kernel_limits();
std::map<std::string, int> algo_codes();
std::map<std::string, int> dtype_codes();

// ar_context.cu: one rank's custom all-reduce context (opaque handle).
uintptr_t ar_create(int rank, int world_size, size_t push_slot_bytes, size_t staging_bytes, bool pdl,
                    size_t channel_bytes);
uintptr_t ar_workspace(uintptr_t ctx);
size_t ar_workspace_bytes(uintptr_t ctx);
size_t ar_staging_offset(uintptr_t ctx);
size_t ar_channel_offset(uintptr_t ctx);
void ar_set_peers(uintptr_t ctx, const std::vector<uintptr_t>& peer_workspaces);
void ar_all_reduce(uintptr_t ctx, int algo, int dtype, uintptr_t in, uintptr_t out, size_t nbytes, int blocks,
                   uintptr_t stream, uint64_t timeout_ns, int row);
// 1shot_push + residual add + RMSNorm: out = weight * rmsnorm(allreduce(in) + residual), residual_out = the sum.
void ar_all_reduce_add_rmsnorm(uintptr_t ctx, int dtype, uintptr_t in, uintptr_t residual, uintptr_t weight,
                               uintptr_t out, uintptr_t residual_out, int rows, int hidden, float eps, int blocks,
                               uintptr_t stream, uint64_t timeout_ns);
int ar_reserve_row(uintptr_t ctx);
void ar_release_rows(uintptr_t ctx, const std::vector<int>& rows);
int ar_rows_in_use(uintptr_t ctx);
void ar_fill_rows(uintptr_t ctx, const std::vector<int>& rows, const std::vector<uintptr_t>& ptrs);
std::string ar_timeout_message(uintptr_t ctx);
// Device address of the host-mapped timeout record (int fired, rank, algo, peer, block), for Triton kernels that
// record their own timeouts there (kernels/lamport.py, algo 4).
uintptr_t ar_timeout_record(uintptr_t ctx);
void ar_destroy(uintptr_t ctx);
bool multicast_env_allowed();

}  // namespace tpgraph
