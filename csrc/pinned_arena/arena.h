// Exact-size pinned host-memory arena (MemAscend, arXiv 2505.23254, "pinned memory" section).
//
// A few large regions are mapped (hugetlbfs pages when reserved, else transparent hugepages,
// else plain pages), mlocked, registered once with CUDA when a CUDA runtime is present, and
// sub-allocated with 4 KiB granularity (O_DIRECT alignment) by a best-fit free list with
// coalescing. It replaces torch's CachingHostAllocator, which rounds every pinned block up to a
// power of two (pytorch #95823, #150517), and DeepSpeed's per-tensor posix_memalign+mlock.
//
// No torch dependency: the pybind layer (bindings.cpp) wraps addresses into tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace memascend {

constexpr std::size_t kArenaAlignBytes = 4096;            // O_DIRECT block alignment
constexpr std::size_t kRegionAlignBytes = 2u << 20;       // 2 MiB: hugepage size on x86-64

// How a region's pages are backed.
enum class Backing : int { kHugetlb = 0, kTransparentHuge = 1, kPages = 2 };

const char* backing_name(Backing b);

struct ArenaConfig {
  std::size_t region_bytes = 64u << 20;  // size of a region created on demand (rounded to 2 MiB)
  bool enable_hugetlb = true;            // use MAP_HUGETLB when HugePages_Free covers the region
  bool enable_thp = true;                // madvise(MADV_HUGEPAGE) otherwise
  bool enable_mlock = true;              // lock every region (fails loudly if the limit is low)
  bool enable_cuda_register = true;      // cudaHostRegister each region when CUDA is usable
  // Before mapping a new region, unmap regions without a live allocation, largest first, until
  // as many bytes as the new region are released: a request that fits no free block then
  // replaces idle memory instead of adding to it (the host block cache; MemAscend section 4,
  // "eradicating fragmentation").
  bool release_empty_before_growing = false;
  // With release_empty_before_growing: release only the bytes by which the new region would raise
  // the process's resident high-water mark (VmRSS + region - VmHWM, from /proc/self/statm and
  // getrusage's ru_maxrss), none while it fits under the peak an earlier phase reached. The regions
  // of every phase then stay mapped up to that peak and later steps reuse their resident pages
  // instead of faulting them in again; the peak itself is what it would have been.
  bool release_only_above_peak = false;
};

struct ArenaStats {
  std::size_t requested_bytes = 0;      // sum of the exact sizes asked for by live allocations
  std::size_t in_use_bytes = 0;         // bytes held by live allocations (4 KiB granules)
  std::size_t peak_in_use_bytes = 0;    // high-water mark of in_use_bytes
  std::size_t reserved_bytes = 0;       // bytes mapped in regions
  std::size_t peak_reserved_bytes = 0;  // high-water mark of reserved_bytes
  std::size_t locked_bytes = 0;         // bytes of regions locked in RAM (mlock or hugetlb)
  std::size_t registered_bytes = 0;     // bytes of regions registered with cudaHostRegister
  std::size_t hugetlb_bytes = 0;        // bytes of regions backed by hugetlbfs pages
  std::size_t thp_bytes = 0;            // bytes of regions advised MADV_HUGEPAGE
  std::size_t free_bytes = 0;           // reserved_bytes - in_use_bytes
  std::size_t largest_free_bytes = 0;   // largest free block
  std::size_t num_regions = 0;
  std::size_t num_allocations = 0;
  std::size_t num_free_blocks = 0;
};

struct RegionInfo {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  Backing backing = Backing::kPages;
  bool locked = false;
  bool registered = false;
};

// cudaHostRegister/cudaHostUnregister through a libcudart loaded at run time (dlopen), so one
// build serves CPU-only and GPU hosts. A libcudart already loaded by the process (torch's) wins.
class CudaHostRuntime {
 public:
  CudaHostRuntime();
  ~CudaHostRuntime();
  CudaHostRuntime(const CudaHostRuntime&) = delete;
  CudaHostRuntime& operator=(const CudaHostRuntime&) = delete;

  bool available() const { return available_; }
  // "available: <lib>, N device(s)" or "not available: <why>".
  const std::string& status() const { return status_; }
  // Returns an empty string on success, else the CUDA error text.
  std::string register_host(void* ptr, std::size_t bytes);
  void unregister_host(void* ptr);

