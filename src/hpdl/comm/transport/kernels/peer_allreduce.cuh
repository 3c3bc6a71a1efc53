// Direct all-reduce over peer (NVLink) memory: one-shot and two-shot kernels.
//
// Torch-free on purpose: peer_allreduce.cu holds the launcher and binding.cpp the Python binding, so this
// header compiles alone with `nvcc -std=c++17 -arch=sm_90 -c`.
//
// Schedule (the same as hpdl.comm.algorithms.peer.reference_all_reduce, which CI tests on CPU):
//   The tensor is split into 16-byte vectors (nv of them; the last may be partial). Block b of the grid works
//   on rounds: in round i it owns `chunk` vectors starting at (i * grid + b) * chunk of the range it spans
//   (the whole tensor for one-shot, one shard of ceil(nv / world) vectors for two-shot).
//   one-shot, per round: push my chunk into slot[rank] of every peer (peers visited in windows of k, starting
//     at rank+1), barrier, then out = x_0 (op) x_1 (op) ... (op) x_{W-1} in rank order.
//   two-shot, per round: push shard p's chunk into peer p's reduce-scatter slot[rank]; barrier; reduce my
//     shard in rank order, write it out and push it into every peer's all-gather slot[rank]; barrier; copy the
//     gathered shards out. Only the owner reduces a shard, so every rank holds the same bits.
//   16-bit floats accumulate in float32 and round once (round-to-nearest-even); avg divides the sum by W.
//
// one-shot, low-latency variant (one_shot_ll, for small messages; NCCL's LL protocol): the payload travels in
//   16-byte packets {data[0:4], epoch, data[4:8], epoch} written with one st.volatile.v4 (8-byte halves are
//   single-copy atomic), and the reader polls its own slot until both flag words equal the epoch. No fence and no
//   barrier: one NVLink crossing per call. Halves alternate by epoch parity, so a peer can only overwrite a half
//   two calls later, after this rank has taken part in the call in between.
//
// Synchronisation: a barrier is per block and per rank pair. Block b stores epoch e into flag[algo][b][rank]
// of each peer with st.release.sys after __syncthreads, and spins with ld.acquire.sys on its own
// flag[algo][b][peer] until it reaches e (TensorRT-LLM / vLLM custom all-reduce pattern). The epoch lives in
// device memory (counter[algo][b]) so that CUDA-graph replays keep counting. Each block owns fixed slots, so
// one barrier per round suffices to stop a peer overwriting data this block still reads: one-shot alternates
// two halves by epoch parity; two-shot's second barrier orders the all-gather slots. A wait longer than
// timeout_ns prints the missing rank and traps (the CUDA context then reports an error instead of hanging).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "peer_args.h"
#include "peer_sync.cuh"

namespace hpdl {

constexpr int kUnroll = 4;   // vectors in flight per thread in the copy loops

__device__ __forceinline__ uint32_t* flag_ptr(char* buf, int algo, int block, int src) {
  return reinterpret_cast<uint32_t*>(buf) + ((long long)algo * kMaxBlocks + block) * kMaxRanks + src;
}
__device__ __forceinline__ uint32_t* counter_ptr(char* buf, int algo, int block) {
  return reinterpret_cast<uint32_t*>(buf + kFlagsBytes) + (long long)algo * kMaxBlocks + block;
}
// Every rank's block b meets here; see the header comment.
__device__ __forceinline__ void peer_barrier(const PeerArgs& a, int algo, uint32_t epoch) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < a.world && t != a.rank) {
    st_release_sys(flag_ptr(a.bufs[t], algo, blockIdx.x, a.rank), epoch);
    const uint32_t* mine = flag_ptr(a.bufs[a.rank], algo, blockIdx.x, t);
    const unsigned long long t0 = global_timer_ns();
    while (static_cast<int>(ld_acquire_sys(mine) - epoch) < 0) {
      if (global_timer_ns() - t0 > a.timeout_ns) {
        printf("hpdl peer all-reduce: rank %d block %d timed out waiting for rank %d (epoch %u)\n", a.rank,
               blockIdx.x, t, epoch);
        __trap();
      }
    }
  }
  __syncthreads();
}

