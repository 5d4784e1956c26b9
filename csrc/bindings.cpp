// pybind11 module tpgraph._C. Plain types only: pointers and streams are Python ints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "api.h"

namespace py = pybind11;
using namespace tpgraph;

PYBIND11_MODULE(_C, m) {
  m.doc() = "tpgraph CUDA extension: device queries, CUDA IPC handles (cached), copies";

  py::class_<DeviceProperties>(m, "DeviceProperties")
      .def_readonly("name", &DeviceProperties::name)
      .def_readonly("major", &DeviceProperties::major)
      .def_readonly("minor", &DeviceProperties::minor)
      .def_readonly("sm_count", &DeviceProperties::sm_count)
      .def_readonly("total_memory", &DeviceProperties::total_memory)
      .def_readonly("pci_bus_id", &DeviceProperties::pci_bus_id)
      .def_readonly("uuid", &DeviceProperties::uuid)
      .def("__repr__", [](const DeviceProperties& p) {
        return "DeviceProperties(name='" + p.name + "', sm=" + std::to_string(p.major) + std::to_string(p.minor) +
               ", sm_count=" + std::to_string(p.sm_count) + ", uuid='" + p.uuid + "')";
      });

  py::class_<BuildInfo>(m, "BuildInfo")
      .def_readonly("archs", &BuildInfo::archs)
      .def_readonly("nvcc_major", &BuildInfo::nvcc_major)
      .def_readonly("nvcc_minor", &BuildInfo::nvcc_minor)
      .def_readonly("runtime_version", &BuildInfo::runtime_version)
      .def("__repr__", [](const BuildInfo& b) {
        return "BuildInfo(archs='" + b.archs + "', nvcc=" + std::to_string(b.nvcc_major) + "." +
               std::to_string(b.nvcc_minor) + ", cudart=" + std::to_string(b.runtime_version) + ")";
      });

  m.def("build_info", &build_info, "how this library was built (nvcc version, gencode targets)");
  m.def(
      "limits",
      [] {
        const KernelLimits k = kernel_limits();
        py::dict d;
        d["vector_bytes"] = k.vector_bytes;
        d["threads_per_block"] = k.threads_per_block;
        d["push_chunk_vectors"] = k.push_chunk_vectors;
        d["max_blocks"] = k.max_blocks;
        d["max_ranks"] = k.max_ranks;
        d["norm_max_row_chunks"] = k.norm_max_row_chunks;
        return d;
      },
      "the kernels' fixed sizes, which the Python policy works with");
  m.def("algo_codes", &algo_codes, "algorithm name -> the code ar_all_reduce takes");
  m.def("dtype_codes", &dtype_codes, "dtype name -> the code ar_all_reduce takes");
  m.def("device_properties", &device_properties, py::arg("device"));
  m.def("driver_version", &driver_version);
  m.def("memcpy_async", &memcpy_async, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"));
  m.def("stream_synchronize", &stream_synchronize, py::arg("stream"));
  m.def("fill_u32", &fill_u32, py::arg("ptr"), py::arg("value"), py::arg("count"), py::arg("stream"));

  m.def(
      "allocation_range",
      [](uintptr_t ptr) {
        auto r = allocation_range(ptr);
        return py::make_tuple(r.base, r.size);
      },
      py::arg("ptr"), "(base, size) of the device allocation that contains ptr");
  m.def(
      "ipc_get_handle", [](uintptr_t ptr) { return py::bytes(ipc_get_handle(ptr)); }, py::arg("ptr"),
      "CUDA IPC handle (64 bytes) of the allocation that contains ptr (peers map its base)");
  m.def(
      "ipc_open_handle", [](py::bytes handle) { return ipc_open_handle(std::string(handle)); }, py::arg("handle"),
      "map a peer's handle into this process (cached: opening twice returns the same pointer)");
  m.def(
      "ipc_close_handle", [](py::bytes handle) { ipc_close_handle(std::string(handle)); }, py::arg("handle"));
  m.def("ar_create", &ar_create, py::arg("rank"), py::arg("world_size"), py::arg("push_slot_bytes"),
        py::arg("staging_bytes"), py::arg("pdl") = true, py::arg("channel_bytes") = 0,
        "allocate this rank's all-reduce workspace; returns an opaque context handle");
  m.def("ar_workspace", &ar_workspace, py::arg("ctx"));
  m.def("ar_workspace_bytes", &ar_workspace_bytes, py::arg("ctx"));
  m.def("ar_staging_offset", &ar_staging_offset, py::arg("ctx"), "byte offset of the staging buffer in the workspace");
  m.def("ar_channel_offset", &ar_channel_offset, py::arg("ctx"),
        "byte offset of the fused GEMV all-reduce's region (channel_bytes long) in the workspace");
  m.def("ar_set_peers", &ar_set_peers, py::arg("ctx"), py::arg("peer_workspaces"));
  m.def("ar_all_reduce", &ar_all_reduce, py::arg("ctx"), py::arg("algo"), py::arg("dtype"), py::arg("inp"),
        py::arg("out"), py::arg("nbytes"), py::arg("blocks"), py::arg("stream"), py::arg("timeout_ns"),
        py::arg("row") = -1, "row -1: eager (pull stages the input); row >= 0: graph, zero-copy through that row");
  m.def("ar_all_reduce_add_rmsnorm", &ar_all_reduce_add_rmsnorm, py::arg("ctx"), py::arg("dtype"), py::arg("inp"),
        py::arg("residual"), py::arg("weight"), py::arg("out"), py::arg("residual_out"), py::arg("rows"),
        py::arg("hidden"), py::arg("eps"), py::arg("blocks"), py::arg("stream"), py::arg("timeout_ns"),
        "1shot_push fused with the residual add and RMSNorm after it (out, residual_out)");
  m.def("ar_reserve_row", &ar_reserve_row, py::arg("ctx"), "a free pointer-table row (graph capture)");
  m.def("ar_release_rows", &ar_release_rows, py::arg("ctx"), py::arg("rows"),
        "zero rows of released graphs and hand them out again (synchronizes the device)");
  m.def("ar_rows_in_use", &ar_rows_in_use, py::arg("ctx"));
  m.def("ar_fill_rows", &ar_fill_rows, py::arg("ctx"), py::arg("rows"), py::arg("ptrs"),
        "fill rows after capture: ptrs holds world_size pointers per row, in rank order");
  m.def("ar_timeout_message", &ar_timeout_message, py::arg("ctx"), "'' unless a kernel wait timed out");
  m.def("ar_timeout_record", &ar_timeout_record, py::arg("ctx"),
        "device address of the timeout record, for kernels that record their own timeouts");
  m.def("ar_destroy", &ar_destroy, py::arg("ctx"));
  m.def("multicast_env_allowed", &multicast_env_allowed,
        "false if any of NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, "
        "TPGRAPH_DISABLE_MULTICAST=1 is set");
  m.def("ipc_open_count", &ipc_open_count, "number of distinct peer mappings currently open");
}
