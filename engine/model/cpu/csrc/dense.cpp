// Batch-invariant matrix products for the CPU: the model's linear layers and its LM head.
//
// y[m, n] = sum_k x[m, k] * w[k, n] is computed for every output element by one chain of
// fused multiply-adds in k order (k = 0, 1, ..., K - 1), each lane of a vector holding one
// output column. Tiles over M and N, the row count of the call and the number of threads
// only decide which elements are computed together, never the order of any element's sum:
// a row's result is a function of that row and the weights alone. With -ffp-contract=off
// the only fused operations are the explicit ones, and a fused multiply-add rounds once
// wherever it runs, so the portable path gives the same bits at any vector width.
//
// Weights are packed once, at load, into panels of NR columns, [panels][K][NR], so a tile
// streams its panel's rows in order. Where the build targets AVX-512 BF16, bfloat16 weights
// are packed in pairs of k, [panels][K/2][NR][2], for vdpbf16ps: activations are rounded to
// bfloat16 and each lane adds x[2i] w[2i] + x[2i+1] w[2i+1] per instruction, again in one
// fixed order along k (pairs in order), whatever the shape of the call.
//
// Fused around the product (each row-wise, so invariant too): an RMSNorm of the input rows,
// SiLU(gate) * up or GELU(gate) * up of the input's two halves, a bias and a residual added
// to the output. Beside the product, two row transforms the model's families need between
// products: RMSNorm of rows or of each head of a row, plus a residual (``rms_norm``), and a
// soft cap, cap * tanh(x / cap) (``softcap_``), each in one fixed order per row.
//
// Every argument is checked on the calling thread before the parallel region, and no
// exception leaves it: a bad call is a RuntimeError (see guard.h).

#include <torch/extension.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "guard.h"
#include "team.h"
#include "tiles.h"

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
#else
constexpr int VW = 8;
#endif
constexpr int NR = 32;        // columns per packed panel
constexpr int NV = NR / VW;   // vectors per panel row
#if defined(__AVX512BF16__)
constexpr bool kDotBF16 = true;
#else
constexpr bool kDotBF16 = false;
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

inline vf splat(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(x);
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = x;
  return v;
#endif
}

inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// bfloat16 bits widened to float32 exactly (a shift: bf16 is the top half of a float).
inline vf loadw(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

inline vf loadw(const float* p) { return loadf(p); }

// a * b + c rounded once: the same bits on every instruction set.
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vf r;
  for (int i = 0; i < VW; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

inline uint16_t to_bf16(float f) {  // round to nearest even (NaN kept a NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Brings one packed row of a panel (``bytes`` long) towards the core: a tile asks for the
// next tile's panels as it streams its own, because the hardware's prefetchers stop at each
// 4 KiB page and a panel spans many.
inline void prefetch_row(const void* p, int bytes) {
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

// The rows at ``offset`` of the NP panels after a tile's own NP (from ``wp``, ``panel`` apart).
template <int NP, typename T>
inline void prefetch_next(const T* wp, int64_t panel, int64_t offset, int bytes) {
  for (int q = 0; q < NP; ++q) prefetch_row(wp + (NP + q) * panel + offset, bytes);
}

// What is added to a tile's sums before they are stored: bias, then the residual.
struct Epilogue {
  const float* bias;      // [N] or null
  const float* residual;  // [M, ldr] or null; may alias y
  int64_t ldr;
};

template <int MR, int NP>
inline void store_tile(vf (&acc)[MR][NP * NV], float* y, int64_t ldy, int64_t m0, int64_t n0,
                       int64_t n_valid, const Epilogue& e) {
  for (int r = 0; r < MR; ++r) {
    float* row = y + (m0 + r) * ldy;
    const float* res = e.residual ? e.residual + (m0 + r) * e.ldr : nullptr;
    for (int j = 0; j < NP * NV; ++j) {
      const int64_t n = n0 + j * VW;
      if (n >= n_valid) break;
      vf v = acc[r][j];
      // Whole vectors: the same sums as the lane loop below, with plain loads. GCC had made
      // that loop's bias and residual reads masked loads from null pointers, which cost 30%
      // of a tile on the Zen 5 (most likely a microcode assist per masked-off unmapped lane).
      if (n + VW <= n_valid) {
        if (e.bias) v = v + loadf(e.bias + n);
        if (res) v = loadf(res + n) + v;
        storef(row + n, v);
        continue;
      }
      float tmp[VW];
      storef(tmp, v);
      const int64_t cols = n_valid - n;
      for (int i = 0; i < cols; ++i) {
        float s = tmp[i];
        if (e.bias) s = s + e.bias[n + i];
        if (res) s = res[n + i] + s;
        row[n + i] = s;
      }
    }
  }
}

// The portable product: float32 activations times float32 or bfloat16 weights (widened
// exactly in registers), one fused multiply-add chain per output element.
template <typename W>
struct FmaKernel {
  const float* x;
  int64_t ldx;
  const W* w;
  int64_t K;
  float* y;
  int64_t ldy, n_valid;
  Epilogue e;

  template <int MR, int NP>
  void tile(int64_t m0, int64_t p, bool ahead) const {
    vf acc[MR][NP * NV] = {};
    const int64_t panel = K * NR;
    const W* wp = w + p * panel;
    const float* xr = x + m0 * ldx;
    for (int64_t k = 0; k < K; ++k) {
      if (ahead) prefetch_next<NP>(wp, panel, k * NR, NR * sizeof(W));
      vf wv[NP * NV];
      for (int q = 0; q < NP; ++q)
        for (int v = 0; v < NV; ++v) wv[q * NV + v] = loadw(wp + q * panel + k * NR + v * VW);
      for (int r = 0; r < MR; ++r) {
        const vf xb = splat(xr[r * ldx + k]);
        for (int j = 0; j < NP * NV; ++j) acc[r][j] = fma(xb, wv[j], acc[r][j]);
      }
    }
    store_tile<MR, NP>(acc, y, ldy, m0, p * NR, n_valid, e);
  }
};

#if defined(__AVX512BF16__)
// vdpbf16ps: x is bfloat16 [M, 2 * K2] (pairs of k), w [panels][K2][NR][2].
struct DotKernel {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t K2;
  float* y;
  int64_t ldy, n_valid;
  Epilogue e;

  template <int MR, int NP>
  void tile(int64_t m0, int64_t p, bool ahead) const {
    static_assert(VW == 16, "the bf16 dot path is AVX-512");
    vf acc[MR][NP * NV] = {};
    const int64_t panel = K2 * NR * 2;
    const uint16_t* wp = w + p * panel;
    const uint16_t* xr = x + m0 * ldx;
    for (int64_t k = 0; k < K2; ++k) {
      if (ahead) prefetch_next<NP>(wp, panel, k * NR * 2, NR * 4);
      __m512i wv[NP * NV];
      for (int q = 0; q < NP; ++q)
        for (int v = 0; v < NV; ++v)
          wv[q * NV + v] = _mm512_loadu_si512(wp + q * panel + (k * NR + v * VW) * 2);
      for (int r = 0; r < MR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, xr + r * ldx + 2 * k, 4);
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(pair));
        for (int j = 0; j < NP * NV; ++j)
          acc[r][j] = (vf)_mm512_dpbf16_ps((__m512)acc[r][j], (__m512bh)xb, (__m512bh)wv[j]);
      }
    }
    store_tile<MR, NP>(acc, y, ldy, m0, p * NR, n_valid, e);
  }
};
#endif

// Tile shapes (speed only: no shape changes what an element computes). One or two rows
// (decode): NP_WIDE panels per tile, for enough independent chains in flight. A few rows (a
// batch of decodes, a verify's drafts; AVX-512 only): the rows in tiles of one panel and up to
// MR_TALL rows, all of a panel's tiles back to back, so the weights come from memory once and
// every extra row costs only its multiply-adds (28 accumulators of 32 registers; on a Zen 5
// the products of a decode pass at 3 to 14 rows took 1.15-1.35x less time than in tiles of
// MR_BIG rows, each tile re-reading the panels). Many rows (prefill): MR_BIG rows per tile
// reuse each loaded weight vector; rows go in blocks of ROW_BLOCK so a tile's panels stay in
// L2 while the block's rows pass over them.
constexpr int NP_WIDE = VW == 16 ? 4 : 2;
constexpr int64_t WIDE_MAX = VW == 16 ? 2 : 4;  // rows for NP_WIDE tiles
constexpr int MR_TALL = 14;
constexpr int64_t TALL_MAX = VW == 16 ? 2 * MR_TALL : 0;  // rows for tiles of one panel
constexpr int NP_BIG = VW == 16 ? 2 : 1;
constexpr int MR_BIG = VW == 16 ? 6 : 3;
constexpr int64_t ROW_BLOCK = 96;
constexpr int64_t CLAIM = 8;  // panels a thread claims at a time (a multiple of NP_WIDE)

// ``rows`` (1..MR) rows from m as one tile.
template <int NP, int MR, typename Kernel>
inline void tile_of(const Kernel& kn, int64_t m, int64_t rows, int64_t p, bool ahead) {
  if constexpr (MR > 1) {
    if (rows == MR) return kn.template tile<MR, NP>(m, p, ahead);
    return tile_of<NP, MR - 1>(kn, m, rows, p, ahead);
  } else {
    kn.template tile<1, NP>(m, p, ahead);
  }
}

// Rows mb..me of NP panels from p; ``ahead``: the next NP panels are the thread's next. The
// last rows are split into tiles of nearly equal height (8 rows: 4 + 4, not 6 + 2), since a
// short tile has too few independent sums in flight to keep the multipliers busy.
template <int NP, int MR, typename Kernel>
void rows_of_panel(const Kernel& kn, int64_t mb, int64_t me, int64_t p, bool ahead) {
  int64_t m = mb;
  while (me - m > 2 * MR) {
    kn.template tile<MR, NP>(m, p, ahead);
    m += MR;
  }
  const int64_t left = me - m;
  if (left > MR) {
    const int64_t first = (left + 1) / 2;
    tile_of<NP, MR>(kn, m, first, p, ahead);
    tile_of<NP, MR>(kn, m + first, left - first, p, ahead);
  } else if (left > 0) {
    tile_of<NP, MR>(kn, m, left, p, ahead);
  }
}

// Rows mb..me (at most TALL_MAX) of panel p in tiles of nearly equal height, at most MR_TALL
// each, one after the other while the panel is in cache; the first asks for the next panel.
template <typename Kernel>
void tall_tiles(const Kernel& kn, int64_t mb, int64_t me, int64_t p, bool ahead) {
  if constexpr (TALL_MAX > 0) {
    const int64_t tiles = (me - mb + MR_TALL - 1) / MR_TALL;
    for (int64_t t = 0, m = mb; t < tiles; ++t) {
      const int64_t rows = (me - m) / (tiles - t);
      tile_of<1, MR_TALL>(kn, m, rows, p, ahead && t == 0);
      m += rows;
    }
  }
}

template <typename Kernel>
void sweep(const Kernel& kn, int64_t M, int64_t p0, int64_t p1) {
  for (int64_t mb = 0; mb < M; mb += ROW_BLOCK) {
    const int64_t me = std::min<int64_t>(M, mb + ROW_BLOCK);
    int64_t p = p0;
    if (me - mb <= WIDE_MAX) {
      for (; p + NP_WIDE <= p1; p += NP_WIDE)
        rows_of_panel<NP_WIDE, 2>(kn, mb, me, p, p + 2 * NP_WIDE <= p1);
    } else if (me - mb <= TALL_MAX) {
      for (; p < p1; ++p) tall_tiles(kn, mb, me, p, p + 1 < p1);
    } else {
      for (; p + NP_BIG <= p1; p += NP_BIG)
        rows_of_panel<NP_BIG, MR_BIG>(kn, mb, me, p, p + 2 * NP_BIG <= p1);
    }
    for (; p < p1; ++p) rows_of_panel<1, MR_BIG>(kn, mb, me, p, false);
  }
}

// Row-wise input transforms, each in one fixed order per row.
enum Prologue : int64_t { NONE = 0, RMSNORM = 1, SILU_MUL = 2, GELU_MUL = 3 };

// Row transforms are defined on 16 lanes whatever the build's vector width, so that an AVX2
// build (two 8-float vectors per step) gives the bits of an AVX-512 one.
constexpr int ROW_LANES = 16;
static_assert(ROW_LANES % VW == 0, "a row step is whole vectors");

// x * rsqrt(mean(x^2) + eps) * weight: squares summed in 16 lanes in k order, the lanes
// folded left to right, the last K % 16 squares added in order.
void rmsnorm_row(const float* x, int64_t K, const float* weight, double eps, float* out) {
  vf acc[ROW_LANES / VW] = {};
  int64_t k = 0;
  for (; k + ROW_LANES <= K; k += ROW_LANES)
    for (int h = 0; h < ROW_LANES / VW; ++h) {
      const vf v = loadf(x + k + h * VW);
      acc[h] = fma(v, v, acc[h]);
    }
  float ss = 0.0f;
  for (int h = 0; h < ROW_LANES / VW; ++h)
    for (int i = 0; i < VW; ++i) ss += acc[h][i];
  for (; k < K; ++k) ss = std::fma(x[k], x[k], ss);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(eps));
  for (int64_t j = 0; j < K; ++j) out[j] = (x[j] * r) * weight[j];
}

// exp(x) in every lane by the same instructions (Cody-Waite reduction by ln 2, a degree-6
// polynomial; ~1 ulp), x clamped to [-87, 88] where float32's exp stays finite and normal.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf k = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - k * splat(0.693359375f);
  r = r - k * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = fma(p, r, splat(1.3981999507e-3f));
  p = fma(p, r, splat(8.3334519073e-3f));
  p = fma(p, r, splat(4.1665795894e-2f));
  p = fma(p, r, splat(1.6666665459e-1f));
  p = fma(p, r, splat(5.0000001201e-1f));
  const vf y = fma(p, r * r, r) + splat(1.0f);
  typedef int32_t vi __attribute__((vector_size(VW * 4)));
  const vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
  return y * (vf)bits;
}

