// bmc's CPU decode step: one call runs every layer of a Llama or OPT decoder for t <= a few dozen new tokens
// per row (decode, speculative verify), with the GEMMs on weights re-laid into 16-column panels.
//
// Why: a decode step of a small model on a CPU is bound by reading the weights (M = batch rows, so every GEMM
// is matrix-vector-like) and, in eager PyTorch, by ~450 op dispatches of ~10 us each. Here a panel
// [K][16] is one contiguous stream the hardware prefetcher follows, each weight is read once per step for all
// M rows (up to 8 rows kept in registers), and nothing goes back to Python between layers.
// Attention reads the cache's whole capacity masked by the additive bias, exactly as the dense path does
// (padding rows cost compute: the trade-off BMC balances), GQA/MQA without repeating KV heads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// Nothing of this module is visible outside it but its Python entry point. Why: the kernel tables below
// (static constexpr members of NativeDecoder) would otherwise be GNU "unique" symbols, bound once per process, so
// a second build of this file loaded beside the first (an A/B of a kernel change) dispatched through the first
// one's tables and ran its kernels.
#pragma GCC visibility push(hidden)

namespace {

constexpr int P = 16;  // panel width: one AVX-512 register of float32 (GCC splits it on narrower ISAs)
// Software prefetch distance in panel rows (64 B each): at M = 8 the FMAs per cache line slow the stream enough
// that the hardware prefetcher falls behind; 4 KiB ahead measured 12 vs 10 GB/s here (M = 1: 15 either way).
constexpr int64_t PREFETCH_ROWS = 64;
// Shared segments are attended in chunks of SEG_KEYS keys (16 KiB of K and of V at head_dim 64, L1-sized) by up
// to SEG_QUERY_ROWS query rows at once (32 samples x 3 heads of a GQA group), their queries transposed once per step.
constexpr int64_t SEG_KEYS = 64;
constexpr int64_t SEG_QUERY_ROWS = 96;
// A row's own cache is walked in chunks of OWN_KEYS keys with the same online softmax: its query rows read each
// chunk from DRAM once and again from L1 (16 KiB of K and of V at head_dim 64; 128 keys measured 0-12 % slower
// with the spread prefetch, on an AVX2 EPYC and an AVX-512 Xeon), and the score buffer stays small at any capacity.
constexpr int64_t OWN_KEYS = 64;
// From this many query rows per (row, KV head) on, scores are computed as a matrix product (wide_scores).
constexpr int64_t WIDE_ROWS = 8;
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
#else
// Without AVX-512 GCC has no 64-byte vector mode: a vector_size(64) type lives in memory and every operation on it
// goes through the stack (the GEMM ran 3-10x slower on an AVX2 EPYC). Two 8-wide halves stay in ymm registers.
typedef float v8 __attribute__((vector_size(32)));
struct v16 {
  v8 lo, hi;
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  v16& operator+=(const v16& o) { lo += o.lo; hi += o.hi; return *this; }
};
inline v16 operator+(const v16& a, const v16& b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator-(const v16& a, const v16& b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16 operator*(const v16& a, const v16& b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator*(float s, const v16& b) { return {s * b.lo, s * b.hi}; }
inline v16 operator*(const v16& b, float s) { return {b.lo * s, b.hi * s}; }
inline v16 operator+(const v16& b, float s) { return {b.lo + s, b.hi + s}; }
#endif

#ifdef __AVX512F__
inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
#else  // half by half: a memcpy of the whole struct went through the stack
inline v16 load16(const float* p) { v8 a, b; std::memcpy(&a, p, 32); std::memcpy(&b, p + 8, 32); return {a, b}; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v.lo, 32); std::memcpy(p + 8, &v.hi, 32); }
#endif
#ifdef __AVX512F__
inline v16 max16(v16 a, v16 b) { return (v16)_mm512_max_ps((__m512)a, (__m512)b); }
#else
inline v8 max8(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
inline v16 max16(v16 a, v16 b) { return {max8(a.lo, b.lo), max8(a.hi, b.hi)}; }
#endif
inline float hsum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int i = 0; i < P; ++i) s += v[i];
  return s;
#endif
}
// Two-source lane shuffles for sum16 and transpose16: with h = 1, 2, 4, 8, pick_a<h> takes lane groups of width h
// alternately from a and b starting with a's first group, pick_b<h> the groups that follow them (lanes h apart).
#ifdef __AVX512F__
template <int h> inline v16 pick_a(v16 a, v16 b);
template <int h> inline v16 pick_b(v16 a, v16 b);
template <> inline v16 pick_a<1>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30); }
template <> inline v16 pick_b<1>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
template <> inline v16 pick_a<2>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29); }
template <> inline v16 pick_b<2>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
template <> inline v16 pick_a<4>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27); }
template <> inline v16 pick_b<4>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31); }
template <> inline v16 pick_a<8>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23); }
template <> inline v16 pick_b<8>(v16 a, v16 b) { return __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31); }
#else  // groups of 1, 2, 4 lanes stay inside each 8-lane half; groups of 8 are the halves
template <int h> inline v8 pick_a8(v8 a, v8 b);
template <int h> inline v8 pick_b8(v8 a, v8 b);
template <> inline v8 pick_a8<1>(v8 a, v8 b) { return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14); }
template <> inline v8 pick_b8<1>(v8 a, v8 b) { return __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15); }
template <> inline v8 pick_a8<2>(v8 a, v8 b) { return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13); }
template <> inline v8 pick_b8<2>(v8 a, v8 b) { return __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15); }
template <> inline v8 pick_a8<4>(v8 a, v8 b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11); }
template <> inline v8 pick_b8<4>(v8 a, v8 b) { return __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15); }
template <int h> inline v16 pick_a(v16 a, v16 b) {
  if constexpr (h == 8) return {a.lo, b.lo}; else return {pick_a8<h>(a.lo, b.lo), pick_a8<h>(a.hi, b.hi)};
}
template <int h> inline v16 pick_b(v16 a, v16 b) {
  if constexpr (h == 8) return {a.hi, b.hi}; else return {pick_b8<h>(a.lo, b.lo), pick_b8<h>(a.hi, b.hi)};
}
inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, 32); return v; }
// Eight 8-wide dot-product partials (one per key) -> the eight sums in key order (as sum16, three levels)
template <int h> inline v8 fold8(v8 a, v8 b) { return pick_a8<h>(a, b) + pick_b8<h>(a, b); }
inline v8 sum8(const v8* v) {
  const v8 c0 = fold8<1>(v[0], v[1]), c1 = fold8<1>(v[2], v[3]), c2 = fold8<1>(v[4], v[5]), c3 = fold8<1>(v[6], v[7]);
  return fold8<4>(fold8<2>(c0, c1), fold8<2>(c2, c3));
}
#endif

// Sixteen dot-product partials v[0..15] (one per key) -> one vector of their sixteen sums: a transposing
// reduction tree (15 shuffle pairs + adds) instead of sixteen horizontal sums. fold<h> adds lane pairs h apart,
// taking keys from a where (lane mod 2h) < h and from b elsewhere.
template <int h> inline v16 fold(v16 a, v16 b) { return pick_a<h>(a, b) + pick_b<h>(a, b); }
inline v16 sum16(const v16* v) {
  v16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) c[i] = fold<1>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) d[i] = fold<2>(c[2 * i], c[2 * i + 1]);
  for (int i = 0; i < 2; ++i) e[i] = fold<4>(d[2 * i], d[2 * i + 1]);
  return fold<8>(e[0], e[1]);
}

// In-place transpose of a 16 x 16 block held in 16 registers: four stages, each swapping one bit of the row index
// with the same bit of the column index through the two-source shuffles of fold (without its add).
template <int h> inline void swap_stage(v16* x) {
  for (int r = 0; r < 16; ++r)
    if ((r & h) == 0) {
      const v16 a = x[r], b = x[r + h];
      x[r] = pick_a<h>(a, b);
      x[r + h] = pick_b<h>(a, b);
    }
}
inline void transpose16(v16* x) {
  swap_stage<1>(x);
  swap_stage<2>(x);
  swap_stage<4>(x);
  swap_stage<8>(x);
}

inline v16 load_part(const float* p, int64_t n) {  // n < P lanes, the rest zero
  float tmp[P] = {0};
  std::memcpy(tmp, p, n * sizeof(float));
  return load16(tmp);
}

// Weights a GGUF file stores in 16 bits (F16, BF16), kept so in float panels' layout ([ceil(N/16), K, 16]) and
// widened to float32 as they are loaded: a widening is exact, so the float kernels below compute exactly what they
// compute on the float32 panels of the same values (quant="none"), reading half the bytes.
struct Half16 {  // IEEE binary16
  uint16_t bits;
};
struct BHalf16 {  // bfloat16: float32's upper half
  uint16_t bits;
};
#if defined(__AVX512F__)
inline v16 load16(const Half16* p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline v16 load16(const BHalf16* p) {
  return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
inline v8 widen_bf16(const BHalf16* p) {
  return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline v16 load16(const BHalf16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
#if defined(__F16C__)
inline v16 load16(const Half16* p) {
  return {(v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
#else
inline v16 load16(const Half16* p) {
  float f[P];
  for (int i = 0; i < P; ++i) f[i] = static_cast<float>(c10::Half(p[i].bits, c10::Half::from_bits()));
  return load16(f);
}
#endif
#endif

// e^x in float32 to < 4 ulp (measured over [-87.3, 88.3]), 0 below -87.3, 2.2e38 above 88.3 (not inf): 2^n p(r)
// with r = x - n ln2 (ln2 split in two so that n ln2 is exact) and p the degree-6 Taylor polynomial of e^r on
// |r| <= ln2/2. Branch-free, so GCC vectorises the loops that call it (8 or 16 lanes, ~10 FP operations a vector)
// where libmvec's expf was ~13 % of shared-prefix attention (one exp per key and query row) and decode attention
// got 1-8 % faster with it.
inline float exp_fast(float x0) {
  const float x = std::min(std::max(x0, -87.3f), 88.3f);
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  const float r = std::fma(n, -1.428606765330187045e-06f, std::fma(n, -0.693145751953125f, x));
  float p = 1.0f / 720;
  p = std::fma(p, r, 1.0f / 120);
  p = std::fma(p, r, 1.0f / 24);
  p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;  // p * 2^n through the exponent field (p in [0.7, 1.5], n >= -126)
  std::memcpy(&p, &bits, 4);
  return x0 < -87.3f ? 0.0f : p;
}

// tanh in float32 through exp_fast (branch-free, so the soft-cap loop vectorises): within ~1e-7 of tanhf, absolute.
// Gemma 2's soft-capped scores with std::tanh were 26 % slower than Llama's at batch 8 on 16 Xeon cores (one tanhf
// call per score).
inline float tanh_fast(float x) { return 1.0f - 2.0f / (exp_fast(2.0f * x) + 1.0f); }

// Lines [0, lines) from `base` (64 bytes each) prefetched a few per advance(), spread evenly over `calls` calls.
// The decode attention prefetches the next chunk's keys and values this way across all its passes over the
// current chunk (one per query row for the scores, one per row block and dimension slice for the values): issued
// in a burst during the first pass they stalled it and left the memory idle during the others (batch-8 decode
// attention 12-20 % faster spread, on an AVX2 EPYC).
struct Prefetch {
  const float* base;
  int64_t lines, step, next = 0;
  Prefetch(const float* b, int64_t n_lines, int64_t calls)
      : base(b), lines(b == nullptr ? 0 : n_lines), step(calls > 0 ? (n_lines + calls - 1) / calls : n_lines) {}
  void advance() {
    const int64_t end = std::min(lines, next + step);
    for (; next < end; ++next) __builtin_prefetch(base + next * P);
  }
};
using Lines = std::pair<const float*, int64_t>;  // a first line and a line count, for a Prefetch

// How many spans to split each of `items` tasks of `chunks` chunks into (flash-decoding's split-K), so that the
// busiest of `threads` threads has the least to do: at::parallel_for gives each thread ceil(items * spans /
// threads) consecutive tasks, and a span costs its chunks plus about a quarter chunk of set-up and merging. The
// old rule (about two tasks a thread) cut 3 tasks into 11 spans each on 16 threads: 33, so 3 or 2 per thread.
inline int64_t split_spans(int64_t items, int64_t chunks, int64_t threads) {
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t spans = 1; spans <= std::max<int64_t>(1, chunks); ++spans) {
    const int64_t per_thread = (items * spans + threads - 1) / threads;
    const int64_t cost = per_thread * (4 * ((chunks + spans - 1) / spans) + 1);
    if (cost < best_cost) best = spans, best_cost = cost;
  }
  return best;
}

// The GEMM kernels' epilogue: a panel's bias (its first `width` columns; none: zero), and one row's result r
// written to (or added into) its first `width` output columns.
inline v16 load_bias(const float* bias, int64_t width) {
  return bias == nullptr ? v16{} : width == P ? load16(bias) : load_part(bias, width);
}
inline void store_out(float* out, v16 r, int64_t width, bool accumulate) {
  if (width == P) {
    store16(out, accumulate ? load16(out) + r : r);
  } else {
    for (int64_t c = 0; c < width; ++c) out[c] = accumulate ? out[c] + r[c] : r[c];
  }
}

// y[MB rows][16] (+)= x[MB rows][K] @ panel[K][16] (+ bias); two partial sums over k halve the FMA chains.
template <int MB, typename W>
void panel_kernel(const float* x, int64_t ldx, const W* wp, int64_t K, const float* bias, float* y,
                  int64_t ldy, int64_t nw, bool accumulate) {
  v16 a0[MB], a1[MB];
  for (int i = 0; i < MB; ++i) a0[i] = a1[i] = v16{};
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    __builtin_prefetch(wp + (k + PREFETCH_ROWS) * P);
    __builtin_prefetch(wp + (k + PREFETCH_ROWS + 1) * P);
    const v16 w0 = load16(wp + k * P), w1 = load16(wp + (k + 1) * P);
    for (int i = 0; i < MB; ++i) {
      a0[i] += x[i * ldx + k] * w0;
      a1[i] += x[i * ldx + k + 1] * w1;
    }
  }
  if (k < K) {
    const v16 w0 = load16(wp + k * P);
    for (int i = 0; i < MB; ++i) a0[i] += x[i * ldx + k] * w0;
  }
  const v16 b = load_bias(bias, nw);
  for (int i = 0; i < MB; ++i) store_out(y + i * ldy, (a0[i] + a1[i]) + b, nw, accumulate);
}

// 1-4 rows, each panel streamed once with the rows in registers (5 and more: block_kernel)
template <typename W>
void rows_kernel(int64_t mb, const float* x, int64_t ldx, const W* wp, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t nw, bool acc) {
  switch (mb) {
    case 1: return panel_kernel<1, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 2: return panel_kernel<2, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 3: return panel_kernel<3, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    default: return panel_kernel<4, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
  }
}

// y[MB rows][NB panels] (+)= x @ NB consecutive panels (+ bias), MB * NB <= 24 accumulators: per k one load per
// panel and one broadcast per row feed MB * NB FMAs (panel_kernel's 8 x 1 needs 9 loads for 8). For steps of 5 or
// more rows (a batch of 8, a verify step's tree, 32 shared-prefix samples), where the FMAs slow the weight stream
// or bound the GEMM. nw: valid columns of the last panel. PF: prefetch the panels ahead (the block that streams
// them from DRAM). next: lines to prefetch over the k steps (a share of the next group's panels).
template <int MB, int NB, bool PF, typename W = float>
void block_kernel(const float* x, int64_t ldx, const W* wp, int64_t K, const float* bias, float* y, int64_t ldy,
                  int64_t nw, bool accumulate, Lines next) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  Prefetch pf(next.first, next.second, K);
  for (int64_t k = 0; k < K; ++k) {
    if (PF)  // the first row block pulls the panels from DRAM: four streams, each a page apart
      for (int j = 0; j < NB; ++j) __builtin_prefetch(wp + (j * K + k + PREFETCH_ROWS) * P);
    pf.advance();
    v16 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load16(wp + (j * K + k) * P);
    for (int i = 0; i < MB; ++i) {
      const float xi = x[i * ldx + k];
      for (int j = 0; j < NB; ++j) acc[i][j] += xi * w[j];
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t width = j == NB - 1 ? nw : P;
    const v16 b = load_bias(bias == nullptr ? nullptr : bias + j * P, width);
    for (int i = 0; i < MB; ++i) store_out(y + i * ldy + j * P, acc[i][j] + b, width, accumulate);
  }
}

template <typename W>
using BlockKernelOf = void (*)(const float*, int64_t, const W*, int64_t, const float*, float*, int64_t, int64_t, bool,
                               Lines);
using BlockKernel = BlockKernelOf<float>;
template <bool PF, typename W = float>
constexpr BlockKernelOf<W> BLOCK_KERNELS[24] = {
    block_kernel<1, 1, PF, W>, block_kernel<1, 2, PF, W>, block_kernel<1, 3, PF, W>, block_kernel<1, 4, PF, W>,
    block_kernel<2, 1, PF, W>, block_kernel<2, 2, PF, W>, block_kernel<2, 3, PF, W>, block_kernel<2, 4, PF, W>,
    block_kernel<3, 1, PF, W>, block_kernel<3, 2, PF, W>, block_kernel<3, 3, PF, W>, block_kernel<3, 4, PF, W>,
    block_kernel<4, 1, PF, W>, block_kernel<4, 2, PF, W>, block_kernel<4, 3, PF, W>, block_kernel<4, 4, PF, W>,
    block_kernel<5, 1, PF, W>, block_kernel<5, 2, PF, W>, block_kernel<5, 3, PF, W>, block_kernel<5, 4, PF, W>,
    block_kernel<6, 1, PF, W>, block_kernel<6, 2, PF, W>, block_kernel<6, 3, PF, W>, block_kernel<6, 4, PF, W>};

template <typename W = float>
constexpr BlockKernelOf<W> WIDE_ROW_KERNELS[12] = {  // 5-8 rows x 1-3 panels, streaming (first-block prefetch)
    block_kernel<5, 1, true, W>, block_kernel<5, 2, true, W>, block_kernel<5, 3, true, W>,
    block_kernel<6, 1, true, W>, block_kernel<6, 2, true, W>, block_kernel<6, 3, true, W>,
    block_kernel<7, 1, true, W>, block_kernel<7, 2, true, W>, block_kernel<7, 3, true, W>,
    block_kernel<8, 1, true, W>, block_kernel<8, 2, true, W>, block_kernel<8, 3, true, W>};

// y[M, N] (+)= x[M, K] @ W (+ bias) with W packed [ceil(N/16), K, 16] and x rows ldx apart; threads split the
// panels, so each streams its own contiguous part of W. Up to 4 rows, each panel is streamed once with all rows in
// registers; 5-8 rows, groups of 3 panels with all rows in registers (bound by the weight stream: at 8 rows on
// one panel the FMAs slowed it, 60 -> 56 ms per step with the default model); beyond, groups of 4 panels are
// walked by blocks of <= 6 rows of near-equal size (bound by FMAs: the group stays in L2 between row blocks).
// The register blocks above are sized for AVX-512's 32 registers, where a v16 is one register. With AVX2 a v16 is
// two of 16, so there each panel goes alone: 3-4 rows and more than 8 in row blocks of <= 6 (12 accumulator
// registers; the later blocks read the panel from L2), 5-8 rows in one pass (16 at 8 rows, a register spilled, but
// the panel is streamed once: the model's GEMMs at 8 rows 45 -> 32 ms against two blocks of 4 on an AVX2 EPYC).
#ifdef __AVX512F__
constexpr int64_t GROUP_PANELS = 4, WIDE_PANELS = 3;
constexpr bool blocked(int64_t M) { return M > 8; }
#else
constexpr int64_t GROUP_PANELS = 1, WIDE_PANELS = 1;
constexpr bool blocked(int64_t M) { return M > 8 || M == 3 || M == 4; }
#endif

// ---- quantized panels (quant="gguf" / "q8_0" / "q4_0"): GGUF's blocks of 32 along K, re-laid per panel ----
// A panel's K rows come in blocks of QK = 32, each holding its 16 columns' scales and quants. Three kinds, told
// apart by the tensor's dtype and block bytes (quant_kind):
//   Q8,  int8  [np, K/32, 576]:  float d[16] | int8 q[32][16]                                        w = d * q
//   Q4,  uint8 [np, K/32, 384]:  float d[16] | float m[16] | uint8 q[16][16], the low nibble row j and the
//                                 high nibble row j + 16 (GGUF's own order within a block)           w = d * q + m
//   Q8X, int8  [np, K/32, 704]:  float d0[16] | float d1[16] | float m[16] | int8 q[32][16]
//                                                                w = d0 * q + m (rows 0-15), d1 * q + m (16-31)
//   Q4H, uint8 [np, K/32, 320]:  fp16 d[16] | fp16 m[16] | Q4's nibbles: Q4_0 and Q4_1, whose scales (and Q4_0's
//                                 -8 d) GGUF stores in fp16 already: 0.625 bytes a weight against Q4's 0.75
// (Q4_0 is Q4 with m = -8 d; Q4_K is Q4 with d = d * sc_j, m = -dmin * m_j per 32-value sub-block. Q8X holds any
// of them: Q5_K (q in 0-31), Q6_K (q - 32 in -32..31, a scale per 16 values), and a fused matrix whose parts are
// of different types.) d * q is exact in float32 (d has at most 18 significant bits: an fp16 times a K-quant's 6-
// or 8-bit sub-block scale; q at most 6 beyond), so these are the very float32 weights the `gguf` package
// dequantizes, and a GEMM over them runs the float kernels above on a panel dequantized into a thread's buffer in
// L1/L2: the same arithmetic as quant="none", bit for bit, reading 4.3x (Q8), 2.9x (Q8X) or 7.1x (Q4) fewer bytes
// from memory.
// Why not torch's int8/int4 ops: measured here (2-core EPYC, AVX-512, the default model's GEMM shapes, 30 layers +
// lm_head, 2 threads), per token at M = 1: this file's fp32 panels 8.2 ms, MKL fp32 33.7, _weight_int8pack_mm 56.6,
// _weight_int4pack_mm_for_cpu 122.6; at M = 8: 12.7, 52.3, 457, 942.
constexpr int64_t QK = 32, Q8_BLOCK = 64 + QK * P, Q4_BLOCK = 128 + QK * P / 2, Q8X_BLOCK = 192 + QK * P;
constexpr int64_t Q4H_BLOCK = 64 + QK * P / 2;
enum QuantKind : int { KQ8 = 0, KQ4 = 1, KQ8X = 2, KQ4H = 3 };
constexpr int64_t KIND_BLOCK[4] = {Q8_BLOCK, Q4_BLOCK, Q8X_BLOCK, Q4H_BLOCK};
constexpr int64_t KIND_QUANTS[4] = {4 * P, 8 * P, 12 * P, 4 * P};  // where a block's quants start (bytes)
constexpr int64_t KIND_OFFSET[4] = {0, 4 * P, 8 * P, 2 * P};       // where its offsets m start (Q8: none)
constexpr bool has_offset(int kind) { return kind != KQ8; }
constexpr bool is_q4(int kind) { return kind == KQ4 || kind == KQ4H; }  // nibbles

// A block's 16 scales (or offsets) at byte `at`: float32, or fp16 in Q4H (widened: exact)
template <int KIND>
inline void scales_of(const uint8_t* blk, int64_t at, float* out) {
  if (KIND == KQ4H) {
    for (int c = 0; c < P; ++c) {
      uint16_t bits;
      std::memcpy(&bits, blk + at + 2 * c, 2);
      out[c] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    }
  } else {
    std::memcpy(out, blk + at, P * sizeof(float));
  }
}

// -1: not a quantized panel layout
inline int quant_kind_or_none(const torch::Tensor& w) {
  if (w.dim() != 3) return -1;
  const int64_t bytes = w.size(2);
  if (w.scalar_type() == torch::kChar) return bytes == Q8_BLOCK ? KQ8 : bytes == Q8X_BLOCK ? KQ8X : -1;
  if (w.scalar_type() == torch::kByte) return bytes == Q4_BLOCK ? KQ4 : bytes == Q4H_BLOCK ? KQ4H : -1;
  return -1;
}
inline QuantKind quant_kind(const torch::Tensor& w) { return static_cast<QuantKind>(quant_kind_or_none(w)); }
inline bool is_quant(const torch::Tensor& w) { return quant_kind_or_none(w) >= 0; }

template <int KIND>
inline void dequant_block(const uint8_t* blk, float* out) {  // out [32][16]
  float d[P], d1[P], m[P];
  scales_of<KIND>(blk, 0, d);
  if (KIND == KQ8X) std::memcpy(d1, blk + 4 * P, sizeof d1);
  if (has_offset(KIND)) scales_of<KIND>(blk, KIND_OFFSET[KIND], m);
  if (is_q4(KIND)) {
    const uint8_t* q = blk + KIND_QUANTS[KIND];
    for (int64_t j = 0; j < QK / 2; ++j)
      for (int64_t c = 0; c < P; ++c) {
        const uint8_t b = q[j * P + c];
        out[j * P + c] = d[c] * static_cast<float>(b & 15) + m[c];
        out[(j + QK / 2) * P + c] = d[c] * static_cast<float>(b >> 4) + m[c];
      }
    return;
  }
  const int8_t* q = reinterpret_cast<const int8_t*>(blk + KIND_QUANTS[KIND]);
  for (int64_t k = 0; k < QK; ++k)
    for (int64_t c = 0; c < P; ++c) {
      const float s = KIND == KQ8X && k >= QK / 2 ? d1[c] : d[c];
      out[k * P + c] = has_offset(KIND) ? s * static_cast<float>(q[k * P + c]) + m[c] : s * static_cast<float>(q[k * P + c]);
    }
}

inline void dequant_any(QuantKind kind, const uint8_t* blk, float* out) {
  switch (kind) {
    case KQ8: return dequant_block<KQ8>(blk, out);
    case KQ4: return dequant_block<KQ4>(blk, out);
    case KQ8X: return dequant_block<KQ8X>(blk, out);
    case KQ4H: return dequant_block<KQ4H>(blk, out);
  }
}

// Panels [p0, p0 + nb) of a quantized weight as float32 panels [nb][K][16] in `out`.
void dequant_panels(const torch::Tensor& wq, int64_t p0, int64_t nb, int64_t K, float* out) {
  const QuantKind kind = quant_kind(wq);
  const int64_t nblk = K / QK, bb = KIND_BLOCK[kind];
  const uint8_t* base = static_cast<const uint8_t*>(wq.data_ptr()) + p0 * nblk * bb;
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* blk = base + (j * nblk + b) * bb;
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk + 8 * bb + line);
      dequant_any(kind, blk, out + (j * K + b * QK) * P);
    }
}

#ifdef __AVX512F__
// 1-4 rows (decode) on AVX-512: the panel streams through registers, no buffer. Measured on the default model's
// GEMMs at M = 1 (30 layers + LM head, 2 threads, AVX-512 EPYC): dequantizing into a buffer first took 10.3 ms a
// token, dequantizing each weight in registers 3.3-3.6 ms. Applying each block's scale once (quant_panel_kernel
// below) instead of per weight made batch-4 decode 10-15 % faster (426-476 -> 473-531 tok/s over Q4_0, Q8_0 and
// Q4_1, two alternating runs each) and left batch 1 where it was (bound elsewhere). 5-8 rows (quant_block_kernel)
// keep the per-weight dequantization: bit for bit the float kernels' arithmetic.
inline v16 q8_ints(const uint8_t* q) {
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
template <int HIGH>
inline v16 q4_ints(const uint8_t* q) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  v = HIGH ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
  return (v16)_mm512_cvtepi32_ps(v);
}
// Row k of a block's quants as integers in float lanes: for Q4, rows 0-15 are the low nibbles of bytes 0-15 and
// rows 16-31 their high nibbles.
template <int KIND>
inline v16 block_ints(const uint8_t* blk, int k) {
  constexpr int64_t q = KIND_QUANTS[KIND];
  if (is_q4(KIND)) return k < QK / 2 ? q4_ints<0>(blk + q + k * P) : q4_ints<1>(blk + q + (k - QK / 2) * P);
  return q8_ints(blk + q + k * P);
}
// A block's 16 scales or offsets at byte `at`, in a register (Q4H's fp16 widened: exact)
template <int KIND>
inline v16 scale_vec(const uint8_t* blk, int64_t at) {
  if (KIND == KQ4H) return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + at)));
  return load16(reinterpret_cast<const float*>(blk + at));
}

