// The extension's C++ surface, free of CUDA headers so bindings.cpp builds with the host compiler.
// Device pointers and streams cross as uintptr_t; nothing here knows about torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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
int device_count();
int current_device();
void set_device(int device);
DeviceProperties device_properties(int device);
bool can_access_peer(int device, int peer);
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

}  // namespace tpgraph
