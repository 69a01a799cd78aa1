// Host-side lifecycle of symmetric workspaces and the registry the EP handlers look them up in.
//
// Python (jax_megamoe/symmetric.py) drives it through a small C ABI (ctypes on the extension's
// own shared object, so the nanobind module stays free of CUDA):
//   megamoe_ep_ws_new        declare a workspace: layout (fused_rows > 0: with the fused
//                            kernel's regions), send blocks, timeout -> id
//   megamoe_ep_ws_alloc      allocate + zero one device's share (rank r of its group), return
//                            its CUDA IPC handle
//   megamoe_ep_ws_connect    map peer rank q for a device: same process -> that device's
//                            pointer (peer access enabled), other process -> cudaIpcOpenMemHandle
//   megamoe_ep_ws_finalize   check every device sees every peer; from here kernels may run
//   megamoe_ep_ws_close_peers / megamoe_ep_ws_free   teardown (close IPC mappings, then free)
//   megamoe_ep_ws_error      the first error any device of the workspace recorded
//   megamoe_ep_ws_new_virtual  a virtual group: all R ranks' shares on one device, connected
//                            (EP at any R on one GPU, for tests); megamoe_ep_ws_set_absent
//                            marks one of its ranks as never arriving (the timeout tests)
// Handlers find a device's PeerView by (workspace id, device ordinal); the id travels as a
// static int64 attribute of the custom call.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ffi/comm/symmetric_memory.h"
#include "ffi/comm/workspace_ops.h"
#include "ffi/comm/workspace_registry.h"
#include "ffi/common/driver_entry_point.h"

namespace megamoe::ep {
namespace {

struct DeviceShare {
  int ordinal = -1;
  void* local = nullptr;              // this device's allocation
  std::vector<void*> ipc_opened;      // peers' allocations opened through CUDA IPC
  ErrorRecord* error_host = nullptr;  // host-mapped record
  PeerView view;
};

struct Workspace {
  WorkspaceLayout layout;
  int comm_blocks = 0;
  long long timeout_ns = 0;
  bool ready = false;
  bool virtual_ranks = false;  // every rank's share on one device (shares in rank order)
  int absent_rank = -1;
  std::vector<std::unique_ptr<DeviceShare>> shares;