// Software prefetch 8 blocks ahead only where a block has enough arithmetic to hide it (3 or more rows): at 1-2
// rows it competed with the hardware prefetcher. Measured on the 2-core EPYC, default model (Q4_1 layers, Q8_0
// head), batch-1 decode, 5 whole-process A/B pairs, medians: int8 activations 189 -> 211 tok/s without it, float
// activations 199 -> 207; at batch 8 (int8 activations) dropping it cost 8 % (688 -> 630), so it stays there.
constexpr bool prefetches_ahead(int rows) { return rows > 2; }

// The block's scale (and offset) is applied once per 32 rows (Q8X's scales once per 16): sum_k x_k (d q_k + m) =
// d sum_k x_k q_k + m sum_k x_k, with the row sums of x per block computed once per GEMM (xsum). One operation
// fewer per 16 weights than dequantizing each; the same value up to float rounding (activations stay float32).
// Two accumulator chains per row: even/odd k, or for Q8X the two 16-row halves, interleaved.
template <int MB, int KIND>
void quant_panel_kernel(const float* x, int64_t ldx, const uint8_t* wq, int64_t K, const float* bias, float* y,
                        int64_t ldy, int64_t nw, bool accumulate, const float* xsum) {
  v16 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = v16{};
  constexpr int64_t bb = KIND_BLOCK[KIND];
  const int64_t nblk = K / QK;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = wq + b * bb;
    if (prefetches_ahead(MB))
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk + 8 * bb + line);
    const v16 d = scale_vec<KIND>(blk, 0);
    const float* xb = x + b * QK;
    v16 s0[MB], s1[MB];
    for (int i = 0; i < MB; ++i) s0[i] = s1[i] = v16{};
    if (KIND == KQ8X) {
      for (int k = 0; k < QK / 2; ++k) {
        const v16 w0 = block_ints<KIND>(blk, k), w1 = block_ints<KIND>(blk, k + QK / 2);
        for (int i = 0; i < MB; ++i) {
          s0[i] += xb[i * ldx + k] * w0;
          s1[i] += xb[i * ldx + k + QK / 2] * w1;
        }
      }
      const v16 d1 = load16(reinterpret_cast<const float*>(blk + 4 * P));
      const v16 m = load16(reinterpret_cast<const float*>(blk + 8 * P));
      for (int i = 0; i < MB; ++i) acc[i] += d * s0[i] + d1 * s1[i] + m * xsum[i * nblk + b];
      continue;
    }
    for (int k = 0; k < QK; k += 2) {
      const v16 w0 = block_ints<KIND>(blk, k), w1 = block_ints<KIND>(blk, k + 1);
      for (int i = 0; i < MB; ++i) {
        s0[i] += xb[i * ldx + k] * w0;
        s1[i] += xb[i * ldx + k + 1] * w1;
      }
    }
    if (has_offset(KIND)) {
      const v16 m = scale_vec<KIND>(blk, KIND_OFFSET[KIND]);
      for (int i = 0; i < MB; ++i) acc[i] += d * (s0[i] + s1[i]) + m * xsum[i * nblk + b];
    } else {
      for (int i = 0; i < MB; ++i) acc[i] += d * (s0[i] + s1[i]);
    }
  }
  const v16 bv = load_bias(bias, nw);
  for (int i = 0; i < MB; ++i) store_out(y + i * ldy, acc[i] + bv, nw, accumulate);
}

// 5-8 rows against NB panels, dequantized in registers: one accumulator chain per (row, column) over k in order,
// as block_kernel runs it (which panels share a pass does not change any sum), so again bit for bit.
template <int MB, int NB, int KIND>
void quant_block_kernel(const float* x, int64_t ldx, const uint8_t* wq, int64_t panel_bytes, int64_t K,
                        const float* bias, float* y, int64_t ldy, int64_t nw, bool accumulate) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  constexpr int64_t bb = KIND_BLOCK[KIND];
  const int64_t nblk = K / QK;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk[NB];
    v16 d[NB], m[NB];  // Q8X: rows 0-15's scales, then 16-31's
    for (int j = 0; j < NB; ++j) {
      blk[j] = wq + j * panel_bytes + b * bb;
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk[j] + 4 * bb + line);
      d[j] = scale_vec<KIND>(blk[j], 0);
      m[j] = has_offset(KIND) ? scale_vec<KIND>(blk[j], KIND_OFFSET[KIND]) : v16{};
    }
    const float* xb = x + b * QK;
    for (int k = 0; k < QK; ++k) {
      if (KIND == KQ8X && k == QK / 2)
        for (int j = 0; j < NB; ++j) d[j] = load16(reinterpret_cast<const float*>(blk[j] + 4 * P));
      v16 w[NB];
      for (int j = 0; j < NB; ++j) {
        const v16 q = block_ints<KIND>(blk[j], k);
        if (has_offset(KIND))
          w[j] = (v16)_mm512_fmadd_ps((__m512)d[j], (__m512)q, (__m512)m[j]);  // d q is exact: one rounding
        else
          w[j] = d[j] * q;
      }
      for (int i = 0; i < MB; ++i) {
        const float xi = xb[i * ldx + k];
        for (int j = 0; j < NB; ++j) acc[i][j] += xi * w[j];
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t width = j == NB - 1 ? nw : P;
    const v16 bv = load_bias(bias == nullptr ? nullptr : bias + j * P, width);
    for (int i = 0; i < MB; ++i) store_out(y + i * ldy + j * P, acc[i][j] + bv, width, accumulate);
  }
}

using QuantBlockKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*,
                                  int64_t, int64_t, bool);
// 5-8 rows x 1-3 panels: Q8 takes three panels a pass (24 accumulators, 3 weight rows, 3 scales), the others two
// (their offsets or second scales take registers too)
template <int KIND>
constexpr QuantBlockKernel QUANT_WIDE_KERNELS[12] = {
    quant_block_kernel<5, 1, KIND>, quant_block_kernel<5, 2, KIND>, quant_block_kernel<5, 3, KIND>,
    quant_block_kernel<6, 1, KIND>, quant_block_kernel<6, 2, KIND>, quant_block_kernel<6, 3, KIND>,
    quant_block_kernel<7, 1, KIND>, quant_block_kernel<7, 2, KIND>, quant_block_kernel<7, 3, KIND>,
    quant_block_kernel<8, 1, KIND>, quant_block_kernel<8, 2, KIND>, quant_block_kernel<8, 3, KIND>};
constexpr const QuantBlockKernel* WIDE_BY_KIND[4] = {QUANT_WIDE_KERNELS<KQ8>, QUANT_WIDE_KERNELS<KQ4>,
                                                     QUANT_WIDE_KERNELS<KQ8X>, QUANT_WIDE_KERNELS<KQ4H>};

using QuantPanelKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                                  int64_t, bool, const float*);
template <int KIND>
constexpr QuantPanelKernel QUANT_ROW_KERNELS[4] = {quant_panel_kernel<1, KIND>, quant_panel_kernel<2, KIND>,
                                                   quant_panel_kernel<3, KIND>, quant_panel_kernel<4, KIND>};
constexpr const QuantPanelKernel* ROWS_BY_KIND[4] = {QUANT_ROW_KERNELS<KQ8>, QUANT_ROW_KERNELS<KQ4>,
                                                     QUANT_ROW_KERNELS<KQ8X>, QUANT_ROW_KERNELS<KQ4H>};
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_I8_KV_DOTS 1  // int8 KV attended in integers (NativeDecoder::attend_i8)
#else
#define HAVE_I8_KV_DOTS 0
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
constexpr bool HAVE_INT8_DOT = true;
// Quantized panels against activations quantized to int8 (int8_activations): each row's block of 32 values x as
// x~ = dx * qx (dx = max|x| / 127, qx = round(x / dx)), and sum_k w_k x~_k = dx (d sum_k q_k qx_k) + m dx sum_k qx_k
// (Q8X: d0 over rows 0-15, d1 over 16-31), the integer sums by VNNI's u8 x s8 dot products (vpdpbusd: 64 products
// an instruction): exactly the weights times the quantized activations, so per output the error is at most
// sum_k |w_k| dx / 2 (plus float rounding), a stated bound (tests/test_quant.py), not quant="none"'s logits.
// (Taking the offsets' factor as the exact sum_k x_k was worse: the error became sum_k d q_k (x~_k - x_k) with q in
// 0..15 all positive, where w's own signs cancel: Q4_0 perplexity 16.925 against 16.578, float activations 16.505.)
// Why: batch-8 decode GEMMs, bound by the float path's dequantizing arithmetic (4 operations per 16 weights), take
// half the time (default model's Q4_0 shapes: 14.3 -> 6.4 ms a step); batch 1, bound by memory, 3.4 -> 3.1 ms.
// A block's quants are regrouped per 4 rows with one vpermb, so each 32-bit lane holds one column's 4 consecutive
// rows, as vpdpbusd takes them: w[g] holds rows 4g .. 4g + 3, so w[0..3] are rows 0-15 and w[4..7] rows 16-31.
// Q4's nibbles are unsigned and go in as they are (against the signed activations); Q8 and Q8X quants are signed,
// so the activations go in as qx + 128 (their bytes' sign bits flipped) and 128 times each column's sum of quants
// is taken back out (those sums by the same instruction against ones, once a block for all rows).
struct VnniOrder {
  alignas(64) int8_t idx[64];
};
constexpr VnniOrder make_vnni_order() {  // byte (row r, column c) of 4 rows x 16 columns -> lane c, byte r
  VnniOrder o{};
  for (int c = 0; c < P; ++c)
    for (int r = 0; r < 4; ++r) o.idx[c * 4 + r] = static_cast<int8_t>(r * P + c);
  return o;
}
constexpr VnniOrder VNNI_ORDER = make_vnni_order();

template <int MB, int KIND>
void quant_int8x_kernel(const int8_t* xq, const float* dx, int64_t ldq, const uint8_t* wq, int64_t K,
                        const float* bias, float* y, int64_t ldy, int64_t nw, bool accumulate, const float* xsum) {
  const __m512i order = _mm512_load_si512(VNNI_ORDER.idx), low = _mm512_set1_epi8(15);
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
  constexpr int64_t bb = KIND_BLOCK[KIND];
  v16 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = v16{};
  const int64_t nblk = K / QK;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = wq + b * bb;
    if (prefetches_ahead(MB))
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk + 8 * bb + line);
    __m512i w[8], c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    if (is_q4(KIND)) {  // 16 rows of bytes: row j's low nibbles are row j, its high nibbles row j + 16
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + KIND_QUANTS[KIND] + g * 64));
        w[g] = _mm512_and_si512(v, low);
        w[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int g = 0; g < 8; ++g)
        w[g] = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + KIND_QUANTS[KIND] + g * 64));
      for (int g = 0; g < 4; ++g) {
        c0 = _mm512_dpbusd_epi32(c0, ones, w[g]);
        c1 = _mm512_dpbusd_epi32(c1, ones, w[4 + g]);
      }
      c0 = _mm512_slli_epi32(c0, 7);
      c1 = _mm512_slli_epi32(c1, 7);
    }
    const v16 d0 = scale_vec<KIND>(blk, 0);
    const v16 d1 = KIND == KQ8X ? load16(reinterpret_cast<const float*>(blk + 4 * P)) : d0;
    const v16 m = has_offset(KIND) ? scale_vec<KIND>(blk, KIND_OFFSET[KIND]) : v16{};
    for (int i = 0; i < MB; ++i) {
      int32_t four[8];  // the row's activations 4 at a time: four[g] matches w[g]
      std::memcpy(four, xq + i * ldq + b * QK, 32);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        if (is_q4(KIND)) {
          s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(four[g]));
          s1 = _mm512_dpbusd_epi32(s1, w[4 + g], _mm512_set1_epi32(four[4 + g]));
        } else {
          s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(_mm512_set1_epi32(four[g]), flip), w[g]);
          s1 = _mm512_dpbusd_epi32(s1, _mm512_xor_si512(_mm512_set1_epi32(four[4 + g]), flip), w[4 + g]);
        }
      }
      const v16 lo = (v16)_mm512_cvtepi32_ps(_mm512_sub_epi32(s0, c0));  // rows 0-15's exact sum
      const v16 hi = (v16)_mm512_cvtepi32_ps(_mm512_sub_epi32(s1, c1));  // rows 16-31's
      const v16 part = KIND == KQ8X ? (d0 * lo + d1 * hi) * dx[i * nblk + b] : d0 * ((lo + hi) * dx[i * nblk + b]);
      acc[i] += has_offset(KIND) ? part + m * xsum[i * nblk + b] : part;
    }
  }
  const v16 bv = load_bias(bias, nw);
  for (int i = 0; i < MB; ++i) store_out(y + i * ldy, acc[i] + bv, nw, accumulate);
}

