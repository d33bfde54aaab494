// Fused inf/nan check (MemAscend, arXiv 2505.23254, "overflow check"): one read-only pass over a
// floating-point buffer, no temporary proportional to it, early exit on the first inf/nan.
// Replaces DeepSpeed stage 3's has_overflow (torch.isinf(flat).any() then torch.isnan(flat).any(),
// a full-size bool mask each) and the _has_inf_or_nan variants on the offload path.
//
// Test on the raw bits, several elements per 64-bit word (SWAR): for a lane holding |x|'s bits
// (sign cleared), |x| is inf or nan iff its exponent is all ones iff |x| >= inf's bits, i.e.
// iff (|x| + (top_bit - inf_bits)) sets the lane's top bit. Lanes never carry into each other
// because |x| + bias < 2 * top_bit. OR-accumulating the sums over a block and testing the top
// bits once is branch-free and vectorizes with plain SSE2 / any SIMD ISA.
#pragma once

#include <cstdint>

namespace memascend {

enum class FloatKind : int { kF16 = 0, kBF16 = 1, kF32 = 2, kF64 = 3 };

struct LaneMasks {
  std::uint64_t abs;   // clears each lane's sign bit
  std::uint64_t bias;  // top_bit - inf_bits, per lane
  std::uint64_t top;   // each lane's top bit
  int elem_bytes;
};

LaneMasks lane_masks(FloatKind kind);

// True when any of the numel elements at data is +-inf or nan. data must be aligned to the
// element size. Runs on up to at::get_num_threads() threads for large buffers.
bool has_inf_or_nan_cpu(const void* data, std::int64_t numel, FloatKind kind);

}  // namespace memascend

// CUDA launcher (overflow_check_cuda.cu), plain C so the .cu needs no torch headers. Checks
// numel elements of kind at device pointer data on stream (a cudaStream_t), and sets *d_flag
// (device memory, zeroed by the caller) to 1 when one is inf/nan. Returns a cudaError_t.
extern "C" int memascend_launch_has_inf_or_nan(const void* data, std::int64_t numel, int kind,
                                               int* d_flag, void* stream);
