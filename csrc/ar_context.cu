// The all-reduce context of one rank: its workspace (one cudaMalloc, exported over IPC by Python), the peers'
// mapped workspaces, the host-mapped timeout record, and argument checking before each launch. No policy:
// the algorithm and the grid size come from Python.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "api.h"
#include "ar_launch.h"

namespace tpgraph {

int resident_blocks_per_sm(const void* kernel) {
  static std::mutex mutex;
  static std::unordered_map<const void*, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(kernel);
  if (it != cache.end()) return it->second;
  int per_sm = 0;
  TPG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  cache.emplace(kernel, per_sm);
  return per_sm;
}

namespace {
__global__ void fill_words(uint32_t* p, uint32_t value, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = value;
}

const char* algo_name(int algo) {
  switch (algo) {
    case 0: return "1shot_push";
    case 1: return "1shot_pull";
    case 2: return "2shot_pull";
    case 3: return "2shot_multicast";
    case 4: return "the all-reduce in a projection's epilogue (kernels/lamport.py)";
    default: return "unknown";
  }
}
}  // namespace

constexpr int kMaxRows = 16384;  // graph-captured pull calls alive at once per communicator (released rows are reused)

struct ArContext {
  int rank = 0;
  uint64_t* rows = nullptr;  // device pointer table [kMaxRows][kMaxRanks]
  int next_row = 0;  // rows below this were handed out at least once
  std::vector<int> free_rows;  // released rows, handed out again before new ones
  std::vector<bool> row_in_use = std::vector<bool>(kMaxRows, false);
  int rows_in_use = 0;
  WorkspaceLayout layout;
  char* workspace = nullptr;
  TimeoutRecord* timeout = nullptr;  // pinned, mapped into the device address space
  std::vector<uintptr_t> peers;
  ArParams base_params{};  // filled once peers are known; each call copies it and sets what varies
  bool pdl = true;  // launch as programmatic dependents of the previous kernel
  int sm_count = 0;
  cudaEvent_t last_done = nullptr;  // recorded after each eager call, to catch use from two streams at once
  cudaStream_t last_stream = nullptr;
  bool used = false;
};

uintptr_t ar_create(int rank, int world_size, size_t push_slot_bytes, size_t staging_bytes, bool pdl,
                    size_t channel_bytes) {
  TPG_CHECK(world_size >= 2 && world_size <= kMaxRanks, "custom all-reduce supports world sizes 2.." << kMaxRanks
                                                                                                    << ", got " << world_size);
  TPG_CHECK(rank >= 0 && rank < world_size, "rank " << rank << " outside world size " << world_size);
  TPG_CHECK(push_slot_bytes % 16 == 0 && staging_bytes % 16 == 0 && channel_bytes % 16 == 0,
            "workspace sizes must be multiples of 16 bytes");
  auto* ctx = new ArContext;
  ctx->rank = rank;
  ctx->pdl = pdl;
  ctx->layout.world_size = world_size;
  ctx->layout.push_slot_bytes = push_slot_bytes;
  ctx->layout.staging_bytes = staging_bytes;
  ctx->layout.channel_bytes = channel_bytes;
  try {
    int device = 0;
    TPG_CUDA_CHECK(cudaGetDevice(&device));
    TPG_CUDA_CHECK(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, device));
    TPG_CUDA_CHECK(cudaMalloc(&ctx->workspace, ctx->layout.total_bytes()));
    TPG_CUDA_CHECK(cudaMemset(ctx->workspace, 0, ctx->layout.push_offset()));  // flags, epochs, phases start at 0
    const size_t push_words = ctx->layout.push_bytes() / sizeof(uint32_t);
    if (push_words) {
      fill_words<<<1024, 256>>>(reinterpret_cast<uint32_t*>(ctx->workspace + ctx->layout.push_offset()),
                                kSentinelWord, push_words);
      TPG_CUDA_CHECK(cudaGetLastError());
    }
    if (channel_bytes) {  // zeroed here; Python arms its slots (it owns the region's layout)
      TPG_CUDA_CHECK(cudaMemset(ctx->workspace + ctx->layout.channel_offset(), 0, channel_bytes));
    }
    TPG_CUDA_CHECK(cudaMalloc(&ctx->rows, sizeof(uint64_t) * kMaxRows * kMaxRanks));
    TPG_CUDA_CHECK(cudaMemset(ctx->rows, 0, sizeof(uint64_t) * kMaxRows * kMaxRanks));
    TPG_CUDA_CHECK(cudaHostAlloc(&ctx->timeout, sizeof(TimeoutRecord), cudaHostAllocMapped));
    TPG_CUDA_CHECK(cudaEventCreateWithFlags(&ctx->last_done, cudaEventDisableTiming));
    std::memset(ctx->timeout, 0, sizeof(TimeoutRecord));
    TPG_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    if (ctx->workspace) cudaFree(ctx->workspace);
    if (ctx->rows) cudaFree(ctx->rows);
    if (ctx->timeout) cudaFreeHost(ctx->timeout);
    delete ctx;
    throw;
  }
  return reinterpret_cast<uintptr_t>(ctx);
}

