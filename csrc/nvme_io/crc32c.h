// CRC32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78), the checksum the device store
// writes per extent and checks on read (MemAscend, arXiv 2505.23254, direct NVMe engine).
// SSE4.2 `crc32` instructions in three interleaved chains when the CPU has them (checked at run
// time; about 3x one chain), a slice-by-8 table otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace memascend::nvme_io {

// Continue a CRC32C over `nbytes` at `data`; start with crc = 0. Standard check value:
// crc32c(0, "123456789", 9) == 0xE3069283.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t nbytes);

// Whether the hardware path is used on this CPU.
bool crc32c_hardware();

}  // namespace memascend::nvme_io
