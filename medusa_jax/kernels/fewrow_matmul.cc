// Few-row matrix products for decoding on CPU, called from XLA through its typed FFI.
//
//   y[g] = x[g] @ w[g]      w [G, K, N]  ("nn": the backbone's [in, out] weights)
//   y[g] = x[g] @ w[g]^T    w [G, N, K]  ("nt": a tied embedding used as the output layer)
//
// x [G, M, K] float32 with M small (1 to ~65 rows: a decoding step's tokens), w float32 or
// bfloat16 (widened to float32 in registers: half the bytes read), y [G, M, N] float32.
//
// A decoding step is bound by reading the weights, so each weight element is read from
// memory once for all M rows: the rows stay in L1/L2 while a tile of weights streams past
// them, no packing copy of the weights is made, and the output columns (nn) or weight rows
// (nt) are split over the threads of the pool XLA hands the handler.
//
// Every output element is accumulated in the same order (k = 0, 1, ... in one float32
// accumulator per element for nn; fixed-lane partial sums then a fixed reduction for nt),
// whatever M, the tile a row falls in, or the thread that computes it: a row's result does
// not depend on how many other rows are in the product, so a 5-token verification pass and
// a 1-token decoding pass agree bit for bit on the tokens they share.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The packed layout is the same for every instruction set (the Python side packs it).
constexpr int PW = 64;   // panel width, in columns
constexpr int KC = 128;  // weight rows per chunk of a panel: KC * PW floats (32 KiB) in L1

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int NN_ROWS = 6, NN_VECS = 4;  // nn tile: 6 rows x 64 columns = 24 accumulators
constexpr int NT_ROWS = 4, NT_COLS = 4;  // nt tile: 4 rows x 4 weight rows = 16 accumulators
#elif defined(__AVX__)
constexpr int VW = 8;
constexpr int NN_ROWS = 3, NN_VECS = 4;  // half a panel at a time
constexpr int NT_ROWS = 3, NT_COLS = 3;
#else
constexpr int VW = 4;
constexpr int NN_ROWS = 2, NN_VECS = 4;
constexpr int NT_ROWS = 2, NT_COLS = 2;
#endif
static_assert(PW % (NN_VECS * VW) == 0, "a panel is a whole number of tiles");

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