static ArContext& get(uintptr_t handle) {
  TPG_CHECK(handle != 0, "all-reduce context is null (destroyed?)");
  return *reinterpret_cast<ArContext*>(handle);
}

uintptr_t ar_workspace(uintptr_t handle) { return reinterpret_cast<uintptr_t>(get(handle).workspace); }

size_t ar_workspace_bytes(uintptr_t handle) { return get(handle).layout.total_bytes(); }

size_t ar_staging_offset(uintptr_t handle) { return get(handle).layout.staging_offset(); }

size_t ar_channel_offset(uintptr_t handle) { return get(handle).layout.channel_offset(); }

void ar_set_peers(uintptr_t handle, const std::vector<uintptr_t>& peer_workspaces) {
  ArContext& ctx = get(handle);
  TPG_CHECK(int(peer_workspaces.size()) == ctx.layout.world_size,
            "expected " << ctx.layout.world_size << " peer workspaces, got " << peer_workspaces.size());
  TPG_CHECK(peer_workspaces[ctx.rank] == reinterpret_cast<uintptr_t>(ctx.workspace),
            "entry " << ctx.rank << " must be this rank's own workspace");
  ctx.peers = peer_workspaces;
  ArParams& p = ctx.base_params;
  for (int r = 0; r < ctx.layout.world_size; ++r) {
    p.peer_ws[r] = reinterpret_cast<char*>(peer_workspaces[r]);
    p.peer_in[r] = p.peer_ws[r] + ctx.layout.staging_offset();
  }
  p.rank = ctx.rank;
  p.world_size = ctx.layout.world_size;
  p.push_slot_bytes = ctx.layout.push_slot_bytes;
  p.phases_offset = ctx.layout.phases_offset();
  p.push_offset = ctx.layout.push_offset();
  TPG_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&p.timeout), ctx.timeout, 0));
}

int ar_reserve_row(uintptr_t handle) {
  ArContext& ctx = get(handle);
  int row;
  if (!ctx.free_rows.empty()) {
    row = ctx.free_rows.back();
    ctx.free_rows.pop_back();
  } else {
    TPG_CHECK(ctx.next_row < kMaxRows, "all " << kMaxRows << " graph pointer-table rows are in use (captured "
                                                 "graphs that were never released?)");
    row = ctx.next_row++;
  }
  ctx.row_in_use[row] = true;
  ctx.rows_in_use += 1;
  return row;
}

void ar_release_rows(uintptr_t handle, const std::vector<int>& rows) {
  ArContext& ctx = get(handle);
  for (int row : rows) {
    TPG_CHECK(row >= 0 && row < ctx.next_row && ctx.row_in_use[row], "row " << row << " is not in use");
  }
  // A graph still replaying would read these rows: wait for the device, then zero them, so a stale replay of a
  // released graph traps as 'unregistered' instead of reading memory that may be gone.
  TPG_CUDA_CHECK(cudaDeviceSynchronize());
  for (int row : rows) {
    TPG_CUDA_CHECK(cudaMemset(ctx.rows + size_t(row) * kMaxRanks, 0, sizeof(uint64_t) * kMaxRanks));
    ctx.row_in_use[row] = false;
    ctx.free_rows.push_back(row);
    ctx.rows_in_use -= 1;
  }
  TPG_CUDA_CHECK(cudaDeviceSynchronize());
}

