// Host block cache: torch's CPU allocator for large host tensors, served from an unlocked arena.
//
// MemAscend (arXiv 2505.23254) section 4, "eradicating fragmentation", allocator half. Torch's
// default CPU allocator (c10 DefaultCPUAllocator -> posix_memalign) hands every activation and
// gradient temporary to glibc malloc. Blocks over the mmap threshold are mapped and unmapped per
// tensor, so each training step faults the same memory in again (on a virtual machine with free
// page reporting each fault also makes the host back the page); blocks under it stay in glibc's
// arenas, which cannot return memory below the heap top, and fragment (see host_allocator.py).
//
// This allocator sits in front of the default one (c10::SetCPUAllocator): a request of at least
// `threshold_bytes` takes a best-fit block of a PinnedArena configured without mlock, CUDA
// registration or hugetlb (transparent hugepages on request); smaller requests go to the
// allocator it replaced. Freed blocks coalesce and keep their pages, so the next step's tensors
// of the same shapes reuse resident memory: no fault, no zeroing, and no glibc fragmentation.
// Only release_empty() gives pages back (regions without a live block).
//
// One process-wide instance, never destroyed: tensors allocated through it may outlive an
// uninstall, and their deleter must still find it.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "arena.h"
#include "cpu_allocator.h"

namespace memascend {
namespace {

class HostBlockCache final : public c10::Allocator {
 public:
  HostBlockCache(std::size_t threshold_bytes, std::size_t region_bytes, bool enable_thp)
      : threshold_bytes_(threshold_bytes), arena_(make_config(region_bytes, enable_thp)) {}

  c10::DataPtr allocate(std::size_t n) override {
    if (n < threshold_bytes_.load(std::memory_order_relaxed)) {
      c10::Allocator* fallback = fallback_.load(std::memory_order_acquire);
      return (fallback != nullptr ? fallback : c10::GetDefaultCPUAllocator())->allocate(n);
    }
    void* ptr = reinterpret_cast<void*>(arena_.allocate(n));
    served_allocations_.fetch_add(1, std::memory_order_relaxed);
    return {ptr, ptr, &HostBlockCache::deleter, c10::Device(c10::DeviceType::CPU)};
  }

  // ATen's raw_allocate/raw_deallocate (kernel workspaces) free through one function pointer for
  // every size, so the deleter tells a cache block from the replaced allocator's by address.
  c10::DeleterFnPtr raw_deleter() const override { return &HostBlockCache::deleter; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  static void deleter(void* ptr) {
    HostBlockCache* cache = instance();
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    if (cache->arena_.is_live(addr)) {
      try {
        cache->arena_.free(addr);
      } catch (...) {
        // Unreachable: addr is live until its deleter runs; a deleter must not throw.
      }
      return;
    }
    // A raw allocation the replaced allocator served (below the threshold).
    c10::Allocator* fallback = cache->fallback_.load(std::memory_order_acquire);
    c10::DeleterFnPtr fallback_deleter = fallback != nullptr ? fallback->raw_deleter() : nullptr;
    if (fallback_deleter != nullptr) fallback_deleter(ptr);
  }

  static HostBlockCache*& instance() {
    static HostBlockCache* cache = nullptr;
    return cache;
  }

  PinnedArena& arena() { return arena_; }
  std::atomic<c10::Allocator*>& fallback() { return fallback_; }
  std::atomic<std::size_t>& threshold_bytes() { return threshold_bytes_; }
  std::size_t served_allocations() const { return served_allocations_.load(std::memory_order_relaxed); }

 private:
  static ArenaConfig make_config(std::size_t region_bytes, bool enable_thp) {
    ArenaConfig config;
    config.region_bytes = region_bytes;
    config.enable_hugetlb = false;  // reserved hugepages are for the pinned arena
    config.enable_thp = enable_thp;
    config.enable_mlock = false;
    config.enable_cuda_register = false;
    config.release_empty_before_growing = true;  // idle regions of one phase make room for the next's
    config.release_only_above_peak = true;        // where the peak would grow, not below it
    return config;
  }

  std::atomic<std::size_t> threshold_bytes_;
  PinnedArena arena_;
  std::atomic<c10::Allocator*> fallback_{nullptr};
  std::atomic<std::size_t> served_allocations_{0};
};

std::mutex g_install_mu;
c10::Allocator* g_replaced = nullptr;  // the CPU allocator in force before install
uint8_t g_priority = 0;                // c10 keeps an allocator only if its priority is >= the current one

}  // namespace

bool install_host_block_cache(std::size_t threshold_bytes, std::size_t region_bytes, bool enable_thp) {
  if (threshold_bytes == 0) throw std::invalid_argument("host block cache: threshold_bytes must be > 0");
  std::lock_guard<std::mutex> lock(g_install_mu);
  HostBlockCache*& cache = HostBlockCache::instance();
  if (cache == nullptr) {
    cache = new HostBlockCache(threshold_bytes, region_bytes, enable_thp);  // lives for the process
    // A fork (DataLoader workers) while another thread holds the cache's lock would leave the
    // child's copy locked forever: hold it across fork() instead.
    pthread_atfork([] { HostBlockCache::instance()->arena().lock_for_fork(); },
                   [] { HostBlockCache::instance()->arena().unlock_after_fork(); },
                   [] { HostBlockCache::instance()->arena().unlock_after_fork(); });
  }  // else: the first install's region_bytes and enable_thp stay in force
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == cache) {
    cache->threshold_bytes().store(threshold_bytes);
    return false;
  }
  if (g_priority == 255) throw std::runtime_error("host block cache: installed too many times");
  g_replaced = current;
  cache->threshold_bytes().store(threshold_bytes);
  cache->fallback().store(current, std::memory_order_release);
  c10::SetCPUAllocator(cache, ++g_priority);
  return true;
}

bool uninstall_host_block_cache() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  HostBlockCache* cache = HostBlockCache::instance();
  if (cache == nullptr || c10::GetCPUAllocator() != cache) return false;
  if (g_priority == 255) throw std::runtime_error("host block cache: uninstalled too many times");
  c10::SetCPUAllocator(g_replaced, ++g_priority);
  return true;
}

bool host_block_cache_installed() {
  HostBlockCache* cache = HostBlockCache::instance();
  return cache != nullptr && c10::GetCPUAllocator() == cache;
}

bool host_block_cache_owns(std::uintptr_t address) {
  HostBlockCache* cache = HostBlockCache::instance();
  return cache != nullptr && cache->arena().is_live(address);
}

std::size_t host_block_cache_release_empty(std::size_t max_bytes) {
  HostBlockCache* cache = HostBlockCache::instance();
  return cache == nullptr ? 0 : cache->arena().release_empty_regions(max_bytes);
}

bool host_block_cache_stats(ArenaStats* stats, std::size_t* threshold_bytes, std::size_t* served) {
  HostBlockCache* cache = HostBlockCache::instance();
  if (cache == nullptr) return false;
  *stats = cache->arena().stats();
  *threshold_bytes = cache->threshold_bytes().load();
  *served = cache->served_allocations();
  return true;
}

}  // namespace memascend
