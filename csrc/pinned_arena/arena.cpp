// Exact-size pinned host-memory arena; see arena.h.
#include "arena.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {

// Bytes by which growing the resident set by grow_bytes would raise the process's resident
// high-water mark (VmRSS + grow_bytes - VmHWM); grow_bytes where /proc/self/statm cannot be read.
std::size_t bytes_above_resident_peak(std::size_t grow_bytes) {
  unsigned long size_pages = 0, resident_pages = 0;
  FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return grow_bytes;
  const int read = std::fscanf(statm, "%lu %lu", &size_pages, &resident_pages);
  std::fclose(statm);
  struct rusage usage;
  if (read != 2 || getrusage(RUSAGE_SELF, &usage) != 0) return grow_bytes;
  const std::size_t rss_bytes = static_cast<std::size_t>(resident_pages) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t peak_bytes = static_cast<std::size_t>(usage.ru_maxrss) * 1024u;  // kilobytes on Linux
  return rss_bytes + grow_bytes > peak_bytes ? rss_bytes + grow_bytes - peak_bytes : 0;
}

}  // namespace

namespace memascend {
namespace {

constexpr unsigned int kCudaHostRegisterPortable = 1;  // pinned for every CUDA context

std::size_t round_up(std::size_t value, std::size_t align) {
  return (value + align - 1) / align * align;
}

// Reads "<key>: <number> kB" (or a bare count) from a /proc file; returns -1 if absent.
// C stdio, not iostreams: an extension linked with a static libstdc++ (a compiler wrapper adding
// -static-libstdc++, GCC 13) has iostream locale facets that are never initialised in this shared
// object, and the first `>>` segfaults (seen on an H200 host, 2026-11-26).
long long read_proc_field(const char* path, const std::string& key) {
  std::FILE* in = std::fopen(path, "re");
  if (in == nullptr) return -1;
  char line[512];
  long long value = -1;
  while (std::fgets(line, sizeof line, in) != nullptr) {
    if (std::strncmp(line, key.c_str(), key.size()) == 0 && line[key.size()] == ':') {
      char* end = nullptr;
      const long long parsed = std::strtoll(line + key.size() + 1, &end, 10);
      if (end != line + key.size() + 1) value = parsed;
      break;
    }
  }
  std::fclose(in);
  return value;
}

std::size_t hugepage_size_bytes() {
  const long long kib = read_proc_field("/proc/meminfo", "Hugepagesize");
  return kib > 0 ? static_cast<std::size_t>(kib) * 1024 : 0;
}

std::string format_limit(std::size_t bytes) {
  if (bytes == SIZE_MAX) return "unlimited";
  return std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 10) + " KiB)";
}

}  // namespace

const char* backing_name(Backing b) {
  switch (b) {
    case Backing::kHugetlb:
      return "hugetlb";
    case Backing::kTransparentHuge:
      return "thp";
    case Backing::kPages:
      return "pages";
  }
  return "unknown";
}

std::size_t hugetlb_free_bytes() {
  const long long free_pages = read_proc_field("/proc/meminfo", "HugePages_Free");
  const std::size_t page = hugepage_size_bytes();
  return free_pages > 0 ? static_cast<std::size_t>(free_pages) * page : 0;
}

std::size_t memlock_limit_bytes() {
  struct rlimit lim {};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  return static_cast<std::size_t>(lim.rlim_cur);
}

// ---------------------------------------------------------------------------------------------
// CudaHostRuntime