template <typename T> struct AccOf { using type = T; };
template <> struct AccOf<__half> { using type = float; };
template <> struct AccOf<__nv_bfloat16> { using type = float; };

template <typename T> __device__ __forceinline__ typename AccOf<T>::type to_acc(T x) { return x; }
template <> __device__ __forceinline__ float to_acc<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_acc<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_acc(typename AccOf<T>::type x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename A> __device__ __forceinline__ A combine(A acc, A x, int op) {
  switch (op) {
    case kProduct: return acc * x;
    case kMin: return x < acc ? x : acc;
    case kMax: return x > acc ? x : acc;
    default: return acc + x;   // kSum, kAvg
  }
}

template <typename T> union Vec {
  static constexpr int N = 16 / sizeof(T);
  int4 raw;
  T e[N];
};

// Vector v of the tensor; elements past n read as zero (they never reach memory on the way out).
template <typename T> __device__ __forceinline__ Vec<T> load_data(const PeerArgs& a, long long v) {
  constexpr int N = Vec<T>::N;
  const T* base = static_cast<const T*>(a.data) + v * N;
  Vec<T> out;
  if ((v + 1) * N <= a.n) {
    out.raw = *reinterpret_cast<const int4*>(base);
  } else {
    out.raw = make_int4(0, 0, 0, 0);
    for (int j = 0; j < N && v * N + j < a.n; ++j) out.e[j] = base[j];
  }
  return out;
}
template <typename T> __device__ __forceinline__ void store_data(const PeerArgs& a, long long v, const Vec<T>& x) {
  constexpr int N = Vec<T>::N;
  T* base = static_cast<T*>(a.data) + v * N;
  if ((v + 1) * N <= a.n) {
    *reinterpret_cast<int4*>(base) = x.raw;
  } else {
    for (int j = 0; j < N && v * N + j < a.n; ++j) base[j] = x.e[j];
  }
}

// Slot `src` of kind/half `k` of block b in rank q's buffer, as 16-byte vectors.
__device__ __forceinline__ int4* slot_ptr(const PeerArgs& a, int q, int k, int src) {
  const long long idx = ((long long)blockIdx.x * 2 + k) * a.world + src;
  return reinterpret_cast<int4*>(a.bufs[q] + a.region + idx * a.slot_vecs * 16);
}

// Reduce element-wise over ranks 0..W-1 in order; rank `a.rank` contributes `mine`, the others `slots[q][i]`.
template <typename T>
__device__ __forceinline__ Vec<T> reduce_ranks(const PeerArgs& a, const Vec<T>& mine, int k, long long i) {
  using A = typename AccOf<T>::type;
  constexpr int N = Vec<T>::N;
  A acc[N];
  for (int q = 0; q < a.world; ++q) {
    Vec<T> x;
    if (q == a.rank) x = mine; else x.raw = __ldcg(slot_ptr(a, a.rank, k, q) + i);
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] = q == 0 ? to_acc<T>(x.e[j]) : combine<A>(acc[j], to_acc<T>(x.e[j]), a.op);
  }
  Vec<T> r;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (a.op == kAvg) acc[j] = acc[j] / static_cast<A>(a.world);
    r.e[j] = from_acc<T>(acc[j]);
  }
  return r;
}

// Push data vectors [first + p * shard_stride, + cnt) into slot (k, rank) of each peer p = rank+1, rank+2, ...
// visiting at most `window` peers per pass over the range (the throttle).
template <typename T>
__device__ __forceinline__ void push_range(const PeerArgs& a, long long first, long long cnt, int k,
                                           long long shard_stride, long long nv) {
  for (int j0 = 1; j0 < a.world; j0 += a.window) {
    const int j1 = min(j0 + a.window, a.world);
    for (long long i = threadIdx.x; i < cnt; i += (long long)kThreads * kUnroll) {
      for (int j = j0; j < j1; ++j) {   // the window's peers are interleaved, 32 KiB at a time
        const int p = (a.rank + j) % a.world;
        const long long src0 = first + p * shard_stride;
        int4* dst = slot_ptr(a, p, k, a.rank);
        Vec<T> x[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const long long ii = i + (long long)u * kThreads;
          if (ii < cnt && src0 + ii < nv) x[u] = load_data<T>(a, src0 + ii);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const long long ii = i + (long long)u * kThreads;
          if (ii < cnt && src0 + ii < nv) dst[ii] = x[u].raw;
        }
      }
    }
  }
}