// silu(gate) * up for a row [gate | up] of 2K values: (g / (1 + exp(-g))) * up, steps of 16
// columns by vexp, the last K % 16 by the C library's exp (the same columns in every row and
// every build).
void silu_mul_row(const float* x, int64_t K, float* out) {
  int64_t j = 0;
  for (; j + ROW_LANES <= K; j += ROW_LANES)
    for (int h = 0; h < ROW_LANES; h += VW) {
      const vf g = loadf(x + j + h);
      storef(out + j + h, (g / (splat(1.0f) + vexp(-g))) * loadf(x + K + j + h));
    }
  for (; j < K; ++j) {
    const float g = x[j];
    out[j] = (g / (1.0f + std::exp(-g))) * x[K + j];
  }
}

// gelu(gate) * up, GELU by tanh (transformers' gelu_pytorch_tanh), written as
// g * sigmoid(2u) = g / (1 + exp(-2u)) with u = sqrt(2 / pi) * (g + 0.044715 g^3); columns
// as silu_mul_row takes them.
void gelu_mul_row(const float* x, int64_t K, float* out) {
  const float c = 0.7978845608028654f, a = 0.044715f;
  int64_t j = 0;
  for (; j + ROW_LANES <= K; j += ROW_LANES)
    for (int h = 0; h < ROW_LANES; h += VW) {
      const vf g = loadf(x + j + h);
      const vf u = splat(c) * (g + splat(a) * (g * g * g));
      storef(out + j + h, (g / (splat(1.0f) + vexp(splat(-2.0f) * u))) * loadf(x + K + j + h));
    }
  for (; j < K; ++j) {
    const float g = x[j];
    const float u = c * (g + a * (g * g * g));
    out[j] = (g / (1.0f + std::exp(-2.0f * u))) * x[K + j];
  }
}

