// Batch-invariant paged attention for the CPU, as one native kernel.
//
// Every query row (a token's query head) is computed by the same code in the same order,
// whatever else shares the call: each score by FMAs over head_dim in eight lanes and a fixed
// reduction tree, the exact maximum over its keys 0..pos, exp by one vectorised routine,
// and the weighted sum of values key by key in position order (float32 inside each 64-key
// block, double across blocks). Work items only decide which rows share a gathered key
// block, never what a row computes, so the output depends on the row's own keys alone.
// Rows that read the same block (a token's query heads of one KV head; the tokens of a
// prefill tile or under a shared prefix) are computed together in register tiles, so each
// key or value load serves every row of the tile; a row's operations are the same in any
// tile, at the build's vector width (8 or 16 floats) and on any thread. bfloat16 pools are
// widened exactly as they are loaded. A work unit covers one KV head or, for a batch of
// decodes, all of them (each block computed head after head, so its pages are read as whole
// token rows); the rows' arithmetic is the same either way. A call with too few units for its
// threads (a lone request) cuts long units into parts of their blocks computed apart; each
// block's float32 sums are kept and added in double in block order at the end, the same
// additions a whole unit makes as it goes.
// Two variants some model families need, both per row and in the same order in any call: a
// soft cap on the scores (cap * tanh(s / cap), tanh by the vectorised exp) before the
// maximum, and a sliding window (a query at position p weighs keys p - window + 1 .. p: the
// maximum is taken over those, and the weights of earlier keys are set to zero after exp).
// Every argument (the pool, the plan's page ids, lengths, positions and order, the slots) is
// checked on the calling thread before the parallel region, so its threads index only what was
// checked; a bad call is a RuntimeError (see guard.h).
// Built per machine with -march=native and -ffp-contract=off (contractions are explicit).

#include <torch/extension.h>
#if defined(__x86_64__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "guard.h"
#include "team.h"

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

// The widest float vector the build targets. A score's arithmetic is defined on eight lanes
// (``LANES``); a wider vector holds two scores' lanes side by side, and every other step is
// lane-wise, so the width changes the speed, never a row's bits.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));  // W bfloat16
typedef uint32_t vu __attribute__((vector_size(W * 4)));

constexpr int BLOCK = 64;  // keys per block: the unit of the float32 partial sums
constexpr int LANES = 8;   // lanes of one score's partial sums
// Register tiles. Query rows per tile: rows reading the same keys (a decode's heads of one
// KV head; the tokens of a run) share each key load. Keys per tile of scores: 4 vectors of
// accumulators per row, so AVX2's 16 registers hold 3 rows x 4 keys + 3 queries + 1 key, and
// AVX-512's 32 hold 4 rows x 8 keys (two keys a vector) + 4 queries + 4 keys.
constexpr int ROWS = W == 16 ? 4 : 3;
constexpr int TILE = W == 16 ? 8 : 4;
constexpr int NACC = TILE * LANES / W;  // accumulators per row (4)
// The value pass holds VECS vectors of each row's output dims (64 dims under AVX-512).
constexpr int VECS = 4;
constexpr int DIM_MULTIPLE = 32;  // head_dim: whole passes of values (native.HEAD_DIM_MULTIPLE)
constexpr int64_t kMaxDim = 512;  // head_dim the fused RoPE's stack buffer holds
constexpr int64_t kWholeRowTokens = 8;  // pieces up to this many tokens may take all KV heads
// A call with fewer units than twice its threads cuts them into parts, aiming at this many
// parts per thread, each of at least this many blocks and this many (row, block) pairs (a
// lone decode's three rows need 8 blocks, 512 keys, to pay for the barriers; see run).
constexpr int64_t kPartTasksPerThread = 2;
constexpr int64_t kMinPartBlocks = 3;
constexpr int64_t kMinPartWork = 24;

// x in every lane (written out: GCC compiles a lane-by-lane loop into masked inserts)
template <typename V>
inline V splat(float x);

template <>
inline v8f splat<v8f>(float x) {
  return v8f{x, x, x, x, x, x, x, x};
}

#if defined(__AVX512F__)
template <>
inline vf splat<vf>(float x) {
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
#endif

template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// W values of a row as float32. A bfloat16 is the top half of a float32: widening is exact
// (the same bits as at::BFloat16's conversion), so a bfloat16 pool is read in place.
inline vf load_row(const float* p) { return load<vf>(p); }

inline vf load_row(const at::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

// a * b + c rounded once, in every build: without the FMA instruction, the C library's fma
// (exact, slow), never a product and a sum rounded apart (other bits than an FMA build's).
inline v8f fmadd(v8f a, v8f b, v8f c) {
#if defined(__x86_64__) && defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  v8f r;
  for (int i = 0; i < 8; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

#if defined(__AVX512F__)
inline vf fmadd(vf a, vf b, vf c) {
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#endif

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial; ~1 ulp), the same
// instructions for every lane, so a value never depends on where it sits in a vector.
template <typename V, typename I>
inline V vexp(V x) {
  const V lo = splat<V>(-87.0f);
  x = x < lo ? lo : x;
  const V magic = splat<V>(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  V k = (x * splat<V>(1.44269504088896341f) + magic) - magic;
  V r = x - k * splat<V>(0.693359375f);
  r = r - k * splat<V>(-2.12194440e-4f);
  V p = splat<V>(1.9875691500e-4f);
  p = fmadd(p, r, splat<V>(1.3981999507e-3f));
  p = fmadd(p, r, splat<V>(8.3334519073e-3f));
  p = fmadd(p, r, splat<V>(4.1665795894e-2f));
  p = fmadd(p, r, splat<V>(1.6666665459e-1f));
  p = fmadd(p, r, splat<V>(5.0000001201e-1f));
  V y = fmadd(p, r * r, r) + splat<V>(1.0f);
  I bits = (__builtin_convertvector(k, I) + 127) << 23;
  return y * (V)bits;
}

template <typename scalar_t>
struct Args {
  const float* q;       // [T, Hq, D]
  const scalar_t* k;    // [slots, Hkv, D]
  const scalar_t* v;    // [slots, Hkv, D]
  float* out;           // [T, Hq, D]
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* table_lens;
  const int32_t* q_seq;
  const int32_t* q_pos;
  const int32_t* order;
  const int32_t* item_ptr;
  int64_t hkv, group, dim, page_size;
  float scale;
  float softcap;   // 0: none
  int64_t window;  // 0: every earlier key
};

// Slots of block ``b`` of sequence ``s``, page by page; positions past its pages read a
// valid slot that nothing uses.
template <typename scalar_t>
void block_slots(const Args<scalar_t>& a, int32_t s, int64_t b, int64_t* slots) {
  const int32_t* table = a.tables + s * a.table_stride;
  const int64_t pages = a.table_lens[s], ps = a.page_size;
  const int64_t past = static_cast<int64_t>(table[pages - 1]) * ps;
  int64_t page = b * BLOCK / ps, off = b * BLOCK % ps;
  for (int j = 0; j < BLOCK; ++page, off = 0) {
    const int run = static_cast<int>(std::min<int64_t>(ps - off, BLOCK - j));
    const int64_t at = page < pages ? static_cast<int64_t>(table[page]) * ps + off : past;
    const int64_t step = page < pages ? 1 : 0;
    for (int i = 0; i < run; ++i) slots[j + i] = at + i * step;
    j += run;
  }
}

// A block's rows widened to float32 in ``copy`` (a bfloat16 block read by several register
// tiles is widened once).
inline const float* const* widen(const at::BFloat16* const* rows, int64_t dim, float* copy,
                                 const float** to) {
  for (int j = 0; j < BLOCK; ++j) {
    for (int64_t e = 0; e < dim; e += W) store(copy + j * dim + e, load_row(rows[j] + e));
    to[j] = copy + j * dim;
  }
  return to;
}

// Scores: per (row, key), eight lanes, lane l accumulating q[e] * k[e] for e = l, l + 8, ...
// by FMA from zero, then the tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). A tile
// keeps NACC accumulators per row; under AVX-512 each holds two keys' lanes, [key i | key
// i + 4], against the row's eight query values in both halves.
#if defined(__AVX512F__)
inline vf load_q(const float* q) {
  return (vf)_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q))));
}

inline vf load_keys(const float* const* keys, int i, int64_t e) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(keys[i] + e)));
  const __m256d hi = _mm256_castps_pd(_mm256_loadu_ps(keys[i + NACC] + e));
  return (vf)_mm512_castpd_ps(_mm512_insertf64x4(lo, hi, 1));
}