  DeviceShare* Find(int ordinal) {
    for (auto& s : shares)
      if (s->ordinal == ordinal) return s.get();
    return nullptr;
  }
};

std::mutex& Mutex() {
  static std::mutex m;
  return m;
}
std::map<int64_t, std::unique_ptr<Workspace>>& Registry() {
  static std::map<int64_t, std::unique_ptr<Workspace>> r;
  return r;
}
int64_t& NextId() {
  static int64_t id = 1;
  return id;
}

int Fail(char* msg, int len, const std::string& text) {
  if (msg != nullptr && len > 0) std::snprintf(msg, len, "%s", text.c_str());
  return 1;
}
int FailCuda(char* msg, int len, const char* what, cudaError_t err) {
  cudaGetLastError();
  return Fail(msg, len, std::string(what) + ": " + cudaGetErrorString(err));
}

// Switches the calling thread to `ordinal` for the scope, then restores the thread's previous
// context exactly, none included. Restoring with cudaSetDevice(previous device) would create a
// context where the thread had none (cudaGetDevice says 0 then): in a process that drives one GPU
// of several visible, hundreds of MB on GPU 0 that it never meant to use.
struct DeviceScope {
  using CtxGetCurrent = CUresult (*)(CUcontext*);
  using CtxSetCurrent = CUresult (*)(CUcontext);
  CUcontext previous = nullptr;
  bool restore = false;
  explicit DeviceScope(int ordinal) {
    static const CtxGetCurrent get = DriverEntryPoint<CtxGetCurrent>("cuCtxGetCurrent");
    restore = get != nullptr && get(&previous) == CUDA_SUCCESS;
    cudaSetDevice(ordinal);
  }
  ~DeviceScope() {
    static const CtxSetCurrent set = DriverEntryPoint<CtxSetCurrent>("cuCtxSetCurrent");
    if (restore && set != nullptr) set(previous);
  }
};

}  // namespace

bool FindLocalRanks(int64_t workspace_id, int device_ordinal, LocalRanks* out,
                    std::string* message) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(workspace_id);
  if (it == Registry().end()) {
    *message = "jax_megamoe: no symmetric workspace with id " + std::to_string(workspace_id) +
               " (it was closed, or created in another process; create it with "
               "jax_megamoe.symmetric.create_workspace before tracing)";
    return false;
  }
  Workspace& ws = *it->second;
  if (!ws.ready) {
    *message = "jax_megamoe: symmetric workspace " + std::to_string(workspace_id) +
               " is not connected yet";
    return false;
  }
  *out = LocalRanks{};
  if (ws.virtual_ranks) {
    if (ws.shares.empty() || ws.shares[0]->ordinal != device_ordinal) {
      *message = "jax_megamoe: the virtual-rank workspace " + std::to_string(workspace_id) +
                 " lives on device ordinal " +
                 std::to_string(ws.shares.empty() ? -1 : ws.shares[0]->ordinal) +
                 ", not on the calling device " + std::to_string(device_ordinal);
      return false;
    }
    for (auto& s : ws.shares) out->views[out->count++] = &s->view;
    out->stacked = true;
    out->absent = ws.absent_rank;
    out->cuda_device = ws.shares[0]->ordinal;
    return true;
  }
  DeviceShare* share = ws.Find(device_ordinal);
  // One device per process (jax.distributed): XLA's ordinal may differ from the CUDA ordinal.
  if (share == nullptr && ws.shares.size() == 1) share = ws.shares[0].get();
  if (share == nullptr) {
    *message = "jax_megamoe: symmetric workspace " + std::to_string(workspace_id) +
               " has no share on device ordinal " + std::to_string(device_ordinal) +
               " (the mesh it was created for does not contain this device)";
    return false;
  }
  out->views[out->count++] = &share->view;
  out->cuda_device = share->ordinal;
  return true;
}

std::string DescribeError(const PeerView& view) {
  const ErrorRecord* e = view.error_host;
  if (e == nullptr) return "";
  const int code = *reinterpret_cast<const volatile int*>(&e->code);
  if (code == 0) return "";
  // What it waited on: one peer, or a counter of a pool block (StageName says which).
  char whom[64];
  if (e->peer >= 0) {
    std::snprintf(whom, sizeof(whom), "peer rank %d", e->peer);
  } else {
    std::snprintf(whom, sizeof(whom), "pool block %d", e->index);
  }
  char buf[700];
  std::snprintf(buf, sizeof(buf),
                "jax_megamoe EP: rank %d timed out after %.3f s in %s, on %s: counter %llu, "
                "expected >= %llu. The EP group is out of step (a peer crashed, ran a different "
                "program, or the timeout is too short: MEGAMOE_EP_TIMEOUT_S); this workspace "
                "cannot be used again: recreate it.",
                e->rank, e->waited_ns * 1e-9, StageName(e->stage), whom, e->value, e->expected);
  return buf;
}

}  // namespace megamoe::ep