// cap * tanh(x / cap) of a row in place, tanh(y) as 1 - 2 / (exp(2y) + 1); columns as
// silu_mul_row takes them.
void softcap_row(float* x, int64_t K, float cap) {
  const float inv = 1.0f / cap;
  int64_t j = 0;
  for (; j + ROW_LANES <= K; j += ROW_LANES)
    for (int h = 0; h < ROW_LANES; h += VW) {
      const vf y = loadf(x + j + h) * splat(inv);
      const vf t = splat(1.0f) - splat(2.0f) / (vexp(splat(2.0f) * y) + splat(1.0f));
      storef(x + j + h, splat(cap) * t);
    }
  for (; j < K; ++j) {
    const float y = x[j] * inv;
    x[j] = cap * (1.0f - 2.0f / (std::exp(2.0f * y) + 1.0f));
  }
}

// A row rounded to bfloat16 (to nearest even) for the dot path: whole vectors by
// vcvtneps2bf16, which reads denormals as zero, as vdpbf16ps does its inputs anyway.
void bf16_row(const float* x, int64_t K, uint16_t* out) {
  int64_t k = 0;
#if defined(__AVX512BF16__)
  for (; k + 16 <= K; k += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
    std::memcpy(out + k, &h, 32);
  }
#endif
  for (; k < K; ++k) out[k] = to_bf16(x[k]);
}