using Int8xKernel = void (*)(const int8_t*, const float*, int64_t, const uint8_t*, int64_t, const float*, float*,
                             int64_t, int64_t, bool, const float*);
template <int KIND>
constexpr Int8xKernel INT8X_KERNELS[8] = {
    quant_int8x_kernel<1, KIND>, quant_int8x_kernel<2, KIND>, quant_int8x_kernel<3, KIND>,
    quant_int8x_kernel<4, KIND>, quant_int8x_kernel<5, KIND>, quant_int8x_kernel<6, KIND>,
    quant_int8x_kernel<7, KIND>, quant_int8x_kernel<8, KIND>};
constexpr const Int8xKernel* INT8X_BY_KIND[4] = {INT8X_KERNELS<KQ8>, INT8X_KERNELS<KQ4>, INT8X_KERNELS<KQ8X>,
                                                 INT8X_KERNELS<KQ4H>};

// Rows of x as int8 blocks of 32 (qx), their scales dx and dx * sum_k qx_k (the offsets' factor), vectorized: a
// scalar loop with nearbyint per value took ~1 ms of a 4.5 ms batch-1 decode step (150 GEMMs a step).
// cvtps_epi32 rounds to nearest even, as nearbyint does under the default rounding mode.
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  const int64_t nblk = K / QK;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < nblk; ++b) {
      const float* xb = x + i * ldx + b * QK;
      const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * K + b * QK), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * K + b * QK + 16), _mm512_cvtepi32_epi8(qc));
      dx[i * nblk + b] = d;
      xsum[i * nblk + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc)));
    }
}
#else
constexpr bool HAVE_INT8_DOT = false;
#endif

float* scratch(int64_t floats) {  // a thread's panel buffer, grown as needed and kept
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf.data();
}

// gemm() over quantized panels: the same row and panel blocking (so the same float kernels see the same panel
// values in the same order), each group of panels dequantized into the thread's buffer first.
void gemm_quant(const float* x, int64_t ldx, int64_t M, int64_t K, const torch::Tensor& wq, int64_t N,
                const float* bias, float* y, bool accumulate, bool int8_x) {
  const int64_t np = wq.size(0);
#ifdef __AVX512F__
  const QuantKind kind = quant_kind(wq);
  const int64_t panel_bytes = K / QK * KIND_BLOCK[kind], nblk = K / QK;
  const uint8_t* base = static_cast<const uint8_t*>(wq.data_ptr());
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (int8_x) {  // activations as int8 blocks: VNNI dot products (a stated bound), 8 rows a pass
    static thread_local std::vector<int8_t> xq_buf;
    static thread_local std::vector<float> dx_buf, xs_buf;
    if (static_cast<int64_t>(xq_buf.size()) < M * K) xq_buf.resize(M * K);
    if (static_cast<int64_t>(dx_buf.size()) < M * nblk) dx_buf.resize(M * nblk), xs_buf.resize(M * nblk);
    int8_t* xq = xq_buf.data();
    float *dx = dx_buf.data(), *xsum = xs_buf.data();
    quantize_rows(x, ldx, M, K, xq, dx, xsum);  // the offsets' factor from x~ too: y = w . x~ exactly
    at::parallel_for(0, np, M <= 8 ? 8 : 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
        for (int64_t r0 = 0; r0 < M; r0 += 8) {  // the panel stays in L1/L2 across the row groups
          const int64_t mb = std::min<int64_t>(8, M - r0);
          INT8X_BY_KIND[kind][mb - 1](xq + r0 * K, dx + r0 * nblk, K, base + p * panel_bytes, K,
                                bias == nullptr ? nullptr : bias + n0, y + r0 * N + n0, N, nw, accumulate,
                                xsum + r0 * nblk);
        }
      }
    });
    return;
  }
#endif
  if (M <= 4) {  // the panel streams through registers, its scales applied once per block
    // each row's sum over each block of K (the offsets' factor), in a buffer kept by the calling thread: no
    // allocation per GEMM on the decode path
    static thread_local std::vector<float> xsum_buf;
    if (static_cast<int64_t>(xsum_buf.size()) < M * nblk) xsum_buf.resize(M * nblk);
    float* xsum = xsum_buf.data();  // taken here: inside the workers the name would be their own thread's buffer
    for (int64_t i = 0; i < (has_offset(kind) ? M : 0); ++i)
      for (int64_t b = 0; b < nblk; ++b) {
        float t = 0.0f;
        for (int64_t k = 0; k < QK; ++k) t += x[i * ldx + b * QK + k];
        xsum[i * nblk + b] = t;
      }
    const QuantPanelKernel kernel = ROWS_BY_KIND[kind][M - 1];
    at::parallel_for(0, np, 8, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
        kernel(x, ldx, base + p * panel_bytes, K, bias == nullptr ? nullptr : bias + n0, y + n0, N, nw, accumulate,
               xsum);
      }
    });
    return;
  }
  if (M <= 8) {  // 5-8 rows: all of them against 3 (Q8) or 2 (the others) panels a pass
    const int64_t per = kind == KQ8 ? 3 : 2, groups = (np + per - 1) / per;
    at::parallel_for(0, groups, 3, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = per * g, nb = std::min<int64_t>(per, np - p0), n0 = p0 * P;
        const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
        WIDE_BY_KIND[kind][(M - 5) * 3 + nb - 1](x, ldx, base + p0 * panel_bytes, panel_bytes, K,
                                                 bias == nullptr ? nullptr : bias + n0, y + n0, N, nw, accumulate);
      }
    });
    return;
  }
#endif
  const int64_t per = blocked(M) ? GROUP_PANELS : M >= 5 ? WIDE_PANELS : 1;
  const int64_t groups = (np + per - 1) / per, grain = blocked(M) ? 8 / GROUP_PANELS : M >= 5 ? 3 : 8;
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    float* buf = scratch(per * K * P);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * per, nb = std::min<int64_t>(per, np - p0), n0 = p0 * P;
      const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
      const float* b = bias == nullptr ? nullptr : bias + n0;
      dequant_panels(wq, p0, nb, K, buf);
      if (blocked(M)) {
        const int64_t blocks = (M + 5) / 6;
        for (int64_t blk = 0, m0 = 0; blk < blocks; ++blk) {
          const int64_t mb = (M - m0) / (blocks - blk);
          BLOCK_KERNELS<false>[(mb - 1) * 4 + nb - 1](x + m0 * ldx, ldx, buf, K, b, y + m0 * N + n0, N, nw,
                                                     accumulate, Lines{nullptr, 0});
          m0 += mb;
        }
      } else if (M >= 5) {
        WIDE_ROW_KERNELS<>[(M - 5) * 3 + nb - 1](x, ldx, buf, K, b, y + n0, N, nw, accumulate, Lines{nullptr, 0});
      } else {
        rows_kernel(M, x, ldx, buf, K, b, y + n0, N, nw, accumulate);
      }
    }
  });
}

// gemm() over float panels of element type W (float32, or 16-bit weights widened as they are loaded)
template <typename W>
void gemm_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const W* w, int64_t np, int64_t N,
                 const float* bias, float* y, bool accumulate) {
  constexpr int64_t per_line = sizeof(float) / sizeof(W);  // panel rows of W per 64-byte line of floats: 1 or 2
  if (blocked(M)) {
    const int64_t groups = (np + GROUP_PANELS - 1) / GROUP_PANELS, blocks = (M + 5) / 6;
    at::parallel_for(0, groups, 8 / GROUP_PANELS, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * GROUP_PANELS, nb = std::min<int64_t>(GROUP_PANELS, np - p0), n0 = p0 * P;
        const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
        // the next group's panels are prefetched over this group's row blocks, a share each (when each group's
        // first block streamed its own panels, the memory was busy in 1 of `blocks` passes and that block ran
        // ~2.6x as long as the others; M = 32 GEMMs of the default model's shapes 4-7 % faster)
        const int64_t next_lines =
            g + 1 < end ? std::min<int64_t>(GROUP_PANELS, np - p0 - GROUP_PANELS) * K / per_line : 0;
        const float* next = reinterpret_cast<const float*>(w + (p0 + GROUP_PANELS) * K * P);
        for (int64_t blk = 0, m0 = 0; blk < blocks; ++blk) {
          const int64_t mb = (M - m0) / (blocks - blk);  // near-equal blocks: 17 rows -> 5, 6, 6
          const int64_t lo = next_lines * blk / blocks, hi = next_lines * (blk + 1) / blocks;
          (blk == 0 && g == begin ? BLOCK_KERNELS<true, W> : BLOCK_KERNELS<false, W>)[(mb - 1) * 4 + nb - 1](
              x + m0 * ldx, ldx, w + p0 * K * P, K, bias == nullptr ? nullptr : bias + n0, y + m0 * N + n0, N, nw,
              accumulate, Lines{hi > lo ? next + lo * P : nullptr, hi - lo});
          m0 += mb;
        }
      }
    });
    return;
  }
  if (M >= 5) {  // 5-8 rows: all of them against WIDE_PANELS panels at a time (AVX-512: 24 accumulators at 8 rows)
    const int64_t groups = (np + WIDE_PANELS - 1) / WIDE_PANELS;
    at::parallel_for(0, groups, 3, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * WIDE_PANELS, nb = std::min<int64_t>(WIDE_PANELS, np - p0), n0 = p0 * P;
        const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
        WIDE_ROW_KERNELS<W>[(M - 5) * 3 + nb - 1](x, ldx, w + p0 * K * P, K, bias == nullptr ? nullptr : bias + n0,
                                                  y + n0, N, nw, accumulate, Lines{nullptr, 0});
      }
    });
    return;
  }
  at::parallel_for(0, np, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
      rows_kernel(M, x, ldx, w + p * K * P, K, bias == nullptr ? nullptr : bias + n0, y + n0, N, nw, accumulate);
    }
  });
}

// 16-bit float panels (F16 / BF16 weights kept as stored): dtype half or bfloat16, [ceil(N/16), K, 16]
inline bool is_half_panels(const torch::Tensor& w) {
  return w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16;
}

void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const torch::Tensor& wp, int64_t N, const float* bias,
          float* y, bool accumulate, bool int8_x = false) {
  const int64_t np = wp.size(0);
  switch (wp.scalar_type()) {
    case torch::kFloat:
      return gemm_panels(x, ldx, M, K, wp.data_ptr<float>(), np, N, bias, y, accumulate);
    case torch::kHalf:
      return gemm_panels(x, ldx, M, K, static_cast<const Half16*>(wp.data_ptr()), np, N, bias, y, accumulate);
    case torch::kBFloat16:
      return gemm_panels(x, ldx, M, K, static_cast<const BHalf16*>(wp.data_ptr()), np, N, bias, y, accumulate);
    default:
      return gemm_quant(x, ldx, M, K, wp, N, bias, y, accumulate, int8_x);
  }
}

// Weights are streamed once per step: 2 MiB pages spare the TLB a miss every 4 KiB of the stream. Asked for
// before the first touch, on the aligned interior (Linux with THP in madvise mode; elsewhere a no-op).
void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = 2u << 20, begin = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(huge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

}  // namespace

torch::Tensor pack_panels(const torch::Tensor& wt) {
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == torch::kFloat, "pack_panels: a float32 [in, out] matrix");
  auto w = wt.contiguous();
  const int64_t K = w.size(0), N = w.size(1), np = (N + P - 1) / P;
  auto out = torch::empty({np, K, P}, w.options());
  float* dst = out.data_ptr<float>();
  advise_huge_pages(dst, out.numel() * sizeof(float));
  const float* src = w.data_ptr<float>();
  at::parallel_for(0, np, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
      for (int64_t k = 0; k < K; ++k) {
        float* row = dst + (p * K + k) * P;
        std::memcpy(row, src + k * N + n0, nw * sizeof(float));
        std::fill(row + nw, row + P, 0.0f);
      }
    }
  });
  return out;
}

// A quantized weight's panels, checked against its [in K, out N] shape.
void check_quant(const torch::Tensor& wq, int64_t K, int64_t N, const char* name) {
  TORCH_CHECK(quant_kind_or_none(wq) >= 0 && wq.is_contiguous() && K % QK == 0 && wq.size(0) == (N + P - 1) / P &&
                  wq.size(1) == K / QK,
              name, ": quantized panels do not match the weight's shape");
}

// A quantized weight's panels dequantized: float32 [ceil(N/16), K, 16] (pack_panels' layout).
torch::Tensor dequantize_panels(const torch::Tensor& wq, int64_t K) {
  check_quant(wq, K, wq.size(0) * P, "dequantize_panels");
  auto out = torch::empty({wq.size(0), K, P}, torch::kFloat);
  at::parallel_for(0, wq.size(0), 16, [&](int64_t begin, int64_t end) {
    dequant_panels(wq, begin, end - begin, K, out.data_ptr<float>() + begin * K * P);
  });
  return out;
}

// Rows `ids` of the [N, K] matrix a quantized weight holds (a tied embedding table looked up from the LM head's
// panels): float32 [len(ids), K].
torch::Tensor quant_rows(const torch::Tensor& wq, int64_t K, const torch::Tensor& ids) {
  check_quant(wq, K, wq.size(0) * P, "quant_rows");
  auto idx = ids.to(torch::kLong).contiguous();
  const QuantKind kind = quant_kind(wq);
  const int64_t n = idx.numel(), nblk = K / QK, bb = KIND_BLOCK[kind];
  auto out = torch::empty({n, K}, torch::kFloat);
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < wq.size(0) * P, "quant_rows: id out of range");
  float panel_block[QK * P];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = id[i] / P, c = id[i] % P;
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* blk = static_cast<const uint8_t*>(wq.data_ptr()) + (p * nblk + b) * bb;
      dequant_any(kind, blk, panel_block);
      for (int64_t k = 0; k < QK; ++k) out.data_ptr<float>()[i * K + b * QK + k] = panel_block[k * P + c];
    }
  }
  return out;
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& wp, int64_t N,
                           const c10::optional<torch::Tensor>& bias, bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && wp.dim() == 3, "panel_linear: float32 x, packed weight");
  auto xc = x.contiguous();
  const int64_t K = xc.size(-1), M = xc.numel() / K;
  if (is_quant(wp))
    check_quant(wp, K, N, "panel_linear");
  else
    TORCH_CHECK((wp.scalar_type() == torch::kFloat || is_half_panels(wp)) && wp.size(2) == P && wp.size(1) == K &&
                    wp.size(0) * P >= N,
                "panel_linear: weight does not match x");
  auto y = torch::empty({M, N}, xc.options());
  gemm(xc.data_ptr<float>(), K, M, K, wp, N, bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
       false, int8_activations);
  return y;
}

// Reads every byte of x once, as a decode step streams its weights (threads over contiguous halves, 64-byte loads
// OR-ed into four accumulators: next to no arithmetic per line), and returns a value that depends on all of them.
// The read-bandwidth probe of the benchmarks' rooflines: torch's sum, the probe before, was bound by its additions
// on one 2-core EPYC, so a step could "beat" it (an F32 decode step read 42 GB/s where sum measured 31-36).
int64_t stream_read(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "stream_read: a contiguous CPU tensor");
  const uint8_t* p = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t lines = x.numel() * x.element_size() / 256;  // 4 lines a step; a ragged tail is not read
  std::atomic<int64_t> folded{0};
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* q = p + i * 256;
      a0 = _mm512_or_si512(a0, _mm512_loadu_si512(q));
      a1 = _mm512_or_si512(a1, _mm512_loadu_si512(q + 64));
      a2 = _mm512_or_si512(a2, _mm512_loadu_si512(q + 128));
      a3 = _mm512_or_si512(a3, _mm512_loadu_si512(q + 192));
    }
    const __m512i a = _mm512_or_si512(_mm512_or_si512(a0, a1), _mm512_or_si512(a2, a3));
    folded.fetch_or(_mm512_reduce_or_epi64(a));
#else
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t i = begin; i < end; ++i)
      for (int j = 0; j < 256; j += 64) {
        a0 = _mm256_or_si256(a0, _mm256_loadu_si256((const __m256i*)(p + i * 256 + j)));
        a1 = _mm256_or_si256(a1, _mm256_loadu_si256((const __m256i*)(p + i * 256 + j + 32)));
      }
    alignas(32) int64_t v[4];
    _mm256_store_si256((__m256i*)v, _mm256_or_si256(a0, a1));
    folded.fetch_or(v[0] | v[1] | v[2] | v[3]);
#endif
  });
  return folded.load();
}