namespace megamoe::ep {
namespace {

// Allocates and zeroes rank `rank`'s share of `ws` on device `ordinal` (its own base mapped);
// ipc_out (may be null) receives its CUDA IPC handle. Caller holds the registry lock.
int AllocShare(Workspace& ws, int ordinal, int rank, unsigned char* ipc_out, char* msg,
               int len) {
  if (rank < 0 || rank >= ws.layout.num_ranks) return Fail(msg, len, "rank out of range");
  DeviceScope scope(ordinal);
  auto share = std::make_unique<DeviceShare>();
  share->ordinal = ordinal;
  cudaError_t err = cudaMalloc(&share->local, ws.layout.total_bytes);
  if (err != cudaSuccess) {
    return FailCuda(msg, len,
                    ("cudaMalloc of " + std::to_string(ws.layout.total_bytes) +
                     " bytes on device " + std::to_string(ordinal))
                        .c_str(),
                    err);
  }
  if ((err = cudaMemset(share->local, 0, ws.layout.total_bytes)) != cudaSuccess ||
      (err = cudaDeviceSynchronize()) != cudaSuccess) {
    cudaFree(share->local);
    return FailCuda(msg, len, "zeroing the workspace", err);
  }
  err = cudaHostAlloc(reinterpret_cast<void**>(&share->error_host), sizeof(ErrorRecord),
                      cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaFree(share->local);
    return FailCuda(msg, len, "cudaHostAlloc (error record)", err);
  }
  std::memset(share->error_host, 0, sizeof(ErrorRecord));
  ErrorRecord* error_dev = nullptr;
  cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev), share->error_host, 0);
  cudaIpcMemHandle_t handle;
  err = cudaIpcGetMemHandle(&handle, share->local);
  if (err != cudaSuccess) {
    cudaFreeHost(share->error_host);
    cudaFree(share->local);
    return FailCuda(msg, len, "cudaIpcGetMemHandle", err);
  }
  if (ipc_out != nullptr) std::memcpy(ipc_out, &handle, sizeof(handle));
  PeerView& v = share->view;
  for (int r = 0; r < kMaxRanks; ++r) v.base[r] = nullptr;
  v.rank = rank;
  v.num_ranks = static_cast<int>(ws.layout.num_ranks);
  v.comm_blocks = ws.comm_blocks;
  v.timeout_ns = ws.timeout_ns;
  v.error = error_dev;
  v.error_host = share->error_host;
  v.layout = ws.layout;
  v.base[rank] = static_cast<char*>(share->local);
  ws.shares.push_back(std::move(share));
  return 0;
}

}  // namespace
}  // namespace megamoe::ep

using namespace megamoe::ep;

#define MEGAMOE_C_API extern "C" __attribute__((visibility("default")))

// The layout's offsets, in WorkspaceLayout's field order from `signals` to `total_bytes`
// (13 values).
MEGAMOE_C_API int megamoe_ep_ws_layout(int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                                       int64_t top_k, int64_t elem_bytes, int64_t fused_rows,
                                       int64_t* out) {
  const WorkspaceLayout l =
      MakeWorkspaceLayout(num_ranks, max_tokens, hidden, top_k, elem_bytes, fused_rows);
  const int64_t vals[13] = {l.signals, l.meta_ids, l.meta_w,  l.pool_d,  l.meta_c,
                            l.pool_c,  l.fsig,     l.fcounts, l.ftiles,  l.fl1done,
                            l.fpool,   l.fcomb,    l.total_bytes};
  std::memcpy(out, vals, sizeof(vals));
  return 0;
}

MEGAMOE_C_API int megamoe_ep_ws_new(int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                                    int64_t top_k, int64_t elem_bytes, int64_t fused_rows,
                                    int comm_blocks, double timeout_s, int64_t* out_id, char* msg,
                                    int len) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    return Fail(msg, len, "num_ranks must be in [1, " + std::to_string(kMaxRanks) + "]");
  if (comm_blocks < 1) return Fail(msg, len, "comm_blocks must be >= 1");
  auto ws = std::make_unique<Workspace>();
  if (fused_rows < 0) return Fail(msg, len, "fused_rows must be >= 0");
  ws->layout = MakeWorkspaceLayout(num_ranks, max_tokens, hidden, top_k, elem_bytes, fused_rows);
  ws->comm_blocks = comm_blocks;
  ws->timeout_ns = static_cast<long long>(timeout_s * 1e9);
  std::lock_guard<std::mutex> lock(Mutex());
  const int64_t id = NextId()++;
  Registry()[id] = std::move(ws);
  *out_id = id;
  return 0;
}