int ar_rows_in_use(uintptr_t handle) { return get(handle).rows_in_use; }

void ar_fill_rows(uintptr_t handle, const std::vector<int>& rows, const std::vector<uintptr_t>& ptrs) {
  ArContext& ctx = get(handle);
  const int ws = ctx.layout.world_size;
  TPG_CHECK(ptrs.size() == rows.size() * ws, "expected " << rows.size() * ws << " pointers, got " << ptrs.size());
  std::vector<uint64_t> row(kMaxRanks, 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    TPG_CHECK(rows[i] >= 0 && rows[i] < ctx.next_row && ctx.row_in_use[rows[i]],
              "row " << rows[i] << " is not reserved");
    for (int r = 0; r < ws; ++r) {
      row[r] = ptrs[i * ws + r];
      TPG_CHECK(row[r] != 0 && row[r] % 16 == 0, "row " << rows[i] << ": pointer of rank " << r << " is null or misaligned");
    }
    TPG_CUDA_CHECK(cudaMemcpy(ctx.rows + size_t(rows[i]) * kMaxRanks, row.data(), sizeof(uint64_t) * kMaxRanks,
                              cudaMemcpyHostToDevice));
  }
}

// One call in flight at a time: the epochs and phases assume it. A call on another stream while the last one
// may still run would interleave two calls' barriers and hang, so it is refused instead. Returns whether the
// stream is capturing.
KernelLimits kernel_limits() {
  return KernelLimits{int(sizeof(uint4)), kThreads, int(kPushChunkVecs), kMaxBlocks, kMaxRanks, kNormMaxRowChunks};
}

std::map<std::string, int> algo_codes() {
  return {{"1shot_push", int(ArAlgo::Push1)}, {"1shot_pull", int(ArAlgo::Pull1)}, {"2shot_pull", int(ArAlgo::Pull2)},
          {"2shot_multicast", int(ArAlgo::Multicast2)}};
}

std::map<std::string, int> dtype_codes() {
  return {{"float32", int(DType::kFloat32)}, {"bfloat16", int(DType::kBFloat16)}, {"float16", int(DType::kFloat16)}};
}

static bool begin_call(ArContext& ctx, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TPG_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  if (!capturing && ctx.used && stream != ctx.last_stream) {
    cudaError_t q = cudaEventQuery(ctx.last_done);
    if (q == cudaErrorNotReady) {
      throw std::runtime_error(
          "custom all-reduce used from two streams at once: the previous call on another stream has not "
          "finished (order the streams, e.g. stream.wait_stream(other), or use one communicator per stream)");
    }
    if (q != cudaSuccess) TPG_CUDA_CHECK(q);
  }
  return capturing;
}

static void end_call(ArContext& ctx, cudaStream_t stream, bool capturing) {
  if (!capturing) {
    TPG_CUDA_CHECK(cudaEventRecord(ctx.last_done, stream));
    ctx.last_stream = stream;
    ctx.used = true;
  }
}

