// Host block cache: torch's CPU allocator for large host tensors (logic in cpu_allocator.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "arena.h"

namespace memascend {

// Puts the host block cache in front of the current c10 CPU allocator: requests of at least
// threshold_bytes come from its unlocked arena (regions of region_bytes rounded to 2 MiB,
// MADV_HUGEPAGE when enable_thp), smaller ones from the allocator it replaces. Returns false when
// it was already installed (the threshold is updated). region_bytes and enable_thp of the
// process's first install stay in force. Throws std::invalid_argument for a zero threshold.
bool install_host_block_cache(std::size_t threshold_bytes, std::size_t region_bytes, bool enable_thp);
// Puts back the allocator the last install replaced; false when the cache was not in force.
// Blocks still alive return to the cache when freed.
bool uninstall_host_block_cache();
bool host_block_cache_installed();
// True when address starts a live block of the cache.
bool host_block_cache_owns(std::uintptr_t address);
// Unmaps the cache's regions that hold no live block, largest first, until at least max_bytes
// are released (SIZE_MAX: all). Returns the bytes released.
std::size_t host_block_cache_release_empty(std::size_t max_bytes);
// Fills the arena counters, the threshold and the number of blocks served; false before the
// first install.
bool host_block_cache_stats(ArenaStats* stats, std::size_t* threshold_bytes, std::size_t* served);

}  // namespace memascend