inline vf load_keys(const at::BFloat16* const* keys, int i, int64_t e) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[i] + e));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[i + NACC] + e));
  const __m256i pair = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pair), 16));
}

// The tile's 8 scores by the tree above: pairwise sums within 128-bit lanes (as hadd) twice,
// then each key's lanes 0-3 sum plus its lanes 4-7 sum.
inline void store_tile(float* s, const vf* acc) {
  const auto hadd = [](__m512 x, __m512 y) {  // per 128-bit lane: [x0+x1, x2+x3, y0+y1, y2+y3]
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xdd));
  };
  const __m512 t0 = hadd((__m512)acc[0], (__m512)acc[1]);
  const __m512 t1 = hadd((__m512)acc[2], (__m512)acc[3]);
  // 128-bit lanes: [l0-3 of keys 0-3 | l4-7 of keys 0-3 | l0-3 of keys 4-7 | l4-7 of keys 4-7]
  const __m512 u = hadd(t0, t1);
  const __m512 lo = _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 hi = _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(3, 1, 3, 1));
  _mm256_storeu_ps(s, _mm256_add_ps(_mm512_castps512_ps256(lo), _mm512_castps512_ps256(hi)));
}
#else
inline vf load_q(const float* q) { return load<vf>(q); }

template <typename T>
inline vf load_keys(const T* const* keys, int i, int64_t e) {
  return load_row(keys[i] + e);
}

// The tile's 4 scores by the tree above.
inline void store_tile(float* s, const vf* acc) {
#if defined(__x86_64__) && defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
  const __m256 u = _mm256_hadd_ps(t0, t1);  // [l0-3 of keys 0-3 | l4-7 of keys 0-3]
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
#else
  for (int k = 0; k < TILE; ++k) {
    const v8f x = acc[k];
    s[k] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
#endif
}
#endif

// Scores of R query rows against a block's 64 keys; each key load serves all R rows.
template <int R, typename T>
inline void block_scores(const float* const* q, const T* const* keys, int64_t dim,
                         float* const* s) {
  for (int c = 0; c < BLOCK; c += TILE) {
    vf acc[R][NACC] = {};
    for (int64_t e = 0; e < dim; e += LANES) {
      vf qe[R];
      for (int r = 0; r < R; ++r) qe[r] = load_q(q[r] + e);
      for (int i = 0; i < NACC; ++i) {
        const vf k = load_keys(keys + c, i, e);
        for (int r = 0; r < R; ++r) acc[r][i] = fmadd(qe[r], k, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) store_tile(s[r] + c, acc[r]);
  }
}

// to[l] += x[l] in double, for the W lanes of x
inline void add_in_double(double* to, vf x) {
#if defined(__AVX512F__)
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256((__m512)x));
  const __m512d hi = _mm512_cvtps_pd(
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)x), 1)));
  _mm512_storeu_pd(to, _mm512_add_pd(_mm512_loadu_pd(to), lo));
  _mm512_storeu_pd(to + 8, _mm512_add_pd(_mm512_loadu_pd(to + 8), hi));
#else
  v8d t;
  std::memcpy(&t, to, sizeof t);
  t = t + __builtin_convertvector(x, v8d);
  std::memcpy(to, &t, sizeof t);
#endif
}

// Where a block's float32 partial goes: added in double to the row's running total (a unit
// that walks all its blocks), or kept as it is, per block, for a later sum in block order (a
// unit cut into parts that threads compute apart): the same additions in the same order.
inline void put(double* to, vf x) { add_in_double(to, x); }
inline void put(float* to, vf x) { store(to, x); }
inline void put_sum(double* to, float x) { *to += x; }
inline void put_sum(float* to, float x) { *to = x; }

// Dims c..c + NV * W of the first ``n`` weights of R rows times a block's values: per (row,
// dim), FMAs key by key in position order from zero (float32; dims are independent lanes),
// then put into ``total``; with SUM, each row's weights summed in key order too.
template <int R, int NV, bool SUM, typename T, typename Acc>
inline void values_pass(const float* const* p, const T* const* values, int64_t c, int n,
                        Acc* const* total, float* sum) {
  vf acc[R][NV] = {};
  float ws[R] = {};
  for (int j = 0; j < n; ++j) {
    vf x[NV];
    for (int i = 0; i < NV; ++i) x[i] = load_row(values[j] + c + i * W);
    for (int r = 0; r < R; ++r) {
      const vf w = splat<vf>(p[r][j]);
      for (int i = 0; i < NV; ++i) acc[r][i] = fmadd(w, x[i], acc[r][i]);
      if (SUM) ws[r] = ws[r] + p[r][j];
    }
  }
  for (int r = 0; r < R; ++r) {
    if (SUM) sum[r] = ws[r];
    for (int i = 0; i < NV; ++i) put(total[r] + c + i * W, acc[r][i]);
  }
}

