// All-to-all over peer (NVLink) memory on one node: PUSH and PULL through a persistent shared buffer.
//
// Torch-free like peer_allreduce.cuh. The schedule is the one hpdl.comm.algorithms.peer_alltoall.
// reference_all_to_all runs on CPU tensors in CI.
//
// Layout: per peer p, this rank sends send_len[p] bytes from src + send_off[p] and receives recv_len[p] bytes
// into dst + recv_off[p] (torch's all_to_all_single, uneven splits allowed). The pair (r, p) moves
// P = max(send_len, recv_len) in rounds: in round i, block b handles bytes [(i * grid + l) * chunk_p, + chunk_p)
// of the pair, where l = (b - me - p) mod grid is the block's lane in that pair (pair_lane). chunk_p depends
// only on P, which both ends of the pair know, so the two ends run the same rounds without exchanging
// anything; a zero-length pair never synchronises at all. PUSH and PULL share the slots (their epochs and
// flags are separate); calls on one communicator must be stream-ordered on each rank.
//   PUSH, per round: copy my bytes for p into slot[block][half][src = me] of p's buffer (NVLink store);
//     pair barrier with p; copy slot[block][half][src = p] of my buffer into dst (local).
//   PULL, per round: copy my bytes for p into slot[block][half][dst = p] of my own buffer (local);
//     pair barrier with p; read slot[block][half][dst = me] of p's buffer into dst (NVLink load).
// My own block (p = me) is copied src -> dst in the same rounds (its own chunk), between the outgoing stores and
// the barrier, so the local copy overlaps the NVLink traffic; it needs no buffer and no barrier.
//
// Synchronisation is per (block, pair): the block's thread p stores the pair's epoch into flag[algo][block][me]
// of p's buffer (st.release.sys after __syncthreads) and spins with ld.acquire.sys on flag[algo][block][p] of
// its own. Epochs live in device memory per (algo, block, peer), so calls and CUDA-graph replays keep
// counting. Halves alternate by the pair's epoch parity: a rank writes a half again two pair rounds later,
// after the pair barrier in between, which its peer reaches only when it has read that half.
// A wait longer than timeout_ns prints the rank that did not answer and traps.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "peer_args.h"
#include "peer_sync.cuh"

namespace hpdl {

constexpr int kA2AUnroll = 4;

__device__ __forceinline__ uint32_t* a2a_flag(char* buf, int algo, int block, int src) {
  return reinterpret_cast<uint32_t*>(buf) + ((long long)algo * kMaxBlocks + block) * kMaxRanks + src;
}
__device__ __forceinline__ uint32_t* a2a_epoch(char* buf, int algo, int block, int peer) {
  return reinterpret_cast<uint32_t*>(buf + kA2AFlagsBytes) + ((long long)algo * kMaxBlocks + block) * kMaxRanks + peer;
}
__device__ __forceinline__ char* a2a_slot(const A2AArgs& a, int q, int half, int idx) {
  return a.bufs[q] + a.region + (((long long)blockIdx.x * 2 + half) * a.world + idx) * a.slot_bytes;
}
// Copy n units of V; `cg` loads bypass L1 (slots written by another GPU).
template <typename V, bool CG>
__device__ __forceinline__ void copy_units(V* __restrict__ dst, const V* __restrict__ src, long long n) {
  for (long long i = threadIdx.x; i < n; i += (long long)kThreads * kA2AUnroll) {
    V x[kA2AUnroll];
#pragma unroll
    for (int u = 0; u < kA2AUnroll; ++u) {
      const long long j = i + (long long)u * kThreads;
      if (j < n) x[u] = CG ? __ldcg(src + j) : src[j];
    }
#pragma unroll
    for (int u = 0; u < kA2AUnroll; ++u) {
      const long long j = i + (long long)u * kThreads;
      if (j < n) dst[j] = x[u];
    }
  }
}

// Barrier of this block with every peer whose bit is set in `mask`, at that pair's epoch.
__device__ __forceinline__ void pair_barrier(const A2AArgs& a, int algo, unsigned mask, const uint32_t* epoch) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < a.world && ((mask >> t) & 1u)) {
    st_release_sys(a2a_flag(a.bufs[t], algo, blockIdx.x, a.rank), epoch[t]);
    const uint32_t* mine = a2a_flag(a.bufs[a.rank], algo, blockIdx.x, t);
    const unsigned long long t0 = global_timer_ns();
    while (static_cast<int>(ld_acquire_sys(mine) - epoch[t]) < 0) {
      if (global_timer_ns() - t0 > a.timeout_ns) {
        printf("hpdl peer all_to_all: rank %d block %d timed out waiting for rank %d (epoch %u)\n", a.rank,
               blockIdx.x, t, epoch[t]);
        __trap();
      }
    }
  }
  __syncthreads();
}

