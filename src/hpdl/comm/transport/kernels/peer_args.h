// Constants and the kernel argument block shared by the CUDA kernels and the host binding (plain C++).
#pragma once

namespace hpdl {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 256;   // flag slots per algorithm
constexpr int kThreads = 512;

enum Op : int { kSum = 0, kAvg = 1, kMin = 2, kMax = 3, kProduct = 4 };
enum Algo : int { kOneShot = 0, kTwoShot = 1, kOneShotLL = 2 };
constexpr int kNumAlgos = 3;

// Flag area at the start of every rank's buffer (offsets in bytes):
//   flags   uint32[2][kMaxBlocks][kMaxRanks]  written by peers
//   counter uint32[kNumAlgos][kMaxBlocks]     this rank's epoch per block
constexpr long long kFlagsBytes = 2LL * kMaxBlocks * kMaxRanks * 4;
constexpr long long kHeaderBytes = 64 * 1024;

struct PeerArgs {
  char* bufs[kMaxRanks];   // base of each rank's registered buffer, mapped in this process
  void* data;              // the tensor, 16-byte aligned, reduced in place
  long long n;             // elements
  long long chunk;         // vectors per block per round (<= slot_vecs)
  long long slot_vecs;     // capacity of one slot, in 16-byte vectors
  long long region;        // byte offset of this algorithm's data region
  unsigned long long timeout_ns;
  int rank, world, window, op;
};


enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kI64 = 4 };

// ---- all-to-all (peer_alltoall.cuh) ----
enum A2AAlgo : int { kPush = 0, kPull = 1 };
constexpr int kNumA2AAlgos = 2;
// Header of the all-to-all buffer: flags u32[algo][block][src], then epochs u32[algo][block][peer].
constexpr long long kA2AFlagsBytes = (long long)kNumA2AAlgos * kMaxBlocks * kMaxRanks * 4;

struct A2AArgs {
  char* bufs[kMaxRanks];
  const char* src;
  char* dst;
  long long send_off[kMaxRanks], send_len[kMaxRanks], recv_off[kMaxRanks], recv_len[kMaxRanks];
  long long chunk[kMaxRanks];   // bytes per block per round of pair (me, p); multiple of 16
  long long slot_bytes;         // capacity of one slot (>= every chunk)
  long long region;             // byte offset of the slots in each buffer
  unsigned long long timeout_ns;
  int rank, world, window;
};

}  // namespace hpdl