// The first ``n`` weights of R rows times a block's values, put into ``total``; the weights'
// sum (float32, in key order) put into ``sums``. head_dim is a multiple of 32: passes of VECS
// vectors, and under AVX-512 one of 2 for the last 32 dims where 64 do not fit.
template <int R, typename T, typename Acc>
inline void block_values(const float* const* p, const T* const* values, int64_t dim, int n,
                         Acc* const* total, Acc* const* sums) {
  float sum[R];
  int64_t c;
  if (dim >= VECS * W) {
    values_pass<R, VECS, true>(p, values, 0, n, total, sum);
    for (c = VECS * W; c + VECS * W <= dim; c += VECS * W)
      values_pass<R, VECS, false>(p, values, c, n, total, nullptr);
  } else {
    values_pass<R, 2, true>(p, values, 0, n, total, sum);
    c = 2 * W;
  }
  for (; c < dim; c += 2 * W) values_pass<R, 2, false>(p, values, c, n, total, nullptr);
  for (int r = 0; r < R; ++r) put_sum(sums[r], sum[r]);
}

// Calls f(std::integral_constant<int, R>(), o) for rows o..o + R - 1 of ``n``, in register
// tiles of at most ROWS rows (a row's result is the same in any tile).
template <typename F>
inline void in_tiles(int64_t n, F f) {
  int64_t o = 0;
  for (; n - o >= ROWS; o += ROWS) f(std::integral_constant<int, ROWS>(), o);
  switch (n - o) {
    case 3:
      f(std::integral_constant<int, 3>(), o);
      break;
    case 2:
      f(std::integral_constant<int, 2>(), o);
      break;
    case 1:
      f(std::integral_constant<int, 1>(), o);
      break;
    default:
      break;
  }
}

// Calls f(rows) with a block's rows for ``n`` query rows: the pool's own rows, or for a
// bfloat16 block read by more than one register tile, rows widened once into ``copy``.
template <typename scalar_t, typename F>
inline void with_rows(const scalar_t* const* rows, int64_t n, int64_t dim,
                      std::vector<float>& copy, F f) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    f(rows);
  } else if (n <= ROWS) {
    f(rows);
  } else {
    const float* wide[BLOCK];
    f(widen(rows, dim, copy.data(), wide));
  }
}

// Asks for block ``b`` of sequence ``s`` (KV head ``h``) to be brought into cache while the
// current block is computed: a head's rows are a strided walk the hardware does not foresee.
// Into L2 (the T1 hint), not L1: on a Zen 4 a lone decode's attention (one head's 128 bytes of
// every 384) took 0.45x the time it took with the T0 hint (1,100 to 4,000 tokens of context),
// batches of decodes the same time.
template <typename scalar_t>
inline void prefetch_block(const Args<scalar_t>& a, const scalar_t* base, int64_t h, int32_t s,
                           int64_t b, int64_t* slots, int64_t nh = 1) {
  block_slots(a, s, b, slots);
  const int64_t bytes = nh * a.dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int j = 0; j < BLOCK; ++j) {
    const char* row = reinterpret_cast<const char*>(base + (slots[j] * a.hkv + h) * a.dim);
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 2);
  }
}

// Walks blocks b_lo..b_hi - 1 of an item's tokens in position order, handing ``visit`` each
// run of tokens that read the same block (consecutive in item order with equal slots: decodes
// under a shared prefix, a prefill tile) with the block's rows in the pool of KV head ``h``. With
// ``by_length`` a run also ends where the number of keys a token uses in the block changes.
// With ``ahead`` each sequence's next block is asked for as its block is reached (a unit over
// one KV head; a unit over several asks head by head, see attend_unit).
template <typename scalar_t, typename Visit>
void for_each_run(const Args<scalar_t>& a, const scalar_t* base, int64_t h, int64_t first,
                  int64_t count, int64_t b_lo, int64_t b_hi, bool by_length,
                  std::vector<int64_t>& run, Visit visit, bool ahead) {
  int64_t slots[BLOCK], held[BLOCK];
  held[0] = -1;  // no slot is negative: the first block is always located
  const scalar_t* rows[BLOCK];
  const scalar_t* const* view = rows;
  for (int64_t b = b_lo; b < b_hi; ++b) {
    int32_t seq_at = -1;
    int n_at = -1;
    run.clear();
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = a.order[first + i];
      if (a.q_pos[t] < b * BLOCK) continue;
      const int n = static_cast<int>(std::min<int64_t>(BLOCK, a.q_pos[t] + 1 - b * BLOCK));
      if (a.q_seq[t] != seq_at) {
        seq_at = a.q_seq[t];
        if (ahead && b + 1 < b_hi) prefetch_block(a, base, h, seq_at, b + 1, slots);
        block_slots(a, seq_at, b, slots);
        if (std::memcmp(slots, held, sizeof slots) != 0) {
          if (!run.empty()) visit(b, run, view);
          run.clear();
          for (int j = 0; j < BLOCK; ++j) rows[j] = base + (slots[j] * a.hkv + h) * a.dim;
          std::memcpy(held, slots, sizeof slots);
        }
      }
      if (by_length && n != n_at && !run.empty()) {
        visit(b, run, view);
        run.clear();
      }
      n_at = n;
      run.push_back(i);
    }
    if (!run.empty()) visit(b, run, view);
  }
}

// A thread's buffers, reused by its work units.
struct Scratch {
  std::vector<float> qs, s, copy;
  std::vector<double> total, sums;
  // per row of a run: its query (scores) or its weights (values), its scores, and where its
  // block's sums go: the running totals (a whole unit) or the block's partials (a part)
  std::vector<const float*> in;
  std::vector<float*> scores;
  std::vector<double*> totals, sums_at;
  std::vector<float*> partials, partial_sums;
  std::vector<int64_t> run;
  std::vector<int64_t> asked;  // per head of a unit: the (block, sequence) last asked for
};

// How much of a unit one call computes: all of it, or one part of its blocks in one of two
// phases (scores and their maximum over the part's keys; then, once every part's maximum is
// known, weights and values, each block's float32 sums kept apart for ``finish_row``).
enum class Phase { WHOLE, SCORES, VALUES };