MEGAMOE_C_API int megamoe_ep_ws_alloc(int64_t id, int ordinal, int rank, unsigned char* ipc_out,
                                      char* msg, int len) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(id);
  if (it == Registry().end()) return Fail(msg, len, "unknown workspace id");
  Workspace& ws = *it->second;
  if (ws.Find(ordinal) != nullptr) return Fail(msg, len, "device already has a share");
  return AllocShare(ws, ordinal, rank, ipc_out, msg, len);
}

MEGAMOE_C_API int megamoe_ep_ws_ipc_handle_bytes() { return sizeof(cudaIpcMemHandle_t); }

// peer_ordinal >= 0: the peer's share lives in this process on that device.
MEGAMOE_C_API int megamoe_ep_ws_connect(int64_t id, int ordinal, int peer_rank, int peer_ordinal,
                                        const unsigned char* ipc_handle, char* msg, int len) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(id);
  if (it == Registry().end()) return Fail(msg, len, "unknown workspace id");
  Workspace& ws = *it->second;
  DeviceShare* share = ws.Find(ordinal);
  if (share == nullptr) return Fail(msg, len, "device has no share (alloc first)");
  if (peer_rank < 0 || peer_rank >= ws.layout.num_ranks) return Fail(msg, len, "bad peer rank");
  if (peer_rank == share->view.rank) return 0;
  DeviceScope scope(ordinal);
  if (peer_ordinal >= 0) {
    DeviceShare* peer = ws.Find(peer_ordinal);
    if (peer == nullptr) return Fail(msg, len, "peer device has no share");
    int can = 0;
    cudaDeviceCanAccessPeer(&can, ordinal, peer_ordinal);
    if (!can) {
      return Fail(msg, len, "device " + std::to_string(ordinal) + " cannot access device " +
                                std::to_string(peer_ordinal) + " (no peer access)");
    }
    // The arrival counters are 64-bit atomics on peer memory (comm/peer_signal.cuh): without
    // native peer atomics (GPUs joined by PCIe only) they would be lost, and the symptom a
    // timeout or a wrong result rather than this message.
    int atomics = 0;
    if (cudaError_t e = cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported,
                                                  ordinal, peer_ordinal);
        e != cudaSuccess)
      return FailCuda(msg, len, "cudaDeviceGetP2PAttribute", e);
    if (!atomics) {
      return Fail(msg, len, "device " + std::to_string(ordinal) + " has no native atomics on " +
                                "device " + std::to_string(peer_ordinal) +
                                "'s memory (NVLink needed; PCIe peers are not supported)");
    }
    cudaError_t err = cudaDeviceEnablePeerAccess(peer_ordinal, 0);
    if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled)
      return FailCuda(msg, len, "cudaDeviceEnablePeerAccess", err);
    cudaGetLastError();
    share->view.base[peer_rank] = static_cast<char*>(peer->local);
    return 0;
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle, sizeof(handle));
  void* ptr = nullptr;
  cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return FailCuda(msg, len, "cudaIpcOpenMemHandle", err);
  share->ipc_opened.push_back(ptr);
  share->view.base[peer_rank] = static_cast<char*>(ptr);
  return 0;
}

MEGAMOE_C_API int megamoe_ep_ws_finalize(int64_t id, char* msg, int len) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(id);
  if (it == Registry().end()) return Fail(msg, len, "unknown workspace id");
  Workspace& ws = *it->second;
  for (auto& s : ws.shares) {
    for (int r = 0; r < ws.layout.num_ranks; ++r) {
      if (s->view.base[r] == nullptr) {
        return Fail(msg, len, "device " + std::to_string(s->ordinal) + " has no mapping of rank " +
                                  std::to_string(r));
      }
    }
  }
  ws.ready = true;
  return 0;
}