void check_cpu(const torch::Tensor& t, const char* name) {
  ARG_CHECK(t.device().is_cpu(), name, ": must be a CPU tensor, got one on ", t.device());
}

// w [N, K] (a linear layer's weight, transformers' layout) -> packed panels.
torch::Tensor pack(torch::Tensor w) {
  check_cpu(w, "w");
  ARG_CHECK(w.dim() == 2, "w: [N, K], got ", w.dim(), " dims");
  ARG_CHECK(w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16,
            "w: float32 or bfloat16, got ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  auto wc = w.contiguous();
  if (w.scalar_type() == torch::kBFloat16 && kDotBF16) {
    const int64_t K2 = (K + 1) / 2;
    auto out = torch::zeros({panels, K2, NR * 2}, w.options());
    if (out.numel() == 0) return out;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[((n / NR) * K2 + k / 2) * NR * 2 + (n % NR) * 2 + (k % 2)] = src[n * K + k];
    return out;
  }
  auto out = torch::zeros({panels, K, NR}, w.options());
  auto padded = torch::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(wc);
  out.copy_(padded.view({panels, NR, K}).transpose(1, 2));
  return out;
}

#if defined(RADIXKV_TILES)
constexpr bool kTilesBuilt = true;
constexpr int64_t kTileElems = radixkv_tiles::kTileElems;
#else
constexpr bool kTilesBuilt = false;
constexpr int64_t kTileElems = 512;  // the layout's last dim, refused where not built
#endif
constexpr int64_t TILE_CLAIM = 16;  // panels of 16 columns an item computes (256 columns)

// w [N, K] bfloat16 -> the AMX tiles' layout [panels of 16, K / 32, 512] (tiles.h).
torch::Tensor pack_tiles(torch::Tensor w) {
  check_cpu(w, "w");
  ARG_CHECK(kTilesBuilt, "pack_tiles: this build has no AMX tile path");
  ARG_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w: bfloat16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + 15) / 16, blocks = (K + 31) / 32;
  auto out = torch::zeros({panels, blocks, kTileElems}, w.options());
#if defined(RADIXKV_TILES)
  auto wc = w.contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t p = 0; p < panels; ++p)
    radixkv_tiles::pack_panel(src, N, K, p * 16, dst + p * blocks * kTileElems);
#endif
  return out;
}