// What the parts of a unit cut by blocks share between the phases (in buffers run allocates).
struct SharedUnit {
  float* scores;        // [rows, width]
  float* maxima;        // [parts, rows]: each part's maximum over its keys, per row
  float* partial;       // [rows, nb, dim]: each block's float32 sums of weights times values
  float* partial_sums;  // [rows, nb]: each block's float32 sum of weights
  int64_t parts;
};

// The shape of one work unit (``count`` query tokens from ``first`` in item order) against
// ``nh`` KV heads from ``h0``. Row r is head h0 + r / (count * g), token r % (count * g) / g,
// query head r % g.
struct UnitShape {
  int64_t first, count, h0, nh;
  int64_t g, per_head, rows, nb, width;
  int64_t b_first;  // the first block any row weighs (past 0 only under a sliding window)

  template <typename scalar_t>
  UnitShape(const Args<scalar_t>& a, int64_t first, int64_t count, int64_t h0, int64_t nh)
      : first(first), count(count), h0(h0), nh(nh), g(a.group), per_head(count * a.group),
        rows(count * a.group * nh) {
    int64_t max_len = 0, min_len = INT64_MAX;
    for (int64_t i = 0; i < count; ++i) {
      max_len = std::max<int64_t>(max_len, a.q_pos[a.order[first + i]] + 1);
      min_len = std::min<int64_t>(min_len, a.q_pos[a.order[first + i]] + 1);
    }
    nb = (max_len + BLOCK - 1) / BLOCK;
    width = nb * BLOCK;
    // Blocks wholly before every row's window are never read: a row's weights there are
    // zero, and leaving a zero out of its sums gives the same bits as adding it.
    b_first = a.window > 0 ? std::max<int64_t>(0, min_len - a.window) / BLOCK : 0;
  }
  template <typename scalar_t>
  int64_t token(const Args<scalar_t>& a, int64_t r) const {
    return a.order[first + r % per_head / g];
  }
  // where row r's query is read and its output written
  template <typename scalar_t>
  int64_t at(const Args<scalar_t>& a, int64_t r) const {
    return (token(a, r) * a.hkv * g + (h0 + r / per_head) * g + r % g) * a.dim;
  }
};

// Keys lo..hi - 1 of a score row: their exact maximum (eight lanes, then the rest; a maximum
// is the same in any order, so parts of a row may take theirs apart and combine them).
inline float max_of(const float* row, int64_t lo, int64_t hi) {
  const int64_t full = lo + std::max<int64_t>(0, hi - lo) / LANES * LANES;
  v8f mv = splat<v8f>(-__builtin_inff());
  for (int64_t c = lo; c < full; c += LANES) {
    const v8f x = load<v8f>(row + c);
    mv = x > mv ? x : mv;
  }
  float m = -__builtin_inff();
  for (int l = 0; l < LANES; ++l) m = std::max(m, mv[l]);
  for (int64_t c = full; c < hi; ++c) m = std::max(m, row[c]);
  return m;
}

