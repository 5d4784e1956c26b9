// CUDA IPC: export a handle for a local allocation, open peers' handles once (cached, refcounted).
#include <map>
#include <mutex>
#include <utility>

#include <cuda.h>

#include "api.h"
#include "common.cuh"

namespace tpgraph {

namespace {
struct OpenMapping {
  uintptr_t ptr = 0;
  int refs = 0;
};

// Keyed by (device, handle bytes): the same peer buffer opened twice maps once. cudaIpcOpenMemHandle
// fails on a second open of one handle in one context, so the cache is a correctness need, not a speedup.
struct HandleCache {
  std::mutex mutex;
  std::map<std::pair<int, std::string>, OpenMapping> open;
};

HandleCache& cache() {
  static HandleCache instance;
  return instance;
}

cudaIpcMemHandle_t to_handle(const std::string& bytes) {
  TPG_CHECK(bytes.size() == sizeof(cudaIpcMemHandle_t),
            "IPC handle must be " << sizeof(cudaIpcMemHandle_t) << " bytes, got " << bytes.size());
  cudaIpcMemHandle_t handle;
  std::copy(bytes.begin(), bytes.end(), handle.reserved);
  return handle;
}
}  // namespace

AllocationRange allocation_range(uintptr_t ptr) {
  TPG_CHECK(ptr != 0, "allocation_range: null pointer");
  // The driver call comes through the runtime's entry-point table, so the library needs no -lcuda.
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    TPG_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &status));
    TPG_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr, "driver has no cuMemGetAddressRange");
    return reinterpret_cast<GetRange>(fn);
  }();
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult res = get_range(&base, &size, static_cast<CUdeviceptr>(ptr));
  TPG_CHECK(res == CUDA_SUCCESS, "cuMemGetAddressRange failed (error " << int(res) << ") for pointer 0x" << std::hex
                                                                        << ptr << ": not device memory?");
  return {static_cast<uintptr_t>(base), size};
}

std::string ipc_get_handle(uintptr_t ptr) {
  TPG_CHECK(ptr != 0, "ipc_get_handle: null pointer");
  cudaIpcMemHandle_t handle;
  cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr));
  if (err == cudaErrorInvalidValue) {
    (void)cudaGetLastError();
    throw std::runtime_error(
        "cudaIpcGetMemHandle failed with 'invalid argument': the buffer is not a plain cudaMalloc allocation "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes memory VMM-backed, which CUDA IPC cannot share)");
  }
  TPG_CUDA_CHECK(err);
  return std::string(handle.reserved, sizeof(handle.reserved));
}

uintptr_t ipc_open_handle(const std::string& bytes) {
  cudaIpcMemHandle_t handle = to_handle(bytes);
  int device = current_device();
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto& entry = c.open[{device, bytes}];
  if (entry.refs == 0) {
    void* ptr = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) c.open.erase({device, bytes});
    TPG_CUDA_CHECK(err);
    entry.ptr = reinterpret_cast<uintptr_t>(ptr);
  }
  entry.refs += 1;
  return entry.ptr;
}

void ipc_close_handle(const std::string& bytes) {
  int device = current_device();
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.open.find({device, bytes});
  TPG_CHECK(it != c.open.end(), "ipc_close_handle: handle is not open on device " << device);
  if (--it->second.refs == 0) {
    uintptr_t ptr = it->second.ptr;
    c.open.erase(it);
    TPG_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)));
  }
}

size_t ipc_open_count() {
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.open.size();
}

}  // namespace tpgraph