// torch.argmax over the last dimension of float32 logits: the first index of the maximum, or of the first NaN
// (torch orders NaN above everything). Why: torch's CPU argmax took ~0.5 ms for 8 rows of a 49k vocabulary,
// 1% of a batch-8 decode step; this takes ~7 us a row. Two 8-lane states keep each lane's maximum and its first
// index; NaN is found through the bits, since -ffast-math lets the compiler assume float compares never see one.
static bool is_nan(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

static int64_t argmax_row(const float* x, int64_t n) {
  typedef float f8 __attribute__((vector_size(32)));
  typedef int32_t i8 __attribute__((vector_size(32)));
  constexpr int U = 2;
  const int64_t n0 = n / (8 * U) * (8 * U);
  const i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  f8 m[U];
  i8 at[U], nan{};
  for (int u = 0; u < U; ++u) {
    m[u] = f8{} + x[0];
    at[u] = i8{};
  }
  for (int64_t j = 0; j < n0; j += 8 * U)
    for (int u = 0; u < U; ++u) {
      f8 v;
      i8 bits;
      std::memcpy(&v, x + j + 8 * u, 32);
      std::memcpy(&bits, x + j + 8 * u, 32);
      nan |= (bits & 0x7fffffff) > 0x7f800000;
      const i8 gt = v > m[u];  // strictly greater: a lane keeps its first index of a tie
      m[u] = gt ? v : m[u];
      at[u] = gt ? lane + static_cast<int32_t>(j + 8 * u) : at[u];
    }
  float best = x[0];
  int64_t idx = 0;
  bool any_nan = false;
  for (int u = 0; u < U; ++u)
    for (int k = 0; k < 8; ++k) {
      if (m[u][k] > best || (m[u][k] == best && at[u][k] < idx)) {
        best = m[u][k];
        idx = at[u][k];
      }
      any_nan |= nan[k] != 0;
    }
  for (int64_t j = n0; j < n; ++j) {
    any_nan |= is_nan(x[j]);
    if (x[j] > best) {
      best = x[j];
      idx = j;
    }
  }
  if (any_nan)
    for (int64_t j = 0; j < n; ++j)
      if (is_nan(x[j])) return j;
  return idx;
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t{1} << 31),
              "argmax_rows: float32, [..., V] with 0 < V < 2^31");
  auto xc = x.contiguous();
  const int64_t n = xc.size(-1), rows = xc.numel() / n;
  auto out = torch::empty(xc.sizes().slice(0, xc.dim() - 1), xc.options().dtype(torch::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = v16{};
  int64_t i = 0;
  for (; i + P <= n; i += P) acc += load16(a + i) * load16(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x
  int64_t i = 0;
  for (; i + P <= n; i += P) store16(y + i, load16(y + i) + a * load16(x + i));
  for (; i < n; ++i) y[i] += a * x[i];
}

void rms_norm(const float* x, const float* w, float* out, int64_t D, double eps) {
  float ss = 0.0f;
  for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / D + static_cast<float>(eps));
  for (int64_t j = 0; j < D; ++j) out[j] = x[j] * r * w[j];
}

void layer_norm(const float* x, const float* w, const float* b, float* out, int64_t D, double eps) {
  float mean = 0.0f, var = 0.0f;
  for (int64_t j = 0; j < D; ++j) mean += x[j];
  mean /= D;
  for (int64_t j = 0; j < D; ++j) var += (x[j] - mean) * (x[j] - mean);
  const float r = 1.0f / std::sqrt(var / D + static_cast<float>(eps));
  for (int64_t j = 0; j < D; ++j) out[j] = (x[j] - mean) * r * w[j] + b[j];
}

const float* ptr(const torch::Tensor& t) { return t.defined() && t.numel() > 0 ? t.data_ptr<float>() : nullptr; }

torch::Tensor f32(const torch::Tensor& t) {  // an optional float32 tensor, contiguous, or undefined
  return t.defined() && t.numel() > 0 ? t.to(torch::kFloat).contiguous() : torch::Tensor();
}

// How a cache stores its K/V rows (bmc/kv/formats.py, which writes and reads the same bits): float32 as the
// attention kernels read it, or a narrower format that a task widens a chunk at a time into float32 buffers (from
// L1 then), so every attention path -- decode, verify trees, shared segments -- reads the narrow bytes from DRAM.
//  - bfloat16 / float16: the values cast, rounding to nearest even;
//  - int8: head_dim int8 values q then their float32 scale s = max|x| * fl(1/127); q = round(x * (1/s)), clamped
//    to +-127 (products, not divisions: this file is compiled with -ffast-math, which may rewrite a division by a
//    constant as a product, and the PyTorch side must round alike); the row reads back as q * s.
enum class KVKind { F32, BF16, F16, I8 };
struct KVLayout {
  KVKind kind = KVKind::F32;
  int64_t row_bytes = 0;  // bytes of one (token, KV head) row
};
constexpr int64_t KV_SCALE_BYTES = 4;
// int8 rows are prefetched this many chunks ahead (2, 3 and 4 measured alike: batch-8 int8 attention at 4K
// context 29.5-32 ms for 30 layers on the 2-core EPYC; 1 chunk ahead, 31-34 ms)
constexpr int64_t I8_AHEAD = 2;

KVLayout kv_layout(const torch::Tensor& kv, int64_t hd, const char* what) {
  switch (kv.scalar_type()) {
    case torch::kFloat:
      TORCH_CHECK(kv.size(-1) == hd, what, ": float32 rows of head_dim");
      return {KVKind::F32, hd * 4};
    case torch::kBFloat16:
      TORCH_CHECK(kv.size(-1) == hd, what, ": bfloat16 rows of head_dim");
      return {KVKind::BF16, hd * 2};
    case torch::kHalf:
#ifndef __F16C__
      TORCH_CHECK(false, what, ": float16 KV on the native step needs a CPU with F16C (x86); use bfloat16, or "
                  "BMC_NATIVE=0");
#endif
      TORCH_CHECK(kv.size(-1) == hd, what, ": float16 rows of head_dim");
      return {KVKind::F16, hd * 2};
    case torch::kChar:
      TORCH_CHECK(kv.size(-1) == hd + KV_SCALE_BYTES, what, ": int8 rows of head_dim values and a float32 scale");
      return {KVKind::I8, hd + KV_SCALE_BYTES};
    default:
      TORCH_CHECK(false, what, ": KV stored as ", kv.scalar_type(), " is not a KV format (float32, bfloat16, "
                  "float16, int8)");
  }
}

// Rows per (row, KV head) slab of a [L, 2, B, H_kv, cap, width] cache: cap when it is contiguous, more when it is
// a view of a mapping whose slabs have room to grow in place (bmc/kv/base.py, grow_in_place: a growth widens the
// view, nothing is copied). Every other stride must be that of a contiguous tensor of `slab` columns.
int64_t slab_rows(const torch::Tensor& kv, const char* what) {
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2, what, ": a [L, 2, B, H_kv, cap, width] cache");
  const int64_t w = kv.size(5), row = kv.stride(4), slab = row > 0 ? kv.stride(3) / row : 0;
  TORCH_CHECK(kv.stride(5) == 1 && row == w && kv.stride(3) == slab * w && slab >= kv.size(4) &&
                  kv.stride(2) == kv.size(3) * kv.stride(3) && kv.stride(1) == kv.size(2) * kv.stride(2) &&
                  kv.stride(0) == 2 * kv.stride(1),
              what, ": a contiguous [L, 2, B, H_kv, cap, width] cache, or a view of one with more columns per slab");
  return slab;
}

// Whether kv is a [L, 2, B, H_kv, len, width] tensor or a view of one with more columns per slab (slab_rows).
bool slab_view(const torch::Tensor& kv) {
  if (kv.dim() != 6 || kv.stride(5) != 1 || kv.stride(4) != kv.size(5) || kv.stride(4) == 0) return false;
  const int64_t slab = kv.stride(3) / kv.stride(4);
  return kv.stride(3) == slab * kv.size(5) && slab >= kv.size(4) && kv.stride(2) == kv.size(3) * kv.stride(3) &&
         kv.stride(1) == kv.size(2) * kv.stride(2) && kv.stride(0) == 2 * kv.stride(1);
}

// One row of hd float32 values x stored as `kind` at dst (the PyTorch side's encode, bit for bit).
void encode_row(KVKind kind, const float* x, int64_t hd, uint8_t* dst) {
  switch (kind) {
    case KVKind::F32:
      std::memcpy(dst, x, hd * sizeof(float));
      return;
    case KVKind::BF16:
      for (int64_t e = 0; e < hd; ++e) {
        uint32_t u;
        std::memcpy(&u, x + e, 4);
        const uint16_t h = std::isnan(x[e]) ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        std::memcpy(dst + 2 * e, &h, 2);
      }
      return;
    case KVKind::F16:
#ifdef __F16C__  // else kv_layout refused the format
      for (int64_t e = 0; e < hd; ++e) {
        const uint16_t h = _cvtss_sh(x[e], _MM_FROUND_TO_NEAREST_INT);
        std::memcpy(dst + 2 * e, &h, 2);
      }
#endif
      return;
    case KVKind::I8: {
      static const float inv127 = 1.0f / 127.0f;  // fl(1/127), as formats.INV_127
      float amax = 0.0f;
      for (int64_t e = 0; e < hd; ++e) amax = std::max(amax, std::fabs(x[e]));
      const float scale = amax * inv127;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      int8_t* q = reinterpret_cast<int8_t*>(dst);
      for (int64_t e = 0; e < hd; ++e)
        q[e] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[e] * inv))));
      std::memcpy(dst + hd, &scale, 4);
      return;
    }
  }
}

// One int8 row (hd values, then its scale) -> hd float32 values. Explicit vector code: GCC's loop over the row's
// bytes, the scale read between, was a scalar loop (12 % of a batch-8 decode attention step, as much as weighing
// the values; this is ~4x less).
inline void widen_i8_row(const uint8_t* row, int64_t hd, float* out) {
  float s;
  std::memcpy(&s, row + hd, 4);
  int64_t e = 0;
#ifdef __AVX512F__
  const __m512 vs = _mm512_set1_ps(s);
  for (; e + 16 <= hd; e += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + e));
    _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs));
  }
#elif defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(s);
  for (; e + 8 <= hd; e += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + e));
    _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs));
  }
#endif
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  for (; e < hd; ++e) out[e] = static_cast<float>(q[e]) * s;
}

// The lines of n rows of row_bytes at `base` (null: none), prefetched a share at a time: share(r) issues the r-th
// of `parts` even shares. Every line: one prefetch per row start skipped one line in 17 of 68-byte int8 rows,
// and each skipped line was a demand miss in the middle of the attention (batch-8 int8 attention at 4K context
// streamed at 11 GB/s against 23 for float32 until the lines were counted).
struct LinePrefetch {
  const uint8_t* base;
  int64_t lines, parts;
  void share(int64_t r) const {
    if (base == nullptr) return;
    for (int64_t i = r * lines / parts, end = (r + 1) * lines / parts; i < end; ++i) __builtin_prefetch(base + 64 * i, 0, 2);
  }
};

// n stored rows from src (row_bytes apart) -> n rows of hd float32 values at dst; the n rows at `next_a` and at
// `next_b` (the next chunk's keys and values, or null) are prefetched over the rows meanwhile
void widen_rows(const KVLayout& lay, const uint8_t* src, int64_t n, int64_t hd, float* dst,
                const uint8_t* next_a = nullptr, const uint8_t* next_b = nullptr) {
  const int64_t lines = (n * lay.row_bytes + 63) / 64;
  const LinePrefetch pa{next_a, lines, n}, pb{next_b, lines, n};
  if (lay.kind == KVKind::I8) {
    for (int64_t r = 0; r < n; ++r) {
      pa.share(r);
      pb.share(r);
      widen_i8_row(src + r * lay.row_bytes, hd, dst + r * hd);
    }
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = src + r * lay.row_bytes;
    pa.share(r);
    pb.share(r);
    float* out = dst + r * hd;
    switch (lay.kind) {
      case KVKind::F32:
        std::memcpy(out, row, hd * sizeof(float));
        break;
      case KVKind::BF16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
        int64_t e = 0;
#ifdef __AVX512F__
        for (; e + 16 <= hd; e += 16) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + e));
          _mm512_storeu_si512(out + e, _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        }
#endif
        uint32_t* o = reinterpret_cast<uint32_t*>(out);
        for (; e < hd; ++e) o[e] = static_cast<uint32_t>(h[e]) << 16;
        break;
      }
      case KVKind::F16: {
#ifdef __F16C__  // else kv_layout refused the format
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
        int64_t e = 0;
#ifdef __AVX512F__
        for (; e + 16 <= hd; e += 16)
          _mm512_storeu_ps(out + e, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + e))));
#endif
        for (; e < hd; ++e) out[e] = _cvtsh_ss(h[e]);
#endif
        break;
      }
      case KVKind::I8:
        widen_i8_row(row, hd, out);
        break;
    }
  }
}

// x [N, hd] float32 -> its rows stored as `like` stores them (a tensor of the format's dtype): what the decode
// step writes into a cache, for the tests to compare with formats.py's encode
torch::Tensor encode_kv(const torch::Tensor& x, const torch::Tensor& like) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x: float32 [N, head_dim]");
  const int64_t N = x.size(0), hd = x.size(1);
  const int64_t width = like.scalar_type() == torch::kChar ? hd + KV_SCALE_BYTES : hd;
  auto out = torch::empty({N, width}, like.options());
  const KVLayout lay = kv_layout(out, hd, "like");
  auto xc = x.contiguous();
  for (int64_t n = 0; n < N; ++n)
    encode_row(lay.kind, xc.data_ptr<float>() + n * hd, hd, static_cast<uint8_t*>(out.data_ptr()) + n * lay.row_bytes);
  return out;
}

struct Segment {  // a shared prefix: KV of `groups` groups, each row reading group[b] (-1: none)
  const uint8_t* kv;
  KVLayout lay;
  const float* bias;
  const int64_t* group;
  int64_t groups, len;
  int64_t slab;  // rows per (group, KV head) slab: len, or more for a view of a longer segment (the prefix cache)
};

struct Layer {
  torch::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // *_b undefined for RMSNorm
  torch::Tensor qkv, o, up, down;            // panels; up = fused gate|up (gated MLP) or fc1
  torch::Tensor qkv_b, o_b, up_b, down_b;    // optional biases
  torch::Tensor q_norm, k_norm;              // Qwen3: RMSNorm weights over head_dim of each query / key head
  torch::Tensor post_attn, post_mlp;         // Gemma 2/3: RMSNorms of the attention's and the MLP's outputs
  bool local = false;                        // attends with the step's window bias and RoPE (Gemma 2/3)
};

}  // namespace