CudaHostRuntime::CudaHostRuntime() {
  // The CUDA runtime API is a C ABI: cudaError_t is an int-sized enum, so these pointer types
  // match the real declarations without needing cuda_runtime.h (absent from torch CPU builds).
  static const char* const kNames[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13"};
  // Prefer a libcudart the process already loaded (torch's), so both share one runtime.
  for (const char* name : kNames) {
    lib_ = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib_ != nullptr) break;
  }
  if (lib_ == nullptr) {
    for (const char* name : kNames) {
      lib_ = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib_ != nullptr) break;
    }
  }
  if (lib_ == nullptr) {
    status_ = "not available: no CUDA runtime (dlopen of libcudart.so, libcudart.so.12, libcudart.so.13 failed)";
    return;
  }
  get_device_count_ = reinterpret_cast<GetDeviceCountFn>(dlsym(lib_, "cudaGetDeviceCount"));
  host_register_ = reinterpret_cast<HostRegisterFn>(dlsym(lib_, "cudaHostRegister"));
  host_unregister_ = reinterpret_cast<HostUnregisterFn>(dlsym(lib_, "cudaHostUnregister"));
  get_error_string_ = reinterpret_cast<GetErrorStringFn>(dlsym(lib_, "cudaGetErrorString"));
  if (!get_device_count_ || !host_register_ || !host_unregister_ || !get_error_string_) {
    status_ = "not available: libcudart lacks cudaGetDeviceCount/cudaHostRegister/cudaHostUnregister";
    return;
  }
  int count = 0;
  const int err = get_device_count_(&count);
  if (err != 0) {
    status_ = "not available: cudaGetDeviceCount failed: " + error_text(err);
    return;
  }
  if (count <= 0) {
    status_ = "not available: no CUDA device";
    return;
  }
  available_ = true;
  status_ = "available: " + std::to_string(count) + " CUDA device(s)";
}

// libcudart is deliberately never dlclose'd: unloading a CUDA runtime that may have created
// contexts is unsafe, and the handle is shared with torch's copy when it was already loaded.
CudaHostRuntime::~CudaHostRuntime() = default;

std::string CudaHostRuntime::error_text(int code) const {
  std::string text = get_error_string_ ? get_error_string_(code) : "unknown error";
  return text + " (cudaError " + std::to_string(code) + ")";
}

std::string CudaHostRuntime::register_host(void* ptr, std::size_t bytes) {
  if (!available_) return status_;
  const int err = host_register_(ptr, bytes, kCudaHostRegisterPortable);
  return err == 0 ? std::string() : error_text(err);
}

void CudaHostRuntime::unregister_host(void* ptr) {
  if (available_) host_unregister_(ptr);
}

// ---------------------------------------------------------------------------------------------
// PinnedArena

PinnedArena::PinnedArena(const ArenaConfig& config) : config_(config) {
  if (config_.region_bytes == 0) throw std::invalid_argument("region_bytes must be > 0");
  config_.region_bytes = round_up(config_.region_bytes, kRegionAlignBytes);
}

PinnedArena::~PinnedArena() {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::size_t i = 0; i < regions_.size(); ++i) {
    if (regions_[i].info.bytes != 0) unmap_region_locked(i);
  }
}

std::size_t PinnedArena::map_region_locked(std::size_t bytes) {
  bytes = round_up(bytes, kRegionAlignBytes);
  void* base = MAP_FAILED;
  Backing backing = Backing::kPages;

  const std::size_t hp = hugepage_size_bytes();
  if (config_.enable_hugetlb && hp != 0 && bytes % hp == 0 && hugetlb_free_bytes() >= bytes) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_POPULATE, -1, 0);
    if (base != MAP_FAILED) backing = Backing::kHugetlb;
  }
  if (base == MAP_FAILED) {
    // Over-map by one hugepage and trim, so the region is 2 MiB aligned and THP can back it.
    const std::size_t span = bytes + kRegionAlignBytes;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      throw std::runtime_error("pinned arena: mmap of " + std::to_string(bytes) +
                               " bytes failed: " + std::strerror(errno));
    }
    const auto raw_addr = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = round_up(raw_addr, kRegionAlignBytes);
    if (aligned > raw_addr) munmap(raw, aligned - raw_addr);
    const std::uintptr_t tail = aligned + bytes;
    if (raw_addr + span > tail) munmap(reinterpret_cast<void*>(tail), raw_addr + span - tail);
    base = reinterpret_cast<void*>(aligned);
    if (config_.enable_thp && madvise(base, bytes, MADV_HUGEPAGE) == 0) {
      backing = Backing::kTransparentHuge;
    }
  }

  bool locked = backing == Backing::kHugetlb;  // hugetlb pages are never swapped out
  if (config_.enable_mlock) {
    if (mlock(base, bytes) != 0) {
      const int err = errno;
      munmap(base, bytes);
      const long long vmlck_kib = read_proc_field("/proc/self/status", "VmLck");
      throw std::runtime_error(
          "pinned arena: mlock of a " + std::to_string(bytes) + "-byte region failed (" + std::strerror(err) +
          "): the memlock limit (RLIMIT_MEMLOCK, `ulimit -l`) is " + format_limit(memlock_limit_bytes()) +
          ", the process already has " + std::to_string(vmlck_kib < 0 ? 0 : vmlck_kib) +
          " KiB locked, and the arena needs " + std::to_string(counters_.locked_bytes + bytes) +
          " bytes locked in total; raise the memlock limit (limits.conf 'memlock', systemd "
          "LimitMEMLOCK=, docker --ulimit memlock=-1) or grant CAP_IPC_LOCK");
    }
    locked = true;
  }

  bool registered = false;
  if (config_.enable_cuda_register && cuda_.available()) {
    const std::string err = cuda_.register_host(base, bytes);
    if (!err.empty()) {
      munmap(base, bytes);
      throw std::runtime_error("pinned arena: cudaHostRegister of " + std::to_string(bytes) +
                               " bytes failed: " + err);
    }
    registered = true;
  }

  Region region;
  region.info.base = reinterpret_cast<std::uintptr_t>(base);
  region.info.bytes = bytes;
  region.info.backing = backing;
  region.info.locked = locked;
  region.info.registered = registered;
  regions_.push_back(region);
  const std::size_t index = regions_.size() - 1;

  counters_.reserved_bytes += bytes;
  counters_.peak_reserved_bytes = std::max(counters_.peak_reserved_bytes, counters_.reserved_bytes);
  if (locked) counters_.locked_bytes += bytes;
  if (registered) counters_.registered_bytes += bytes;
  if (backing == Backing::kHugetlb) counters_.hugetlb_bytes += bytes;
  if (backing == Backing::kTransparentHuge) counters_.thp_bytes += bytes;
  ++counters_.num_regions;
  insert_free_locked(region.info.base, bytes, index);
  return index;
}

