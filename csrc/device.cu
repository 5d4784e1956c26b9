// Device queries, copies and a tiny fill kernel (also proves the gencode targets load).
#include <cstdio>

#include "api.h"
#include "common.cuh"

#ifndef TPGRAPH_ARCHS
#define TPGRAPH_ARCHS "unknown"
#endif

namespace tpgraph {

namespace {
__global__ void fill_u32_kernel(uint32_t* out, uint32_t value, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

std::string format_uuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return buf;
}
}  // namespace

int current_device() {
  int dev = 0;
  TPG_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

DeviceProperties device_properties(int device) {
  cudaDeviceProp prop{};
  TPG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceProperties out;
  out.name = prop.name;
  out.major = prop.major;
  out.minor = prop.minor;
  out.sm_count = prop.multiProcessorCount;
  out.total_memory = prop.totalGlobalMem;
  char bus[32];
  TPG_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  out.pci_bus_id = bus;
  out.uuid = format_uuid(prop.uuid);
  return out;
}

int driver_version() {
  int v = 0;
  TPG_CUDA_CHECK(cudaDriverGetVersion(&v));
  return v;
}

BuildInfo build_info() {
  BuildInfo info;
  info.archs = TPGRAPH_ARCHS;
  info.nvcc_major = __CUDACC_VER_MAJOR__;
  info.nvcc_minor = __CUDACC_VER_MINOR__;
  info.runtime_version = CUDART_VERSION;
  return info;
}

void memcpy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
  TPG_CHECK(dst != 0 && src != 0, "memcpy_async: null pointer");
  TPG_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                                 cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)));
}

void stream_synchronize(uintptr_t stream) {
  TPG_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

void fill_u32(uintptr_t ptr, uint32_t value, size_t count, uintptr_t stream) {
  TPG_CHECK(ptr != 0, "fill_u32: null pointer");
  TPG_CHECK(ptr % alignof(uint32_t) == 0, "fill_u32: pointer is not 4-byte aligned");
  if (count == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<size_t>((count + threads - 1) / threads, 1024));
  fill_u32_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(reinterpret_cast<uint32_t*>(ptr),
                                                                                   value, count);
  TPG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tpgraph
