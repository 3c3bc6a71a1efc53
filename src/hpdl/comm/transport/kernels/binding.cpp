// Python binding of the peer all-reduce: one registered communicator per (group, device), one launch per call.
// Only integers cross the boundary (pointers as int), so no torch type casters are compiled and the per-call
// cost is one pybind call plus one kernel launch on the current stream of the tensor's device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "peer_args.h"

namespace py = pybind11;

namespace hpdl {
cudaError_t launch_peer_all_reduce(const PeerArgs& a, int algo, int dtype, int grid, cudaStream_t stream);
cudaError_t launch_peer_all_to_all(const A2AArgs& a, int algo, int unit, int grid, cudaStream_t stream);
}

namespace {

struct Comm {
  hpdl::PeerArgs args{};
  long long region[hpdl::kNumAlgos]{};
  long long slot_vecs[hpdl::kNumAlgos]{};
  int device = 0;
  bool live = false;
};

std::vector<Comm> g_comms;

Comm& get(int handle) {
  if (handle < 0 || handle >= static_cast<int>(g_comms.size()) || !g_comms[handle].live)
    throw std::invalid_argument("peer all-reduce: unknown or released communicator handle " + std::to_string(handle));
  return g_comms[handle];
}

int create(const std::vector<int64_t>& bufs, int rank, int world, int device, const std::vector<int64_t>& regions,
           const std::vector<int64_t>& slot_vecs, int64_t timeout_ns) {
  if (world < 1 || world > hpdl::kMaxRanks || static_cast<int>(bufs.size()) != world)
    throw std::invalid_argument("peer all-reduce: world must be 1.." + std::to_string(hpdl::kMaxRanks) +
                                " with one buffer per rank, got world=" + std::to_string(world));
  if (rank < 0 || rank >= world) throw std::invalid_argument("peer all-reduce: rank out of range");
  if (regions.size() != hpdl::kNumAlgos || slot_vecs.size() != hpdl::kNumAlgos)
    throw std::invalid_argument("peer all-reduce: need one region and slot size per algorithm (" +
                                std::to_string(hpdl::kNumAlgos) + ")");
  Comm c;
  for (int q = 0; q < world; ++q) c.args.bufs[q] = reinterpret_cast<char*>(bufs[q]);
  c.args.rank = rank;
  c.args.world = world;
  c.args.timeout_ns = static_cast<unsigned long long>(timeout_ns);
  for (int k = 0; k < hpdl::kNumAlgos; ++k) {
    c.region[k] = regions[k];
    c.slot_vecs[k] = slot_vecs[k];
  }
  c.device = device;
  c.live = true;
  g_comms.push_back(c);
  return static_cast<int>(g_comms.size()) - 1;
}

void release(int handle) { get(handle).live = false; }

void all_reduce(int handle, int64_t data, int64_t n, int dtype, int op, int algo, int window, int grid,
                int64_t chunk) {
  Comm& c = get(handle);
  if (algo < 0 || algo >= hpdl::kNumAlgos) throw std::invalid_argument("peer all-reduce: bad algorithm");
  if (chunk < 1 || chunk > c.slot_vecs[algo])
    throw std::invalid_argument("peer all-reduce: chunk " + std::to_string(chunk) + " outside 1.." +
                                std::to_string(c.slot_vecs[algo]) + " vectors");
  if (data % 16 != 0) throw std::invalid_argument("peer all-reduce: data pointer must be 16-byte aligned");
  hpdl::PeerArgs a = c.args;
  a.data = reinterpret_cast<void*>(data);
  a.n = n;
  a.chunk = chunk;
  a.slot_vecs = c.slot_vecs[algo];
  a.region = c.region[algo];
  a.window = window < 1 ? a.world - 1 : window;
  a.op = op;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.device)).stream();
  const cudaError_t err = hpdl::launch_peer_all_reduce(a, algo, dtype, grid, stream);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("peer all-reduce: kernel launch failed: ") + cudaGetErrorString(err));
}

// ---- all-to-all: one communicator per (group, device), launch plans registered once per layout ----
struct A2AComm {
  hpdl::A2AArgs args{};
  int device = 0, grid = 0;
  bool live = false;
  std::vector<hpdl::A2AArgs> plans;   // args with the layout filled in; src/dst set per call
};

std::vector<A2AComm> g_a2a;

A2AComm& get_a2a(int handle) {
  if (handle < 0 || handle >= static_cast<int>(g_a2a.size()) || !g_a2a[handle].live)
    throw std::invalid_argument("peer all_to_all: unknown or released communicator handle " + std::to_string(handle));
  return g_a2a[handle];
}

int a2a_create(const std::vector<int64_t>& bufs, int rank, int world, int device, int64_t region, int64_t slot_bytes,
               int grid, int64_t timeout_ns) {
  if (world < 1 || world > hpdl::kMaxRanks || static_cast<int>(bufs.size()) != world || rank < 0 || rank >= world)
    throw std::invalid_argument("peer all_to_all: world must be 1.." + std::to_string(hpdl::kMaxRanks) +
                                " with one buffer per rank and 0 <= rank < world");
  if (grid < 1 || grid > hpdl::kMaxBlocks || slot_bytes < 16 || slot_bytes % 16 ||
      region < hpdl::kA2AFlagsBytes * 2)
    throw std::invalid_argument("peer all_to_all: bad grid, slot size or region offset");
  A2AComm c;
  for (int q = 0; q < world; ++q) c.args.bufs[q] = reinterpret_cast<char*>(bufs[q]);
  c.args.rank = rank;
  c.args.world = world;
  c.args.slot_bytes = slot_bytes;
  c.args.region = region;
  c.args.timeout_ns = static_cast<unsigned long long>(timeout_ns);
  c.device = device;
  c.grid = grid;
  c.live = true;
  g_a2a.push_back(c);
  return static_cast<int>(g_a2a.size()) - 1;
}

