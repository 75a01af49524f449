// SIMD vectors (v16: one AVX-512 register, or two AVX2 halves), lane shuffles and transposes, 16-bit float
// loads, exp/tanh, prefetch helpers, the work-splitting rule, and the kernels' tuning constants.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {


constexpr int P = 16;  // panel width: one AVX-512 register of float32 (GCC splits it on narrower ISAs)
// Software prefetch distance in panel rows (64 B each): at M = 8 the FMAs per cache line slow the stream enough
// that the hardware prefetcher falls behind; 4 KiB ahead streamed faster there, and the same at M = 1
// (docs/performance.md, "Figures behind the code's choices").
constexpr int64_t PREFETCH_ROWS = 64;
// Shared segments are attended in chunks of SEG_KEYS keys (16 KiB of K and of V at head_dim 64, L1-sized) by up
// to SEG_QUERY_ROWS query rows at once (32 samples x 3 heads of a GQA group), their queries transposed once per step.
constexpr int64_t SEG_KEYS = 64;
constexpr int64_t SEG_QUERY_ROWS = 96;
// A row's own cache is walked in chunks of OWN_KEYS keys with the same online softmax: its query rows read each
// chunk from DRAM once and again from L1 (16 KiB of K and of V at head_dim 64; 128 keys were no faster, often
// slower, with the spread prefetch: docs/performance.md, "Figures behind the code's choices"), and the score
// buffer stays small at any capacity.
constexpr int64_t OWN_KEYS = 64;
// Key chunks per span of a decode or verify row's capacity (attention's split-K): fixed, so a row's sums do not
// depend on its batch, the batch's capacity or the threads (docs/performance.md, "Figures behind the code's choices").
constexpr int64_t SPAN_CHUNKS = 4;
// A prompt's query positions per attention task: a block's rows share each key chunk (L1/L2), blocks spread a
// batch-1 prompt over the threads, and a block of a causal prompt skips the key chunks past its diagonal. Steps of
// up to this many new tokens a row (decode, verify) are one block, as before.
constexpr int64_t QUERY_BLOCK = 64;
// From this many query rows per (row, KV head) on, scores are computed as a matrix product (wide_scores).
constexpr int64_t WIDE_ROWS = 8;
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
#else
// Without AVX-512 GCC has no 64-byte vector mode: a vector_size(64) type lives in memory and every operation on it
// goes through the stack (the GEMM ran several times slower: docs/performance.md, "Figures behind the code's
// choices"). Two 8-wide halves stay in ymm registers.
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
// c + a * b rounded once, and a + b, spelled out: left to -ffast-math, a chain `acc += x * w` was contracted to
// FMAs in some blockings and not others, or re-associated into a tree in some row counts' kernels, and a row's
// result depended on the rows beside it. The GEMM kernels sum in the order these write.
inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return {(v8)_mm256_fmadd_ps((__m256)a.lo, (__m256)b.lo, (__m256)c.lo),
          (v8)_mm256_fmadd_ps((__m256)a.hi, (__m256)b.hi, (__m256)c.hi)};
#else
  return c + a * b;
#endif
}
inline v16 add16(v16 a, v16 b) {
#if defined(__AVX512F__)
  return (v16)_mm512_add_ps((__m512)a, (__m512)b);
#else
  return {(v8)_mm256_add_ps((__m256)a.lo, (__m256)b.lo), (v8)_mm256_add_ps((__m256)a.hi, (__m256)b.hi)};
#endif
}
inline v16 bcast16(const float* p) {  // *p in every lane (a memory operand of the FMA that takes it)
#if defined(__AVX512F__)
  return (v16)_mm512_set1_ps(*p);
#else
  const v8 h = (v8)_mm256_set1_ps(*p);
  return {h, h};
#endif
}
inline float hsum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else  // a pinned tree (a scalar loop is -ffast-math's to re-associate, differently where it is inlined)
  const __m256 a = _mm256_add_ps((__m256)v.lo, (__m256)v.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
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
inline v8 fma8(v8 a, v8 b, v8 c) {  // c + a * b rounded once (fma16's half)
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return c + a * b;
#endif
}
inline v8 add8(v8 a, v8 b) { return (v8)_mm256_add_ps((__m256)a, (__m256)b); }
// Eight 8-wide dot-product partials (one per key) -> the eight sums in key order (as sum16, three levels)
template <int h> inline v8 fold8(v8 a, v8 b) { return add8(pick_a8<h>(a, b), pick_b8<h>(a, b)); }
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
// where libmvec's expf was a visible share of shared-prefix attention (one exp per key and query row), and decode
// attention got faster with it (docs/performance.md, "Figures behind the code's choices").
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
// With std::tanh, one tanhf call per score, Gemma 2's soft-capped attention was markedly slower than Llama's
// (docs/performance.md, "Figures behind the code's choices").
inline float tanh_fast(float x) { return 1.0f - 2.0f / (exp_fast(2.0f * x) + 1.0f); }

// Lines [0, lines) from `base` (64 bytes each) prefetched a few per advance(), spread evenly over `calls` calls.
// The decode attention prefetches the next chunk's keys and values this way across all its passes over the
// current chunk (one per query row for the scores, one per row block and dimension slice for the values): issued
// in a burst during the first pass they stalled it and left the memory idle during the others (figures:
// docs/performance.md, "Figures behind the code's choices").
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

}  // namespace