void ar_all_reduce(uintptr_t handle, int algo, int dtype, uintptr_t in, uintptr_t out, size_t nbytes, int blocks,
                   uintptr_t stream_handle, uint64_t timeout_ns, int row) {
  ArContext& ctx = get(handle);
  // After a timed-out kernel trapped, the context is dead: say why instead of a bare sticky CUDA error.
  if (ctx.timeout->fired) throw std::runtime_error(ar_timeout_message(handle));
  const int ws = ctx.layout.world_size;
  TPG_CHECK(int(ctx.peers.size()) == ws, "peer workspaces are not set: exchange IPC handles first");
  TPG_CHECK(algo >= 0 && algo <= 3, "unknown algorithm code " << algo);
  TPG_CHECK(dtype >= 0 && dtype <= 2, "unsupported dtype code " << dtype);
  TPG_CHECK(nbytes > 0 && nbytes % 16 == 0, "message size must be a positive multiple of 16 bytes, got " << nbytes);
  TPG_CHECK(in % 16 == 0 && out % 16 == 0, "input and output must be 16-byte aligned");
  TPG_CHECK(blocks >= 1 && blocks <= kMaxBlocks, "grid must have 1.." << kMaxBlocks << " blocks, got " << blocks);
  TPG_CHECK(row < 0 || (row < ctx.next_row && ctx.row_in_use[row]), "row " << row << " is not reserved");
  const bool zero_copy = row >= 0 && (algo == 1 || algo == 2);  // multicast is always staged
  TPG_CHECK(!(zero_copy && algo == 1 && in == out), "1shot_pull in a graph reads peers' inputs: output must differ");
  TPG_CHECK(!(zero_copy && algo == 2 && in != out), "2shot_pull in a graph reduces in place: output must be the input");
  TPG_CHECK(in == out || in + nbytes <= out || out + nbytes <= in, "input and output overlap without being the same");
  // 1shot_push takes any size: a message larger than the slot goes through it in slot-sized pieces (below)
  const size_t capacity = algo == 0 || zero_copy ? SIZE_MAX : ctx.layout.staging_bytes;
  TPG_CHECK(nbytes <= capacity, algo_name(algo) << ": " << nbytes << " bytes exceed the workspace (" << capacity
                                                << " bytes)");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const bool capturing = begin_call(ctx, stream);
  ArParams p = ctx.base_params;
  p.timeout_ns = timeout_ns;
  p.row = zero_copy ? ctx.rows + size_t(row) * kMaxRanks : nullptr;
  const auto dt = static_cast<DType>(dtype);
  const Launch launch{blocks, ctx.pdl, stream, ctx.sm_count};
  const auto* in_ptr = reinterpret_cast<const void*>(in);
  auto* out_ptr = reinterpret_cast<void*>(out);
  switch (static_cast<ArAlgo>(algo)) {
    case ArAlgo::Push1: {
      // Pieces of at most one slot, one launch each, in order: each is a complete push call (its chunks' phases
      // advance at its end), so a large message costs no more workspace than the slot, only a launch per piece.
      const size_t piece = ctx.layout.push_slot_bytes;
      TPG_CHECK(piece > 0, "1shot_push: this workspace has no push slot");
      for (size_t off = 0; off < nbytes; off += piece) {
        launch_push_1shot(p, dt, static_cast<const char*>(in_ptr) + off, static_cast<char*>(out_ptr) + off,
                          std::min(piece, nbytes - off), launch);
      }
      break;
    }
    case ArAlgo::Pull1:
    case ArAlgo::Pull2: launch_pull(static_cast<ArAlgo>(algo), p, dt, in_ptr, out_ptr, nbytes, launch); break;
    // this build never creates multicast objects, so p.mc_staging is null: the launcher runs the emulation
    case ArAlgo::Multicast2: launch_multicast_2shot(p, dt, in_ptr, out_ptr, nbytes, launch); break;
  }
  end_call(ctx, stream, capturing);
}

void ar_all_reduce_add_rmsnorm(uintptr_t handle, int dtype, uintptr_t in, uintptr_t residual, uintptr_t weight,
                               uintptr_t out, uintptr_t residual_out, int rows, int hidden, float eps, int blocks,
                               uintptr_t stream_handle, uint64_t timeout_ns) {
  ArContext& ctx = get(handle);
  if (ctx.timeout->fired) throw std::runtime_error(ar_timeout_message(handle));
  TPG_CHECK(int(ctx.peers.size()) == ctx.layout.world_size, "peer workspaces are not set: exchange IPC handles first");
  TPG_CHECK(dtype >= 0 && dtype <= 2, "unsupported dtype code " << dtype);
  const size_t elem = dtype == 0 ? 4 : 2;
  const size_t row_bytes = size_t(hidden) * elem;
  TPG_CHECK(rows > 0 && hidden > 0 && row_bytes % (kPushChunkVecs * 16) == 0,
            "fused all-reduce + RMSNorm needs rows of whole 512-byte chunks, got hidden " << hidden);
  const int row_chunks = int(row_bytes / (kPushChunkVecs * 16));
  TPG_CHECK(row_chunks <= kNormMaxRowChunks, "fused all-reduce + RMSNorm rows hold at most "
                                                 << kNormMaxRowChunks * kPushChunkVecs * 16 << " bytes, got "
                                                 << row_bytes);
  const size_t nbytes = row_bytes * size_t(rows);
  TPG_CHECK(nbytes <= ctx.layout.push_slot_bytes, "1shot_push + RMSNorm: " << nbytes
                                                      << " bytes exceed the workspace ("
                                                      << ctx.layout.push_slot_bytes << " bytes)");
  for (uintptr_t ptr : {in, residual, weight, out, residual_out}) {
    TPG_CHECK(ptr % 16 == 0, "fused all-reduce + RMSNorm tensors must be 16-byte aligned");
  }
  TPG_CHECK(blocks >= 1 && blocks <= kMaxBlocks, "grid must have 1.." << kMaxBlocks << " blocks, got " << blocks);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const bool capturing = begin_call(ctx, stream);
  ArParams p = ctx.base_params;
  p.timeout_ns = timeout_ns;
  p.row = nullptr;
  const NormArgs args{reinterpret_cast<const void*>(in), reinterpret_cast<const void*>(residual),
                      reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(out),
                      reinterpret_cast<void*>(residual_out), rows, row_chunks, eps, 1.0f / float(hidden)};
  launch_push_1shot_add_rmsnorm(p, static_cast<DType>(dtype), args, Launch{blocks, ctx.pdl, stream, ctx.sm_count});
  end_call(ctx, stream, capturing);
}

