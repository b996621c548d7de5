// The bf16 product on AMX tiles (Sapphire Rapids and later), batch-invariant like the rest.
//
// TDPBF16PS adds, into each float32 element of a C tile, the products of one row of the A tile
// (32 bfloat16 values of x: 16 pairs of k) with one column of the B tile (the same 32 k of a
// weight column). Each element's sum runs over K in blocks of 32, in block order, in one C
// tile that stays in its register from the first block to the last; no row of a tile takes
// part in another row's sums. So the tile's row count (1 to 16), the number of tiles a call
// needs, the thread that runs a tile and the call's row count decide only which elements are
// computed together, never what one computes. The hardware's own order inside an instruction
// is fixed by the instruction; the self-test (products.tiles_work) checks the contract on the
// machine, in a child process, before any engine uses this path.
//
// Weights are packed once into the B tiles' layout: [panels of 16 columns][K / 32][16 pairs]
// [16 columns][2], zero-padded in K and N; activations are staged as bfloat16 rows of
// K padded to 32, as the AVX-512 BF16 path stages them.
//
// The tile registers are granted per process by Linux (arch_prctl ARCH_REQ_XCOMP_PERM); a
// thread that uses them without the grant dies with SIGILL. Each call's items set the tile
// configuration on their own thread and release it at the end.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXKV_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace radixkv_tiles {

constexpr int kCols = 16;      // float32 columns per C tile (64 bytes)
constexpr int kRows = 16;      // rows per tile at most
constexpr int kBlock = 32;     // bf16 values of k per A row / B tile (16 pairs)
constexpr int kTileElems = kBlock * kCols;  // bf16 values in one packed B tile

// Linux's request for the AMX tile data state (arch/x86/include/uapi/asm/prctl.h).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Asks Linux for the tile registers for this process; true once granted.
inline bool request_tiles() {
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The 64-byte configuration LDTILECFG reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: C of panels p and p + 1 (``mr`` rows); tmm2: A (``mr`` rows of 32 bf16);
// tmm3, tmm4: B of the two panels (16 pairs of k, 16 columns of 2).
inline void configure(int mr) {
  TileConfig c;
  for (int t : {0, 1}) {
    c.rows[t] = static_cast<uint8_t>(mr);
    c.colsb[t] = kCols * 4;
  }
  c.rows[2] = static_cast<uint8_t>(mr);
  c.colsb[2] = kBlock * 2;
  for (int t : {3, 4}) {
    c.rows[t] = kBlock / 2;
    c.colsb[t] = kCols * 4;
  }
  _tile_loadconfig(&c);
}

// Packs one weight column block: out[kb][j][c][t] = w[n0 + c][kb * 32 + 2j + t] (zero past
// n or k). ``w``: bf16 bits [N, K] row-major; ``out``: one panel, K2 = ceil(K / 32) blocks.
inline void pack_panel(const uint16_t* w, int64_t N, int64_t K, int64_t n0, uint16_t* out) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  for (int64_t kb = 0; kb < blocks; ++kb)
    for (int j = 0; j < kBlock / 2; ++j)
      for (int c = 0; c < kCols; ++c)
        for (int t = 0; t < 2; ++t) {
          const int64_t n = n0 + c, k = kb * kBlock + 2 * j + t;
          out[((kb * (kBlock / 2) + j) * kCols + c) * 2 + t] =
              n < N && k < K ? w[n * K + k] : uint16_t{0};
        }
}

// y rows m0..m0+mr of columns [p * 16, (p + pn) * 16) (pn: 1 or 2 panels), from staged bf16
// rows ``x`` (row stride ``ldx`` values, K padded to ``blocks`` * 32) and packed panels
// ``w``. ``out``: float32 [mr][32] for the caller's epilogue.
inline void product(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t blocks,
                    int64_t p, int pn, float* out) {
  const int64_t panel = blocks * kTileElems;
  const uint16_t* w0 = w + p * panel;
  const uint16_t* w1 = pn == 2 ? w0 + panel : w0;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    _tile_loadd(2, x + kb * kBlock, ldx * 2);
    _tile_loadd(3, w0 + kb * kTileElems, kCols * 4);
    _tile_dpbf16ps(0, 2, 3);
    if (pn == 2) {
      _tile_loadd(4, w1 + kb * kTileElems, kCols * 4);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, out, 2 * kCols * 4);
  if (pn == 2) _tile_stored(1, out + kCols, 2 * kCols * 4);
}

inline void release() { _tile_release(); }

}  // namespace radixkv_tiles

#endif  // __AMX_TILE__ && __AMX_BF16__