void PinnedArena::unmap_region_locked(std::size_t index) {
  Region& region = regions_[index];
  const RegionInfo info = region.info;
  // An empty region is exactly one free block spanning it.
  auto it = free_by_addr_.find(info.base);
  if (it != free_by_addr_.end()) erase_free_locked(it);
  void* base = reinterpret_cast<void*>(info.base);
  if (info.registered) cuda_.unregister_host(base);
  munmap(base, info.bytes);  // also unlocks

  counters_.reserved_bytes -= info.bytes;
  if (info.locked) counters_.locked_bytes -= info.bytes;
  if (info.registered) counters_.registered_bytes -= info.bytes;
  if (info.backing == Backing::kHugetlb) counters_.hugetlb_bytes -= info.bytes;
  if (info.backing == Backing::kTransparentHuge) counters_.thp_bytes -= info.bytes;
  --counters_.num_regions;
  region.info = RegionInfo{};
}

void PinnedArena::insert_free_locked(std::uintptr_t addr, std::size_t bytes, std::size_t region) {
  // Merge with the following block, then with the preceding one, within the same region.
  auto next = free_by_addr_.find(addr + bytes);
  if (next != free_by_addr_.end() && next->second.region == region) {
    bytes += next->second.bytes;
    erase_free_locked(next);
  }
  auto after = free_by_addr_.lower_bound(addr);
  if (after != free_by_addr_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second.bytes == addr && prev->second.region == region) {
      addr = prev->first;
      bytes += prev->second.bytes;
      erase_free_locked(prev);
    }
  }
  free_by_addr_.emplace(addr, FreeBlock{bytes, region});
  free_by_size_.emplace(bytes, addr);
}

void PinnedArena::erase_free_locked(std::map<std::uintptr_t, FreeBlock>::iterator it) {
  free_by_size_.erase({it->second.bytes, it->first});
  free_by_addr_.erase(it);
}

bool PinnedArena::region_is_empty_locked(std::size_t index) const {
  return regions_[index].info.bytes != 0 && regions_[index].live_allocations == 0;
}