// One work unit, or (with ``P`` other than WHOLE) one phase of its blocks b_lo..b_hi - 1, over
// the unit's ``nh`` KV heads: each block is computed for every head in turn, so its pages are
// read as whole token rows.
template <typename scalar_t, Phase P = Phase::WHOLE>
void attend_unit(const Args<scalar_t>& a, const UnitShape& u, Scratch& w,
                 const SharedUnit* shared = nullptr, int64_t part = 0, int64_t b_lo = 0,
                 int64_t b_hi = -1) {
  const int64_t g = u.g, dim = a.dim, per_head = u.per_head, rows = u.rows, nb = u.nb;
  const int64_t width = u.width, first = u.first, count = u.count, h0 = u.h0, nh = u.nh;
  if (b_hi < 0) b_hi = nb;
  if constexpr (P == Phase::WHOLE) b_lo = std::max(b_lo, u.b_first);
  const auto length = [&](int64_t r) -> int64_t { return a.q_pos[u.token(a, r)] + 1; };
  // the first key row r weighs (its window's start)
  const auto first_key = [&](int64_t r) -> int64_t {
    return a.window > 0 ? std::max<int64_t>(0, length(r) - a.window) : 0;
  };

  // (a row's scores are written before they are read: its own blocks, nothing past them)
  if constexpr (P == Phase::WHOLE) {
    w.s.resize(rows * width);
    w.total.assign(rows * dim, 0.0);
    w.sums.assign(rows, 0.0);
  }
  float* const s = P == Phase::WHOLE ? w.s.data() : shared->scores;
  if constexpr (!std::is_same_v<scalar_t, float>) w.copy.resize(BLOCK * dim);
  w.in.resize(per_head);
  w.scores.resize(per_head);
  if constexpr (P == Phase::WHOLE) {
    w.totals.resize(per_head);
    w.sums_at.resize(per_head);
  } else if constexpr (P == Phase::VALUES) {
    w.partials.resize(per_head);
    w.partial_sums.resize(per_head);
  }

  // Over several heads, the next block of ``base`` is asked for one head at a time, just
  // before that head's share of this block is computed: 64 rows of one head (128 lines of
  // bfloat16) at a time, not the three heads' 384 at once. A burst that long stalls the core
  // until most of it has arrived: on a Zen 4, 30 layers at b=8 x 512 took 6.5 ms in bursts of
  // one head against 9.4 in bursts of three (same bits).
  const auto ask_next = [&](const scalar_t* base, int64_t b, int64_t hh,
                            const std::vector<int64_t>& tokens) {
    if (nh == 1 || b + 1 >= b_hi) return;
    int64_t slots[BLOCK];
    for (const int64_t i : tokens) {
      const int64_t sq = a.q_seq[a.order[first + i]], key = ((b + 1) << 32) + sq;
      if (w.asked[hh] == key) continue;
      w.asked[hh] = key;
      prefetch_block(a, base, h0 + hh, static_cast<int32_t>(sq), b + 1, slots);
    }
  };
  // Calls f(n, keys or values of the block for that head) for each head after pointing w.in,
  // w.scores and the sums' destinations at the n rows of ``tokens`` for that head.
  const scalar_t* shifted[BLOCK];
  const auto per_head_of_block = [&](const scalar_t* base, int64_t b,
                                     const std::vector<int64_t>& tokens,
                                     const scalar_t* const* block, auto f) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      ask_next(base, b, hh, tokens);
      if (hh > 0)
        for (int j = 0; j < BLOCK; ++j) shifted[j] = block[j] + hh * dim;
      int64_t n = 0;
      for (const int64_t i : tokens)
        for (int64_t r = hh * per_head + i * g; r < hh * per_head + (i + 1) * g; ++r, ++n) {
          if constexpr (P != Phase::VALUES) w.in[n] = w.qs.data() + r * dim;
          w.scores[n] = s + r * width + b * BLOCK;
          if constexpr (P == Phase::VALUES) {
            w.partials[n] = shared->partial + (r * nb + b) * dim;
            w.partial_sums[n] = shared->partial_sums + r * nb + b;
          } else if constexpr (P == Phase::WHOLE) {
            w.totals[n] = w.total.data() + r * dim;
            w.sums_at[n] = &w.sums[r];
          }
        }
      f(n, hh > 0 ? static_cast<const scalar_t* const*>(shifted) : block);
    }
  };

  if constexpr (P != Phase::VALUES) {
    w.qs.resize(rows * dim);
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = a.q + u.at(a, r);
      for (int64_t e = 0; e < dim; ++e) w.qs[r * dim + e] = src[e] * a.scale;
    }
    w.asked.assign(nh, -1);
    for_each_run(a, a.k, h0, first, count, b_lo, b_hi, false, w.run,
                 [&](int64_t b, const std::vector<int64_t>& tokens, const scalar_t* const* block) {
                   per_head_of_block(a.k, b, tokens, block,
                                     [&](int64_t n, const scalar_t* const* k) {
                     with_rows(k, n, dim, w.copy, [&](auto keys) {
                       in_tiles(n, [&](auto tile, int64_t o) {
                         block_scores<decltype(tile)::value>(&w.in[o], keys, dim, &w.scores[o]);
                       });
                     });
                   });
                 }, nh == 1);
  }
  if constexpr (P != Phase::VALUES) {
    if (a.softcap > 0) {
      const vf cap = splat<vf>(a.softcap), inv = splat<vf>(1.0f / a.softcap);
      const vf one = splat<vf>(1.0f), two = splat<vf>(2.0f), top = splat<vf>(88.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t span = (length(r) + BLOCK - 1) / BLOCK * BLOCK;
        float* row = s + r * width;
        for (int64_t c = b_lo * BLOCK; c < std::min(span, b_hi * BLOCK); c += W) {
          vf x = two * (load<vf>(row + c) * inv);
          x = x > top ? top : x;  // tanh is 1 in float32 long before; exp stays finite
          const vf e = vexp<vf, vi>(x);
          store(row + c, cap * (one - two / (e + one)));
        }
      }
    }
  }
  if constexpr (P == Phase::SCORES) {
    for (int64_t r = 0; r < rows; ++r)
      shared->maxima[part * rows + r] =
          max_of(s + r * width, std::max(first_key(r), b_lo * BLOCK),
                 std::min(length(r), b_hi * BLOCK));
    return;
  }

  // the values' first block is on its way while the maxima and exps are computed
  {
    int64_t slots[BLOCK];
    int32_t seq_at = -1;
    for (int64_t i = 0; i < count; ++i) {
      const int32_t sq = a.q_seq[a.order[first + i]];
      if (sq != seq_at) prefetch_block(a, a.v, h0, seq_at = sq, b_lo, slots, nh);
    }
  }

  // each row: its exact maximum over keys 0..pos, then exp over its whole blocks
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = length(r), span = (len + BLOCK - 1) / BLOCK * BLOCK;
    float* row = s + r * width;
    float m = -__builtin_inff();
    if constexpr (P == Phase::WHOLE) {
      m = max_of(row, first_key(r), len);
    } else {
      for (int64_t p = 0; p < shared->parts; ++p) m = std::max(m, shared->maxima[p * rows + r]);
    }
    const vf mm = splat<vf>(m);
    for (int64_t c = b_lo * BLOCK; c < std::min(span, b_hi * BLOCK); c += W)
      store(row + c, vexp<vf, vi>(load<vf>(row + c) - mm));
    for (int64_t c = b_lo * BLOCK; c < std::min(first_key(r), b_hi * BLOCK); ++c) row[c] = 0.0f;
  }

  w.asked.assign(nh, -1);
  for_each_run(a, a.v, h0, first, count, b_lo, b_hi, true, w.run,
               [&](int64_t b, const std::vector<int64_t>& tokens, const scalar_t* const* block) {
                 const int64_t pos = a.q_pos[a.order[first + tokens[0]]];
                 const int n = static_cast<int>(std::min<int64_t>(BLOCK, pos + 1 - b * BLOCK));
                 per_head_of_block(a.v, b, tokens, block, [&](int64_t m, const scalar_t* const* v) {
                   with_rows(v, m, dim, w.copy, [&](auto values) {
                     in_tiles(m, [&](auto tile, int64_t o) {
                       if constexpr (P == Phase::VALUES)
                         block_values<decltype(tile)::value>(&w.scores[o], values, dim, n,
                                                             &w.partials[o], &w.partial_sums[o]);
                       else
                         block_values<decltype(tile)::value>(&w.scores[o], values, dim, n,
                                                             &w.totals[o], &w.sums_at[o]);
                     });
                   });
                 });
               }, nh == 1);

  if constexpr (P == Phase::WHOLE) {
    for (int64_t r = 0; r < rows; ++r) {
      float* o = a.out + u.at(a, r);
      for (int64_t e = 0; e < dim; ++e)
        o[e] = static_cast<float>(w.total[r * dim + e] / w.sums[r]);
    }
  }
}

// Row r of a unit computed in parts: its blocks' float32 partials added in double in block
// order, from zero, as a whole unit adds them as it goes; then the division.
template <typename scalar_t>
void finish_row(const Args<scalar_t>& a, const UnitShape& u, const SharedUnit& shared,
                int64_t r, std::vector<double>& total) {
  const int64_t dim = a.dim, blocks = (a.q_pos[u.token(a, r)] + BLOCK) / BLOCK;
  total.assign(dim, 0.0);
  double sum = 0.0;
  for (int64_t b = u.b_first; b < blocks; ++b) {
    const float* p = shared.partial + (r * u.nb + b) * dim;
    for (int64_t e = 0; e < dim; ++e) total[e] = total[e] + static_cast<double>(p[e]);
    sum += shared.partial_sums[r * u.nb + b];
  }
  float* o = a.out + u.at(a, r);
  for (int64_t e = 0; e < dim; ++e) o[e] = static_cast<float>(total[e] / sum);
}

// Does nothing to the tokens before they are attended (``exact_attention``: q, K and V are
// ready).
struct NoPrepare {
  static constexpr bool kActive = false;
  void operator()(int64_t) const {}
};

