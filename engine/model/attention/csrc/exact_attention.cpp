// Batch-invariant paged attention for the CPU, as one native kernel.
//
// Every query row (a token's query head) is computed by the same code in the same order,
// whatever else shares the call: each score by FMAs over head_dim in eight lanes and a fixed
// reduction tree, the exact maximum over its keys 0..pos, exp by one vectorised routine,
// and the weighted sum of values key by key in position order (float32 inside each 64-key
// block, double across blocks). Work items only decide which rows share a gathered key
// block, never what a row computes, so the output depends on the row's own keys alone.
// Built per machine with -march=native and -ffp-contract=off (contractions are explicit).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

constexpr int BLOCK = 64;  // keys per block: the unit of the float32 partial sums
constexpr int LANES = 8;
constexpr int CHUNK = 32;  // keys (scores) or head dims (values) per register tile

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

inline v8f load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

inline v8f fmadd(v8f a, v8f b, v8f c) {
#if defined(__x86_64__) && defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial; ~1 ulp), the same
// instructions for every lane, so a value never depends on where it sits in a vector.
inline v8f vexp(v8f x) {
  const v8f lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8f k = (x * splat(1.44269504088896341f) + magic) - magic;
  v8f r = x - k * splat(0.693359375f);
  r = r - k * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  v8f y = fmadd(p, r * r, r) + splat(1.0f);
  v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  return y * (v8f)bits;
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
};

// Slots of block ``b`` of sequence ``s``; positions past its pages read a valid slot that
// nothing uses.
template <typename scalar_t>
void block_slots(const Args<scalar_t>& a, int32_t s, int64_t b, int64_t* slots) {
  const int32_t* table = a.tables + s * a.table_stride;
  const int64_t pages = a.table_lens[s];
  int64_t page = b * BLOCK / a.page_size, off = b * BLOCK % a.page_size;
  for (int j = 0; j < BLOCK; ++j) {
    slots[j] = page < pages ? static_cast<int64_t>(table[page]) * a.page_size + off
                            : static_cast<int64_t>(table[pages - 1]) * a.page_size;
    if (++off == a.page_size) {
      off = 0;
      ++page;
    }
  }
}

// Rows of one KV head for a block's slots, as float32: pointers into a float32 pool, or
// into ``copy`` for a bfloat16 pool.
template <typename scalar_t>
void locate(const scalar_t* base, const Args<scalar_t>& a, int64_t h, const int64_t* slots,
            const float** rows, std::vector<float>& copy) {
  const int64_t dim = a.dim;
  for (int j = 0; j < BLOCK; ++j) {
    const scalar_t* from = base + (slots[j] * a.hkv + h) * dim;
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[j] = from;
    } else {
      float* to = copy.data() + j * dim;
      for (int64_t e = 0; e < dim; ++e) to[e] = static_cast<float>(from[e]);
      rows[j] = to;
    }
  }
}

// Eight lane-wise partial dot products reduced to eight sums, each as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline v8f reduce8(const v8f* acc) {
#if defined(__x86_64__) && defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)acc[0], (__m256)acc[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)acc[2], (__m256)acc[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)acc[4], (__m256)acc[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)acc[6], (__m256)acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                            _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8f out;
  for (int k = 0; k < LANES; ++k) {
    const v8f x = acc[k];
    out[k] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
  return out;
#endif
}

// Scores of one query row against a block's 64 keys: per key, FMAs over head_dim in eight
// lanes, then ``reduce8``.
inline void block_scores(const float* q, const float* const* keys, int64_t dim, float* s) {
  for (int c = 0; c < BLOCK; c += LANES) {
    v8f acc[LANES] = {};
    for (int64_t e = 0; e < dim; e += LANES) {
      const v8f qe = load(q + e);
      for (int k = 0; k < LANES; ++k) acc[k] = fmadd(qe, load(keys[c + k] + e), acc[k]);
    }
    store(s + c, reduce8(acc));
  }
}