std::uintptr_t PinnedArena::allocate(std::size_t bytes) {
  const std::size_t granted = round_up(std::max<std::size_t>(bytes, 1), kArenaAlignBytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw std::runtime_error("pinned arena: allocate() after close()");
  auto fit = free_by_size_.lower_bound({granted, 0});
  if (fit == free_by_size_.end()) {
    const std::size_t region_bytes = round_up(std::max(config_.region_bytes, granted), kRegionAlignBytes);
    if (config_.release_empty_before_growing) {
      const std::size_t release_bytes =
          config_.release_only_above_peak ? bytes_above_resident_peak(region_bytes) : region_bytes;
      if (release_bytes > 0) release_empty_regions_locked(release_bytes);
    }
    map_region_locked(region_bytes);
    fit = free_by_size_.lower_bound({granted, 0});
  }
  const std::uintptr_t addr = fit->second;
  auto block = free_by_addr_.find(addr);
  const FreeBlock taken = block->second;
  erase_free_locked(block);
  if (taken.bytes > granted) {
    free_by_addr_.emplace(addr + granted, FreeBlock{taken.bytes - granted, taken.region});
    free_by_size_.emplace(taken.bytes - granted, addr + granted);
  }
  live_.emplace(addr, Allocation{granted, bytes, taken.region});
  ++regions_[taken.region].live_allocations;
  counters_.requested_bytes += bytes;
  counters_.in_use_bytes += granted;
  counters_.peak_in_use_bytes = std::max(counters_.peak_in_use_bytes, counters_.in_use_bytes);
  ++counters_.num_allocations;
  return addr;
}

void PinnedArena::free(std::uintptr_t addr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    throw std::invalid_argument("pinned arena: free() of an address that is not a live allocation");
  }
  const Allocation alloc = it->second;
  live_.erase(it);
  counters_.requested_bytes -= alloc.requested_bytes;
  counters_.in_use_bytes -= alloc.granted_bytes;
  --counters_.num_allocations;
  --regions_[alloc.region].live_allocations;
  insert_free_locked(addr, alloc.granted_bytes, alloc.region);
  if (closed_ && region_is_empty_locked(alloc.region)) unmap_region_locked(alloc.region);
}

std::size_t PinnedArena::reserve(std::size_t bytes) {
  const std::size_t granted = round_up(std::max<std::size_t>(bytes, 1), kArenaAlignBytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw std::runtime_error("pinned arena: reserve() after close()");
  if (free_by_size_.lower_bound({granted, 0}) != free_by_size_.end()) return 0;
  const std::size_t index = map_region_locked(granted);
  return regions_[index].info.bytes;
}

std::size_t PinnedArena::release_empty_regions(std::size_t max_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  return release_empty_regions_locked(max_bytes);
}

std::size_t PinnedArena::release_empty_regions_locked(std::size_t max_bytes) {
  std::vector<std::pair<std::size_t, std::size_t>> empty;  // (bytes, index)
  for (std::size_t i = 0; i < regions_.size(); ++i) {
    if (region_is_empty_locked(i)) empty.emplace_back(regions_[i].info.bytes, i);
  }
  std::sort(empty.begin(), empty.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::size_t released = 0;
  for (const auto& [bytes, index] : empty) {
    if (released >= max_bytes) break;
    released += bytes;
    unmap_region_locked(index);
  }
  return released;
}

void PinnedArena::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  for (std::size_t i = 0; i < regions_.size(); ++i) {
    if (region_is_empty_locked(i)) unmap_region_locked(i);
  }
}

bool PinnedArena::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

bool PinnedArena::contains(std::uintptr_t addr, std::size_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Region& r : regions_) {
    if (r.info.bytes != 0 && addr >= r.info.base && addr - r.info.base <= r.info.bytes &&
        bytes <= r.info.bytes - (addr - r.info.base)) {
      return true;
    }
  }
  return false;
}

bool PinnedArena::is_live(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.count(addr) != 0;
}

std::size_t PinnedArena::requested_size(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  return it == live_.end() ? 0 : it->second.requested_bytes;
}

ArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats out = counters_;
  out.free_bytes = counters_.reserved_bytes - counters_.in_use_bytes;
  out.largest_free_bytes = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  out.num_free_blocks = free_by_addr_.size();
  return out;
}

std::vector<RegionInfo> PinnedArena::regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionInfo> out;
  for (const Region& r : regions_) {
    if (r.info.bytes != 0) out.push_back(r.info);
  }
  return out;
}

std::vector<std::pair<std::uintptr_t, std::size_t>> PinnedArena::free_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  out.reserve(free_by_addr_.size());
  for (const auto& [addr, block] : free_by_addr_) out.emplace_back(addr, block.bytes);
  return out;
}

}  // namespace memascend
