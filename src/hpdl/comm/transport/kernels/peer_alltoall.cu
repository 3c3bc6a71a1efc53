// Launcher for the peer all-to-all kernels (torch-free: the binding passes raw pointers and the stream).
#include "peer_alltoall.cuh"

namespace hpdl {

cudaError_t launch_peer_all_to_all(const A2AArgs& a, int algo, int unit, int grid, cudaStream_t stream) {
  if (grid < 1 || grid > kMaxBlocks || a.world < 1 || a.world > kMaxRanks || algo < 0 || algo >= kNumA2AAlgos)
    return cudaErrorInvalidValue;
  const dim3 g(grid), b(kThreads);
#define HPDL_A2A(V)                                                                    \
  if (algo == kPush) peer_all_to_all_kernel<V, kPush><<<g, b, 0, stream>>>(a);        \
  else peer_all_to_all_kernel<V, kPull><<<g, b, 0, stream>>>(a);
  switch (unit) {
    case 16: HPDL_A2A(int4) break;
    case 8: HPDL_A2A(int2) break;
    case 4: HPDL_A2A(int) break;
    case 2: HPDL_A2A(short) break;
    case 1: HPDL_A2A(char) break;
    default: return cudaErrorInvalidValue;
  }
#undef HPDL_A2A
  return cudaGetLastError();
}

}  // namespace hpdl