 private:
  using GetDeviceCountFn = int (*)(int*);
  using HostRegisterFn = int (*)(void*, std::size_t, unsigned int);
  using HostUnregisterFn = int (*)(void*);
  using GetErrorStringFn = const char* (*)(int);

  std::string error_text(int code) const;

  void* lib_ = nullptr;
  GetDeviceCountFn get_device_count_ = nullptr;
  HostRegisterFn host_register_ = nullptr;
  HostUnregisterFn host_unregister_ = nullptr;
  GetErrorStringFn get_error_string_ = nullptr;
  bool available_ = false;
  std::string status_;
};

class PinnedArena {
 public:
  explicit PinnedArena(const ArenaConfig& config);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // Returns the address of a block of at least `bytes` (rounded up to 4 KiB), 4 KiB aligned.
  // Grows by a new region when no free block fits. Throws std::runtime_error when mapping or
  // locking fails (the message names the memlock limit and the bytes needed) or when closed.
  std::uintptr_t allocate(std::size_t bytes);
  // Returns a block to the free list, coalescing with free neighbours. Throws
  // std::invalid_argument for an address that is not a live allocation.
  void free(std::uintptr_t addr);
  // Makes sure a free block of at least `bytes` exists, mapping one region of exactly
  // round_up(bytes, 2 MiB) if needed. Returns the bytes newly reserved (0 if none).
  std::size_t reserve(std::size_t bytes);
  // Unmaps regions with no live allocation, largest first, until at least max_bytes are released
  // (SIZE_MAX: all of them). Returns the bytes released.
  std::size_t release_empty_regions(std::size_t max_bytes = SIZE_MAX);
  // Stops new allocations; regions are unmapped as soon as they hold no live allocation.
  void close();

  bool closed() const;
  // True when [addr, addr + bytes) lies inside one region of this arena.
  bool contains(std::uintptr_t addr, std::size_t bytes) const;
  // True when addr is the start of a live allocation of this arena.
  bool is_live(std::uintptr_t addr) const;
  // Exact bytes requested for the live allocation at addr (0 if none).
  std::size_t requested_size(std::uintptr_t addr) const;
  ArenaStats stats() const;
  std::vector<RegionInfo> regions() const;
  // Free blocks as (address, bytes), ordered by address.
  std::vector<std::pair<std::uintptr_t, std::size_t>> free_blocks() const;
  const ArenaConfig& config() const { return config_; }
  // pthread_atfork handlers: hold the arena's lock across fork() so a child never inherits it
  // locked by a thread that does not exist there. Called in the forking thread only.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }
  const std::string& cuda_status() const { return cuda_.status(); }

 private:
  struct Region {
    RegionInfo info;
    std::size_t live_allocations = 0;
  };
  struct FreeBlock {
    std::size_t bytes;
    std::size_t region;  // index into regions_ (blocks of different regions never merge)
  };
  struct Allocation {
    std::size_t granted_bytes;
    std::size_t requested_bytes;
    std::size_t region;
  };

  // All private helpers expect mu_ to be held.
  std::size_t map_region_locked(std::size_t bytes);
  void unmap_region_locked(std::size_t index);
  void insert_free_locked(std::uintptr_t addr, std::size_t bytes, std::size_t region);
  void erase_free_locked(std::map<std::uintptr_t, FreeBlock>::iterator it);
  bool region_is_empty_locked(std::size_t index) const;
  std::size_t release_empty_regions_locked(std::size_t max_bytes);

  ArenaConfig config_;
  CudaHostRuntime cuda_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::vector<Region> regions_;  // unmapped regions keep their slot with bytes == 0
  std::map<std::uintptr_t, FreeBlock> free_by_addr_;
  std::set<std::pair<std::size_t, std::uintptr_t>> free_by_size_;  // best fit: (bytes, addr)
  std::map<std::uintptr_t, Allocation> live_;
  ArenaStats counters_;  // requested/in_use/peak/reserved/locked/registered/... kept current
};

// Bytes of HugePages_Free x Hugepagesize from /proc/meminfo (0 if unreadable).
std::size_t hugetlb_free_bytes();
// RLIMIT_MEMLOCK soft limit in bytes (SIZE_MAX when unlimited).
std::size_t memlock_limit_bytes();

}  // namespace memascend