template <typename T> __global__ void __launch_bounds__(kThreads) one_shot_kernel(const __grid_constant__ PeerArgs a) {
  __shared__ uint32_t s_epoch;
  const long long nv = (a.n + Vec<T>::N - 1) / Vec<T>::N;
  if (threadIdx.x == 0) s_epoch = __ldcg(counter_ptr(a.bufs[a.rank], kOneShot, blockIdx.x));
  __syncthreads();
  uint32_t epoch = s_epoch;
  for (long long first = blockIdx.x * a.chunk; first < nv; first += (long long)gridDim.x * a.chunk) {
    const long long cnt = min(a.chunk, nv - first);
    ++epoch;
    const int half = epoch & 1;
    push_range<T>(a, first, cnt, half, 0, nv);
    peer_barrier(a, kOneShot, epoch);
    for (long long i = threadIdx.x; i < cnt; i += kThreads) {
      store_data<T>(a, first + i, reduce_ranks<T>(a, load_data<T>(a, first + i), half, i));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter_ptr(a.bufs[a.rank], kOneShot, blockIdx.x) = epoch;
}

template <typename T> __global__ void __launch_bounds__(kThreads) two_shot_kernel(const __grid_constant__ PeerArgs a) {
  constexpr int kRS = 0, kAG = 1;
  __shared__ uint32_t s_epoch;
  const long long nv = (a.n + Vec<T>::N - 1) / Vec<T>::N;
  const long long sv = (nv + a.world - 1) / a.world;   // shard length in vectors
  if (threadIdx.x == 0) s_epoch = __ldcg(counter_ptr(a.bufs[a.rank], kTwoShot, blockIdx.x));
  __syncthreads();
  uint32_t epoch = s_epoch;
  for (long long first = blockIdx.x * a.chunk; first < sv; first += (long long)gridDim.x * a.chunk) {
    const long long cnt = min(a.chunk, sv - first);
    // reduce-scatter: shard p's chunk goes to peer p
    push_range<T>(a, first, cnt, kRS, sv, nv);
    peer_barrier(a, kTwoShot, ++epoch);
    // reduce my shard in rank order, write it, and push it to every peer's all-gather slot
    const long long mine0 = a.rank * sv + first;
    for (long long i = threadIdx.x; i < cnt && mine0 + i < nv; i += kThreads) {
      const Vec<T> r = reduce_ranks<T>(a, load_data<T>(a, mine0 + i), kRS, i);
      store_data<T>(a, mine0 + i, r);
      if (a.window >= a.world - 1) {
        for (int j = 1; j < a.world; ++j) slot_ptr(a, (a.rank + j) % a.world, kAG, a.rank)[i] = r.raw;
      }
    }
    if (a.window < a.world - 1) {
      __syncthreads();   // the pushes below read back what this block just wrote
      push_range<T>(a, mine0, min(cnt, nv - mine0), kAG, 0, nv);   // same source for every peer
    }
    peer_barrier(a, kTwoShot, ++epoch);
    // all-gather: copy the shards the peers reduced
    for (int j = 1; j < a.world; ++j) {
      const int p = (a.rank + j) % a.world;
      const long long src0 = p * sv + first;
      const int4* src = slot_ptr(a, a.rank, kAG, p);
      for (long long i = threadIdx.x; i < cnt; i += (long long)kThreads * kUnroll) {
        Vec<T> x[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const long long ii = i + (long long)u * kThreads;
          if (ii < cnt && src0 + ii < nv) x[u].raw = __ldcg(src + ii);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const long long ii = i + (long long)u * kThreads;
          if (ii < cnt && src0 + ii < nv) store_data<T>(a, src0 + ii, x[u]);
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter_ptr(a.bufs[a.rank], kTwoShot, blockIdx.x) = epoch;
}

// ---------------------------------------------------------------------------------------------------------
// one-shot, LL protocol: 8 payload bytes per 16-byte packet, flag = epoch in both halves.
template <typename T> union Unit {
  static constexpr int N = 8 / sizeof(T);
  uint2 raw;
  T e[N];
};

template <typename T> __device__ __forceinline__ Unit<T> load_unit(const PeerArgs& a, long long u) {
  constexpr int N = Unit<T>::N;
  const T* base = static_cast<const T*>(a.data) + u * N;
  Unit<T> out;
  if ((u + 1) * N <= a.n) {
    out.raw = *reinterpret_cast<const uint2*>(base);
  } else {
    out.raw = make_uint2(0, 0);
    for (int j = 0; j < N && u * N + j < a.n; ++j) out.e[j] = base[j];
  }
  return out;
}

__device__ __forceinline__ void st_volatile_v4(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint2 poll_packet(const PeerArgs& a, const uint4* p, uint32_t epoch, int src) {
  unsigned long long t0 = 0;
  while (true) {
    const uint4 v = ld_volatile_v4(p);
    if (v.y == epoch && v.w == epoch) return make_uint2(v.x, v.z);
    const unsigned long long now = global_timer_ns();
    if (t0 == 0) {
      t0 = now;
    } else if (now - t0 > a.timeout_ns) {
      printf("hpdl peer all-reduce (one_shot_ll): rank %d block %d timed out waiting for rank %d (epoch %u)\n",
             a.rank, blockIdx.x, src, epoch);
      __trap();
    }
  }
}

template <typename T> __global__ void __launch_bounds__(kThreads) one_shot_ll_kernel(const __grid_constant__ PeerArgs a) {
  using A = typename AccOf<T>::type;
  constexpr int N = Unit<T>::N;
  __shared__ uint32_t s_epoch;
  const long long nu = (a.n + N - 1) / N;
  if (threadIdx.x == 0) s_epoch = __ldcg(counter_ptr(a.bufs[a.rank], kOneShotLL, blockIdx.x));
  __syncthreads();
  uint32_t epoch = s_epoch;
  for (long long first = blockIdx.x * a.chunk; first < nu; first += (long long)gridDim.x * a.chunk) {
    const long long cnt = min(a.chunk, nu - first);
    if (++epoch == 0) epoch = 1;   // 0 is the initial content of the slots
    const int half = epoch & 1;
    // push: each thread sends its units to every peer (windows of k peers at a time)
    for (int j0 = 1; j0 < a.world; j0 += a.window) {
      const int j1 = min(j0 + a.window, a.world);
      for (long long i = threadIdx.x; i < cnt; i += kThreads) {
        const Unit<T> x = load_unit<T>(a, first + i);
        const uint4 pkt = make_uint4(x.raw.x, epoch, x.raw.y, epoch);
        for (int j = j0; j < j1; ++j) st_volatile_v4(reinterpret_cast<uint4*>(slot_ptr(a, (a.rank + j) % a.world, half, a.rank)) + i, pkt);
      }
    }
    // poll and reduce in rank order; a thread reads back only the units it pushed, so in place is safe
    for (long long i = threadIdx.x; i < cnt; i += kThreads) {
      const Unit<T> mine = load_unit<T>(a, first + i);
      A acc[N];
      for (int q = 0; q < a.world; ++q) {
        Unit<T> x;
        if (q == a.rank) x = mine; else x.raw = poll_packet(a, reinterpret_cast<const uint4*>(slot_ptr(a, a.rank, half, q)) + i, epoch, q);
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = q == 0 ? to_acc<T>(x.e[j]) : combine<A>(acc[j], to_acc<T>(x.e[j]), a.op);
      }
      const long long u = first + i;
      T* out = static_cast<T*>(a.data) + u * N;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (a.op == kAvg) acc[j] = acc[j] / static_cast<A>(a.world);
        if (u * N + j < a.n) out[j] = from_acc<T>(acc[j]);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter_ptr(a.bufs[a.rank], kOneShotLL, blockIdx.x) = epoch;
}

}  // namespace hpdl
