// Launcher for the peer all-reduce kernels (torch-free: the binding passes raw pointers and the stream).
#include "peer_allreduce.cuh"

namespace hpdl {

cudaError_t launch_peer_all_reduce(const PeerArgs& a, int algo, int dtype, int grid, cudaStream_t stream) {
  if (grid < 1 || grid > kMaxBlocks || a.world < 1 || a.world > kMaxRanks) return cudaErrorInvalidValue;
  const dim3 g(grid), b(kThreads);
#define HPDL_CASE(code, T)                                                     \
  case code:                                                                   \
    if (algo == kOneShot) one_shot_kernel<T><<<g, b, 0, stream>>>(a);          \
    else if (algo == kOneShotLL) one_shot_ll_kernel<T><<<g, b, 0, stream>>>(a); \
    else two_shot_kernel<T><<<g, b, 0, stream>>>(a);                           \
    break;
  switch (dtype) {
    HPDL_CASE(kF32, float)
    HPDL_CASE(kF16, __half)
    HPDL_CASE(kBF16, __nv_bfloat16)
    HPDL_CASE(kI32, int)
    HPDL_CASE(kI64, long long)
    default: return cudaErrorInvalidValue;
  }
#undef HPDL_CASE
  return cudaGetLastError();
}

}  // namespace hpdl