// How a call's units are cut into parts of their blocks, when there are too few units for
// the threads (a lone decode or verify: one unit per KV head, three of them on two threads):
// the parts' tasks, the buffers their two phases share, and the rows the finishing pass adds
// up. Each phase computes what a whole unit computes for those blocks, and the finishing pass
// adds the blocks' float32 sums in double in block order, as a whole unit does as it goes:
// the same bits. No tasks: the units run whole.
struct Parts {
  struct Task {
    int64_t unit, part, b_lo, b_hi;
  };
  std::vector<Task> tasks;
  std::vector<SharedUnit> shared;         // per unit
  std::vector<int64_t> row_start{0};      // per unit, its first row in the finishing pass
  std::unique_ptr<float[]> buffer;        // not zeroed: every value is written before it is read

  template <typename scalar_t>
  Parts(const Args<scalar_t>& a, const std::vector<UnitShape>& shapes, int threads) {
    const int64_t work = static_cast<int64_t>(shapes.size());
    if (threads <= 1 || work >= 2 * threads) return;
    int64_t want = (kPartTasksPerThread * threads + work - 1) / work;
    while ((want * work) % threads != 0) ++want;  // whole rounds of tasks, where parts allow
    std::vector<int64_t> parts(work), offsets(work);
    bool cut = false;
    int64_t size = 0;
    for (int64_t i = 0; i < work; ++i) {
      const UnitShape& u = shapes[i];
      const int64_t nb = u.nb - u.b_first;  // the blocks the unit reads
      parts[i] = std::max<int64_t>(
          1, std::min({want, nb / kMinPartBlocks, u.rows * nb / kMinPartWork}));
      cut = cut || parts[i] > 1;
      offsets[i] = size;
      size += u.rows * (u.width + parts[i] + u.nb * a.dim + u.nb);
    }
    if (!cut) return;
    buffer.reset(new float[size]);
    for (int64_t i = 0; i < work; ++i) {
      const UnitShape& u = shapes[i];
      for (int64_t p = 0; p < parts[i]; ++p)
        tasks.push_back({i, p, u.b_first + (u.nb - u.b_first) * p / parts[i],
                         u.b_first + (u.nb - u.b_first) * (p + 1) / parts[i]});
      float* scores = buffer.get() + offsets[i];
      float* maxima = scores + u.rows * u.width;
      float* partial = maxima + u.rows * parts[i];
      shared.push_back({scores, maxima, partial, partial + u.rows * u.nb * a.dim, parts[i]});
      row_start.push_back(row_start.back() + u.rows);
    }
  }
};

// ``prepare(t)`` for every token t (split over the threads), then every token attended: one
// parallel region, a barrier between the two (a prefill's tokens read each other's keys).
template <typename scalar_t, typename Prepare = NoPrepare>
void run(const Args<scalar_t>& a, int64_t items, int threads, int64_t tokens = 0,
         const Prepare& prepare = Prepare()) {
  // Pieces: the items, cut where two tokens of different sequences start on different pages
  // (they share no block, so nothing is lost). A decode item of 8 unrelated requests is then
  // 8 pieces, which threads share evenly.
  std::vector<int64_t> cuts;
  for (int64_t item = 0; item < items; ++item) {
    cuts.push_back(a.item_ptr[item]);
    for (int64_t i = a.item_ptr[item] + 1; i < a.item_ptr[item + 1]; ++i) {
      const int32_t s0 = a.q_seq[a.order[i - 1]], s1 = a.q_seq[a.order[i]];
      if (s0 != s1 && a.tables[s0 * a.table_stride] != a.tables[s1 * a.table_stride])
        cuts.push_back(i);
    }
  }
  cuts.push_back(a.item_ptr[items]);
  const int64_t pieces = static_cast<int64_t>(cuts.size()) - 1;
  // A piece of a few tokens is one unit over all KV heads, if there are pieces enough to keep
  // every thread busy: its blocks are then read as whole page rows (every head's keys of a
  // token side by side), which a Zen 5 streamed ~15% faster than one head's strided rows
  // (b=8, 512 of context; on a Zen 4, 2-4% slower); else, and for prefill tiles, one unit per
  // KV head.
  struct Unit {
    int64_t piece, head, heads;
  };
  std::vector<Unit> units;
  for (int64_t p = 0; p < pieces; ++p) {
    if (cuts[p + 1] - cuts[p] <= kWholeRowTokens && pieces >= 2 * std::max<int64_t>(threads, 1)) {
      units.push_back({p, 0, a.hkv});
    } else {
      for (int64_t h = 0; h < a.hkv; ++h) units.push_back({p, h, 1});
    }
  }
  const int64_t work = static_cast<int64_t>(units.size());
  std::vector<UnitShape> shapes;
  for (const Unit& u : units)
    shapes.emplace_back(a, cuts[u.piece], cuts[u.piece + 1] - cuts[u.piece], u.head, u.heads);
  const Parts parts(a, shapes, threads);
  const bool split = !parts.tasks.empty();
  const int64_t claims = split ? static_cast<int64_t>(parts.tasks.size()) : work;
  // Units (or parts) are claimed one at a time (they differ in cost); which thread runs one
  // never changes what it computes. Up to ``threads`` threads per call, whatever torch's own
  // thread setting (a decode step's attention is worth both cores). Phases: every token
  // prepared (its K and V in the pool before any is read: a prefill's tokens read each
  // other's keys); then the units whole, or their parts' scores, their values and the
  // finishing sums of their rows.
  const int nt = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, std::max(claims, tokens))));
  std::vector<Scratch> scratch(nt);
  std::vector<std::vector<double>> total(nt);
  const int64_t prepared = Prepare::kActive ? tokens : 0;
  const std::vector<int64_t>& starts = parts.row_start;
  auto body = [&](int phase, int64_t item, int worker) {
    if (phase == 0) {
      if constexpr (Prepare::kActive) prepare(item);
    } else if (!split) {
      attend_unit(a, shapes[item], scratch[worker]);
    } else if (phase == 3) {
      const int64_t i = std::upper_bound(starts.begin(), starts.end(), item) - starts.begin() - 1;
      finish_row(a, shapes[i], parts.shared[i], item - starts[i], total[worker]);
    } else {
      const Parts::Task& t = parts.tasks[item];
      if (phase == 1)
        attend_unit<scalar_t, Phase::SCORES>(a, shapes[t.unit], scratch[worker],
                                             &parts.shared[t.unit], t.part, t.b_lo, t.b_hi);
      else
        attend_unit<scalar_t, Phase::VALUES>(a, shapes[t.unit], scratch[worker],
                                             &parts.shared[t.unit], t.part, t.b_lo, t.b_hi);
    }
  };
  if (split)
    radixkv::run_phases(nt, {prepared, claims, claims, starts.back()}, body);
  else
    radixkv::run_phases(nt, {prepared, work}, body);
}