// The first ``n`` weights of R rows times a block's values, added in double to ``total``;
// the weights' sum (float32, in key order) added to ``sums``.
template <int R>
inline void block_values(const float* const* p, const float* const* values, int64_t dim, int n,
                         double* const* total, double* sums) {
  v8f sum[R] = {};
  for (int64_t c = 0; c < dim; c += CHUNK) {
    v8f acc[R][CHUNK / LANES] = {};
    for (int j = 0; j < n; ++j) {
      const float* vv = values[j] + c;
      const v8f x0 = load(vv), x1 = load(vv + 8), x2 = load(vv + 16), x3 = load(vv + 24);
      for (int r = 0; r < R; ++r) {
        const v8f w = splat(p[r][j]);
        acc[r][0] = fmadd(w, x0, acc[r][0]);
        acc[r][1] = fmadd(w, x1, acc[r][1]);
        acc[r][2] = fmadd(w, x2, acc[r][2]);
        acc[r][3] = fmadd(w, x3, acc[r][3]);
        if (c == 0) sum[r] = sum[r] + w;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < CHUNK / LANES; ++i) {
        double* to = total[r] + c + i * LANES;
        v8d t;
        std::memcpy(&t, to, sizeof t);
        t = t + __builtin_convertvector(acc[r][i], v8d);
        std::memcpy(to, &t, sizeof t);
      }
  }
  for (int r = 0; r < R; ++r) sums[r] += sum[r][0];
}

// Walks the blocks of an item's tokens in position order, handing each token the rows of its
// block; a block whose slots equal the last one's is located once (shared prefixes).
template <typename scalar_t, typename Visit>
void for_each_block(const Args<scalar_t>& a, const scalar_t* base, int64_t h, int64_t first,
                    int64_t count, int64_t nb, std::vector<float>& copy, Visit visit) {
  int64_t slots[BLOCK], held[BLOCK];
  held[0] = -1;  // no slot is negative: the first block is always located
  const float* rows[BLOCK];
  int32_t seq_at = -1;
  int64_t block_at = -1;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = a.order[first + i];
      if (a.q_pos[t] < b * BLOCK) continue;
      if (a.q_seq[t] != seq_at || b != block_at) {
        seq_at = a.q_seq[t];
        block_at = b;
        block_slots(a, seq_at, b, slots);
        if (std::memcmp(slots, held, sizeof slots) != 0) {
          locate(base, a, h, slots, rows, copy);
          std::memcpy(held, slots, sizeof slots);
        }
      }
      visit(b, i, t, static_cast<const float* const*>(rows));
    }
  }
}