#if defined(RADIXKV_TILES)
// Panels p0..p1 (of 16 columns) for every row, in tiles of up to 16 rows and two panels; the
// configuration set on this thread for the item and released after it.
void tile_sweep(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t blocks, int64_t M,
                int64_t p0, int64_t p1, float* y, int64_t ldy, int64_t n_valid,
                const Epilogue& e) {
  alignas(64) float out[16 * 32];
  int configured = 0;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int mr = static_cast<int>(std::min<int64_t>(16, M - m0));
    if (mr != configured) {
      radixkv_tiles::configure(mr);
      configured = mr;
    }
    for (int64_t p = p0; p < p1; p += 2) {
      const int pn = p + 2 <= p1 ? 2 : 1;
      radixkv_tiles::product(x + m0 * ldx, ldx, w, blocks, p, pn, out);
      for (int r = 0; r < mr; ++r) {
        float* row = y + (m0 + r) * ldy;
        const float* res = e.residual ? e.residual + (m0 + r) * e.ldr : nullptr;
        for (int c = 0; c < pn * 16; ++c) {
          const int64_t n = p * 16 + c;
          if (n >= n_valid) break;
          float v = out[r * 32 + c];
          if (e.bias) v = v + e.bias[n];
          if (res) v = res[n] + v;
          row[n] = v;
        }
      }
    }
  }
  radixkv_tiles::release();
}
#endif

// Asks Linux for the tile registers (once per process; idempotent): true where granted.
bool request_tiles() {
#if defined(RADIXKV_TILES)
  return radixkv_tiles::request_tiles();
#else
  return false;
#endif
}

