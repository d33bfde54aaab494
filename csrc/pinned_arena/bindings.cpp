// pybind11 bindings of the pinned arena (logic in arena.cpp). Tensors handed out hold a
// shared_ptr to the arena in their deleter: the block returns to the free list when the last
// tensor viewing it dies, and the arena outlives every tensor it backs.
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <stdexcept>

#include "arena.h"
#include "cpu_allocator.h"

namespace py = pybind11;
using memascend::ArenaConfig;
using memascend::ArenaStats;
using memascend::PinnedArena;
using memascend::RegionInfo;

namespace {

std::shared_ptr<PinnedArena> make_arena(std::size_t region_bytes, bool enable_hugetlb, bool enable_thp,
                                        bool enable_mlock, bool enable_cuda_register,
                                        bool release_empty_before_growing) {
  ArenaConfig config;
  config.region_bytes = region_bytes;
  config.enable_hugetlb = enable_hugetlb;
  config.enable_thp = enable_thp;
  config.enable_mlock = enable_mlock;
  config.enable_cuda_register = enable_cuda_register;
  config.release_empty_before_growing = release_empty_before_growing;
  return std::make_shared<PinnedArena>(config);
}

torch::Tensor allocate_tensor(const std::shared_ptr<PinnedArena>& arena, int64_t numel, at::ScalarType dtype) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  std::uintptr_t addr = 0;
  {
    py::gil_scoped_release no_gil;  // a new region may mmap+mlock GiBs
    addr = arena->allocate(bytes);
  }
  std::shared_ptr<PinnedArena> keep = arena;
  auto deleter = [keep, addr](void*) {
    try {
      keep->free(addr);
    } catch (...) {
      // Unreachable: addr is live until this deleter runs; a destructor must not throw.
    }
  };
  try {
    return torch::from_blob(reinterpret_cast<void*>(addr), {numel}, deleter,
                            torch::TensorOptions().dtype(dtype).device(torch::kCPU));
  } catch (...) {
    arena->free(addr);
    throw;
  }
}

py::dict stats_dict_of(const ArenaStats& s) {
  py::dict d;
  d["requested_bytes"] = s.requested_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["locked_bytes"] = s.locked_bytes;
  d["registered_bytes"] = s.registered_bytes;
  d["hugetlb_bytes"] = s.hugetlb_bytes;
  d["thp_bytes"] = s.thp_bytes;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_bytes"] = s.largest_free_bytes;
  d["num_regions"] = s.num_regions;
  d["num_allocations"] = s.num_allocations;
  d["num_free_blocks"] = s.num_free_blocks;
  return d;
}

py::dict stats_dict(const PinnedArena& arena) { return stats_dict_of(arena.stats()); }

py::object host_block_cache_stats_dict() {
  ArenaStats s;
  std::size_t threshold_bytes = 0;
  std::size_t served = 0;
  if (!memascend::host_block_cache_stats(&s, &threshold_bytes, &served)) return py::none();
  py::dict d = stats_dict_of(s);
  d["threshold_bytes"] = threshold_bytes;
  d["num_served"] = served;
  d["installed"] = memascend::host_block_cache_installed();
  return d;
}