// The pool's shape, once its tensors are checked.
struct PoolShape {
  int64_t pages, page_size, hkv, dim;
};

void check_cpu(const torch::Tensor& t, const char* name) {
  ARG_CHECK(t.device().is_cpu(), name, ": must be a CPU tensor, got one on ", t.device());
}

// The K/V pool, the GQA group and the thread count of a call.
PoolShape check_pool(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t group,
                     int64_t threads) {
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  ARG_CHECK(k_cache.dim() == 4, "k_cache: [pages, page_size, Hkv, D], got ", k_cache.dim(),
            " dims");
  ARG_CHECK(k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16,
            "k_cache: float32 or bfloat16, got ", k_cache.scalar_type());
  ARG_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
            "v_cache: the shape and dtype of k_cache");
  ARG_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache, v_cache: contiguous");
  ARG_CHECK(k_cache.numel() > 0, "k_cache: an empty pool");
  const PoolShape pool{k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3)};
  ARG_CHECK(pool.dim % DIM_MULTIPLE == 0, "head_dim: a multiple of 32, got ", pool.dim);
  ARG_CHECK(group >= 1 && group <= 65536, "group: 1 to 65536 query heads per KV head, got ",
            group);
  ARG_CHECK(threads >= 1 && threads <= radixkv::kMaxThreads, "threads: 1 to ",
            radixkv::kMaxThreads, ", got ", threads);
  return pool;
}

const int32_t* index_data(const torch::Tensor& t, const char* name, int64_t dims) {
  check_cpu(t, name);
  ARG_CHECK(t.scalar_type() == torch::kInt, name, ": int32, got ", t.scalar_type());
  ARG_CHECK(t.dim() == dims, name, ": ", dims, " dims, got ", t.dim());
  ARG_CHECK(t.is_contiguous(), name, ": contiguous");
  return t.data_ptr<int32_t>();
}

// The plan of a call over ``tokens`` query tokens: every page id a request's table uses is in
// the pool, every token belongs to a request and attends a position its pages hold, ``order``
// lists each token once, and ``item_ptr`` cuts it into items from 0 to ``tokens``.
void check_plan(const PoolShape& pool, const torch::Tensor& tables,
                const torch::Tensor& table_lens, const torch::Tensor& q_seq,
                const torch::Tensor& q_pos, const torch::Tensor& order,
                const torch::Tensor& item_ptr, int64_t tokens) {
  const int32_t* tab = index_data(tables, "tables", 2);
  const int32_t* lens = index_data(table_lens, "table_lens", 1);
  const int32_t* seq = index_data(q_seq, "q_seq", 1);
  const int32_t* pos = index_data(q_pos, "q_pos", 1);
  const int32_t* ord = index_data(order, "order", 1);
  const int32_t* ptr = index_data(item_ptr, "item_ptr", 1);
  const int64_t requests = tables.size(0), width = tables.size(1);
  ARG_CHECK(table_lens.numel() == requests, "table_lens: one per table (", requests, "), got ",
            table_lens.numel());
  for (const auto& [t, name] : {std::pair{&q_seq, "q_seq"}, {&q_pos, "q_pos"}, {&order, "order"}})
    ARG_CHECK(t->numel() == tokens, name, ": one per query token (", tokens, "), got ",
              t->numel());
  ARG_CHECK(item_ptr.numel() >= 1, "item_ptr: at least [0]");
  for (int64_t s = 0; s < requests; ++s) {
    ARG_CHECK(lens[s] >= 0 && lens[s] <= width, "table_lens: ", lens[s], " pages for request ",
              s, ", outside 0..", width);
    for (int64_t p = 0; p < lens[s]; ++p) {
      const int32_t page = tab[s * width + p];
      ARG_CHECK(page >= 0 && page < pool.pages, "tables: page ", page, " of request ", s,
                " outside the pool's ", pool.pages, " pages");
    }
  }
  std::vector<char> seen(tokens, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    ARG_CHECK(seq[t] >= 0 && seq[t] < requests, "q_seq: request ", seq[t], " of token ", t,
              " outside 0..", requests - 1);
    const int64_t held = static_cast<int64_t>(lens[seq[t]]) * pool.page_size;
    ARG_CHECK(pos[t] >= 0 && pos[t] < held, "q_pos: position ", pos[t], " of token ", t,
              " outside the ", held, " its request's pages hold");
    ARG_CHECK(ord[t] >= 0 && ord[t] < tokens && !seen[ord[t]],
              "order: not each token once (", ord[t], " at ", t, ")");
    seen[ord[t]] = 1;
  }
  const int64_t items = item_ptr.numel() - 1;
  ARG_CHECK(ptr[0] == 0 && ptr[items] == tokens, "item_ptr: from 0 to the tokens (", tokens,
            "), got ", ptr[0], " to ", ptr[items]);
  for (int64_t i = 0; i < items; ++i)
    ARG_CHECK(ptr[i] <= ptr[i + 1], "item_ptr: decreases at item ", i);
}

// Calls ``go(args, k, v)`` with the kernel's arguments in the pool's dtype (float32 or
// bfloat16); every tensor was checked.
template <typename Go>
void with_args(const PoolShape& pool, const torch::Tensor& q, const torch::Tensor& out,
               const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& tables, const torch::Tensor& table_lens,
               const torch::Tensor& q_seq, const torch::Tensor& q_pos, const torch::Tensor& order,
               const torch::Tensor& item_ptr, int64_t group, double scale, double softcap,
               int64_t window, Go go) {
  auto call = [&](auto* k, auto* v) {
    using scalar_t = std::remove_pointer_t<decltype(k)>;
    const Args<scalar_t> a{q.data_ptr<float>(), k, v, out.data_ptr<float>(),
                           tables.data_ptr<int32_t>(), tables.size(1),
                           table_lens.data_ptr<int32_t>(), q_seq.data_ptr<int32_t>(),
                           q_pos.data_ptr<int32_t>(), order.data_ptr<int32_t>(),
                           item_ptr.data_ptr<int32_t>(), pool.hkv, group, pool.dim,
                           pool.page_size, static_cast<float>(scale),
                           static_cast<float>(softcap), window};
    go(a, k, v);
  };
  if (k_cache.scalar_type() == torch::kFloat) {
    call(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  } else {
    call(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  }
}

void check_variant(double softcap, int64_t window) {
  ARG_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap: 0 (none) or positive, got ",
            softcap);
  ARG_CHECK(window >= 0, "window: 0 (none) or a number of keys, got ", window);
}

torch::Tensor exact_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor tables, torch::Tensor table_lens,
                              torch::Tensor q_seq, torch::Tensor q_pos, torch::Tensor order,
                              torch::Tensor item_ptr, int64_t group, double scale,
                              int64_t threads, double softcap, int64_t window) {
  const PoolShape pool = check_pool(k_cache, v_cache, group, threads);
  check_variant(softcap, window);
  check_cpu(q, "q");
  ARG_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
            "q: float32 [T, Hq, D], contiguous");
  ARG_CHECK(q.size(1) == pool.hkv * group && q.size(2) == pool.dim,
            "q: heads or head_dim mismatch (", q.size(1), " x ", q.size(2), " for ",
            pool.hkv * group, " x ", pool.dim, ")");
  check_plan(pool, tables, table_lens, q_seq, q_pos, order, item_ptr, q.size(0));
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  with_args(pool, q, out, k_cache, v_cache, tables, table_lens, q_seq, q_pos, order, item_ptr,
            group, scale, softcap, window, [&](const auto& a, auto*, auto*) {
              run(a, item_ptr.numel() - 1, static_cast<int>(threads));
            });
  return out;
}