// Pair (me, p)'s chunk index c runs on block (c + me + p) % G: both ends compute the same block, and small
// messages of different pairs land on different blocks. Returns this block's slot in the pair's sequence.
__device__ __forceinline__ long long pair_lane(int me, int p, int b, int G) {
  return ((b - (me + p) % G) % G + G) % G;
}

__device__ __forceinline__ long long clamp_len(long long len, long long pos, long long chunk) {
  const long long left = len - pos;
  return left <= 0 ? 0 : (left < chunk ? left : chunk);
}

template <typename V, int ALGO>
__global__ void __launch_bounds__(kThreads) peer_all_to_all_kernel(const __grid_constant__ A2AArgs a) {
  constexpr int U = sizeof(V);
  __shared__ uint32_t s_epoch[kMaxRanks];
  const int me = a.rank, W = a.world, G = gridDim.x, b = blockIdx.x;
  if (threadIdx.x < W) s_epoch[threadIdx.x] = __ldcg(a2a_epoch(a.bufs[me], ALGO, b, threadIdx.x));
  long long rounds = 0;   // rounds this block takes part in, over all its pairs
  for (int p = 0; p < W; ++p) {   // p == me: my own block, copied in the same rounds (no buffer, no barrier)
    const long long P = a.send_len[p] > a.recv_len[p] ? a.send_len[p] : a.recv_len[p];
    const long long units = (P + a.chunk[p] - 1) / a.chunk[p];   // block-rounds of the pair
    const long long lane = pair_lane(me, p, b, G);
    const long long mine = units > lane ? (units - lane + G - 1) / G : 0;
    rounds = mine > rounds ? mine : rounds;
  }
  __syncthreads();
  for (long long i = 0; i < rounds; ++i) {
    __syncthreads();   // every thread is done with the previous round's halves before the epochs move
    unsigned mask = 0;
    for (int p = 0; p < W; ++p) {
      const long long P = a.send_len[p] > a.recv_len[p] ? a.send_len[p] : a.recv_len[p];
      if (p != me && (i * G + pair_lane(me, p, b, G)) * a.chunk[p] < P) mask |= 1u << p;
    }
    if (threadIdx.x < W && ((mask >> threadIdx.x) & 1u)) ++s_epoch[threadIdx.x];
    __syncthreads();
    // outgoing: peers in windows of k starting at me + 1 (the throttle), one peer at a time within the block
    for (int j = 1; j < W; ++j) {
      const int p = (me + j) % W;
      if (!((mask >> p) & 1u)) continue;
      const long long pos = (i * G + pair_lane(me, p, b, G)) * a.chunk[p];
      const long long n = clamp_len(a.send_len[p], pos, a.chunk[p]) / U;
      const int half = s_epoch[p] & 1;
      char* slot = ALGO == kPush ? a2a_slot(a, p, half, me) : a2a_slot(a, me, half, p);
      copy_units<V, false>(reinterpret_cast<V*>(slot), reinterpret_cast<const V*>(a.src + a.send_off[p] + pos), n);
      if (a.window < W - 1 && j % a.window == 0) __syncthreads();   // finish this window before the next
    }
    {   // my own block's chunk of this round, while the stores above drain over NVLink
      const long long pos = (i * G + pair_lane(me, me, b, G)) * a.chunk[me];
      const long long n = clamp_len(a.send_len[me], pos, a.chunk[me]) / U;
      copy_units<V, false>(reinterpret_cast<V*>(a.dst + a.recv_off[me] + pos),
                           reinterpret_cast<const V*>(a.src + a.send_off[me] + pos), n);
    }
    pair_barrier(a, ALGO, mask, s_epoch);
    // incoming
    for (int j = 1; j < W; ++j) {
      const int p = (me - j + W) % W;
      if (!((mask >> p) & 1u)) continue;
      const long long pos = (i * G + pair_lane(me, p, b, G)) * a.chunk[p];
      const long long n = clamp_len(a.recv_len[p], pos, a.chunk[p]) / U;
      const int half = s_epoch[p] & 1;
      const char* slot = ALGO == kPush ? a2a_slot(a, me, half, p) : a2a_slot(a, p, half, me);
      copy_units<V, true>(reinterpret_cast<V*>(a.dst + a.recv_off[p] + pos), reinterpret_cast<const V*>(slot), n);
    }
  }
  __syncthreads();
  if (threadIdx.x < W) *a2a_epoch(a.bufs[me], ALGO, b, threadIdx.x) = s_epoch[threadIdx.x];
}

}  // namespace hpdl