uintptr_t ar_timeout_record(uintptr_t handle) {
  void* device = nullptr;
  TPG_CUDA_CHECK(cudaHostGetDevicePointer(&device, get(handle).timeout, 0));
  return reinterpret_cast<uintptr_t>(device);
}

std::string ar_timeout_message(uintptr_t handle) {
  ArContext& ctx = get(handle);
  const TimeoutRecord& t = *ctx.timeout;
  if (!t.fired) return "";
  std::ostringstream msg;
  if (t.peer == kUnregisteredPeer) {
    msg << "rank " << t.rank << ": a CUDA graph ran " << algo_name(t.algo)
        << " before its inputs were registered (replay only after the communicator's capture() has exited)";
    return msg.str();
  }
  msg << "custom all-reduce timed out on rank " << t.rank << ": " << algo_name(t.algo) << " (block " << t.block
      << ") waited too long for rank " << t.peer << " (a dead peer, or ranks that issued different all-reduces)";
  return msg.str();
}

void ar_destroy(uintptr_t handle) {
  ArContext* ctx = &get(handle);
  cudaFree(ctx->workspace);
  cudaFree(ctx->rows);
  cudaEventDestroy(ctx->last_done);
  cudaFreeHost(ctx->timeout);
  delete ctx;
}

bool multicast_env_allowed() {
  // Same list and the same reading as tpgraph/comm/multicast.py (trimmed, case-insensitive; unclear values err
  // towards off): any of these means multicast objects must never be created. NCCL_NVLS_ENABLE is read as NCCL
  // reads it (strtoll base 0: off unless it starts with a nonzero number); the others are off switches, set by any
  // value but a clear no ("0", "false", "no", "n", "off", a number 0 that is the whole value: not "0abc", "0.5" or
  // "08"). Empty counts as unset.
  struct Var {
    const char* name;
    bool enable_switch;
  };
  const Var vars[] = {{"NCCL_NVLS_ENABLE", true},
                      {"TORCH_SYMM_MEM_DISABLE_MULTICAST", false},
                      {"NVSHMEM_DISABLE_NVLS", false},
                      {"TPGRAPH_DISABLE_MULTICAST", false}};
  for (const Var& v : vars) {
    const char* value = std::getenv(v.name);
    if (value == nullptr || value[0] == '\0') continue;  // set to nothing: as unset
    std::string s(value);
    const char* space = " \t\n\v\f\r";  // C's isspace, as tpgraph/comm/multicast.py's C_WHITESPACE
    const size_t first = s.find_first_not_of(space), last = s.find_last_not_of(space);
    s = first == std::string::npos ? "" : s.substr(first, last - first + 1);
    for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    char* end = nullptr;
    const long long number = std::strtoll(s.c_str(), &end, 0);
    const bool has_number = end != s.c_str();
    if (v.enable_switch) {
      if (number == 0) return false;  // (no number reads as 0 too, as in NCCL)
    } else {
      const bool whole_number = has_number && *end == '\0';
      const bool clear_no = s == "0" || s == "false" || s == "no" || s == "n" || s == "off" ||
                            (whole_number && number == 0);
      if (!clear_no) return false;
    }
  }
  return true;
}

}  // namespace tpgraph