MEGAMOE_C_API int megamoe_ep_ws_error(int64_t id, char* msg, int len) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(id);
  if (it == Registry().end()) return 0;
  for (auto& s : it->second->shares) {
    if (s->error_host != nullptr && s->error_host->code != 0) {
      return Fail(msg, len, DescribeError(s->view));
    }
  }
  return 0;
}

// Synchronises the workspace's devices and unmaps peers opened through IPC. Call on every process
// before anyone frees (a barrier between the two steps when there are several processes).
MEGAMOE_C_API int megamoe_ep_ws_close_peers(int64_t id, char* msg, int len) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(id);
  if (it == Registry().end()) return 0;
  Workspace& ws = *it->second;
  ws.ready = false;
  for (auto& s : ws.shares) {
    DeviceScope scope(s->ordinal);
    cudaDeviceSynchronize();
    for (void* p : s->ipc_opened) cudaIpcCloseMemHandle(p);
    s->ipc_opened.clear();
    cudaGetLastError();  // teardown is best effort; clear what it met on this device
  }
  return 0;
}

MEGAMOE_C_API int megamoe_ep_ws_free(int64_t id, char* msg, int len) {
  std::unique_ptr<Workspace> ws;
  {
    std::lock_guard<std::mutex> lock(Mutex());
    auto it = Registry().find(id);
    if (it == Registry().end()) return 0;
    ws = std::move(it->second);
    Registry().erase(it);
  }
  for (auto& s : ws->shares) {
    DeviceScope scope(s->ordinal);
    cudaDeviceSynchronize();
    for (void* p : s->ipc_opened) cudaIpcCloseMemHandle(p);
    if (s->local != nullptr) cudaFree(s->local);
    if (s->error_host != nullptr) cudaFreeHost(s->error_host);
    cudaGetLastError();
  }
  return 0;
}

// A virtual group: R shares on device `ordinal`, every rank's peer bases pointing at the others'
// shares, ready for kernels. One EP call then runs all R ranks (handlers: FindLocalRanks).
MEGAMOE_C_API int megamoe_ep_ws_new_virtual(int64_t num_ranks, int64_t max_tokens,
                                            int64_t hidden, int64_t top_k, int64_t elem_bytes,
                                            int64_t fused_rows, int comm_blocks, double timeout_s,
                                            int ordinal, int64_t* out_id, char* msg, int len) {
  int64_t id = 0;
  if (int rc = megamoe_ep_ws_new(num_ranks, max_tokens, hidden, top_k, elem_bytes, fused_rows,
                                 comm_blocks, timeout_s, &id, msg, len);
      rc != 0) {
    return rc;
  }
  std::unique_lock<std::mutex> lock(Mutex());
  Workspace& ws = *Registry()[id];
  ws.virtual_ranks = true;
  for (int r = 0; r < num_ranks; ++r) {
    if (int rc = AllocShare(ws, ordinal, r, nullptr, msg, len); rc != 0) {
      lock.unlock();
      megamoe_ep_ws_free(id, nullptr, 0);
      return rc;
    }
  }
  for (auto& share : ws.shares) {
    for (auto& peer : ws.shares) share->view.base[peer->view.rank] = static_cast<char*>(peer->local);
  }
  ws.ready = true;
  *out_id = id;
  return 0;
}

// Test knob of a virtual group: rank `rank`'s kernels are not launched from now on (-1: none),
// as if that GPU had died; the others' waits on it time out and report.
MEGAMOE_C_API int megamoe_ep_ws_set_absent(int64_t id, int rank, char* msg, int len) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Registry().find(id);
  if (it == Registry().end()) return Fail(msg, len, "unknown workspace id");
  Workspace& ws = *it->second;
  if (!ws.virtual_ranks) return Fail(msg, len, "only a virtual-rank workspace has absent ranks");
  if (rank < -1 || rank >= ws.layout.num_ranks) return Fail(msg, len, "rank out of range");
  ws.absent_rank = rank;
  return 0;
}
