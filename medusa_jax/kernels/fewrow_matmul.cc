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

// Units are claimed from a shared counter by the caller and by the pool's threads; the
// caller waits only for units already claimed, so a pool thread that starts late (or never)
// cannot stall it, and one that starts after the product is done finds nothing to do.
struct Job {
  Product p;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void work() {
    const int64_t n = p.units();
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      p.run_unit(u);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

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
  auto job = std::make_shared<Job>();
  job->p = plan(static_cast<const float*>(x.untyped_data()), w.untyped_data(), out, G, M,
                K, N, transposed, bf16, threads);
  const int64_t units = job->p.units();
  const int64_t helpers = std::min(threads, units) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->finished.load(std::memory_order_acquire) < units) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
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
  return 0;
}
