// Shared helpers for tpgraph's CUDA extension: error checking with context.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace tpgraph {

// Raised for every failed CUDA call; pybind11 maps it to RuntimeError, which Python wraps.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  std::ostringstream msg;
  msg << "CUDA error " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ") in `" << expr
      << "` at " << file << ":" << line;
  throw std::runtime_error(msg.str());
}

}  // namespace tpgraph

#define TPG_CUDA_CHECK(expr)                                                   \
  do {                                                                         \
    cudaError_t tpg_err_ = (expr);                                             \
    if (tpg_err_ != cudaSuccess) {                                             \
      (void)cudaGetLastError(); /* clear the sticky-free error state */        \
      ::tpgraph::throw_cuda_error(tpg_err_, #expr, __FILE__, __LINE__);        \
    }                                                                          \
  } while (0)

#define TPG_CHECK(cond, message)                                               \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::ostringstream tpg_msg_;                                             \
      tpg_msg_ << message;                                                     \
      throw std::invalid_argument(tpg_msg_.str());                             \
    }                                                                          \
  } while (0)
