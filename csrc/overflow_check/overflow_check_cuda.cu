// CUDA fused inf/nan check: grid-stride over 64-bit words with the SWAR bit test of
// overflow_check.h, one flag written, early exit once any thread found an inf/nan.
// No torch headers: the binding passes raw pointers and the stream.
#include <cuda_runtime.h>

#include <cstdint>

#include "overflow_check.h"

namespace {

struct DeviceMasks {
  unsigned long long abs, bias, top;
  int elem_bytes;
};

__device__ __forceinline__ bool element_nonfinite(const unsigned char* p, const DeviceMasks& m) {
  unsigned long long w = 0;
  for (int i = 0; i < m.elem_bytes; ++i) w |= static_cast<unsigned long long>(p[i]) << (8 * i);
  return (((w & m.abs) + m.bias) & m.top) != 0;
}

// head_bytes/tail cover elements outside the 8-byte aligned word range; block 0 checks them.
__global__ void has_inf_or_nan_kernel(const unsigned char* __restrict__ bytes, long long head_bytes,
                                      long long num_words, long long total_bytes, DeviceMasks m,
                                      int* __restrict__ flag) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (long long off = 0; off < head_bytes; off += m.elem_bytes) {
      if (element_nonfinite(bytes + off, m)) *flag = 1;
    }
    for (long long off = head_bytes + num_words * 8; off < total_bytes; off += m.elem_bytes) {
      if (element_nonfinite(bytes + off, m)) *flag = 1;
    }
  }
  const auto* words = reinterpret_cast<const unsigned long long*>(bytes + head_bytes);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const volatile int* seen = flag;
  unsigned long long acc = 0;
  for (int step = 1; i < num_words; i += stride, ++step) {
    acc |= (__ldg(words + i) & m.abs) + m.bias;
    if ((step & 31) == 0) {  // every 32 words: publish, and stop if anyone found one
      if (acc & m.top) {
        *flag = 1;
        return;
      }
      if (*seen) return;
    }
  }
  if (acc & m.top) *flag = 1;
}

}  // namespace

extern "C" int memascend_launch_has_inf_or_nan(const void* data, std::int64_t numel, int kind,
                                               int* d_flag, void* stream) {
  if (numel <= 0) return static_cast<int>(cudaSuccess);
  const memascend::LaneMasks h = memascend::lane_masks(static_cast<memascend::FloatKind>(kind));
  const DeviceMasks m{h.abs, h.bias, h.top, h.elem_bytes};
  const auto addr = reinterpret_cast<std::uintptr_t>(data);
  const long long total_bytes = static_cast<long long>(numel) * h.elem_bytes;
  long long head_bytes = static_cast<long long>((8 - addr % 8) % 8);
  if (head_bytes > total_bytes) head_bytes = total_bytes;
  const long long num_words = (total_bytes - head_bytes) / 8;

  int device = 0;
  int sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  constexpr int kThreads = 256;
  long long blocks = (num_words + kThreads - 1) / kThreads;
  const long long max_blocks = static_cast<long long>(sms > 0 ? sms : 1) * 8;
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  has_inf_or_nan_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0,
                          static_cast<cudaStream_t>(stream)>>>(
      static_cast<const unsigned char*>(data), head_bytes, num_words, total_bytes, m, d_flag);
  return static_cast<int>(cudaGetLastError());
}