// Products below this many weight bytes run on the calling thread alone: waking a pool
// thread costs more than it saves.
constexpr int64_t kParallelBytes = 256 * 1024;

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const uint16_t* p) {  // bfloat16 -> float32: the high half of the bits
#if defined(__AVX512F__)
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

inline float scalar(const float* p) { return *p; }

inline float scalar(const uint16_t* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// One broadcast instruction (`vf{} + s` is a real addition, since -0 + 0 = +0).
#if defined(__AVX512F__)
inline vf splat(float s) { return (vf)_mm512_set1_ps(s); }
#elif defined(__AVX__)
inline vf splat(float s) { return (vf)_mm256_set1_ps(s); }
#else
inline vf splat(float s) { return vf{s, s, s, s}; }
#endif

inline float lane_sum(vf v) {  // a fixed reduction order
  float s = 0.0f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// ------------------------------------------------------------------ nn: packed panels
//
// The [K, N] weight is packed at load time into panels of PW columns, [N/PW][K][PW] (N
// padded with zeros to a multiple of PW): each panel is one contiguous stream, which the
// hardware prefetchers follow and which maps onto the caches without the set conflicts
// that power-of-two row strides cause. A panel's rows are read KC at a time, and that chunk
// (KC * PW weights, in L1) serves every block of rows before the next chunk is read.

// acc[r, c .. c + V*VW) += x[r, k0 .. k1) @ panel[k0 .. k1, c .. c + V*VW), rows [0, R).
// The first row block of a chunk (`prefetch`) also asks for the next chunk, into L2: the
// row blocks after it compute from L1 while the next weights are already on their way,
// so memory never waits for arithmetic.
template <typename W, int R, int V, bool prefetch>
inline void nn_tile(const float* x, int64_t K, const W* panel, float* acc_rows, int64_t c,
                    int64_t k0, int64_t k1) {
  vf acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = load(acc_rows + r * PW + c + j * VW);
  const W* wk = panel + k0 * PW + c;
  for (int64_t k = k0; k < k1; ++k, wk += PW) {
    if constexpr (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(wk + KC * PW);
      for (int line = 0; line < int(V * VW * sizeof(W)); line += 64)
        __builtin_prefetch(ahead + line, 0, 2);
    }
    vf wv[V];
    for (int j = 0; j < V; ++j) wv[j] = load(wk + j * VW);
    for (int r = 0; r < R; ++r) {
      const vf xb = splat(x[r * K + k]);
      for (int j = 0; j < V; ++j) acc[r][j] += xb * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) store(acc_rows + r * PW + c + j * VW, acc[r][j]);
}

// A tile of exactly `rows` (1 .. R) rows.
template <typename W, int R, bool prefetch>
void nn_rows(const float* x, int64_t K, const W* panel, float* acc, int64_t c, int64_t k0,
             int64_t k1, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return nn_tile<W, R, NN_VECS, prefetch>(x, K, panel, acc, c, k0, k1);
    nn_rows<W, R - 1, prefetch>(x, K, panel, acc, c, k0, k1, rows);
  }
}

// All M rows times panels [p0, p1); `acc` is M * PW floats of scratch.
template <typename W>
void nn_block(const float* x, const W* w, float* y, float* acc, int64_t M, int64_t K,
              int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = w + p * K * PW;
    std::fill(acc, acc + M * PW, 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t k1 = std::min(K, k0 + KC);
      for (int64_t c = 0; c < PW; c += NN_VECS * VW) {
        // row blocks of near-equal height: a block of 1 or 2 rows has too few
        // accumulators to hide the FMA latency, so 8 rows are 4 + 4, not 6 + 2
        const int64_t blocks = (M + NN_ROWS - 1) / NN_ROWS;
        for (int64_t b = 0, m = 0; b < blocks; ++b) {
          const int64_t rows = (M - m + blocks - b - 1) / (blocks - b);
          if (b == 0)
            nn_rows<W, NN_ROWS, true>(x, K, panel, acc, c, k0, k1, rows);
          else
            nn_rows<W, NN_ROWS, false>(x + m * K, K, panel, acc + m * PW, c, k0, k1, rows);
          m += rows;
        }
      }
    }
    const int64_t cols = std::min<int64_t>(PW, N - p * PW);
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(y + m * N + p * PW, acc + m * PW, cols * sizeof(float));
  }
}

// ------------------------------------------------------------------ nt: w [N, K]

// Rows [0, R) of x times weight rows [n, n + C): y[r, n + j] = x[r] . w[n + j].
template <typename W, int R, int C>
inline void nt_tile(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = vf{};
  const W* wn = w + n * K;
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vf wv[C];
    for (int j = 0; j < C; ++j) wv[j] = load(wn + j * K + k);
    for (int r = 0; r < R; ++r) {
      const vf xv = load(x + r * K + k);
      for (int j = 0; j < C; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) {
      float s = lane_sum(acc[r][j]);
      for (int64_t t = k; t < K; ++t) s = std::fma(x[r * K + t], scalar(wn + j * K + t), s);
      y[r * N + n + j] = s;
    }
}

template <typename W, int R>
void nt_rows(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  for (; n + NT_COLS <= n1; n += NT_COLS) nt_tile<W, R, NT_COLS>(x, w, y, K, N, n);
  for (; n < n1; ++n) nt_tile<W, R, 1>(x, w, y, K, N, n);
}

template <typename W, int R>
void nt_tail(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0,
             int64_t n1, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return nt_rows<W, R>(x, w, y, K, N, n0, n1);
    nt_tail<W, R - 1>(x, w, y, K, N, n0, n1, rows);
  }
}

// All M rows times weight rows [n0, n1), the weight tile kept in L1 across row blocks.
template <typename W>
void nt_block(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NT_COLS) {
    const int64_t e = std::min(n1, n + NT_COLS);
    int64_t m = 0;
    for (; m + NT_ROWS <= M; m += NT_ROWS)
      nt_rows<W, NT_ROWS>(x + m * K, w, y + m * N, K, N, n, e);
    nt_tail<W, NT_ROWS - 1>(x + m * K, w, y + m * N, K, N, n, e, M - m);
  }
}

// ------------------------------------------------------------------ the whole product

inline int64_t panels(int64_t N) { return (N + PW - 1) / PW; }

struct Product {
  const float* x;
  const void* w;  // nn: [G][panels(N)][K][PW]; nt: [G][N][K]
  float* y;
  int64_t G, M, K, N;
  bool transposed, bf16;
  int64_t units_per_group, unit_span;  // work units: ranges of panels (nn) / weight rows (nt)

  int64_t units() const { return G * units_per_group; }
  int64_t span_end() const { return transposed ? N : panels(N); }

  void run_unit(int64_t u) const {
    const int64_t g = u / units_per_group;
    const int64_t a = (u % units_per_group) * unit_span;
    const int64_t b = std::min(span_end(), a + unit_span);
    const float* xg = x + g * M * K;
    float* yg = y + g * M * N;
    const int64_t woff = g * K * (transposed ? N : panels(N) * PW);
    std::unique_ptr<float[]> acc(transposed ? nullptr : new float[M * PW]);
    if (bf16) {
      const uint16_t* wg = static_cast<const uint16_t*>(w) + woff;
      transposed ? nt_block(xg, wg, yg, M, K, N, a, b)
                 : nn_block(xg, wg, yg, acc.get(), M, K, N, a, b);
    } else {
      const float* wg = static_cast<const float*>(w) + woff;
      transposed ? nt_block(xg, wg, yg, M, K, N, a, b)
                 : nn_block(xg, wg, yg, acc.get(), M, K, N, a, b);
    }
  }
};

Product plan(const float* x, const void* w, float* y, int64_t G, int64_t M, int64_t K,
             int64_t N, bool transposed, bool bf16, int64_t threads) {
  Product p{x, w, y, G, M, K, N, transposed, bf16, 1, 0};
  p.unit_span = p.span_end();
  const int64_t bytes = G * K * N * (bf16 ? 2 : 4);
  if (threads > 1 && bytes >= kParallelBytes) {
    // a few units per thread, each a whole number of tiles (contiguous weight streams)
    const int64_t tile = transposed ? NT_COLS : 1;
    const int64_t want = std::max<int64_t>(1, (2 * threads + G - 1) / G);
    const int64_t tiles = (p.span_end() + tile - 1) / tile;
    const int64_t per = std::max<int64_t>(1, (tiles + want - 1) / want);
    p.unit_span = per * tile;
    p.units_per_group = (p.span_end() + p.unit_span - 1) / p.unit_span;
  }
  return p;
}

// A call's work (a `Product` or an `Attention`: `units()` and `run_unit(u)`) on the
// calling thread and the pool's. Units are claimed from a shared counter; the caller waits
// only for units already claimed, so a pool thread that starts late (or never) cannot
// stall it, and one that starts after the work is done finds nothing to do.
template <typename Work>
struct Job {
  Work work;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void run() {
    const int64_t n = work.units();
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      work.run_unit(u);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename Work>
void run_shared(ffi::ThreadPool& pool, const Work& work) {
  auto job = std::make_shared<Job<Work>>();
  job->work = work;
  const int64_t units = work.units();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads, units) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->run(); });
  job->run();
  while (job->finished.load(std::memory_order_acquire) < units) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> y, bool transposed) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 3 || yd.size() != 3 || wd.size() != (transposed ? 3u : 4u))
    return ffi::Error::InvalidArgument(
        "medusa_fewrow_matmul: x, y must be [G, M, K], [G, M, N] and w [G, N, K] "
        "(transposed) or packed [G, N/64, K, 64]");
  if (x.element_type() != ffi::F32 || y->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("medusa_fewrow_matmul: x and y must be float32");
  const bool bf16 = w.element_type() == ffi::BF16;
  if (!bf16 && w.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("medusa_fewrow_matmul: w must be float32 or bfloat16");
  const int64_t G = xd[0], M = xd[1], K = xd[2], N = yd[2];
  const bool w_ok = transposed ? (wd[1] == N && wd[2] == K)
                               : (wd[1] == panels(N) && wd[2] == K && wd[3] == PW);
  if (wd[0] != G || !w_ok || yd[0] != G || yd[1] != M)
    return ffi::Error::InvalidArgument("medusa_fewrow_matmul: shapes do not match");
  if (G * M * N == 0) return ffi::Error::Success();
  float* out = static_cast<float*>(y->untyped_data());
  if (K == 0) {
    std::fill(out, out + G * M * N, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  run_shared(pool, plan(static_cast<const float*>(x.untyped_data()), w.untyped_data(), out,
                        G, M, K, N, transposed, bf16, threads));
  return ffi::Error::Success();
}


// ------------------------------------------------------------------ few-query attention
//
//   out[h, r] = softmax over the slots j that mask[b, t, j] allows of (q[h, r] . k[h, j])
//               applied to v[h, j]
//
// q [H, R, D] float32, already scaled (H = B * KVH: each batch row's KV heads; a KV
// head's R = G * T query rows are the G query heads sharing it times the T new tokens, row
// r being token r % T), k, v [H, W, D] float32 (the first W slots of a per-layer cache,
// the new tokens' keys/values written already), mask [B, T, W] bool, out [H, R, D].
//
// XLA:CPU runs a product of a few query rows by the cache as a library call far slower
// than its emitted one-row loop; here each row reads its KV head's keys and values once,
// skips the slots its mask hides, and is computed alone, in an order that depends on
// neither R nor W: a token's attention in a 5-token verification pass equals its
// attention in a 1-token decoding pass bit for bit.

typedef int32_t vi __attribute__((vector_size(VW * 4)));

inline vf bits_select(vi keep, vf a, vf b) {  // keep ? a : b, lane by lane
  return (vf)(((vi)a & keep) | ((vi)b & ~keep));
}

// exp(x) for x <= 0 (scores minus their maximum), 0 below -87: Cephes' expf polynomial
// after the reduction x = n ln 2 + r.
inline vf exp_nonpositive(vf x) {
  const vf lo = splat(-87.0f);
  const vi live = x >= lo;
  x = bits_select(live, x, lo);
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  const vf r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const vf y = p * (r * r) + r + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return bits_select(live, y * (vf)e, vf{});
}

inline float tree_sum(vf v) {  // pairwise, in a fixed order
  float a[VW];
  std::memcpy(a, &v, sizeof v);
  for (int h = VW / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) a[i] += a[i + h];
  return a[0];
}

inline float hsum(vf v) {  // a fixed order
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  return tree_sum(v);
#endif
}

// One query row: s (W rounded up to VW floats of scratch) holds its scores, then weights.
// V > 0: D = V * VW, q held in registers; V = 0: any D, one by one.
template <int V>
void attend_row(const float* q, const float* k, const float* v, const bool* mask,
                float* out, float* s, int64_t W, int64_t D) {
  const int64_t Wp = (W + VW - 1) / VW * VW;
  if constexpr (V > 0) {
    vf qv[V];
    for (int c = 0; c < V; ++c) qv[c] = load(q + c * VW);
    for (int64_t j = 0; j < W; ++j) {
      if (!mask[j]) {
        s[j] = -INFINITY;
        continue;
      }
      const float* kj = k + j * D;
      vf acc = qv[0] * load(kj);
      for (int c = 1; c < V; ++c) acc += qv[c] * load(kj + c * VW);
      s[j] = hsum(acc);
    }
  } else {
    for (int64_t j = 0; j < W; ++j) {
      float d_sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) d_sum = std::fma(q[d], k[j * D + d], d_sum);
      s[j] = mask[j] ? d_sum : -INFINITY;
    }
  }
  for (int64_t j = W; j < Wp; ++j) s[j] = -INFINITY;
  vf tops = splat(-INFINITY);
  for (int64_t j = 0; j < Wp; j += VW) {
    const vf x = load(s + j);
    tops = bits_select(x > tops, x, tops);
  }
  float top = -INFINITY;
  for (int i = 0; i < VW; ++i) top = std::max(top, tops[i]);
  if (top == -INFINITY) {  // nothing to attend (never in decoding): zeros, not NaN
    std::fill(out, out + D, 0.0f);
    return;
  }
  vf sums = vf{};
  const vf shift = splat(top);
  for (int64_t j = 0; j < Wp; j += VW) {
    const vf w = exp_nonpositive(load(s + j) - shift);
    store(s + j, w);
    sums += w;
  }
  const float inv = 1.0f / tree_sum(sums);
  if constexpr (V > 0) {
    vf even[V], odd[V];  // two chains per vector, over the slots of even and odd index
    for (int c = 0; c < V; ++c) even[c] = odd[c] = vf{};
    for (int64_t j = 0; j < Wp; j += 2) {  // s[W ..] are 0
      if (s[j] != 0.0f) {
        const vf w = splat(s[j]);
        for (int c = 0; c < V; ++c) even[c] += w * load(v + j * D + c * VW);
      }
      if (s[j + 1] != 0.0f) {
        const vf w = splat(s[j + 1]);
        for (int c = 0; c < V; ++c) odd[c] += w * load(v + (j + 1) * D + c * VW);
      }
    }
    for (int c = 0; c < V; ++c) store(out + c * VW, (even[c] + odd[c]) * splat(inv));
  } else {
    std::fill(out, out + D, 0.0f);
    for (int64_t j = 0; j < W; ++j) {
      if (s[j] == 0.0f) continue;
      for (int64_t d = 0; d < D; ++d) out[d] = std::fma(s[j], v[j * D + d], out[d]);
    }
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  }
}

void attend(const float* q, const float* k, const float* v, const bool* mask, float* out,
            float* s, int64_t W, int64_t D) {
  switch (D % VW == 0 ? D / VW : 0) {
    case 1: return attend_row<1>(q, k, v, mask, out, s, W, D);
    case 2: return attend_row<2>(q, k, v, mask, out, s, W, D);
    case 4: return attend_row<4>(q, k, v, mask, out, s, W, D);
    case 8: return attend_row<8>(q, k, v, mask, out, s, W, D);
    default: return attend_row<0>(q, k, v, mask, out, s, W, D);
  }
}

// Attention below this many multiply-adds per call runs on the calling thread alone.
constexpr int64_t kParallelMacs = 1 << 18;

struct Attention {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t H, R, W, D, T, KVH;
  int64_t rows_per_unit;

  int64_t units() const { return (H * R + rows_per_unit - 1) / rows_per_unit; }

  void run_unit(int64_t u) const {
    thread_local std::unique_ptr<float[]> scratch;
    thread_local int64_t capacity = 0;
    const int64_t Wp = (W + VW - 1) / VW * VW;
    if (capacity < Wp) {
      scratch.reset(new float[Wp]);
      capacity = Wp;
    }
    const int64_t end = std::min(H * R, (u + 1) * rows_per_unit);
    for (int64_t i = u * rows_per_unit; i < end; ++i) {
      const int64_t h = i / R, r = i % R, b = h / KVH, t = r % T;
      attend(q + i * D, k + h * W * D, v + h * W * D, mask + (b * T + t) * W,
                 out + i * D, scratch.get(), W, D);
    }
  }
};

ffi::Error FewQueryAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::AnyBuffer mask,
                             ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || md.size() != 3)
    return ffi::Error::InvalidArgument(
        "medusa_fewquery_attention: q [H, R, D], k and v [H, W, D], mask [B, T, W]");
  if (q.element_type() != ffi::F32 || k.element_type() != ffi::F32 ||
      v.element_type() != ffi::F32 || out->element_type() != ffi::F32 ||
      mask.element_type() != ffi::PRED)
    return ffi::Error::InvalidArgument(
        "medusa_fewquery_attention: q, k, v and out must be float32, mask bool");
  const int64_t H = qd[0], R = qd[1], D = qd[2], W = kd[1], B = md[0], T = md[1];
  if (kd[0] != H || kd[2] != D || vd[0] != H || vd[1] != W || vd[2] != D || md[2] != W ||
      B == 0 || T == 0 || H % B != 0 || R % T != 0)
    return ffi::Error::InvalidArgument("medusa_fewquery_attention: shapes do not match");
  if (H * R * D == 0) return ffi::Error::Success();
  Attention a{static_cast<const float*>(q.untyped_data()),
              static_cast<const float*>(k.untyped_data()),
              static_cast<const float*>(v.untyped_data()),
              static_cast<const bool*>(mask.untyped_data()),
              static_cast<float*>(out->untyped_data()), H, R, W, D, T, H / B, H * R};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads > 1 && H * R * W * D >= kParallelMacs)
    a.rows_per_unit = std::max<int64_t>(1, H * R / (4 * threads));
  run_shared(pool, a);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_fewrow_matmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(medusa_fewquery_attention, FewQueryAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// A check of every code path against a double-precision product, with no XLA involved:
// run in a child process right after a build, so a build that computes wrong results, or
// uses instructions this CPU lacks, is caught before any program uses it. 0: all good,
// 3: a wrong product.
extern "C" int medusa_fewrow_selftest() {
  uint32_t state = 12345;
  auto rnd = [&state] {
    state = state * 1664525u + 1013904223u;
    return float(int32_t(state >> 8) % 2001 - 1000) / 1000.0f;
  };
  const int64_t shapes[][3] = {{1, 7, 5}, {5, 33, 70}, {9, 64, 129}, {13, 17, 200},
                               {65, 40, 37}, {2, 3, 1}, {7, 100, 64}};
  for (const auto& s : shapes) {
    const int64_t M = s[0], K = s[1], N = s[2];
    for (int transposed = 0; transposed < 2; ++transposed)
      for (int bf16 = 0; bf16 < 2; ++bf16) {
        std::unique_ptr<float[]> x(new float[M * K]), y(new float[M * N]);
        std::unique_ptr<float[]> wf(new float[K * N]);
        std::unique_ptr<uint16_t[]> wh(new uint16_t[K * N]);
        for (int64_t i = 0; i < M * K; ++i) x[i] = rnd();
        for (int64_t i = 0; i < K * N; ++i) {
          float f = rnd();
          uint32_t u;
          std::memcpy(&u, &f, 4);
          wh[i] = uint16_t(u >> 16);
          u = uint32_t(wh[i]) << 16;
          std::memcpy(&f, &u, 4);
          wf[i] = f;  // the value bfloat16 holds, so both dtypes share one reference
        }
        // the layout the kernel reads: nt as it is, nn packed into zero-padded panels
        const int64_t P = panels(N);
        std::unique_ptr<float[]> pf(new float[P * K * PW]());
        std::unique_ptr<uint16_t[]> ph(new uint16_t[P * K * PW]());
        if (!transposed)
          for (int64_t k = 0; k < K; ++k)
            for (int64_t n = 0; n < N; ++n) {
              pf[(n / PW) * K * PW + k * PW + n % PW] = wf[k * N + n];
              ph[(n / PW) * K * PW + k * PW + n % PW] = wh[k * N + n];
            }
        const void* w = transposed ? (bf16 ? static_cast<const void*>(wh.get()) : wf.get())
                                   : (bf16 ? static_cast<const void*>(ph.get()) : pf.get());
        Product p = plan(x.get(), w, y.get(), 1, M, K, N, transposed, bf16, 2);
        for (int64_t u = 0; u < p.units(); ++u) p.run_unit(u);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double ref = 0.0, mag = 0.0;
            for (int64_t k = 0; k < K; ++k) {
              const double wv = transposed ? wf[n * K + k] : wf[k * N + n];
              ref += double(x[m * K + k]) * wv;
              mag += std::fabs(double(x[m * K + k]) * wv);
            }
            if (!(std::fabs(y[m * N + n] - ref) <= 1e-5 * mag + 1e-30)) return 3;
          }
      }
  }
  // attention: every path (D a multiple of the vector or not, masks with holes, a row with
  // nothing to attend, one or several units) against double precision
  const int64_t cases[][5] = {{1, 1, 1, 1, 8}, {2, 3, 37, 3, 8}, {4, 10, 64, 5, 64},
                              {6, 4, 200, 2, 32}, {2, 1, 19, 1, 16}, {3, 2, 5, 2, 7}};
  for (const auto& c : cases) {
    const int64_t B = c[0] == 4 ? 2 : 1, H = c[0], R = c[1], W = c[2], T = c[3], D = c[4];
    std::unique_ptr<float[]> q(new float[H * R * D]), k(new float[H * W * D]),
        v(new float[H * W * D]), o(new float[H * R * D]);
    std::unique_ptr<bool[]> m(new bool[B * T * W]);
    for (int64_t i = 0; i < H * R * D; ++i) q[i] = 3.0f * rnd();
    for (int64_t i = 0; i < H * W * D; ++i) k[i] = rnd(), v[i] = rnd();
    for (int64_t i = 0; i < B * T * W; ++i) m[i] = rnd() > -0.4f;
    if (W > 1) std::fill(m.get(), m.get() + W, false);  // row (0, 0) attends nothing
    for (int64_t units : {int64_t(1), H * R}) {
      Attention a{q.get(), k.get(), v.get(), m.get(), o.get(), H, R, W, D, T, H / B,
                  (H * R + units - 1) / units};
      for (int64_t u = 0; u < a.units(); ++u) a.run_unit(u);
      for (int64_t i = 0; i < H * R; ++i) {
        const int64_t h = i / R, t = (i % R) % T, b = h / (H / B);
        const bool* mr = m.get() + (b * T + t) * W;
        std::unique_ptr<double[]> sc(new double[W]);
        double top = -1e300, sum = 0.0;
        for (int64_t j = 0; j < W; ++j) {
          sc[j] = 0.0;
          for (int64_t d = 0; d < D; ++d) sc[j] += double(q[i * D + d]) * k[(h * W + j) * D + d];
          if (mr[j]) top = std::max(top, sc[j]);
        }
        for (int64_t j = 0; j < W; ++j) sum += mr[j] ? std::exp(sc[j] - top) : 0.0;
        for (int64_t d = 0; d < D; ++d) {
          double ref = 0.0;
          for (int64_t j = 0; j < W; ++j)
            if (mr[j]) ref += std::exp(sc[j] - top) / sum * v[(h * W + j) * D + d];
          if (sum == 0.0) ref = 0.0;
          if (!(std::fabs(o[i * D + d] - ref) <= 1e-5)) return 4;
        }
      }
    }
  }
  return 0;
}