// y = prologue(x) @ w (+ bias) (+ residual), float32 [M, n].
torch::Tensor dense(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t prologue,
                    c10::optional<torch::Tensor> norm_weight, double eps,
                    c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual,
                    int64_t threads) {
  check_cpu(x, "x");
  ARG_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
            "x: float32 [M, K] with unit column stride");
  ARG_CHECK(prologue >= NONE && prologue <= GELU_MUL,
            "prologue: 0 (none), 1 (RMSNorm), 2 (SiLU * up) or 3 (GELU * up), got ", prologue);
  const bool gated = prologue == SILU_MUL || prologue == GELU_MUL;
  ARG_CHECK(!gated || x.size(1) % 2 == 0,
            "x: act(gate) * up takes [M, 2K] (gate | up), got an odd ", x.size(1), " features");
  check_cpu(packed, "packed");
  ARG_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                (packed.scalar_type() == torch::kFloat ||
                 packed.scalar_type() == torch::kBFloat16),
            "packed: a contiguous float32 or bfloat16 [panels, K, ", NR, "] from pack()");
  const bool tiles = packed.scalar_type() == torch::kBFloat16 && packed.size(2) == kTileElems;
  ARG_CHECK(!tiles || kTilesBuilt, "packed: the AMX tile layout, which this build cannot run");
  const bool dot = !tiles && packed.scalar_type() == torch::kBFloat16 && kDotBF16;
  const bool bf16_rows = dot || tiles;  // x staged as bfloat16 rows
  ARG_CHECK(tiles || packed.size(2) == (dot ? 2 * NR : NR), "packed: [panels, K, ",
            dot ? 2 * NR : NR, "] from pack(), got ", packed.size(2), " in its last dim");
  ARG_CHECK(threads >= 1 && threads <= radixkv::kMaxThreads, "threads: 1 to ",
            radixkv::kMaxThreads, ", got ", threads);
  const int64_t M = x.size(0);
  const int64_t K_in = gated ? x.size(1) / 2 : x.size(1);
  const int64_t K = packed.size(1);  // float path: K; dot path: K / 2 pairs; tiles: K / 32
  const int64_t per_k = tiles ? 32 : dot ? 2 : 1;  // values of k per step of packed.size(1)
  ARG_CHECK(per_k * K >= K_in && per_k * K - K_in < per_k,
            "x: its features do not match the packed weight");
  const int64_t panel_cols = tiles ? 16 : NR;
  ARG_CHECK(n >= 0 && n <= packed.size(0) * panel_cols, "n: 0 to the ",
            packed.size(0) * panel_cols, " columns packed, got ", n);
  const float* nw = nullptr;
  if (prologue == RMSNORM) {
    ARG_CHECK(norm_weight.has_value() && norm_weight->device().is_cpu() &&
                  norm_weight->scalar_type() == torch::kFloat && norm_weight->numel() == K_in &&
                  norm_weight->is_contiguous(),
              "norm_weight: float32 [K], contiguous, for RMSNorm");
    nw = norm_weight->data_ptr<float>();
  }
  Epilogue e{nullptr, nullptr, 0};
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    ARG_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == n &&
                  bias->is_contiguous(), "bias: float32 [N], contiguous");
    e.bias = bias->data_ptr<float>();
  }
  if (residual.has_value()) {
    check_cpu(*residual, "residual");
    ARG_CHECK(residual->scalar_type() == torch::kFloat && residual->dim() == 2 &&
                  residual->size(0) == M && residual->size(1) == n &&
                  (residual->stride(1) == 1 || n <= 1),
              "residual: float32 [M, N] with unit column stride");
    e.residual = residual->data_ptr<float>();
    e.ldr = residual->stride(0);
  }
  auto y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Every data pointer is taken here, on the calling thread (data_ptr<T> throws on a dtype
  // mismatch; nothing inside the region may).
  const void* wp = packed.scalar_type() == torch::kBFloat16
                       ? static_cast<const void*>(packed.data_ptr<at::BFloat16>())
                       : static_cast<const void*>(packed.data_ptr<float>());
  // The input as the product reads it: transformed rows, or bf16 pairs for the dot path.
  const bool staged = prologue != NONE || bf16_rows;
  const int64_t lds = per_k * K;
  std::vector<float> stage_f(staged && !bf16_rows ? M * lds : 0);
  std::vector<uint16_t> stage_h(bf16_rows ? M * lds : 0);
  const int64_t panels = (n + panel_cols - 1) / panel_cols;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
  float* yp = y.data_ptr<float>();
  // Staging (phase 0, a row an item) before the products (phase 1, runs of CLAIM panels):
  // every row is staged before any product reads it. Which thread computes a column never
  // changes what it computes.
  std::vector<std::vector<float>> rows(bf16_rows ? nt : 0);  // a worker's float row
  const int64_t claim = tiles ? TILE_CLAIM : CLAIM;
  const int64_t runs = (panels + claim - 1) / claim;
  const bool float_weights = packed.scalar_type() == torch::kFloat;
  radixkv::run_phases(nt, {staged ? M : 0, runs}, [&](int phase, int64_t item, int worker) {
    if (phase == 0) {
      const int64_t m = item;
      const float* src = xp + m * ldx;
      float* to = stage_f.data() + m * lds;
      if (bf16_rows) {
        rows[worker].resize(K_in);
        to = rows[worker].data();
      }
      if (prologue == RMSNORM) rmsnorm_row(src, K_in, nw, eps, to);
      else if (prologue == SILU_MUL) silu_mul_row(src, K_in, to);
      else if (prologue == GELU_MUL) gelu_mul_row(src, K_in, to);
      else std::memcpy(to, src, K_in * sizeof(float));
      if (bf16_rows) {
        uint16_t* h = stage_h.data() + m * lds;
        bf16_row(to, K_in, h);
        for (int64_t k = K_in; k < lds; ++k) h[k] = 0;
      }
      return;
    }
    const int64_t p0 = item * claim, p1 = std::min<int64_t>(panels, p0 + claim);
    if (tiles) {
#if defined(RADIXKV_TILES)
      tile_sweep(stage_h.data(), lds, static_cast<const uint16_t*>(wp), K, M, p0, p1, yp, n, n,
                 e);
#endif
    } else if (dot) {
#if defined(__AVX512BF16__)
      const DotKernel kn{stage_h.data(), lds, static_cast<const uint16_t*>(wp), K, yp, n, n, e};
      sweep(kn, M, p0, p1);
#endif
    } else if (float_weights) {
      const FmaKernel<float> kn{staged ? stage_f.data() : xp, staged ? lds : ldx,
                                static_cast<const float*>(wp), K, yp, n, n, e};
      sweep(kn, M, p0, p1);
    } else {
      const FmaKernel<uint16_t> kn{staged ? stage_f.data() : xp, staged ? lds : ldx,
                                   static_cast<const uint16_t*>(wp), K, yp, n, n, e};
      sweep(kn, M, p0, p1);
    }
  });
  return y;
}