void a2a_clear_plans(int handle) { get_a2a(handle).plans.clear(); }

void a2a_release(int handle) {
  A2AComm& c = get_a2a(handle);
  c.live = false;
  c.plans.clear();
}

// layout = send_off[W] + send_len[W] + recv_off[W] + recv_len[W] (bytes), chunks[W]: bytes per block-round.
int a2a_plan(int handle, const std::vector<int64_t>& layout, const std::vector<int64_t>& chunks, int window) {
  A2AComm& c = get_a2a(handle);
  const int W = c.args.world;
  if (static_cast<int>(layout.size()) != 4 * W || static_cast<int>(chunks.size()) != W)
    throw std::invalid_argument("peer all_to_all: layout needs 4 x world entries and chunks world entries");
  hpdl::A2AArgs a = c.args;
  for (int p = 0; p < W; ++p) {
    a.send_off[p] = layout[p];
    a.send_len[p] = layout[W + p];
    a.recv_off[p] = layout[2 * W + p];
    a.recv_len[p] = layout[3 * W + p];
    a.chunk[p] = chunks[p];
    if (chunks[p] < 16 || chunks[p] % 16 || chunks[p] > c.args.slot_bytes)
      throw std::invalid_argument("peer all_to_all: chunk " + std::to_string(chunks[p]) +
                                  " must be a multiple of 16 in 16.." + std::to_string(c.args.slot_bytes));
    if (a.send_off[p] < 0 || a.send_len[p] < 0 || a.recv_off[p] < 0 || a.recv_len[p] < 0)
      throw std::invalid_argument("peer all_to_all: negative offset or length");
  }
  a.window = window < 1 ? W - 1 : window;
  c.plans.push_back(a);
  return static_cast<int>(c.plans.size()) - 1;
}

void all_to_all(int handle, int plan, int64_t src, int64_t dst, int algo, int unit, int64_t timeout_ns) {
  A2AComm& c = get_a2a(handle);
  if (plan < 0 || plan >= static_cast<int>(c.plans.size()))
    throw std::invalid_argument("peer all_to_all: unknown plan " + std::to_string(plan));
  if (unit != 1 && unit != 2 && unit != 4 && unit != 8 && unit != 16)
    throw std::invalid_argument("peer all_to_all: unit must be 1, 2, 4, 8 or 16 bytes");
  if (src % unit || dst % unit)
    throw std::invalid_argument("peer all_to_all: src and dst must be aligned to the unit");
  hpdl::A2AArgs a = c.plans[plan];
  a.src = reinterpret_cast<const char*>(src);
  a.dst = reinterpret_cast<char*>(dst);
  if (timeout_ns > 0) a.timeout_ns = static_cast<unsigned long long>(timeout_ns);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.device)).stream();
  const cudaError_t err = hpdl::launch_peer_all_to_all(a, algo, unit, c.grid, stream);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("peer all_to_all: kernel launch failed: ") + cudaGetErrorString(err));
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// CUDA IPC fallback (as vLLM's custom all-reduce): a plain cudaMalloc allocation, so the handle names the
// allocation's base and no offset is needed; peers open it in their own device's context.
py::tuple ipc_alloc(int64_t nbytes, int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, static_cast<size_t>(nbytes)), "cudaMalloc");
  check(cudaMemset(ptr, 0, static_cast<size_t>(nbytes)), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, ptr), "cudaIpcGetMemHandle");
  return py::make_tuple(reinterpret_cast<int64_t>(ptr),
                        py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle)));
}

int64_t ipc_open(const std::string& handle_bytes, int device) {
  if (handle_bytes.size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("bad CUDA IPC handle size");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close(int64_t ptr, int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

void ipc_free(int64_t ptr, int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hpdl direct all-reduce over peer memory (one-shot / two-shot)";
  m.def("create", &create, "register a communicator; returns its handle");
  m.def("release", &release, "forget a communicator (the buffer itself is freed by Python)");
  m.def("all_reduce", &all_reduce, "in-place all-reduce of a 16-byte aligned device buffer on the current stream");
  m.def("a2a_create", &a2a_create, "register an all-to-all communicator; returns its handle");
  m.def("a2a_release", &a2a_release, "forget an all-to-all communicator and its plans");
  m.def("a2a_clear_plans", &a2a_clear_plans, "forget every registered plan of a communicator");
  m.def("a2a_plan", &a2a_plan, "register a layout (offsets, lengths, chunks); returns the plan id");
  m.def("all_to_all", &all_to_all, "push (0) / pull (1) all-to-all of one plan on the current stream (timeout_ns > 0 "
        "overrides the communicator's)");
  m.def("ipc_alloc", &ipc_alloc, "cudaMalloc + zero + IPC handle: returns (ptr, handle bytes)");
  m.def("ipc_open", &ipc_open, "open a peer's IPC handle in this device's context; returns the pointer");
  m.def("ipc_close", &ipc_close, "close a pointer returned by ipc_open");
  m.def("ipc_free", &ipc_free, "free a pointer returned by ipc_alloc");
  m.attr("MAX_RANKS") = hpdl::kMaxRanks;
  m.attr("MAX_BLOCKS") = hpdl::kMaxBlocks;
  m.attr("HEADER_BYTES") = hpdl::kHeaderBytes;
  m.attr("A2A_HEADER_BYTES") = 2 * hpdl::kA2AFlagsBytes;
}
