#include "crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace memascend::nvme_io {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;

// Slice-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes.
struct Tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  Tables() {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (std::uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
};

const Tables& tables() {
  static const Tables tab;
  return tab;
}

std::uint32_t crc32c_software(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  const auto& t = tables().t;
  crc = ~crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
          t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

#if defined(__x86_64__)
// The `crc32` instruction has a latency of 3 cycles and a throughput of 1 per cycle: one dependent
// chain runs at a third of the unit's speed. Three independent chains over adjacent blocks keep it
// busy; their CRCs are then merged by shifting one block's CRC over the next block's length
// (a linear map of the 32-bit register, applied with four 256-entry tables) and XOR-ing.
constexpr std::size_t kLongBlock = 8192;  // bytes per chain in the main loop (3 x 8 KiB per round)
constexpr std::size_t kShortBlock = 256;  // bytes per chain for the rest (3 x 256 per round)

// table[k][b]: the register (b << 8k) advanced over `len` zero bytes (no pre/post inversion).
struct ShiftTable {
  std::array<std::array<std::uint32_t, 256>, 4> t{};
};

__attribute__((target("sse4.2"))) ShiftTable make_shift_table(std::size_t len) {
  ShiftTable tab;
  for (int k = 0; k < 4; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint64_t c = static_cast<std::uint64_t>(b) << (8 * k);
      for (std::size_t i = 0; i < len / 8; ++i) c = _mm_crc32_u64(c, 0);
      tab.t[k][b] = static_cast<std::uint32_t>(c);
    }
  }
  return tab;
}

inline std::uint64_t shift_crc(const ShiftTable& tab, std::uint64_t c) {
  return tab.t[0][c & 0xFF] ^ tab.t[1][(c >> 8) & 0xFF] ^ tab.t[2][(c >> 16) & 0xFF] ^ tab.t[3][(c >> 24) & 0xFF];
}

const ShiftTable& long_shift() {
  static const ShiftTable tab = make_shift_table(kLongBlock);
  return tab;
}

const ShiftTable& short_shift() {
  static const ShiftTable tab = make_shift_table(kShortBlock);
  return tab;
}

inline std::uint64_t load64(const unsigned char* p) {
  std::uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// Three chains over blocks of `block` bytes while 3 * block bytes remain.
__attribute__((target("sse4.2"))) inline std::uint64_t crc32c_3way(std::uint64_t c, const unsigned char*& p,
                                                                  std::size_t& n, std::size_t block,
                                                                  const ShiftTable& shift) {
  while (n >= 3 * block) {
    std::uint64_t c1 = 0;
    std::uint64_t c2 = 0;
    const unsigned char* end = p + block;
    while (p < end) {
      c = _mm_crc32_u64(c, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + block));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * block));
      p += 8;
    }
    c = shift_crc(shift, c) ^ c1;
    c = shift_crc(shift, c) ^ c2;
    p += 2 * block;
    n -= 3 * block;
  }
  return c;
}

__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc, const unsigned char* p,
                                                              std::size_t n) {
  std::uint64_t c = ~crc;
  while (n && (reinterpret_cast<std::uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
    --n;
  }
  c = crc32c_3way(c, p, n, kLongBlock, long_shift());
  c = crc32c_3way(c, p, n, kShortBlock, short_shift());
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
  return ~static_cast<std::uint32_t>(c);
}
#endif

}  // namespace

bool crc32c_hardware() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t nbytes) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (crc32c_hardware()) return crc32c_sse42(crc, p, nbytes);
#endif
  return crc32c_software(crc, p, nbytes);
}

}  // namespace memascend::nvme_io