py::list regions_list(const PinnedArena& arena) {
  py::list out;
  for (const RegionInfo& r : arena.regions()) {
    py::dict d;
    d["base"] = r.base;
    d["bytes"] = r.bytes;
    d["backing"] = memascend::backing_name(r.backing);
    d["locked"] = r.locked;
    d["registered"] = r.registered;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Exact-size pinned host-memory arena (memascend csrc/pinned_arena)";
  m.attr("ALIGN_BYTES") = memascend::kArenaAlignBytes;
  m.attr("REGION_ALIGN_BYTES") = memascend::kRegionAlignBytes;
  m.def("hugetlb_free_bytes", &memascend::hugetlb_free_bytes,
        "HugePages_Free x Hugepagesize from /proc/meminfo, in bytes.");
  m.def("memlock_limit_bytes", &memascend::memlock_limit_bytes,
        "RLIMIT_MEMLOCK soft limit in bytes (SIZE_MAX when unlimited).");

  m.def("install_host_block_cache", &memascend::install_host_block_cache, py::arg("threshold_bytes"),
        py::arg("region_bytes"), py::arg("enable_thp"),
        "Puts the host block cache in front of torch's CPU allocator; False if already installed.");
  m.def("uninstall_host_block_cache", &memascend::uninstall_host_block_cache,
        "Puts back the CPU allocator the cache replaced; False if it was not in force.");
  m.def("host_block_cache_installed", &memascend::host_block_cache_installed);
  m.def("host_block_cache_owns", &memascend::host_block_cache_owns, py::arg("address"),
        "True when address starts a live block of the host block cache.");
  m.def("host_block_cache_release_empty", &memascend::host_block_cache_release_empty,
        py::arg("max_bytes") = SIZE_MAX,
        "Unmaps the cache's regions without a live block, largest first, until max_bytes are released; "
        "returns the bytes released.");
  m.def("host_block_cache_stats", &host_block_cache_stats_dict,
        "Arena counters of the host block cache plus threshold_bytes, num_served, installed; None before install.");

  py::class_<PinnedArena, std::shared_ptr<PinnedArena>>(m, "Arena")
      .def(py::init(&make_arena), py::arg("region_bytes"), py::arg("enable_hugetlb") = true,
           py::arg("enable_thp") = true, py::arg("enable_mlock") = true,
           py::arg("enable_cuda_register") = true, py::arg("release_empty_before_growing") = false,
           "Creates an empty arena; regions of region_bytes (rounded up to 2 MiB) are mapped on demand.")
      .def("allocate_tensor", &allocate_tensor, py::arg("numel"), py::arg("dtype"),
           "1-D CPU tensor of exactly numel elements viewing a 4 KiB-aligned arena block; the block "
           "returns to the free list when the last tensor viewing it is destroyed.")
      .def(
          "allocate_raw",
          [](PinnedArena& self, std::size_t bytes) {
            py::gil_scoped_release no_gil;
            return self.allocate(bytes);
          },
          py::arg("bytes"), "Address of a 4 KiB-aligned block of at least bytes; pair with free_raw.")
      .def("free_raw", &PinnedArena::free, py::arg("address"),
           "Returns a block obtained from allocate_raw to the free list.")
      .def(
          "reserve",
          [](PinnedArena& self, std::size_t bytes) {
            py::gil_scoped_release no_gil;
            return self.reserve(bytes);
          },
          py::arg("bytes"),
          "Maps one region of round_up(bytes, 2 MiB) unless a free block of bytes exists; returns bytes mapped.")
      .def("release_empty_regions", &PinnedArena::release_empty_regions, py::arg("max_bytes") = SIZE_MAX,
           "Unmaps regions without live allocations; returns the bytes released.")
      .def("close", &PinnedArena::close,
           "Stops allocation; regions are unmapped once no live allocation remains in them.")
      .def_property_readonly("closed", &PinnedArena::closed)
      .def("contains", &PinnedArena::contains, py::arg("address"), py::arg("bytes"),
           "True when [address, address + bytes) lies in one region of this arena.")
      .def("is_live", &PinnedArena::is_live, py::arg("address"),
           "True when address starts a live allocation.")
      .def("requested_size", &PinnedArena::requested_size, py::arg("address"),
           "Exact bytes requested for the live allocation at address (0 if none).")
      .def("stats", &stats_dict, "Accounting counters as a dict of *_bytes / num_* integers.")
      .def("regions", &regions_list, "Mapped regions as dicts: base, bytes, backing, locked, registered.")
      .def("free_blocks", &PinnedArena::free_blocks, "Free blocks as (address, bytes), by address.")
      .def_property_readonly("region_bytes", [](const PinnedArena& self) { return self.config().region_bytes; })
      .def_property_readonly("cuda_status", &PinnedArena::cuda_status,
                             "'available: ...' or 'not available: <reason>' for cudaHostRegister.");
}