// One decoder's weights, packed once; forward() runs a whole step for t new tokens per row.
class NativeDecoder {
 public:
  NativeDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, bool rms,
                bool gated, std::string act, double eps, double scale)
      : D_(hidden), h_(heads), kvh_(kv_heads), hd_(head_dim), I_(inter), rms_(rms), gated_(gated),
        act_(std::move(act)), eps_(eps), scale_(scale) {
    TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(act_ == "silu" || act_ == "relu" || act_ == "gelu" || (gated && act_ == "gelu_tanh"), "activation ",
                act_, " not supported");
  }

  void add_layer(const torch::Tensor& ln1_w, const torch::Tensor& ln1_b, const torch::Tensor& qkv,
                 const torch::Tensor& qkv_b, const torch::Tensor& o, const torch::Tensor& o_b,
                 const torch::Tensor& ln2_w, const torch::Tensor& ln2_b, const torch::Tensor& up,
                 const torch::Tensor& up_b, const torch::Tensor& down, const torch::Tensor& down_b) {
    const int64_t nq = (h_ + 2 * kvh_) * hd_, nu = gated_ ? 2 * I_ : I_;
    layers_.push_back(Layer{f32(ln1_w), f32(ln1_b), f32(ln2_w), f32(ln2_b), panels(qkv, D_, nq, "qkv"),
                            panels(o, h_ * hd_, D_, "o"), panels(up, D_, nu, "up"), panels(down, I_, D_, "down"),
                            f32(qkv_b), f32(o_b), f32(up_b), f32(down_b)});
  }

  // lm_head: [hidden, vocab], or its panels with `vocab` given
  void set_head(const torch::Tensor& norm_w, const torch::Tensor& norm_b, const torch::Tensor& lm_head,
                int64_t vocab) {
    vocab_ = lm_head.dim() == 3 ? vocab : lm_head.size(1);  // panels (float or quantized) carry no exact width
    norm_w_ = f32(norm_w);
    norm_b_ = f32(norm_b);
    head_ = panels(lm_head, D_, vocab_, "lm_head");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Qwen3's per-head RMSNorm of queries and keys (before RoPE) for layer `layer`: [head_dim] weights each.
  void set_qk_norm(int64_t layer, const torch::Tensor& q_norm, const torch::Tensor& k_norm) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_qk_norm: no layer ", layer);
    TORCH_CHECK(q_norm.numel() == hd_ && k_norm.numel() == hd_, "set_qk_norm: [head_dim] weights");
    layers_[layer].q_norm = f32(q_norm);
    layers_[layer].k_norm = f32(k_norm);
  }

  // Gemma 2/3: RMSNorms ([hidden] weights) applied to the attention's and the MLP's outputs before each joins the
  // residual stream.
  void set_post_norms(int64_t layer, const torch::Tensor& post_attn, const torch::Tensor& post_mlp) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_post_norms: no layer ", layer);
    TORCH_CHECK(post_attn.numel() == D_ && post_mlp.numel() == D_, "set_post_norms: [hidden] weights");
    layers_[layer].post_attn = f32(post_attn);
    layers_[layer].post_mlp = f32(post_mlp);
  }

  // A layer that attends through the sliding window where only some do (Gemma 2/3): it reads the step's `local`
  // bias and RoPE tables (forward's last argument) instead of the main ones.
  void set_local(int64_t layer, bool local) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_local: no layer ", layer);
    layers_[layer].local = local;
  }

  // Gemma 2: attention scores become cap * tanh(score / cap) before the bias is added (0: off).
  // quantized weights against int8-quantized activations (VNNI): a stated bound, not the float weights' logits
  void set_int8_activations(bool on) {
    TORCH_CHECK(!on || HAVE_INT8_DOT, "int8 activations need AVX512-VNNI and AVX512-VBMI, which this CPU lacks");
    int8_x_ = on;
  }

  // int8 KV attended in integers (attend_i8, a stated bound beside int8 rows' own) or widened to float32 first
  void set_int8_kv_dots(bool on) {
    TORCH_CHECK(!on || HAVE_I8_KV_DOTS, "integer int8 KV attention needs AVX512-VNNI and AVX512-BW");
    int8_kv_dots_ = on;
  }
  bool int8_kv_dots() const { return int8_kv_dots_; }

  void set_softcap(double cap) {
    TORCH_CHECK(cap >= 0.0, "set_softcap: cap >= 0");
    softcap_ = cap;
  }

  // A weight as the GEMMs read it: [in, out] float32 packed here, or panels packed beforehand by pack_panels
  // ([ceil(out/16), in, 16]: a memory-mapped file shared by several processes hands them over as they are).
  static torch::Tensor panels(const torch::Tensor& w, int64_t in, int64_t out, const char* name) {
    if (w.dim() == 3 && is_quant(w)) {
      check_quant(w, in, out, name);
      return w;
    }
    if (w.dim() == 3) {
      TORCH_CHECK((w.scalar_type() == torch::kFloat || is_half_panels(w)) && w.is_contiguous() &&
                      w.size(0) == (out + P - 1) / P &&
                      w.size(1) == in && w.size(2) == P,
                  name, ": panels do not match the decoder");
      return w;
    }
    TORCH_CHECK(w.dim() == 2 && w.size(0) == in && w.size(1) == out, name, ": weight shape does not match the decoder");
    return pack_panels(w);
  }

  // Seconds per phase over the decode steps (t = 1) run since profiling was switched on (the paper's Table IV).
  void set_profiling(bool on) {
    profiling_ = on;
    std::fill(std::begin(phase_s_), std::end(phase_s_), 0.0);
  }
  std::map<std::string, double> profile() const {
    return {{"kv_write_s", phase_s_[0]}, {"attention_s", phase_s_[1]}, {"other_s", phase_s_[2]},
            {"gemm_s", phase_s_[3]}, {"lm_head_s", phase_s_[4]}};
  }

  // x [B, t, D] (embedded inputs, overwritten), kv [L, 2, B, H_kv, cap, d] written at columns [start, start+t),
  // bias [B, 1, 1 or t, cap] additive, cos / sin_signed [B, t, d] or empty (no RoPE). Returns logits
  // [B, t or 1, vocab].
  // Shared segments (optional): seg_kv[i] [L, 2, groups, H_kv, len, d], seg_bias[i] [groups, 1, 1, len],
  // seg_group[i] [B] int64, the group each row reads. local: empty, or the window layers' (set_local) bias (empty:
  // the main one), cos and sin, shaped as the main ones.
  torch::Tensor forward(torch::Tensor x, torch::Tensor kv, torch::Tensor bias, torch::Tensor cos, torch::Tensor sin,
                        int64_t start, bool all_logits, std::vector<torch::Tensor> seg_kv,
                        std::vector<torch::Tensor> seg_bias, std::vector<torch::Tensor> seg_group,
                        std::vector<torch::Tensor> local) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.size(2) == D_, "x: float32 [B, t, hidden]");
    const int64_t B = x.size(0), t = x.size(1);
    std::vector<Part> parts{make_part(kv, bias, cos, sin, start, B, t, local)};
    parts[0].segs = parse_segments(seg_kv, seg_bias, seg_group, B, num_layers());
    x = x.reshape({B * t, D_}).contiguous();
    auto logits = run(x, parts, all_logits);
    return logits.view({B, all_logits ? t : 1, vocab_});
  }

  // Several batches in one step (the scheduler's decode rows and a prompt chunk being prefilled): part i has
  // xs[i] [B_i, t_i, D] and its own cache kvs[i], bias, cos / sin and start as in forward(). Every GEMM runs over
  // the rows of all parts together, so each weight is read once for all of them (a prompt chunk costs its FLOPs,
  // not another pass over the weights); each part's KV write and attention read only its own cache. Returns the
  // logits of every row's last token, [sum B_i, vocab], in part order.
  torch::Tensor forward_parts(std::vector<torch::Tensor> xs, std::vector<torch::Tensor> kvs,
                              std::vector<torch::Tensor> biases, std::vector<torch::Tensor> coss,
                              std::vector<torch::Tensor> sins, std::vector<int64_t> starts,
                              std::vector<std::vector<torch::Tensor>> locals,
                              std::vector<std::vector<torch::Tensor>> seg_kvs,
                              std::vector<std::vector<torch::Tensor>> seg_biases,
                              std::vector<std::vector<torch::Tensor>> seg_groups) {
    const size_t n = xs.size();
    TORCH_CHECK(n > 0 && kvs.size() == n && biases.size() == n && coss.size() == n && sins.size() == n &&
                    starts.size() == n && locals.size() == n && seg_kvs.size() == n && seg_biases.size() == n &&
                    seg_groups.size() == n,
                "forward_parts: one x, kv, bias, cos, sin, start, local and segment list per part");
    std::vector<Part> parts;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(xs[i].scalar_type() == torch::kFloat && xs[i].dim() == 3 && xs[i].size(2) == D_,
                  "x: float32 [B, t, hidden]");
      parts.push_back(make_part(kvs[i], biases[i], coss[i], sins[i], starts[i], xs[i].size(0), xs[i].size(1),
                                locals[i]));
      parts.back().segs = parse_segments(seg_kvs[i], seg_biases[i], seg_groups[i], xs[i].size(0), num_layers());
      TORCH_CHECK((coss[i].numel() > 0) == (coss[0].numel() > 0), "forward_parts: RoPE on every part or none");
    }
    std::vector<torch::Tensor> flat;
    for (auto& x : xs) flat.push_back(x.reshape({-1, D_}));
    auto x = torch::cat(flat, 0);
    return run(x, parts, false);
  }

  // One layer's attention alone, the kernel a decode or verify step runs (bmc-calibrate and the benchmarks time
  // it): q [B, t, H*d] with RoPE applied, kv [L, 2, B, H_kv, cap, d] already holding the step's keys, bias
  // [B, 1, 1 or t, cap], segments as in forward(). Returns [B, t, H*d].
  torch::Tensor attention_step(torch::Tensor q, torch::Tensor kv, int64_t layer, torch::Tensor bias,
                               std::vector<torch::Tensor> seg_kv, std::vector<torch::Tensor> seg_bias,
                               std::vector<torch::Tensor> seg_group) const {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "q: float32");
    TORCH_CHECK(q.dim() == 3 && q.size(2) == h_ * hd_, "q: [B, t, heads * head_dim]");
    const int64_t slab = slab_rows(kv, "kv");
    TORCH_CHECK(kv.size(2) == q.size(0) && kv.size(3) == kvh_ && layer >= 0 && layer < kv.size(0),
                "kv: a [L, 2, B, H_kv, cap, d] cache of this decoder's heads holding `layer`");
    const KVLayout lay = kv_layout(kv, hd_, "kv");
    const int64_t B = q.size(0), t = q.size(1), cap = kv.size(4);
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(-1) == cap && (bias.size(2) == 1 || bias.size(2) == t), "bias shape");
    q = q.contiguous();
    bias = bias.to(torch::kFloat).contiguous();
    const std::vector<Segment> segs = parse_segments(seg_kv, seg_bias, seg_group, B, kv.size(0));
    auto out = torch::empty_like(q);
    const int64_t layer_bytes = 2 * B * kvh_ * slab * lay.row_bytes;
    const uint8_t* kc = static_cast<const uint8_t*>(kv.data_ptr()) + layer * layer_bytes;
    attention(layer, q.data_ptr<float>(), h_ * hd_, kc, kc + layer_bytes / 2, lay, cap, slab, bias.data_ptr<float>(),
              bias.size(2), B, t, segs, out.data_ptr<float>());
    return out;
  }

 private:
  struct Part {  // one batch of a step: B rows of t new tokens each, over its own cache
    int64_t B, t, cap, start;
    int64_t slab;  // rows per (row, KV head) slab: cap, or more in a cache that grows in place
    KVLayout lay;  // how the cache stores its rows
    torch::Tensor kv, bias, cos, sin;  // bias made contiguous float32; cos / sin contiguous or empty
    torch::Tensor local_bias, local_cos, local_sin;  // the window layers' (set_local), or empty: the main ones
    std::vector<Segment> segs;
    const torch::Tensor& bias_of(const Layer& L) const {
      return L.local && local_bias.numel() > 0 ? local_bias : bias;
    }
    const float* cos_of(const Layer& L) const {
      return (L.local && local_cos.numel() > 0 ? local_cos : cos).data_ptr<float>();
    }
    const float* sin_of(const Layer& L) const {
      return (L.local && local_sin.numel() > 0 ? local_sin : sin).data_ptr<float>();
    }
  };

  Part make_part(const torch::Tensor& kv, const torch::Tensor& bias, const torch::Tensor& cos,
                 const torch::Tensor& sin, int64_t start, int64_t B, int64_t t,
                 const std::vector<torch::Tensor>& local) const {
    const int64_t slab = slab_rows(kv, "kv");
    TORCH_CHECK(kv.size(0) == num_layers() && kv.size(3) == kvh_, "kv: a [L, 2, B, H_kv, cap, d] cache of this decoder");
    const KVLayout lay = kv_layout(kv, hd_, "kv");
    const int64_t cap = kv.size(4);
    TORCH_CHECK(kv.size(2) == B && start >= 0 && start + t <= cap, "kv: batch or capacity does not fit the step");
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(-1) == cap && (bias.size(2) == 1 || bias.size(2) == t),
                "bias shape");
    if (cos.numel() > 0)
      TORCH_CHECK(cos.numel() == B * t * hd_ && sin.numel() == B * t * hd_, "cos / sin: [B, t, head_dim]");
    Part part{B, t, cap, start, slab, lay, kv, bias.to(torch::kFloat).contiguous(),
              cos.numel() > 0 ? cos.contiguous() : cos, sin.numel() > 0 ? sin.contiguous() : sin};
    if (!local.empty()) {
      TORCH_CHECK(local.size() == 3, "local: [bias, cos, sin] of the window layers");
      if (local[0].numel() > 0) {
        TORCH_CHECK(local[0].sizes() == bias.sizes(), "local bias: shaped as the bias");
        part.local_bias = local[0].to(torch::kFloat).contiguous();
      }
      if (local[1].numel() > 0) {
        TORCH_CHECK(cos.numel() > 0 && local[1].numel() == cos.numel() && local[2].numel() == sin.numel(),
                    "local cos / sin: shaped as cos / sin");
        part.local_cos = local[1].contiguous();
        part.local_sin = local[2].contiguous();
      }
    }
    return part;
  }

  // Every layer over x [M, D] (contiguous, overwritten; M = the parts' rows in order), then the final norm and
  // the LM head: logits [M or the parts' row count, vocab] of every token (all_logits) or every row's last.
  torch::Tensor run(torch::Tensor& x, const std::vector<Part>& parts, bool all_logits) {
    const int64_t M = x.size(0);
    const int64_t nq = (h_ + 2 * kvh_) * hd_, nu = gated_ ? 2 * I_ : I_;
    auto opts = x.options();
    auto hbuf = torch::empty({M, D_}, opts), qkv = torch::empty({M, nq}, opts);
    auto attn = torch::empty({M, h_ * hd_}, opts), mid = torch::empty({M, nu}, opts);
    float *xp = x.data_ptr<float>(), *hp = hbuf.data_ptr<float>(), *qp = qkv.data_ptr<float>();
    float *ap = attn.data_ptr<float>(), *mp = mid.data_ptr<float>();
    bool decode_only = true;
    for (const Part& part : parts) decode_only = decode_only && part.t == 1;
    Clock clock(profiling_ && decode_only && parts.size() == 1, phase_s_);  // decode steps only
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Layer& L = layers_[l];
      norm(xp, L.ln1_w, L.ln1_b, hp, M);
      clock.lap(2);
      gemm(hp, D_, M, D_, L.qkv, nq, ptr(L.qkv_b), qp, false, int8_x_);
      clock.lap(3);
      if (L.q_norm.defined()) {  // in place, each head of each row: q heads, then the k heads after them
        const float *qn = L.q_norm.data_ptr<float>(), *kn = L.k_norm.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
          for (int64_t head = 0; head < h_ + kvh_; ++head) {
            float* v = qp + m * nq + head * hd_;
            rms_norm(v, head < h_ ? qn : kn, v, hd_, eps_);
          }
      }
      int64_t row = 0;
      for (const Part& part : parts) {
        const int64_t rows = part.B * part.t, layer_bytes = 2 * part.B * kvh_ * part.slab * part.lay.row_bytes;
        float* q = qp + row * nq;
        if (part.cos.numel() > 0) apply_rope(q, rows, nq, part.cos_of(L), part.sin_of(L));
        uint8_t* kc = static_cast<uint8_t*>(part.kv.data_ptr()) + l * layer_bytes;
        uint8_t* vc = kc + layer_bytes / 2;
        clock.lap(2);
        write_kv(q, nq, kc, vc, part.lay, part.B, part.t, part.slab, part.start);
        clock.lap(0);
        const torch::Tensor& bias = part.bias_of(L);
        attention(l, q, nq, kc, vc, part.lay, part.cap, part.slab, bias.data_ptr<float>(), bias.size(2), part.B, part.t,
                  part.segs, ap + row * h_ * hd_);
        clock.lap(1);
        row += rows;
      }
      if (L.post_attn.defined()) {  // Gemma 2/3: x += norm(o(attn)); hp is free again
        clock.lap(2);
        gemm(ap, h_ * hd_, M, h_ * hd_, L.o, D_, ptr(L.o_b), hp, false, int8_x_);
        clock.lap(3);
        add_normed(hp, L.post_attn, xp, M);
      } else {
        clock.lap(2);
        gemm(ap, h_ * hd_, M, h_ * hd_, L.o, D_, ptr(L.o_b), xp, true, int8_x_);
        clock.lap(3);
      }
      norm(xp, L.ln2_w, L.ln2_b, hp, M);
      clock.lap(2);
      gemm(hp, D_, M, D_, L.up, nu, ptr(L.up_b), mp, false, int8_x_);
      clock.lap(3);
      activate(mp, M);
      if (L.post_mlp.defined()) {
        clock.lap(2);
        gemm(mp, nu, M, I_, L.down, D_, ptr(L.down_b), hp, false, int8_x_);
        clock.lap(3);
        add_normed(hp, L.post_mlp, xp, M);
      } else {
        clock.lap(2);
        gemm(mp, nu, M, I_, L.down, D_, ptr(L.down_b), xp, true, int8_x_);
        clock.lap(3);
      }
    }
    std::vector<int64_t> out_rows;  // the rows of x whose logits are returned
    int64_t row = 0;
    for (const Part& part : parts) {
      for (int64_t b = 0; b < part.B; ++b)
        for (int64_t i = all_logits ? 0 : part.t - 1; i < part.t; ++i) out_rows.push_back(row + b * part.t + i);
      row += part.B * part.t;
    }
    const int64_t n_out = static_cast<int64_t>(out_rows.size());
    auto last = torch::empty({n_out, D_}, opts);
    for (int64_t r = 0; r < n_out; ++r) {
      const float* src = xp + out_rows[r] * D_;
      float* out = last.data_ptr<float>() + r * D_;
      if (norm_w_.defined())
        norm(src, norm_w_, norm_b_, out, 1);
      else
        std::memcpy(out, src, D_ * sizeof(float));
    }
    auto logits = torch::empty({n_out, vocab_}, opts);
    clock.lap(2);
    gemm(last.data_ptr<float>(), D_, n_out, D_, head_, vocab_, nullptr, logits.data_ptr<float>(), false, int8_x_);
    clock.lap(4);
    return logits;
  }

  // Checks the shared segments against the decoder and batch and makes them contiguous in place where they are
  // not a view of one with more columns per slab (the vectors keep the tensors alive while the step runs). A row
  // whose group is -1 does not read that segment.
  std::vector<Segment> parse_segments(std::vector<torch::Tensor>& seg_kv, std::vector<torch::Tensor>& seg_bias,
                                      std::vector<torch::Tensor>& seg_group, int64_t B, int64_t L) const {
    TORCH_CHECK(seg_kv.size() == seg_bias.size() && seg_kv.size() == seg_group.size(), "segments: kv, bias, group");
    std::vector<Segment> segs;
    for (size_t n = 0; n < seg_kv.size(); ++n) {
      if (!slab_view(seg_kv[n])) seg_kv[n] = seg_kv[n].contiguous();
      seg_bias[n] = seg_bias[n].to(torch::kFloat).contiguous();
      seg_group[n] = seg_group[n].to(torch::kLong).contiguous();
      const auto& sk = seg_kv[n];
      TORCH_CHECK(sk.dim() == 6 && sk.size(0) == L && sk.size(1) == 2 && sk.size(3) == kvh_ &&
                      seg_bias[n].numel() == sk.size(2) * sk.size(4) && seg_group[n].numel() == B,
                  "segment ", n, ": shapes do not match the decoder and batch");
      const KVLayout lay = kv_layout(sk, hd_, "segment");
      const int64_t* grp = seg_group[n].data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(grp[b] >= -1 && grp[b] < sk.size(2), "segment ", n, ": row ", b, " reads group ", grp[b],
                    " of ", sk.size(2));
      segs.push_back(Segment{static_cast<const uint8_t*>(sk.data_ptr()), lay, seg_bias[n].data_ptr<float>(), grp,
                             sk.size(2), sk.size(4), slab_rows(sk, "segment")});
    }
    return segs;
  }

  // x[m] += rms_norm(y[m]) * w for `rows` rows (y normalised in place)
  void add_normed(float* y, const torch::Tensor& w, float* x, int64_t rows) const {
    for (int64_t m = 0; m < rows; ++m) {
      float* ym = y + m * D_;
      rms_norm(ym, w.data_ptr<float>(), ym, D_, eps_);
      float* xm = x + m * D_;
      for (int64_t j = 0; j < D_; ++j) xm[j] += ym[j];
    }
  }

  void norm(const float* x, const torch::Tensor& w, const torch::Tensor& b, float* out, int64_t rows) const {
    for (int64_t m = 0; m < rows; ++m) {
      if (rms_)
        rms_norm(x + m * D_, w.data_ptr<float>(), out + m * D_, D_, eps_);
      else
        layer_norm(x + m * D_, w.data_ptr<float>(), b.data_ptr<float>(), out + m * D_, D_, eps_);
    }
  }

  // x*cos + roll(x, d/2)*sin_signed on every query and key head (values follow them in each row). The two halves
  // are separate loops so that both vectorise: with the roll as `(j + half) % d` in one loop this was 17 ms of a
  // 150 ms step at batch 32 (4 of 46 at batch 8), now well under 1.
  void apply_rope(float* qkv, int64_t M, int64_t nq, const float* cos, const float* sin) const {
    const int64_t half = hd_ / 2;
    std::vector<float> lo_buf(half);
    float* lo = lo_buf.data();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t head = 0; head < h_ + kvh_; ++head) {
        float* v = qkv + m * nq + head * hd_;
        const float *c = cos + m * hd_, *s = sin + m * hd_;
        std::memcpy(lo, v, half * sizeof(float));
        for (int64_t j = 0; j < half; ++j) v[j] = v[j] * c[j] + v[j + half] * s[j];
        for (int64_t j = half; j < hd_; ++j) v[j] = v[j] * c[j] + lo[j - half] * s[j];
      }
  }

  void write_kv(const float* qkv, int64_t nq, uint8_t* kc, uint8_t* vc, const KVLayout& lay, int64_t B, int64_t t,
                int64_t slab, int64_t start) const {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < t; ++i) {
        const float* row = qkv + (b * t + i) * nq;
        for (int64_t kh = 0; kh < kvh_; ++kh) {
          const int64_t at = ((b * kvh_ + kh) * slab + start + i) * lay.row_bytes;
          encode_row(lay.kind, row + (h_ + kh) * hd_, hd_, kc + at);
          encode_row(lay.kind, row + (h_ + kvh_ + kh) * hd_, hd_, vc + at);
        }
      }
  }

  // softmax(q K^T * scale + bias) V for every query row, in two passes over one running softmax state per query
  // row (max m, sum s, and the unnormalised output, kept in the output row itself):
  //  1. shared segments (Hydragen's prefixes, stored once per group): the query rows of a group and KV head walk
  //     the segment together in chunks of SEG_KEYS keys, so a chunk comes from memory once per step for many rows
  //     and from L1/L2 for the rest -- the matrix-matrix product the technique is about -- with an online softmax
  //     across chunks;
  //  2. the row's own cache over its whole capacity with the additive bias (padding rows cost compute, as in the
  //     dense path), merged into the same state, then normalised: the exact softmax over all keys.
  // The G*t query rows of a KV head share each K/V row read (GQA/MQA never repeat KV heads).
  void attention(int64_t l, const float* qkv, int64_t nq, const uint8_t* kc, const uint8_t* vc, const KVLayout& lay,
                 int64_t cap, int64_t slab, const float* bias, int64_t bias_rows, int64_t B, int64_t t,
                 const std::vector<Segment>& segs, float* out) const {
    const int64_t G = h_ / kvh_, R = G * t;
    const float scale = static_cast<float>(scale_);
    const bool prior = !segs.empty();
    TORCH_CHECK(!prior || softcap_ == 0.0, "soft-capped attention reads no shared segments");
    std::vector<float> run_m, run_s;
    if (prior) {
      run_m.assign(B * t * h_, -FLT_MAX);
      run_s.assign(B * t * h_, 0.0f);
      std::fill(out, out + B * t * h_ * hd_, 0.0f);
      for (const Segment& sg : segs) attend_segment(l, qkv, nq, B, t, sg, scale, run_m.data(), run_s.data(), out);
    }
    // Tasks are (row, KV head, span of the capacity). A step at batch 1 has only H_kv (row, KV head) pairs, fewer
    // than twice the threads: the capacity is then split into spans (flash-decoding's split-K), each attended into
    // its own partial state, and the partials are merged exactly by their maxima and sums. Each key is still read
    // once; one span per pair writes straight into the output.
    const int64_t pairs = B * kvh_, threads = at::get_num_threads(), chunks = (cap + OWN_KEYS - 1) / OWN_KEYS;
    const int64_t spans = split_spans(pairs, chunks, threads);
    const int64_t span_chunks = (chunks + spans - 1) / spans;
    std::vector<float> part_m, part_s, part_o;  // [pair, span, R] (and [.., d]) when spans > 1
    if (spans > 1) {
      part_m.resize(pairs * spans * R);
      part_s.resize(pairs * spans * R);
      part_o.resize(pairs * spans * R * hd_);
    }
    auto state_of = [&](int64_t b, int64_t kh, int64_t r) { return (b * t + r % t) * h_ + kh * G + r / t; };
    const bool narrow = lay.kind != KVKind::F32;  // rows widened a chunk at a time into kbuf / vbuf
    const bool dots = integer_dots(lay);           // int8 rows attended in integers (attend_i8)
    const float* kf = reinterpret_cast<const float*>(kc);
    const float* vf = reinterpret_cast<const float*>(vc);
    at::parallel_for(0, pairs * spans, 1, [&](int64_t begin, int64_t end) {
      Rows rows(R, OWN_KEYS * hd_);
      std::vector<float> p(R * OWN_KEYS);
      std::vector<float> kbuf(narrow ? OWN_KEYS * hd_ : 0), vbuf(narrow ? OWN_KEYS * hd_ : 0);
      std::vector<const float*> bias0(R);
#if HAVE_I8_KV_DOTS
      I8Buffers i8(dots ? R : 0, hd_ / 64);
#endif
      for (int64_t task = begin; task < end; ++task) {
        const int64_t pair = task / spans, span = task % spans, kh = pair / B, b = pair % B;
        const int64_t k0 = span * span_chunks * OWN_KEYS, k1 = std::min(cap, k0 + span_chunks * OWN_KEYS);
        // where this thread's next task starts reading (its first chunk is prefetched during this task's last)
        const int64_t next_pair = (task + 1) / spans, next_k0 = (task + 1) % spans * span_chunks * OWN_KEYS;
        const int64_t next_task = task + 1 < end && next_k0 < cap  // a row index
                                      ? (next_pair % B * kvh_ + next_pair / B) * slab + next_k0
                                      : -1;
        const bool direct = spans == 1;  // else the span's partial state goes to part_*
        for (int64_t r = 0; r < R; ++r) {  // row r = g * t + i: query i of the KV head's g-th query head
          const int64_t state = state_of(b, kh, r), i = r % t;
          rows.q[r] = qkv + (b * t + i) * nq + (kh * G + r / t) * hd_;
          rows.o[r] = direct ? out + state * hd_ : part_o.data() + (task * R + r) * hd_;
          bias0[r] = bias + (b * bias_rows + (bias_rows > 1 ? i : 0)) * cap;
          rows.m[r] = direct && prior ? run_m[state] : -FLT_MAX;
          rows.s[r] = direct && prior ? run_s[state] : 0.0f;
        }
#if HAVE_I8_KV_DOTS
        if (dots)
          for (int64_t r = 0; r < R; ++r) split_query(rows.q[r], hd_, scale, i8.q[r]);
#endif
        const int64_t own = (b * kvh_ + kh) * slab;  // the pair's first row
        for (int64_t c0 = k0; c0 < k1; c0 += OWN_KEYS) {  // chunks: K/V come from DRAM once, then from L1/L2
          const int64_t nc = std::min<int64_t>(OWN_KEYS, k1 - c0);
          for (int64_t r = 0; r < R; ++r) rows.bias[r] = bias0[r] + c0;
          // the next chunk is prefetched while this one is attended, spread over the passes (see Prefetch): on
          // the hardware prefetcher alone the KV stream ran at 9-10 GB/s here, against ~15 for the weights
          const int64_t next = c0 + OWN_KEYS < k1 ? own + c0 + OWN_KEYS : next_task;
          const bool more = (direct && prior) || c0 > k0;
          if (narrow) {  // widened into L1-sized buffers, the next chunk's stored rows prefetched meanwhile
            const uint8_t* v_at = vc + (own + c0) * lay.row_bytes;
            if (weighs_int8(lay)) {  // the values weighed straight from their int8 rows (see weigh_int8)
              // two chunks ahead: a chunk's arithmetic (~1 us a thread) is short beside the time its 136 lines take
              // to arrive; the first two of a span are left to the hardware prefetcher
              constexpr int64_t D = I8_AHEAD;
              const int64_t ahead = c0 + D * OWN_KEYS < k1 ? own + c0 + D * OWN_KEYS : -1;
              if (c0 == k0) {  // the chunks before the first `ahead` one, at once
                const int64_t n = std::min((D - 1) * OWN_KEYS, k1 - c0 - OWN_KEYS);
                const LinePrefetch pk{kc + (own + c0 + OWN_KEYS) * lay.row_bytes, (n * lay.row_bytes + 63) / 64, 1};
                const LinePrefetch pv{vc + (own + c0 + OWN_KEYS) * lay.row_bytes, pk.lines, 1};
                if (n > 0) pk.share(0), pv.share(0);
              }
#if HAVE_I8_KV_DOTS
              if (dots) {
                attend_i8(rows, R, i8, kc + (own + c0) * lay.row_bytes, v_at, lay.row_bytes, nc, p.data(), OWN_KEYS,
                          more, ahead >= 0 ? kc + ahead * lay.row_bytes : nullptr,
                          ahead >= 0 ? vc + ahead * lay.row_bytes : nullptr);
                continue;
              }
#endif
              widen_rows(lay, kc + (own + c0) * lay.row_bytes, nc, hd_, kbuf.data(),
                         ahead >= 0 ? kc + ahead * lay.row_bytes : nullptr,
                         ahead >= 0 ? vc + ahead * lay.row_bytes : nullptr);
              attend_keys(rows, R, kbuf.data(), nullptr, nc, scale, p.data(), OWN_KEYS, more, nullptr, nullptr,
                          v_at, lay.row_bytes);
              continue;
            }
            widen_rows(lay, kc + (own + c0) * lay.row_bytes, nc, hd_, kbuf.data(),
                       next >= 0 ? kc + next * lay.row_bytes : nullptr);
            widen_rows(lay, v_at, nc, hd_, vbuf.data(), next >= 0 ? vc + next * lay.row_bytes : nullptr);
            attend_keys(rows, R, kbuf.data(), vbuf.data(), nc, scale, p.data(), OWN_KEYS, more);
          } else {
            attend_keys(rows, R, kf + (own + c0) * hd_, vf + (own + c0) * hd_, nc, scale, p.data(), OWN_KEYS, more,
                        next >= 0 ? kf + next * hd_ : nullptr, next >= 0 ? vf + next * hd_ : nullptr);
          }
        }
        if (k0 >= k1) {  // an empty span (more spans than the rounding left chunks for)
          for (int64_t r = 0; r < R; ++r) std::fill(rows.o[r], rows.o[r] + hd_, 0.0f);
        }
        for (int64_t r = 0; r < R; ++r) {
          if (direct) {
            const float inv = 1.0f / rows.s[r];
            for (int64_t e = 0; e < hd_; ++e) rows.o[r][e] *= inv;
          } else {
            part_m[task * R + r] = rows.m[r];
            part_s[task * R + r] = rows.s[r];
          }
        }
      }
    });
    if (spans == 1) return;
    at::parallel_for(0, pairs * R, 16, [&](int64_t begin, int64_t end) {  // the exact merge of the spans
      for (int64_t n = begin; n < end; ++n) {
        const int64_t pair = n / R, r = n % R, state = state_of(pair % B, pair / B, r);
        float* o = out + state * hd_;
        float m = -FLT_MAX, sum = 0.0f;
        if (prior) {
          m = run_m[state];
          sum = run_s[state];
        } else {
          std::fill(o, o + hd_, 0.0f);
        }
        for (int64_t sp = 0; sp < spans; ++sp) {
          const int64_t at = (pair * spans + sp) * R + r;
          fold_state(m, sum, o, part_m[at], part_s[at], part_o.data() + at * hd_);
        }
        const float inv = 1.0f / sum;
        for (int64_t e = 0; e < hd_; ++e) o[e] *= inv;
      }
    });
  }

  struct Rows {  // query rows attended together: query, output/accumulator, bias row, running max and sum
    std::vector<const float*> q, bias;
    std::vector<float*> o;
    std::vector<float> m, s, alpha;
    std::vector<float> kt;  // a chunk's keys transposed into 16-key panels [n/16][d][16] (the wide path)
    std::vector<float> col;  // new maxima and sums of the column path
    Rows(int64_t n, int64_t kt_floats) : q(n), bias(n), o(n), m(n), s(n), alpha(n), kt(kt_floats), col(2 * n) {}
  };

  // Tasks are (KV head, group, a slice of up to SEG_QUERY_ROWS of the group's query rows, a span of the segment):
  // the rows of a slice read each chunk of their span once, and with few (KV head, group, slice) triples the
  // segment is split into spans so every thread has work; spans are merged by fold_state.
  void attend_segment(int64_t l, const float* qkv, int64_t nq, int64_t B, int64_t t, const Segment& sg, float scale,
                      float* run_m, float* run_s, float* out) const {
    const int64_t G = h_ / kvh_;
    std::vector<std::vector<int64_t>> members(sg.groups);
    for (int64_t b = 0; b < B; ++b)
      if (sg.group[b] >= 0) members[sg.group[b]].push_back(b);
    const int64_t slice = std::max<int64_t>(1, SEG_QUERY_ROWS / (G * t)), rmax = slice * G * t;
    const int64_t rpad = (rmax + P - 1) / P * P;
    struct Task { int64_t kh, grp, first, count; };
    std::vector<Task> row_tasks;
    for (int64_t kh = 0; kh < kvh_; ++kh)
      for (int64_t grp = 0; grp < sg.groups; ++grp)
        for (int64_t first = 0; first < static_cast<int64_t>(members[grp].size()); first += slice)
          row_tasks.push_back({kh, grp, first, std::min<int64_t>(slice, members[grp].size() - first)});
    const int64_t nrt = static_cast<int64_t>(row_tasks.size()), chunks = (sg.len + SEG_KEYS - 1) / SEG_KEYS;
    if (nrt == 0) return;  // no row of this batch reads the segment
    const int64_t spans = split_spans(nrt, chunks, at::get_num_threads());
    const int64_t span_chunks = (chunks + spans - 1) / spans;
    // [row task, span, row] (and [.., d]) when spans > 1, written by the tasks (the outputs zeroed there, in
    // parallel: zeroing all up front here was ~0.1 ms of a 0.35 ms step on 16 threads)
    std::unique_ptr<float[]> part_m, part_s, part_o;
    if (spans > 1) {
      part_m.reset(new float[nrt * spans * rmax]);
      part_s.reset(new float[nrt * spans * rmax]);
      part_o.reset(new float[nrt * spans * rmax * hd_]);
    }
    auto state_of = [&](const Task& task, int64_t r) {  // row r = (member c, head g, query i)
      const int64_t b = members[task.grp][task.first + r / (G * t)], g = r / t % G, i = r % t;
      return (b * t + i) * h_ + task.kh * G + g;
    };
    const bool narrow = sg.lay.kind != KVKind::F32;  // rows widened a chunk at a time into kbuf / vbuf
    at::parallel_for(0, nrt * spans, 1, [&](int64_t begin, int64_t end) {
      Rows rows(rpad, 0);
      std::vector<float> p(rpad * SEG_KEYS), qt(hd_ * rpad);
      std::vector<float> kbuf(narrow ? SEG_KEYS * hd_ : 0), vbuf(narrow ? SEG_KEYS * hd_ : 0);
      for (int64_t n = begin; n < end; ++n) {
        const Task& task = row_tasks[n / spans];
        const int64_t span = n % spans, R = task.count * G * t, Rp = (R + P - 1) / P * P;
        const bool cols = R >= WIDE_ROWS && hd_ % P == 0;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t state = state_of(task, r), b = state / h_ / t, i = state / h_ % t;
          rows.q[r] = qkv + (b * t + i) * nq + (state % h_) * hd_;
          if (spans == 1) {
            rows.o[r] = out + state * hd_;
            rows.m[r] = run_m[state];
            rows.s[r] = run_s[state];
          } else {
            rows.o[r] = part_o.get() + (n * rmax + r) * hd_;
            std::fill(rows.o[r], rows.o[r] + hd_, 0.0f);
            rows.m[r] = -FLT_MAX;
            rows.s[r] = 0.0f;
          }
        }
        if (cols) {
          for (int64_t r = R; r < Rp; ++r) {  // padding rows of the 16-row panels: an empty state, never read back
            rows.m[r] = -FLT_MAX;
            rows.s[r] = 0.0f;
          }
          transpose_queries(rows, R, Rp, scale, qt.data());
        }
        const int64_t head = (sg.groups * 2 * l) * kvh_;  // [L, 2, groups, H, slab, d]
        const int64_t k_row = (head + task.grp * kvh_ + task.kh) * sg.slab, v_row = k_row + sg.groups * kvh_ * sg.slab;
        const float* Kf = reinterpret_cast<const float*>(sg.kv) + k_row * hd_;
        const float* Vf = reinterpret_cast<const float*>(sg.kv) + v_row * hd_;
        const int64_t k1 = std::min(sg.len, (span + 1) * span_chunks * SEG_KEYS);
        for (int64_t c0 = span * span_chunks * SEG_KEYS; c0 < k1; c0 += SEG_KEYS) {
          const int64_t nc = std::min<int64_t>(SEG_KEYS, k1 - c0);
          const float* bias = sg.bias + task.grp * sg.len + c0;
          const bool more = c0 + SEG_KEYS < k1;
          const float *K = Kf + c0 * hd_, *V = Vf + c0 * hd_;
          const float *K_next = more ? K + SEG_KEYS * hd_ : nullptr, *V_next = more ? V + SEG_KEYS * hd_ : nullptr;
          if (narrow) {  // widened into L1-sized buffers, the next chunk's stored rows prefetched meanwhile
            const uint8_t* k_at = sg.kv + (k_row + c0) * sg.lay.row_bytes;
            const uint8_t* v_at = sg.kv + (v_row + c0) * sg.lay.row_bytes;
            const int64_t skip = SEG_KEYS * sg.lay.row_bytes;
            widen_rows(sg.lay, k_at, nc, hd_, kbuf.data(), more ? k_at + skip : nullptr);
            widen_rows(sg.lay, v_at, nc, hd_, vbuf.data(), more ? v_at + skip : nullptr);
            K = kbuf.data(), V = vbuf.data(), K_next = nullptr, V_next = nullptr;
          }
          if (cols) {
            // the next chunk of this span is prefetched while this one is attended (K over the score blocks, V
            // over the weighing passes), as in the own-cache path
            attend_columns(rows, R, Rp, qt.data(), K, V, nc, bias, p.data(), K_next, V_next,
                           more ? std::min<int64_t>(SEG_KEYS, k1 - c0 - SEG_KEYS) : 0);
          } else {
            for (int64_t r = 0; r < R; ++r) rows.bias[r] = bias;
            attend_keys(rows, R, K, V, nc, scale, p.data(), SEG_KEYS, true);
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          if (spans == 1) {
            const int64_t state = state_of(task, r);
            run_m[state] = rows.m[r];
            run_s[state] = rows.s[r];
          } else {
            part_m[n * rmax + r] = rows.m[r];
            part_s[n * rmax + r] = rows.s[r];
          }
        }
      }
    });
    if (spans == 1) return;
    at::parallel_for(0, nrt * rmax, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const Task& task = row_tasks[n / rmax];
        const int64_t r = n % rmax;
        if (r >= task.count * G * t) continue;
        const int64_t state = state_of(task, r);
        for (int64_t sp = 0; sp < spans; ++sp) {
          const int64_t at = ((n / rmax) * spans + sp) * rmax + r;
          fold_state(run_m[state], run_s[state], out + state * hd_, part_m[at], part_s[at], part_o.get() + at * hd_);
        }
      }
    });
  }

  // The shared-segment path for R >= WIDE_ROWS rows of one group and KV head (all reading the same keys with the
  // same bias): the queries are transposed once per task into qt [d][Rp] (pre-scaled, Rp = R rounded up to 16),
  // so a chunk's scores come out as st [key][row] -- one broadcast per key, one load per 16 rows, no transpose of
  // the keys per chunk -- and the softmax runs down the columns, 16 rows per instruction.
  void transpose_queries(const Rows& rows, int64_t R, int64_t Rp, float scale, float* qt) const {
    for (int64_t e = 0; e < hd_; ++e) {
      float* dst = qt + e * Rp;
      for (int64_t r = 0; r < R; ++r) dst[r] = rows.q[r][e] * scale;
      std::fill(dst + R, dst + Rp, 0.0f);
    }
  }

  // Merges keys [0, n) into the running state of the R rows whose queries are qt: scores into st [n][Rp], the
  // online softmax per column, then the value rows weighed by columns of st. The next chunk's n_next keys and
  // values (K_next, V_next; null for none) are prefetched over the score blocks and the weighing passes.
  void attend_columns(Rows& rows, int64_t R, int64_t Rp, const float* qt, const float* K, const float* V, int64_t n,
                      const float* bias, float* st, const float* K_next, const float* V_next, int64_t n_next) const {
    const int64_t panels = Rp / P;
    int64_t blocks = 0;  // score blocks below, over which the next chunk's keys are prefetched
    for (int64_t i0 = 0; i0 < panels; i0 += COL_PANELS)
      blocks += n / COL_KEYS[std::min<int64_t>(COL_PANELS, panels - i0) - 1];
    const Lines kn = share(K_next, n_next, 0, 1);
    Prefetch pf(kn.first, kn.second, blocks);
    float* m = rows.m.data();
    float* s = rows.s.data();
    float* alpha = rows.alpha.data();
    float* mx = rows.col.data();  // the column maxima, folded in by the score blocks as they store
    float* sum = mx + Rp;
    std::copy(m, m + Rp, mx);
    std::fill(sum, sum + Rp, 0.0f);
    for (int64_t i0 = 0; i0 < panels; i0 += COL_PANELS) {
      const int64_t np = std::min<int64_t>(COL_PANELS, panels - i0), nk = COL_KEYS[np - 1];
      int64_t j = 0;
      for (; j + nk <= n; j += nk) {
        pf.advance();
        COL_BLOCKS[np - 1](K + j * hd_, bias + j, hd_, qt + i0 * P, Rp, st + j * Rp + i0 * P, mx + i0 * P);
      }
#ifdef __AVX512F__
      for (; j < n; ++j)
        COL_TAILS[np - 1](K + j * hd_, bias + j, hd_, qt + i0 * P, Rp, st + j * Rp + i0 * P, mx + i0 * P);
#else  // the < 6 keys left in one block: one key alone is a chain of d dependent FMAs
      if (j < n) COL_REST[n - j - 1](K + j * hd_, bias + j, hd_, qt + i0 * P, Rp, st + j * Rp + i0 * P, mx + i0 * P);
#endif
    }
    for (int64_t j = 0; j < n; ++j) {
      float* row = st + j * Rp;
      for (int64_t r = 0; r < Rp; ++r) {
        row[r] = exp_fast(row[r] - mx[r]);
        sum[r] += row[r];
      }
    }
    for (int64_t r = 0; r < Rp; ++r) {
      alpha[r] = exp_fast(m[r] - mx[r]);  // rescales what earlier keys contributed
      s[r] = s[r] * alpha[r] + sum[r];
      m[r] = mx[r];
    }
    weigh_rows(rows, R, st, Rp, true, V, n, true, V_next, n_next);
  }

  // st[j][r] = qt[.][r] . K[j] + bias[j] for NK keys x NP 16-row panels (NK * NP accumulators), and the column
  // maxima mx[r] raised to cover them (from registers: a separate pass re-read all of st, ~2 % of the step)
  template <int NK, int NP>
  static void column_block(const float* K, const float* bias, int64_t hd, const float* qt, int64_t Rp, float* st,
                           float* mx) {
    v16 acc[NK][NP];
    for (int j = 0; j < NK; ++j)
      for (int i = 0; i < NP; ++i) acc[j][i] = v16{};
    for (int64_t e = 0; e < hd; ++e) {
      v16 q[NP];
      for (int i = 0; i < NP; ++i) q[i] = load16(qt + e * Rp + i * P);
      for (int j = 0; j < NK; ++j) {
        const float k = K[j * hd + e];
        for (int i = 0; i < NP; ++i) acc[j][i] += k * q[i];
      }
    }
    for (int i = 0; i < NP; ++i) {
      v16 top = load16(mx + i * P);
      for (int j = 0; j < NK; ++j) {
        const v16 x = acc[j][i] + bias[j];
        store16(st + j * Rp + i * P, x);
        top = max16(top, x);
      }
      store16(mx + i * P, top);
    }
  }
  using ColumnBlock = void (*)(const float*, const float*, int64_t, const float*, int64_t, float*, float*);
