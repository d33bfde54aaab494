// CPU fused inf/nan check; see overflow_check.h for the bit trick.
#include "overflow_check.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <stdexcept>

namespace memascend {
namespace {

constexpr std::int64_t kBlockWords = 2048;      // 16 KiB between early-exit checks
constexpr std::int64_t kGrainWords = 1 << 16;   // 512 KiB: below this, one thread

// Branch-free OR-accumulation over a block; the compiler vectorizes this loop.
inline bool words_nonfinite(const std::uint64_t* words, std::int64_t n, const LaneMasks& m) {
  std::uint64_t acc = 0;
  for (std::int64_t i = 0; i < n; ++i) acc |= (words[i] & m.abs) + m.bias;
  return (acc & m.top) != 0;
}

// One element, zero-extended into a word: the upper lanes hold 0 and stay below their top bit.
inline bool element_nonfinite(const unsigned char* p, const LaneMasks& m) {
  std::uint64_t w = 0;
  std::memcpy(&w, p, static_cast<std::size_t>(m.elem_bytes));
  return (((w & m.abs) + m.bias) & m.top) != 0;
}

}  // namespace

LaneMasks lane_masks(FloatKind kind) {
  switch (kind) {
    case FloatKind::kF16:  // inf = 0x7C00
      return {0x7FFF7FFF7FFF7FFFull, 0x0400040004000400ull, 0x8000800080008000ull, 2};
    case FloatKind::kBF16:  // inf = 0x7F80
      return {0x7FFF7FFF7FFF7FFFull, 0x0080008000800080ull, 0x8000800080008000ull, 2};
    case FloatKind::kF32:  // inf = 0x7F800000
      return {0x7FFFFFFF7FFFFFFFull, 0x0080000000800000ull, 0x8000000080000000ull, 4};
    case FloatKind::kF64:  // inf = 0x7FF0000000000000
      return {0x7FFFFFFFFFFFFFFFull, 0x0010000000000000ull, 0x8000000000000000ull, 8};
  }
  throw std::invalid_argument("unknown FloatKind");
}

bool has_inf_or_nan_cpu(const void* data, std::int64_t numel, FloatKind kind) {
  if (numel <= 0) return false;
  const LaneMasks m = lane_masks(kind);
  const auto* bytes = static_cast<const unsigned char*>(data);
  const auto addr = reinterpret_cast<std::uintptr_t>(data);
  if (addr % static_cast<std::uintptr_t>(m.elem_bytes) != 0) {
    throw std::invalid_argument("has_inf_or_nan: data is not aligned to its element size");
  }
  const std::int64_t total_bytes = numel * m.elem_bytes;
  // Head: elements before the first 8-byte boundary; tail: elements after the last one.
  std::int64_t head_bytes = static_cast<std::int64_t>((8 - addr % 8) % 8);
  if (head_bytes > total_bytes) head_bytes = total_bytes;
  for (std::int64_t off = 0; off < head_bytes; off += m.elem_bytes) {
    if (element_nonfinite(bytes + off, m)) return true;
  }
  const std::int64_t num_words = (total_bytes - head_bytes) / 8;
  const std::int64_t tail_start = head_bytes + num_words * 8;
  for (std::int64_t off = tail_start; off < total_bytes; off += m.elem_bytes) {
    if (element_nonfinite(bytes + off, m)) return true;
  }
  if (num_words == 0) return false;

  const auto* words = reinterpret_cast<const std::uint64_t*>(bytes + head_bytes);
  std::atomic<bool> found{false};
  at::parallel_for(0, num_words, kGrainWords, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t b = begin; b < end; b += kBlockWords) {
      if (found.load(std::memory_order_relaxed)) return;
      const std::int64_t n = end - b < kBlockWords ? end - b : kBlockWords;
      if (words_nonfinite(words + b, n, m)) {
        found.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  return found.load();
}

}  // namespace memascend