// One work item (some query tokens) against one KV head.
template <typename scalar_t>
void attend_item(const Args<scalar_t>& a, int64_t item, int64_t h) {
  const int64_t first = a.item_ptr[item], count = a.item_ptr[item + 1] - first;
  const int64_t g = a.group, dim = a.dim, hq = a.hkv * g, rows = count * g;
  int64_t max_len = 0;
  for (int64_t i = 0; i < count; ++i)
    max_len = std::max<int64_t>(max_len, a.q_pos[a.order[first + i]] + 1);
  const int64_t nb = (max_len + BLOCK - 1) / BLOCK, width = nb * BLOCK;

  std::vector<float> qs(rows * dim), s(rows * width), copy;
  if constexpr (!std::is_same_v<scalar_t, float>) copy.resize(BLOCK * dim);
  std::vector<double> total(rows * dim, 0.0), sums(rows, 0.0);
  std::vector<const float*> prow(rows);
  std::vector<double*> trow(rows);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = a.order[first + i];
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = i * g + j;
      const float* src = a.q + (t * hq + h * g + j) * dim;
      for (int64_t e = 0; e < dim; ++e) qs[r * dim + e] = src[e] * a.scale;
      trow[r] = total.data() + r * dim;
    }
  }

  for_each_block(a, a.k, h, first, count, nb, copy,
                 [&](int64_t b, int64_t i, int64_t, const float* const* keys) {
                   for (int64_t j = 0; j < g; ++j) {
                     const int64_t r = i * g + j;
                     block_scores(qs.data() + r * dim, keys, dim, s.data() + r * width + b * BLOCK);
                   }
                 });

  // each row: its exact maximum over keys 0..pos, then exp over its whole blocks
  for (int64_t i = 0; i < count; ++i) {
    const int64_t len = a.q_pos[a.order[first + i]] + 1;
    const int64_t full = len / LANES * LANES, span = (len + BLOCK - 1) / BLOCK * BLOCK;
    for (int64_t j = 0; j < g; ++j) {
      float* row = s.data() + (i * g + j) * width;
      v8f mv = splat(-__builtin_inff());
      for (int64_t c = 0; c < full; c += LANES) {
        const v8f x = load(row + c);
        mv = x > mv ? x : mv;
      }
      float m = -__builtin_inff();
      for (int l = 0; l < LANES; ++l) m = std::max(m, mv[l]);
      for (int64_t c = full; c < len; ++c) m = std::max(m, row[c]);
      const v8f mm = splat(m);
      for (int64_t c = 0; c < span; c += LANES) store(row + c, vexp(load(row + c) - mm));
    }
  }

  for_each_block(a, a.v, h, first, count, nb, copy,
                 [&](int64_t b, int64_t i, int64_t t, const float* const* values) {
                   const int n =
                       static_cast<int>(std::min<int64_t>(BLOCK, a.q_pos[t] + 1 - b * BLOCK));
                   const int64_t r0 = i * g;
                   for (int64_t j = 0; j < g; ++j) prow[r0 + j] = s.data() + (r0 + j) * width + b * BLOCK;
                   int64_t j = 0;
                   for (; j + 3 <= g; j += 3)
                     block_values<3>(&prow[r0 + j], values, dim, n, &trow[r0 + j], &sums[r0 + j]);
                   for (; j + 2 <= g; j += 2)
                     block_values<2>(&prow[r0 + j], values, dim, n, &trow[r0 + j], &sums[r0 + j]);
                   for (; j < g; ++j)
                     block_values<1>(&prow[r0 + j], values, dim, n, &trow[r0 + j], &sums[r0 + j]);
                 });

  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = a.order[first + i];
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = i * g + j;
      float* o = a.out + (t * hq + h * g + j) * dim;
      for (int64_t e = 0; e < dim; ++e) o[e] = static_cast<float>(trow[r][e] / sums[r]);
    }
  }
}

template <typename scalar_t>
void run(const Args<scalar_t>& a, int64_t items) {
  const int64_t work = items * a.hkv;
  std::atomic<int64_t> next{0};
  // items are claimed dynamically (they differ in cost); which thread runs one never
  // changes what it computes
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t w = next.fetch_add(1); w < work; w = next.fetch_add(1))
      attend_item(a, w / a.hkv, w % a.hkv);
  });
}

torch::Tensor exact_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor tables, torch::Tensor table_lens,
                              torch::Tensor q_seq, torch::Tensor q_pos, torch::Tensor order,
                              torch::Tensor item_ptr, int64_t group, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q: float32 [T, Hq, D], contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [pages, page_size, Hkv, D] of one dtype");
  const int64_t hkv = k_cache.size(2), dim = k_cache.size(3);
  TORCH_CHECK(q.size(1) == hkv * group && q.size(2) == dim, "q: heads or head_dim mismatch");
  TORCH_CHECK(dim % CHUNK == 0, "head_dim: must be a multiple of 32");
  for (const auto& t : {tables, table_lens, q_seq, q_pos, order, item_ptr})
    TORCH_CHECK(t.scalar_type() == torch::kInt && t.is_contiguous(), "index tensors: int32");
  auto out = torch::empty_like(q);
  const int64_t items = item_ptr.numel() - 1;
  auto fill = [&](auto* k, auto* v) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    Args<scalar_t> a{q.data_ptr<float>(), k, v, out.data_ptr<float>(),
                     tables.data_ptr<int32_t>(), tables.size(1),
                     table_lens.data_ptr<int32_t>(), q_seq.data_ptr<int32_t>(),
                     q_pos.data_ptr<int32_t>(), order.data_ptr<int32_t>(),
                     item_ptr.data_ptr<int32_t>(), hkv, group, dim, k_cache.size(1),
                     static_cast<float>(scale)};
    run(a, items);
  };
  if (k_cache.scalar_type() == torch::kFloat) {
    fill(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    fill(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "k_cache: float32 or bfloat16");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact_attention", &exact_attention,
        "Batch-invariant paged attention (see engine/model/attention/native.py)");
}