// RoPE (half-split pairs (i, i + D/2), as transformers' rotate_half) of one head's D values:
// each output one rounded product minus/plus another, the same for q and k on every token.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// One token's new q, K and V from its row of the fused projection [q heads | k heads | v
// heads]: q rotated into ``q``, K rotated and V copied into the pool at its slot (rounded to
// the pool's dtype as torch rounds: to nearest even).
template <typename scalar_t>
struct RopeWrite {
  static constexpr bool kActive = true;
  const float* qkv;
  int64_t ldqkv;
  const float* cos;  // [T, D/2]
  const float* sin;
  const int64_t* slots;
  scalar_t* k;  // [slots, Hkv, D]
  scalar_t* v;
  float* q;  // [T, Hq, D]
  int64_t hq, hkv, dim;

  void operator()(int64_t t) const {
    const float* row = qkv + t * ldqkv;
    const float* c = cos + t * (dim / 2);
    const float* s = sin + t * (dim / 2);
    for (int64_t h = 0; h < hq; ++h) rotate(row + h * dim, c, s, dim, q + (t * hq + h) * dim);
    scalar_t* kt = k + slots[t] * hkv * dim;
    scalar_t* vt = v + slots[t] * hkv * dim;
    float rotated[kMaxDim];
    for (int64_t h = 0; h < hkv; ++h) {
      rotate(row + (hq + h) * dim, c, s, dim, rotated);
      const float* vs = row + (hq + hkv + h) * dim;
      for (int64_t e = 0; e < dim; ++e) {
        kt[h * dim + e] = static_cast<scalar_t>(rotated[e]);
        vt[h * dim + e] = static_cast<scalar_t>(vs[e]);
      }
    }
  }
};

// Attention for a layer straight from its fused q/k/v projection rows ``qkv`` [T, (Hq + 2
// Hkv) * D]: RoPE on q and k (``cos``/``sin`` [T, D/2] of each token's position), the new K
// and V written into the pool at ``slots``, then every token attended as ``exact_attention``
// does. One call, one parallel region: no tensor ops in between.
torch::Tensor rope_write_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                torch::Tensor slots, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor tables, torch::Tensor table_lens,
                                torch::Tensor q_seq, torch::Tensor q_pos, torch::Tensor order,
                                torch::Tensor item_ptr, int64_t group, double scale,
                                int64_t threads, double softcap, int64_t window) {
  const PoolShape pool = check_pool(k_cache, v_cache, group, threads);
  check_variant(softcap, window);
  const int64_t hkv = pool.hkv, dim = pool.dim, hq = hkv * group;
  const int64_t capacity = pool.pages * pool.page_size;
  check_cpu(qkv, "qkv");
  ARG_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat &&
                (qkv.stride(1) == 1 || qkv.size(1) <= 1) && qkv.size(1) == (hq + 2 * hkv) * dim,
            "qkv: float32 [T, (Hq + 2 Hkv) * D] with unit column stride");
  ARG_CHECK(dim <= kMaxDim, "head_dim: at most ", kMaxDim, " in the fused call, got ", dim);
  const int64_t T = qkv.size(0);
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}}) {
    check_cpu(*t, name);
    ARG_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() &&
                  t->numel() == T * dim / 2,
              name, ": contiguous float32, T * D/2 values ([T, D/2] or [T, 1, D/2])");
  }
  check_cpu(slots, "slots");
  ARG_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
            "slots: int64 [T], contiguous");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    ARG_CHECK(sp[t] >= 0 && sp[t] < capacity, "slots: ", sp[t], " outside the pool's ",
              capacity);
  check_plan(pool, tables, table_lens, q_seq, q_pos, order, item_ptr, T);
  auto q = torch::empty({T, hq, dim}, qkv.options());
  auto out = torch::empty_like(q);
  if (T == 0) return out;
  with_args(pool, q, out, k_cache, v_cache, tables, table_lens, q_seq, q_pos, order, item_ptr,
            group, scale, softcap, window, [&](const auto& a, auto* k, auto* v) {
              using scalar_t = std::remove_pointer_t<decltype(k)>;
              const RopeWrite<scalar_t> prepare{qkv.data_ptr<float>(), qkv.stride(0),
                                                cos.data_ptr<float>(), sin.data_ptr<float>(),
                                                sp, k, v, q.data_ptr<float>(), hq, hkv, dim};
              run(a, item_ptr.numel() - 1, static_cast<int>(threads), T, prepare);
            });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("exact_attention", &exact_attention,
        "Batch-invariant paged attention (see engine/model/cpu/exact_attention.py)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"),
        py::arg("table_lens"), py::arg("q_seq"), py::arg("q_pos"), py::arg("order"),
        py::arg("item_ptr"), py::arg("group"), py::arg("scale"), py::arg("threads"),
        py::arg("softcap") = 0.0, py::arg("window") = 0);
  m.def("rope_write_attend", &rope_write_attend,
        "RoPE, the K/V write and exact_attention in one call, from fused q/k/v rows",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("tables"), py::arg("table_lens"), py::arg("q_seq"),
        py::arg("q_pos"), py::arg("order"), py::arg("item_ptr"), py::arg("group"),
        py::arg("scale"), py::arg("threads"), py::arg("softcap") = 0.0, py::arg("window") = 0);
}