#ifdef __AVX512F__
  static constexpr int64_t COL_PANELS = 6;
  static constexpr int64_t COL_KEYS[COL_PANELS] = {8, 8, 8, 6, 4, 4};  // keys per block: <= 24 accumulators
  static constexpr ColumnBlock COL_BLOCKS[COL_PANELS] = {column_block<8, 1>, column_block<8, 2>, column_block<8, 3>,
                                                         column_block<6, 4>, column_block<4, 5>, column_block<4, 6>};
  static constexpr ColumnBlock COL_TAILS[COL_PANELS] = {column_block<1, 1>, column_block<1, 2>, column_block<1, 3>,
                                                        column_block<1, 4>, column_block<1, 5>, column_block<1, 6>};
#else  // AVX2: a v16 is two of 16 registers, so one 16-row panel x 6 keys (6 * 2 accumulators + 2 for q)
  static constexpr int64_t COL_PANELS = 1;
  static constexpr int64_t COL_KEYS[COL_PANELS] = {6};
  static constexpr ColumnBlock COL_BLOCKS[COL_PANELS] = {column_block<6, 1>};
  static constexpr ColumnBlock COL_REST[5] = {column_block<1, 1>, column_block<2, 1>, column_block<3, 1>,
                                              column_block<4, 1>, column_block<5, 1>};