// RMSNorm of each of ``heads`` equal segments of every row of x [M, K] (one segment: the row),
// by weight [K] (segment h by its slice h), plus residual [M, K] if given; into a new tensor,
// or with ``in_place`` into x itself (a row's segment is read before it is written).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, int64_t heads,
                       c10::optional<torch::Tensor> residual, bool in_place, int64_t threads) {
  check_cpu(x, "x");
  ARG_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
            "x: float32 [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1);
  ARG_CHECK(heads >= 1 && K % heads == 0, "heads: a divisor of ", K, ", got ", heads);
  check_cpu(weight, "weight");
  ARG_CHECK(weight.scalar_type() == torch::kFloat && weight.numel() == K &&
                weight.is_contiguous(), "weight: float32 [K], contiguous");
  ARG_CHECK(threads >= 1 && threads <= radixkv::kMaxThreads, "threads: 1 to ",
            radixkv::kMaxThreads, ", got ", threads);
  const float* rp = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    check_cpu(*residual, "residual");
    ARG_CHECK(residual->scalar_type() == torch::kFloat && residual->dim() == 2 &&
                  residual->size(0) == M && residual->size(1) == K && residual->stride(1) == 1,
              "residual: float32 [M, K] with unit column stride");
    rp = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  torch::Tensor y = in_place ? x : torch::empty({M, K}, x.options());
  if (M == 0) return y;
  float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0), D = K / heads;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, M)));
  radixkv::run_phases(nt, {M}, [&](int, int64_t m, int) {
    for (int64_t h = 0; h < heads; ++h)
      rmsnorm_row(xp + m * ldx + h * D, D, wp + h * D, eps, yp + m * ldy + h * D);
    if (rp != nullptr)
      for (int64_t k = 0; k < K; ++k) yp[m * ldy + k] = rp[m * ldr + k] + yp[m * ldy + k];
  });
  return y;
}

// x = cap * tanh(x / cap) for every element of x [M, K], in place, row by row.
torch::Tensor softcap_(torch::Tensor x, double cap, int64_t threads) {
  check_cpu(x, "x");
  ARG_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
            "x: float32 [M, K] with unit column stride");
  ARG_CHECK(cap > 0, "cap: positive, got ", cap);
  ARG_CHECK(threads >= 1 && threads <= radixkv::kMaxThreads, "threads: 1 to ",
            radixkv::kMaxThreads, ", got ", threads);
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  if (M == 0) return x;
  float* xp = x.data_ptr<float>();
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, M)));
  radixkv::run_phases(nt, {M}, [&](int, int64_t m, int) {
    softcap_row(xp + m * ldx, K, static_cast<float>(cap));
  });
  return x;
}

std::string path_name() {
  return std::string(kDotBF16 ? "fma+bf16dot" : "fma") + "/" + std::to_string(VW * 32);
}

bool tiles_built() { return kTilesBuilt; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "Pack a [N, K] weight into the panels dense() streams");
  m.def("dense", &dense, "Batch-invariant y = prologue(x) @ w + bias + residual");
  m.def("rms_norm", &rms_norm, "Batch-invariant RMSNorm of rows (or of each head of a row)");
  m.def("softcap_", &softcap_, "Batch-invariant cap * tanh(x / cap), in place");
  m.def("path_name", &path_name, "Which product the build uses, and its vector width in bits");
  m.def("pack_tiles", &pack_tiles, "Pack a bfloat16 [N, K] weight into AMX B tiles");
  m.def("tiles_built", &tiles_built, "Whether this build has the AMX tile path");
  m.def("request_tiles", &request_tiles, "Ask Linux for the AMX tile registers (per process)");
}