#endif

  // (m, s, o) := the softmax state over the keys of both (m, s, o) and (m2, s2, o2): running maxima, sums of
  // exp(score - max), and unnormalised outputs. Empty states are (-FLT_MAX, 0, 0).
  void fold_state(float& m, float& s, float* o, float m2, float s2, const float* o2) const {
    const float mx = std::max(m, m2), a = std::exp(m - mx), b = std::exp(m2 - mx);
    s = s * a + s2 * b;
    for (int64_t e = 0; e < hd_; ++e) o[e] = o[e] * a + o2[e] * b;
    m = mx;
  }

  // Part i of `parts` of the lines of n key or value rows starting at `next` (the next chunk's), for a Prefetch
  Lines share(const float* next, int64_t n, int64_t i, int64_t parts) const {
    if (next == nullptr) return {nullptr, 0};
    const int64_t lines = n * hd_ / P, lo = lines * i / parts;
    return {next + lo * P, lines * (i + 1) / parts - lo};
  }

  // p[j] = cap * tanh(p[j] / cap) + bias[j] (Gemma 2's soft-capped attention scores, in HF's order)
  void cap_scores(float* p, const float* bias, int64_t n) const {
    const float cap = static_cast<float>(softcap_);
    for (int64_t j = 0; j < n; ++j) p[j] = tanh_fast(p[j] / cap) * cap + bias[j];
  }

  // Merges keys [0, n) (K/V rows of hd floats; rows.bias[r][j] added to query r's score of key j) into the running
  // state of R query rows. Without `prior` the state is empty and the output rows are not read.
  // With `vq` (int8 rows row_bytes apart, weighs_int8), the values are read from there instead of V.
  void attend_keys(Rows& rows, int64_t R, const float* K, const float* V, int64_t n, float scale, float* p,
                   int64_t ldp, bool prior, const float* K_next = nullptr, const float* V_next = nullptr,
                   const uint8_t* vq = nullptr, int64_t row_bytes = 0) const {
    const bool wide = R >= WIDE_ROWS && hd_ % P == 0;
    if (wide) wide_scores(rows, R, K, n, scale, p, ldp);
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p + r * ldp;
      if (!wide) {
        // soft-capped scores (Gemma 2): q.k * scale first (a zero bias), then capped and biased
        const float* bias = softcap_ > 0.0 ? zeros_.data() : rows.bias[r];
        switch (hd_) {
          case 64: scores<4>(rows.q[r], K, n, bias, scale, pr, share(K_next, n, r, R)); break;
          case 128: scores<8>(rows.q[r], K, n, bias, scale, pr, share(K_next, n, r, R)); break;
          default:
            for (int64_t j = 0; j < n; ++j) pr[j] = dot(rows.q[r], K + j * hd_, hd_) * scale + bias[j];
        }
        if (softcap_ > 0.0) cap_scores(pr, rows.bias[r], n);
      }
      softmax_row(rows, r, pr, n, prior);
    }
    if (vq != nullptr) {
      weigh_int8(rows, R, p, ldp, vq, row_bytes, n, prior);
      return;
    }
    weigh_rows(rows, R, p, ldp, false, V, n, prior, V_next);
  }

  // The online softmax over one chunk of query row r's scores pr[0, n): each becomes e^(score - m') with m' the
  // row's new running maximum; the running sum follows, and alpha[r] rescales what earlier keys contributed
  static void softmax_row(Rows& rows, int64_t r, float* pr, int64_t n, bool prior) {
    float mx = rows.m[r];
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, pr[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      pr[j] = exp_fast(pr[j] - mx);
      sum += pr[j];
    }
    rows.alpha[r] = prior ? exp_fast(rows.m[r] - mx) : 0.0f;
    rows.s[r] = rows.s[r] * rows.alpha[r] + sum;
    rows.m[r] = mx;
  }

  // Whether this step's own-cache chunks of an int8 cache are attended in integers (attend_i8): with VNNI, at
  // head_dim 64 or 128 and without soft-capping, unless set_int8_kv_dots turned it off
  bool integer_dots(const KVLayout& lay) const {
    return HAVE_I8_KV_DOTS && int8_kv_dots_ && lay.kind == KVKind::I8 && (hd_ == 64 || hd_ == 128) &&
           softcap_ == 0.0;
  }

  // Whether int8 values are weighed straight from their rows: AVX-512 at head_dim 64 or 128 (elsewhere they are
  // widened first, as every other format is)
  bool weighs_int8(const KVLayout& lay) const {
#ifdef __AVX512F__
    return lay.kind == KVKind::I8 && (hd_ == 64 || hd_ == 128);
#else
    return false;
#endif
  }

  // weigh_rows for int8 values: each row's weights p[r][j] take the value row's scale s_j first (p * (q * s) =
  // (p * s) * q), then the values are converted in registers as they are read, so a chunk of values is neither
  // written out as float32 nor read back. Measured on the 2-core EPYC (AVX-512), batch 8, 8K context: widening
  // the values into a buffer first cost as much as weighing them.
  void weigh_int8(Rows& rows, int64_t R, float* p, int64_t ldp, const uint8_t* vq, int64_t row_bytes, int64_t n,
                  bool prior) const {
#ifdef __AVX512F__
    float sv[std::max(OWN_KEYS, SEG_KEYS)];
    for (int64_t j = 0; j < n; ++j) std::memcpy(sv + j, vq + j * row_bytes + hd_, 4);
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p + r * ldp;
      for (int64_t j = 0; j < n; ++j) pr[j] *= sv[j];
    }
    const int64_t rstep = hd_ == 64 ? 6 : 4;
    for (int64_t r0 = 0; r0 < R; r0 += rstep) {
      const int64_t rc = std::min<int64_t>(rstep, R - r0);
      (hd_ == 64 ? WEIGH_I8_64 : WEIGH_I8_128)[rc - 1](p + r0 * ldp, ldp, vq, row_bytes, n, rows.alpha.data() + r0,
                                                       prior, rows.o.data() + r0);
    }
#else
    TORCH_CHECK(false, "weigh_int8 is built for AVX-512 only");
#endif
  }

#if HAVE_I8_KV_DOTS
  // Integer attention over an int8 cache (int8_kv_dots): a chunk's scores and its weighted values as VNNI u8 x s8
  // dot products (vpdpbusd, 64 products an instruction) on the stored bytes, where the widening path converts
  // every key and value to float32 and spends 16 FMAs on each 16 products. Measured on the 2-core EPYC (AVX-512,
  // Zen 4), SmolLM2's heads, batch 8 at 8K context, 30 layers: attention 21.7 against 43.4 ms widened (float32
  // 48.7); with the KV in cache 7.1-7.4 against 12.4-13 ns of thread time per (row, KV head, key).
  // The bound it adds to int8 KV's own (a row is within half a step of its values): each query row is split into
  // two int8 digits, q ~ e (256 hi + lo) with |256 hi + lo| <= 32639 (e = max|q| / 32639, so a score moves by at
  // most e/2 * sum_d |k_d|), and each chunk's weights p_j s_j (s_j the value row's scale) are rounded to 16 bits
  // of their chunk maximum w (two u8 digits; a weight moves by at most w / 131070). Both are ~2^-16 of what they
  // round, against int8 rows' 2^-8: the int8 cache's logits move by what its rows move them (tests/test_kv_dtype).
  // The mask of a 16-lane vector's first min(n, 16) lanes (n >= 1): a block's keys left before a chunk's end
  static __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
  struct QueryI8 {  // one query row as two int8 digits
    alignas(64) int8_t hi[128];
    alignas(64) int8_t lo[128];
    float step;      // e times the softmax scale
    int32_t offset;  // 128 * sum_d (256 hi_d + lo_d): what reading each key byte as k + 128 (unsigned) adds
  };
  static void split_query(const float* q, int64_t hd, float scale, QueryI8& out) {
    float amax = 0.0f;
    for (int64_t e = 0; e < hd; ++e) amax = std::max(amax, std::fabs(q[e]));
    const float step = amax / 32639.0f, inv = step > 0.0f ? 1.0f / step : 0.0f;
    int32_t sum = 0;
    for (int64_t e = 0; e < hd; ++e) {
      const int32_t v = std::min(32639, std::max(-32639, static_cast<int32_t>(std::nearbyint(q[e] * inv))));
      const int32_t h = (v + 128) >> 8;  // floor: v = 256 h + l with l in [-128, 127], |h| <= 127
      out.hi[e] = static_cast<int8_t>(h);
      out.lo[e] = static_cast<int8_t>(v - 256 * h);
      sum += v;
    }
    out.step = step * scale;
    out.offset = 128 * sum;
  }

  // The 16 key rows from `rows` (row_bytes apart; those at and past n read as zero), bytes [64 g, 64 g + 64) of
  // each, transposed: x[c] holds in lane i the key i's dimensions 4c .. 4c + 3, each byte + 128 (unsigned)
  static void key_block(const uint8_t* rows, int64_t row_bytes, int64_t n, int g, __m512i* x) {
    v16 t[16];
    for (int i = 0; i < 16; ++i)
      t[i] = i < n ? (v16)_mm512_loadu_si512(rows + i * row_bytes + 64 * g) : v16{};
    transpose16(t);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 16; ++c) x[c] = _mm512_xor_si512((__m512i)t[c], flip);
  }

  // The n <= OWN_KEYS key rows at K transposed once, block by block (key_block), into kx [n/16][NG][16], for query
  // rows in several passes (i8_scores<.., true>); the next chunk's lines (pk, pv) prefetched a share a block
  template <int NG>
  static void key_blocks(const uint8_t* K, int64_t row_bytes, int64_t n, __m512i* kx, const LinePrefetch& pk,
                         const LinePrefetch& pv) {
    for (int64_t s = 0; s < n; s += 16) {
      pk.share(s / 16);
      pv.share(s / 16);
      for (int g = 0; g < NG; ++g) key_block(K + s * row_bytes, row_bytes, n - s, g, kx + (s / 16 * NG + g) * 16);
    }
  }

  // p[r][j] = q_r . k_j * scale + bias_r[j] for RC query rows and the n <= OWN_KEYS keys at K (int8 rows of NG * 64
  // values, row_bytes apart, their scales in sk): 16 keys a block, each block's transposed key bytes shared by
  // the rows' two digits; the next chunk's lines (pk, pv) are prefetched a share a block. BUF: the blocks come
  // transposed already from kx (key_blocks), and K, pk and pv are unused.
  template <int NG, int RC, bool BUF>
  static void i8_scores(const QueryI8* qs, const uint8_t* K, int64_t row_bytes, const __m512i* kx, int64_t n,
                        const float* sk, const float* const* bias, float* p, int64_t ldp, const LinePrefetch& pk,
                        const LinePrefetch& pv) {
    for (int64_t s = 0; s < n; s += 16) {
      if (!BUF) {
        pk.share(s / 16);
        pv.share(s / 16);
      }
      __m512i hi[RC], lo[RC];
      for (int r = 0; r < RC; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
      for (int g = 0; g < NG; ++g) {
        __m512i own[16];
        const __m512i* x = own;
        if constexpr (BUF) {
          x = kx + (s / 16 * NG + g) * 16;
        } else {
          key_block(K + s * row_bytes, row_bytes, n - s, g, own);
        }
        for (int r = 0; r < RC; ++r) {
          const int32_t* h4 = reinterpret_cast<const int32_t*>(qs[r].hi + 64 * g);
          const int32_t* l4 = reinterpret_cast<const int32_t*>(qs[r].lo + 64 * g);
          for (int c = 0; c < 16; ++c) {
            hi[r] = _mm512_dpbusd_epi32(hi[r], x[c], _mm512_set1_epi32(h4[c]));
            lo[r] = _mm512_dpbusd_epi32(lo[r], x[c], _mm512_set1_epi32(l4[c]));
          }
        }
      }
      const __mmask16 live = first_lanes(n - s);
      const __m512 scales = _mm512_maskz_loadu_ps(live, sk + s);
      for (int r = 0; r < RC; ++r) {
        const __m512i dots = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]),
                                              _mm512_set1_epi32(qs[r].offset));
        const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scales, _mm512_set1_ps(qs[r].step)));
        _mm512_storeu_ps(p + r * ldp + s, _mm512_add_ps(sc, _mm512_maskz_loadu_ps(live, bias[r] + s)));
      }
    }
  }

  // sums[r][2 H + k] = sum_j (256 wh[r][j] + wl[r][j]) v_j over half H of the 64 values at V (dimensions 8 H .. 8 H + 7
  // of each 16) for RC rows: 4 value rows at a time interleaved bytewise, so that a lane holds one dimension of the
  // 4 keys, against the 4 keys' weight digits broadcast. A lane's dimension is the interleave's: lane 4 L + i of
  // sums[r][m] is dimension 16 L + 4 m + i (i8_finish puts them back). Half the dimensions a pass keeps the
  // 4 RC accumulators in registers (all 64 at 3 rows spilled to the stack on every key, GCC 12).
  template <int H, int RC>
  static void i8_weigh(const uint8_t* wh, const uint8_t* wl, int64_t ldw, const uint8_t* V, int64_t row_bytes,
                       int64_t n, __m512i (*sums)[4]) {
    __m512i hi[RC][2], lo[RC][2];
    for (int r = 0; r < RC; ++r)
      for (int k = 0; k < 2; ++k) hi[r][k] = lo[r][k] = _mm512_setzero_si512();
    for (int64_t j = 0; j < n; j += 4) {
      __m512i v[4];
      for (int i = 0; i < 4; ++i)
        v[i] = j + i < n ? _mm512_loadu_si512(V + (j + i) * row_bytes) : _mm512_setzero_si512();
      const __m512i a = H == 0 ? _mm512_unpacklo_epi8(v[0], v[1]) : _mm512_unpackhi_epi8(v[0], v[1]);
      const __m512i c = H == 0 ? _mm512_unpacklo_epi8(v[2], v[3]) : _mm512_unpackhi_epi8(v[2], v[3]);
      const __m512i x[2] = {_mm512_unpacklo_epi16(a, c), _mm512_unpackhi_epi16(a, c)};
      for (int r = 0; r < RC; ++r) {
        int32_t h4, l4;
        std::memcpy(&h4, wh + r * ldw + j, 4);
        std::memcpy(&l4, wl + r * ldw + j, 4);
        const __m512i bh = _mm512_set1_epi32(h4), bl = _mm512_set1_epi32(l4);
        for (int k = 0; k < 2; ++k) {
          hi[r][k] = _mm512_dpbusd_epi32(hi[r][k], bh, x[k]);
          lo[r][k] = _mm512_dpbusd_epi32(lo[r][k], bl, x[k]);
        }
      }
    }
    for (int r = 0; r < RC; ++r)
      for (int k = 0; k < 2; ++k) sums[r][2 * H + k] = _mm512_add_epi32(_mm512_slli_epi32(hi[r][k], 8), lo[r][k]);
  }
  using I8Weigh = void (*)(const uint8_t*, const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, __m512i (*)[4]);
  using I8Scores = void (*)(const QueryI8*, const uint8_t*, int64_t, const __m512i*, int64_t, const float*,
                            const float* const*, float*, int64_t, const LinePrefetch&, const LinePrefetch&);
  static constexpr int I8_SCORE_ROWS = 7;  // rows a pass: 2 accumulators each beside 16 key registers, in 32
  template <int NG, bool BUF>
  static constexpr I8Scores I8_SCORES[I8_SCORE_ROWS] = {
      i8_scores<NG, 1, BUF>, i8_scores<NG, 2, BUF>, i8_scores<NG, 3, BUF>, i8_scores<NG, 4, BUF>,
      i8_scores<NG, 5, BUF>, i8_scores<NG, 6, BUF>, i8_scores<NG, 7, BUF>};
  static constexpr int I8_WEIGH_ROWS = 3;  // rows a pass: 4 accumulators each, in 32 registers with the values'

  static constexpr I8Weigh I8_WEIGH[2][I8_WEIGH_ROWS] = {{i8_weigh<0, 1>, i8_weigh<0, 2>, i8_weigh<0, 3>},
                                                         {i8_weigh<1, 1>, i8_weigh<1, 2>, i8_weigh<1, 3>}};

  // o[0, 64) = alpha * o (or 0) + w * the sums of i8_weigh's two halves (c[m], m = 2 H + k), in dimension order: a
  // 4 x 4 transpose of 128-bit blocks
  static void i8_finish(const __m512i* c, float w, float alpha, bool prior, float* o) {
    const __m512i t0 = _mm512_shuffle_i32x4(c[0], c[1], 0x44), t1 = _mm512_shuffle_i32x4(c[2], c[3], 0x44);
    const __m512i t2 = _mm512_shuffle_i32x4(c[0], c[1], 0xee), t3 = _mm512_shuffle_i32x4(c[2], c[3], 0xee);
    const __m512i dims[4] = {_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xdd),
                             _mm512_shuffle_i32x4(t2, t3, 0x88), _mm512_shuffle_i32x4(t2, t3, 0xdd)};
    const __m512 wv = _mm512_set1_ps(w), av = _mm512_set1_ps(alpha);
    for (int q = 0; q < 4; ++q) {
      const __m512 add = _mm512_mul_ps(_mm512_cvtepi32_ps(dims[q]), wv);
      _mm512_storeu_ps(o + 16 * q, prior ? _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * q), av, add) : add);
    }
  }

  // The float32 scales of n <= OWN_KEYS int8 rows (row_bytes apart, each after its hd values) -> out[0, n), and
  // zeros up to the next 16: gathered 16 at a time (two scalar loads and stores a key were ~10 % of attend_i8)
  static void gather_scales(const uint8_t* rows, int64_t row_bytes, int64_t n, int64_t hd, float* out) {
    const __m512i at = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(static_cast<int32_t>(row_bytes))),
        _mm512_set1_epi32(static_cast<int32_t>(hd)));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = first_lanes(n - j);
      _mm512_store_ps(out + j, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, rows + j * row_bytes, 1));
    }
  }

  // Per-thread buffers of attend_i8 for R query rows
  struct I8Buffers {
    std::vector<QueryI8> q;      // the rows' digits
    std::vector<uint8_t> w;      // [R][2][OWN_KEYS + 4]: each row's weight digits
    std::vector<float> wstep;    // [R]: each row's weight step
    std::vector<__m512i> keys;   // [OWN_KEYS / 16][NG][16]: a chunk's keys transposed, for R > I8_SCORE_ROWS
    I8Buffers(int64_t R, int64_t NG)
        : q(R), w(2 * R * (OWN_KEYS + 4)), wstep(R), keys(R > I8_SCORE_ROWS ? OWN_KEYS / 16 * NG * 16 : 0) {}
  };

  // One chunk of a row's own int8 cache (n <= OWN_KEYS keys at K and V, row_bytes apart) merged into the running
  // state of R query rows, in integers (see QueryI8; buf.q holds their digits); the lines at K_next / V_next are
  // prefetched meanwhile. Up to I8_SCORE_ROWS rows transpose each key block as they score it; more read the chunk
  // transposed once.
  void attend_i8(Rows& rows, int64_t R, I8Buffers& buf, const uint8_t* K, const uint8_t* V, int64_t row_bytes,
                 int64_t n, float* p, int64_t ldp, bool prior, const uint8_t* K_next, const uint8_t* V_next) const {
    const int NG = static_cast<int>(hd_ / 64);
    alignas(64) float sk[OWN_KEYS], sv[OWN_KEYS];  // the rows' scales, zero past n
    gather_scales(K, row_bytes, n, hd_, sk);
    gather_scales(V, row_bytes, n, hd_, sv);
    const int64_t blocks = (n + 15) / 16, lines = (n * row_bytes + 63) / 64;
    const LinePrefetch pk{K_next, lines, blocks}, pv{V_next, lines, blocks};
    const QueryI8* qs = buf.q.data();
    if (R <= I8_SCORE_ROWS) {
      (NG == 1 ? I8_SCORES<1, false> : I8_SCORES<2, false>)[R - 1](qs, K, row_bytes, nullptr, n, sk,
                                                                   rows.bias.data(), p, ldp, pk, pv);
    } else {
      (NG == 1 ? key_blocks<1> : key_blocks<2>)(K, row_bytes, n, buf.keys.data(), pk, pv);
      for (int64_t r0 = 0; r0 < R; r0 += I8_SCORE_ROWS) {
        const int64_t rc = std::min<int64_t>(I8_SCORE_ROWS, R - r0);
        (NG == 1 ? I8_SCORES<1, true> : I8_SCORES<2, true>)[rc - 1](qs + r0, nullptr, 0, buf.keys.data(), n, sk,
                                                                     rows.bias.data() + r0, p + r0 * ldp, ldp, pk,
                                                                     pv);
      }
    }
    for (int64_t r = 0; r < R; ++r) softmax_row(rows, r, p + r * ldp, n, prior);
    // the weights p_j s_j of each row as 16 bits of their maximum, two u8 digits (buf.w: [R][2][ldw] bytes)
    const int64_t ldw = OWN_KEYS + 4;
    uint8_t* wq = buf.w.data();
    float* wstep = buf.wstep.data();
    for (int64_t r = 0; r < R; ++r) {  // 16 weights a vector; those past n are zero (sv is)
      float* pr = p + r * ldp;
      __m512 vmax = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(pr + j), _mm512_load_ps(sv + j));
        _mm512_storeu_ps(pr + j, w);
        vmax = _mm512_max_ps(vmax, w);
      }
      const float wmax = _mm512_reduce_max_ps(vmax);
      wstep[r] = wmax / 65535.0f;
      const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 65535.0f / wmax : 0.0f);
      uint8_t *hi = wq + 2 * r * ldw, *lo = hi + ldw;
      for (int64_t j = 0; j < n; j += 16) {  // rounded to nearest even, as nearbyint
        const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pr + j), inv)),
                                           _mm512_set1_epi32(65535));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + j), _mm512_cvtepi32_epi8(_mm512_srli_epi32(v, 8)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + j),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(255))));
      }
    }
    for (int64_t r0 = 0; r0 < R; r0 += I8_WEIGH_ROWS) {
      const int64_t rc = std::min<int64_t>(I8_WEIGH_ROWS, R - r0);
      for (int g = 0; g < NG; ++g) {
        __m512i sums[I8_WEIGH_ROWS][4];  // a 64-value group's sums, 4 registers a row (see i8_weigh)
        for (int h = 0; h < 2; ++h)
          I8_WEIGH[h][rc - 1](wq + 2 * r0 * ldw, wq + (2 * r0 + 1) * ldw, 2 * ldw, V + 64 * g, row_bytes, n, sums);
        for (int64_t r = 0; r < rc; ++r)
          i8_finish(sums[r], wstep[r0 + r], rows.alpha[r0 + r], prior, rows.o[r0 + r] + 64 * g);
      }
    }
  }
#endif

#ifdef __AVX512F__
  // o[r] = alpha[r] * o[r] (or 0) + sum_j p[r][j] q_j for RC rows, q_j the int8 row j widened in registers
  template <int NV, int RC>
  static void weigh_i8(const float* p, int64_t ldp, const uint8_t* vq, int64_t row_bytes, int64_t n,
                       const float* alpha, bool prior, float* const* o) {
    v16 acc[RC][NV];
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = prior ? load16(o[r] + P * j) * alpha[r] : v16{};
    for (int64_t s = 0; s < n; ++s) {
      const uint8_t* row = vq + s * row_bytes;
      v16 v[NV];
      for (int j = 0; j < NV; ++j)
        v[j] = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + P * j))));
      for (int r = 0; r < RC; ++r) {
        const float w = p[r * ldp + s];
        for (int j = 0; j < NV; ++j) acc[r][j] += w * v[j];
      }
    }
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NV; ++j) store16(o[r] + P * j, acc[r][j]);
  }
  using WeighI8 = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*, bool, float* const*);
  static constexpr WeighI8 WEIGH_I8_64[6] = {weigh_i8<4, 1>, weigh_i8<4, 2>, weigh_i8<4, 3>,
                                             weigh_i8<4, 4>, weigh_i8<4, 5>, weigh_i8<4, 6>};
  static constexpr WeighI8 WEIGH_I8_128[4] = {weigh_i8<8, 1>, weigh_i8<8, 2>, weigh_i8<8, 3>, weigh_i8<8, 4>};
#endif

  // o[r] = alpha[r] * o[r] (or 0 without prior) + sum_j p[r][j] V[j] for R rows, a few rows per register pass;
  // p is [row][key] with row stride ldp, or with `cols` [key][row] with key stride ldp (the shared-segment path)
  void weigh_rows(Rows& rows, int64_t R, const float* p, int64_t ldp, bool cols, const float* V, int64_t n,
                  bool prior, const float* V_next = nullptr, int64_t n_next = -1) const {
    if (n_next < 0) n_next = n;  // the next chunk's keys (to prefetch), by default as many as this one's
#ifndef __AVX512F__
    // AVX2: the blocks below are 24-48 accumulators of 16 ymm registers (they spilled on every key). Instead 12
    // accumulators a pass: 6 rows x 16 dims (a shared segment's columns, a verify tree), else 3 rows x 32 dims
    // (decode's G = 3 query heads of a KV head); the value rows are re-read from L1 by the passes.
    if (hd_ % 32 == 0) {
      const bool many = R >= 6;
      const int64_t rstep = many ? 6 : 3, dstep = many ? 16 : 32;
      const int64_t passes = (R + rstep - 1) / rstep * (hd_ / dstep);
      for (int64_t r0 = 0, pass = 0; r0 < R; r0 += rstep) {
        const int64_t rc = std::min<int64_t>(rstep, R - r0);
        for (int64_t d0 = 0; d0 < hd_; d0 += dstep, ++pass)
          (many ? WEIGH_PART16[cols][rc - 1] : WEIGH_PART32[cols][rc - 1])(
              cols ? p + r0 : p + r0 * ldp, ldp, V + d0, hd_, n, rows.alpha.data() + r0, prior, rows.o.data() + r0,
              d0, share(V_next, n_next, pass, passes));
      }
      return;
    }
#endif
    const int64_t rstep = hd_ == 64 ? 6 : 4;  // rows per pass: rstep * d/16 accumulators + d/16 value registers
    const int64_t passes = (R + rstep - 1) / rstep;
    for (int64_t r0 = 0; r0 < R; r0 += rstep) {
      const int64_t rc = std::min<int64_t>(rstep, R - r0);
      const float* pr = cols ? p + r0 : p + r0 * ldp;
      float* const* o = rows.o.data() + r0;
      const float* alpha = rows.alpha.data() + r0;
      if (hd_ == 64) {
        WEIGH_64[cols][rc - 1](pr, ldp, V, n, alpha, prior, o, share(V_next, n_next, r0 / rstep, passes));
      } else if (hd_ == 128) {
        WEIGH_128[cols][rc - 1](pr, ldp, V, n, alpha, prior, o, share(V_next, n_next, r0 / rstep, passes));
      } else {
        for (int64_t r = 0; r < rc; ++r) {
          if (prior)
            for (int64_t j = 0; j < hd_; ++j) o[r][j] *= alpha[r];
          else
            std::fill(o[r], o[r] + hd_, 0.0f);
          for (int64_t j = 0; j < n; ++j) axpy(o[r], cols ? pr[j * ldp + r] : pr[r * ldp + j], V + j * hd_, hd_);
        }
      }
    }
  }

  // Scores of R >= WIDE_ROWS query rows against n keys as a matrix product (a verify step's tree, a shared
  // segment's group): the chunk's keys are transposed once into 16-key panels, then blocks of up to 6 query rows x
  // 4 panels (24 accumulators) take one broadcast per row and one load per panel for every FMA row -- instead of
  // one dot product per (row, key) and a reduction across lanes.
  void wide_scores(Rows& rows, int64_t R, const float* K, int64_t n, float scale, float* p, int64_t ldp) const {
    const int64_t panels = (n + P - 1) / P;
    float* kt = rows.kt.data();
    for (int64_t j = 0; j < panels; ++j) {
      float* panel = kt + j * hd_ * P;
      const int64_t nk = std::min<int64_t>(P, n - j * P);
      if (nk == P) {  // 16 x 16 blocks through registers
        for (int64_t e0 = 0; e0 < hd_; e0 += P) {
          v16 x[P];
          for (int kk = 0; kk < P; ++kk) x[kk] = load16(K + (j * P + kk) * hd_ + e0);
          transpose16(x);
          for (int e = 0; e < P; ++e) store16(panel + (e0 + e) * P, x[e]);
        }
        continue;
      }
      for (int64_t kk = 0; kk < nk; ++kk) {
        const float* key = K + (j * P + kk) * hd_;
        for (int64_t e = 0; e < hd_; ++e) panel[e * P + kk] = key[e];
      }
      for (int64_t kk = nk; kk < P; ++kk)
        for (int64_t e = 0; e < hd_; ++e) panel[e * P + kk] = 0.0f;
    }
#ifdef __AVX512F__
    constexpr int64_t key_panels = 4;
#else
    constexpr int64_t key_panels = 1;  // AVX2: 6 rows x 1 panel, 12 accumulators of 16 registers
#endif
    for (int64_t r0 = 0; r0 < R; r0 += 6)
      for (int64_t j0 = 0; j0 < panels; j0 += key_panels) {
        const int64_t mb = std::min<int64_t>(6, R - r0), nb = std::min<int64_t>(key_panels, panels - j0);
        SCORE_BLOCKS[(mb - 1) * 4 + nb - 1](rows.q.data() + r0, kt + j0 * hd_ * P, hd_, p + r0 * ldp + j0 * P, ldp);
      }
    for (int64_t r = 0; r < R; ++r) {  // scale and bias, over the n valid keys only
      float* pr = p + r * ldp;
      const float* br = rows.bias[r];
      if (softcap_ > 0.0) {  // Gemma 2's cap * tanh(score / cap), before the bias
        for (int64_t j = 0; j < n; ++j) pr[j] *= scale;
        cap_scores(pr, br, n);
        continue;
      }
      int64_t j = 0;
      for (; j + P <= n; j += P) store16(pr + j, load16(pr + j) * scale + load16(br + j));
      for (; j < n; ++j) pr[j] = pr[j] * scale + br[j];
    }
  }

  template <int MB, int NB>
  static void score_block(const float* const* q, const float* kt, int64_t hd, float* p, int64_t ldp) {
    v16 acc[MB][NB];
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = v16{};
    for (int64_t e = 0; e < hd; ++e) {
      v16 w[NB];
      for (int j = 0; j < NB; ++j) w[j] = load16(kt + (j * hd + e) * P);
      for (int r = 0; r < MB; ++r) {
        const float x = q[r][e];
        for (int j = 0; j < NB; ++j) acc[r][j] += x * w[j];
      }
    }
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < NB; ++j) store16(p + r * ldp + j * P, acc[r][j]);
  }
  using ScoreBlock = void (*)(const float* const*, const float*, int64_t, float*, int64_t);
  static constexpr ScoreBlock SCORE_BLOCKS[24] = {
      score_block<1, 1>, score_block<1, 2>, score_block<1, 3>, score_block<1, 4>,
      score_block<2, 1>, score_block<2, 2>, score_block<2, 3>, score_block<2, 4>,
      score_block<3, 1>, score_block<3, 2>, score_block<3, 3>, score_block<3, 4>,
      score_block<4, 1>, score_block<4, 2>, score_block<4, 3>, score_block<4, 4>,
      score_block<5, 1>, score_block<5, 2>, score_block<5, 3>, score_block<5, 4>,
      score_block<6, 1>, score_block<6, 2>, score_block<6, 3>, score_block<6, 4>};

  // out[j] = q . K[j] * scale + bias[j] for n keys of head_dim 16 * NV: q in NV registers, 16 keys' partial
  // products summed by one transposing reduction
  template <int NV>
  static void scores(const float* q, const float* K, int64_t n, const float* bias, float scale, float* out,
                     Lines next) {
#ifndef __AVX512F__
    // AVX2: sixteen 16-wide partials are 32 registers of 16 (the block spilled to the stack): 8 keys at a time,
    // each an 8-wide partial over its d/8 products, reduced by sum8
    v8 q8[2 * NV];
    for (int j = 0; j < 2 * NV; ++j) q8[j] = load8(q + 8 * j) * scale;
    Prefetch pf(next.first, next.second, n / 8);
    int64_t s8 = 0;
    for (; s8 + 8 <= n; s8 += 8) {
      pf.advance();
      v8 part[8];
      for (int kk = 0; kk < 8; ++kk) {
        const float* k = K + (s8 + kk) * P * NV;
        part[kk] = q8[0] * load8(k);
        for (int j = 1; j < 2 * NV; ++j) part[kk] += q8[j] * load8(k + 8 * j);
      }
      const v8 r = sum8(part) + load8(bias + s8);
      std::memcpy(out + s8, &r, 32);
    }
    for (; s8 < n; ++s8) {
      const float* k = K + s8 * P * NV;
      v8 a = q8[0] * load8(k);
      for (int j = 1; j < 2 * NV; ++j) a += q8[j] * load8(k + 8 * j);
      float t = 0.0f;
      for (int i = 0; i < 8; ++i) t += a[i];
      out[s8] = t + bias[s8];
    }
#else
    v16 qr[NV];
    for (int j = 0; j < NV; ++j) qr[j] = load16(q + P * j) * scale;
    Prefetch pf(next.first, next.second, n / P);
    int64_t s = 0;
    for (; s + P <= n; s += P) {
      pf.advance();
      v16 part[P];
      for (int kk = 0; kk < P; ++kk) {
        const float* k = K + (s + kk) * P * NV;
        part[kk] = qr[0] * load16(k);
        for (int j = 1; j < NV; ++j) part[kk] += qr[j] * load16(k + P * j);
      }
      store16(out + s, sum16(part) + load16(bias + s));
    }
    for (; s < n; ++s) {
      const float* k = K + s * P * NV;
      v16 a = qr[0] * load16(k);
      for (int j = 1; j < NV; ++j) a += qr[j] * load16(k + P * j);
      out[s] = hsum(a) + bias[s];
    }
#endif
  }

  // o[r] = alpha[r] * o[r] (or 0 without prior) + sum_j p[r][j] V[j] for RC rows, head_dim 16 * NV, in registers
  template <int NV, int RC, bool COLS>
  static void weigh(const float* p, int64_t ldp, const float* V, int64_t n, const float* alpha, bool prior,
                    float* const* o, Lines next) {
    Prefetch pf(next.first, next.second, n);
    v16 acc[RC][NV];
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = prior ? load16(o[r] + P * j) * alpha[r] : v16{};
    for (int64_t s = 0; s < n; ++s) {
      pf.advance();
      v16 v[NV];
      for (int j = 0; j < NV; ++j) v[j] = load16(V + s * P * NV + P * j);
      for (int r = 0; r < RC; ++r) {
        const float w = COLS ? p[s * ldp + r] : p[r * ldp + s];
        for (int j = 0; j < NV; ++j) acc[r][j] += w * v[j];
      }
    }
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NV; ++j) store16(o[r] + P * j, acc[r][j]);
  }

#ifndef __AVX512F__
  // o[r][d0, d0 + 8 NW) = alpha[r] * o[r][..] (or 0) + sum_j p[r][j] V[j][d0, d0 + 8 NW) for RC rows (V advanced
  // by d0, its rows ld apart); `next`: lines to prefetch over the keys
  template <int RC, int NW, bool COLS>
  static void weigh_part(const float* p, int64_t ldp, const float* V, int64_t ld, int64_t n, const float* alpha,
                         bool prior, float* const* o, int64_t d0, Lines next) {
    Prefetch pf(next.first, next.second, n);
    v8 acc[RC][NW];
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NW; ++j) acc[r][j] = prior ? load8(o[r] + d0 + 8 * j) * alpha[r] : v8{};
    for (int64_t s = 0; s < n; ++s) {
      pf.advance();
      const float* v = V + s * ld;
      for (int r = 0; r < RC; ++r) {
        const float w = COLS ? p[s * ldp + r] : p[r * ldp + s];
        for (int j = 0; j < NW; ++j) acc[r][j] += w * load8(v + 8 * j);
      }
    }
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NW; ++j) std::memcpy(o[r] + d0 + 8 * j, &acc[r][j], 32);
  }
  using WeighPart = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, bool, float* const*,
                             int64_t, Lines);
  static constexpr WeighPart WEIGH_PART32[2][3] = {
      {weigh_part<1, 4, false>, weigh_part<2, 4, false>, weigh_part<3, 4, false>},
      {weigh_part<1, 4, true>, weigh_part<2, 4, true>, weigh_part<3, 4, true>}};
  static constexpr WeighPart WEIGH_PART16[2][6] = {
      {weigh_part<1, 2, false>, weigh_part<2, 2, false>, weigh_part<3, 2, false>, weigh_part<4, 2, false>,
       weigh_part<5, 2, false>, weigh_part<6, 2, false>},
      {weigh_part<1, 2, true>, weigh_part<2, 2, true>, weigh_part<3, 2, true>, weigh_part<4, 2, true>,
       weigh_part<5, 2, true>, weigh_part<6, 2, true>}};
#endif
  using Weigh = void (*)(const float*, int64_t, const float*, int64_t, const float*, bool, float* const*, Lines);
  static constexpr Weigh WEIGH_64[2][6] = {
      {weigh<4, 1, false>, weigh<4, 2, false>, weigh<4, 3, false>, weigh<4, 4, false>, weigh<4, 5, false>,
       weigh<4, 6, false>},
      {weigh<4, 1, true>, weigh<4, 2, true>, weigh<4, 3, true>, weigh<4, 4, true>, weigh<4, 5, true>,
       weigh<4, 6, true>}};
  static constexpr Weigh WEIGH_128[2][4] = {
      {weigh<8, 1, false>, weigh<8, 2, false>, weigh<8, 3, false>, weigh<8, 4, false>},
      {weigh<8, 1, true>, weigh<8, 2, true>, weigh<8, 3, true>, weigh<8, 4, true>}};

  void activate(float* mid, int64_t M) const {
    const int64_t n = gated_ ? 2 * I_ : I_;
    for (int64_t m = 0; m < M; ++m) {
      float* row = mid + m * n;
      if (gated_ && act_ == "gelu_tanh") {  // Gemma's GeGLU: torch's gelu(approximate="tanh")(gate) * up
        for (int64_t j = 0; j < I_; ++j) {
          const float g = row[j];
          row[j] = 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * row[I_ + j];
        }
      } else if (gated_) {  // silu(gate) * up, written over the gate half (the down GEMM reads rows of stride 2I)
        for (int64_t j = 0; j < I_; ++j) row[j] = row[j] / (1.0f + std::exp(-row[j])) * row[I_ + j];
      } else if (act_ == "relu") {
        for (int64_t j = 0; j < I_; ++j) row[j] = std::max(row[j], 0.0f);
      } else {
        for (int64_t j = 0; j < I_; ++j) row[j] = 0.5f * row[j] * (1.0f + std::erf(row[j] * 0.70710678118654752f));
      }
    }
  }

  struct Clock {  // adds the time since the last lap to one phase; free when profiling is off
    bool on;
    double* acc;
    std::chrono::steady_clock::time_point last;
    Clock(bool on_, double* acc_) : on(on_), acc(acc_) {
      if (on) last = std::chrono::steady_clock::now();
    }
    void lap(int phase) {
      if (!on) return;
      const auto now = std::chrono::steady_clock::now();
      acc[phase] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };

  bool profiling_ = false;
  double phase_s_[5] = {};  // KV writes, attention, the rest (norms, RoPE, activation), layer GEMMs, LM head
  int64_t D_, h_, kvh_, hd_, I_;
  bool rms_, gated_;
  std::string act_;
  double eps_, scale_, softcap_ = 0.0;
  bool int8_x_ = false;
  bool int8_kv_dots_ = HAVE_I8_KV_DOTS;
  std::vector<float> zeros_ = std::vector<float>(std::max(OWN_KEYS, SEG_KEYS), 0.0f);  // a bias that adds nothing
  std::vector<Layer> layers_;
  torch::Tensor norm_w_, norm_b_, head_;
  int64_t vocab_ = 0;
};

#pragma GCC visibility pop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "[in, out] float32 -> [ceil(out/16), in, 16] panels");
  m.def("panel_linear", &panel_linear, "x @ W (+ b) with W packed by pack_panels (int8_activations: Q4 panels "
        "against int8 activation blocks, where the CPU has VNNI)", py::arg("x"), py::arg("wp"), py::arg("N"),
        py::arg("bias"), py::arg("int8_activations") = false);
  m.def("has_int8_dot", []() { return HAVE_INT8_DOT; }, "whether int8 activations can run (AVX512-VNNI and VBMI)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) for float32 x, NaN included");
  m.def("stream_read", &stream_read, "read every byte of x once (the read-bandwidth probe)");
  m.def("dequantize_panels", &dequantize_panels, "quantized panels -> float32 [ceil(out/16), in, 16] panels");
  m.def("encode_kv", &encode_kv, "float32 [N, head_dim] rows stored as a KV format (the dtype of `like`)");
  m.def("quant_rows", &quant_rows, "rows `ids` of the [out, in] matrix quantized panels hold, float32");
  // module_local: two builds of this file (an A/B of a kernel change) can be loaded into one process
  pybind11::class_<NativeDecoder>(m, "NativeDecoder", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, std::string, double, double>())
      .def("add_layer", &NativeDecoder::add_layer)
      .def("set_head", &NativeDecoder::set_head)
      .def("set_qk_norm", &NativeDecoder::set_qk_norm)
      .def("set_post_norms", &NativeDecoder::set_post_norms)
      .def("set_local", &NativeDecoder::set_local)
      .def("set_softcap", &NativeDecoder::set_softcap)
      .def("set_int8_activations", &NativeDecoder::set_int8_activations)
      .def("set_int8_kv_dots", &NativeDecoder::set_int8_kv_dots)
      .def("int8_kv_dots", &NativeDecoder::int8_kv_dots)
      .def("num_layers", &NativeDecoder::num_layers)
      .def("set_profiling", &NativeDecoder::set_profiling)
      .def("profile", &NativeDecoder::profile)
      .def("forward", &NativeDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_parts", &NativeDecoder::forward_parts, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("attention_step", &NativeDecoder::attention_step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
