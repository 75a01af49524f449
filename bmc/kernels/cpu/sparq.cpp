// SparQ decode attention (steps 1-3) for one query row per head, fused into one call per layer on the CPU.
//
// Why one call: at 8K context the PyTorch version's ~30 op dispatches, the [B, H, G, S] score tensors it builds
// and its indirect top-k cost more than the reads SparQ saves. Here step 1 streams the r chosen rows of the
// dimension-major K in column blocks that stay in L1 (parallel over rows, KV heads and blocks, so batch 1 uses
// every thread), the softmax is folded per block (a block max and sum, rescaled once), the top-k threshold comes
// from a histogram of the scores' bits plus nth_element within one bucket, and step 2 reads only the k chosen K/V
// rows.
//
// Arithmetic is that of sparq_select + exact attention over the chosen positions (bmc/attention/sparq.py); the
// tests compare both. Masked columns carry finfo.min in `bias`; with -ffast-math only finite sentinels are used.
//
// Narrow KV (kv_dtype, bmc/kv/formats.py) is read as stored: the K mirror's r rows and the k chosen K/V rows are
// widened to float32 in L1 as they are read, so the step moves the narrow bytes from DRAM. An int8 mirror holds
// the K rows' int8 values dimension-major and their scales as one float32 per column (`kt_scale`): step 1 sums
// w_j * q8[j, s] and multiplies by the column's scale once. bfloat16 / float16 are widened as cast.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace {

constexpr float BIG = 3.0e38f;
constexpr int64_t BLOCK = 256;  // step 1 columns per task: G x 256 accumulators (3 KiB at G = 3) stay in L1

struct Shape {
  int64_t B, kvh, G, d, S, r, kk, blocks;
};

// How K, V and the K mirror store their values (the cache's kv_dtype)
enum class Kind { F32, BF16, F16, I8 };
constexpr int64_t SCALE_BYTES = 4;  // an int8 row's float32 scale, after its values

Kind kind_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return Kind::F32;
    case torch::kBFloat16: return Kind::BF16;
    case torch::kHalf: return Kind::F16;
    case torch::kChar: return Kind::I8;
    default: TORCH_CHECK(false, "sparq_decode: K stored as ", t.scalar_type(), " (float32, bfloat16, float16, int8)");
  }
}

// n stored values at src -> float32 at dst (int8: the integers, not yet scaled). Plain loops GCC vectorises
// (-O3 -march=native), except float16, converted 8 at a time with F16C where the CPU has it.
inline void widen_run(Kind kind, const uint8_t* src, int64_t n, float* dst) {
  switch (kind) {
    case Kind::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case Kind::I8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(q[i]);
      return;
    }
    case Kind::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
      uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(h[i]) << 16;
      return;
    }
    case Kind::F16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
      int64_t i = 0;
#ifdef __F16C__
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
      for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
      return;
    }
  }
}

// One stored K/V row of d values -> d float32 values (an int8 row times its scale)
inline void widen_row(Kind kind, const uint8_t* row, int64_t d, float* dst) {
  widen_run(kind, row, d, dst);
  if (kind == Kind::I8) {
    float s;
    std::memcpy(&s, row + d, SCALE_BYTES);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) dst[c] *= s;
  }
}

#ifdef __AVX512F__
// 16 stored values at p as float32 (int8: the integers, unscaled)
template <Kind KIND>
inline __m512 load16(const uint8_t* p) {
  if constexpr (KIND == Kind::I8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  else if constexpr (KIND == Kind::BF16)
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  else if constexpr (KIND == Kind::F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

constexpr int64_t elem_bytes(Kind k) { return k == Kind::F32 ? 4 : k == Kind::I8 ? 1 : 2; }

// Step 1's logits for the G query heads over columns [s0, s0 + n) in tiles of NV vectors, the G x NV sums held in
// registers over the r mirror rows: each stored value is loaded (and widened) once and feeds G FMAs. The plain
// loop below kept the G score rows in L1 and paid a load and a store per FMA: step 1 was then most of SparQ's
// step, and int8 KV's fewer bytes did not help it (docs/performance.md, "Figures behind the code's choices").
// Returns the columns done (a multiple of 16); int8 sums are multiplied by their column's scale.
template <Kind KIND, int G, int NV>
int64_t approx_tiles(const float* w, int64_t r, const int64_t* comps, const uint8_t* Kt, int64_t sD,
                     const float* kscale, float* e, int64_t S, int64_t s0, int64_t n, int64_t s) {
  constexpr int64_t ES = elem_bytes(KIND);
  for (; s + 16 * NV <= n; s += 16 * NV) {
    __m512 acc[G][NV];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; ++j) {
      const uint8_t* src = Kt + comps[j] * sD + (s0 + s) * ES;
      __m512 k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load16<KIND>(src + v * 16 * ES);
      for (int g = 0; g < G; ++g) {
        const __m512 wj = _mm512_set1_ps(w[g * r + j]);
        for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(wj, k[v], acc[g][v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      if (kscale) {
        const __m512 sc = _mm512_loadu_ps(kscale + s0 + s + 16 * v);
        for (int g = 0; g < G; ++g) acc[g][v] = _mm512_mul_ps(acc[g][v], sc);
      }
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(e + g * S + s0 + s + 16 * v, acc[g][v]);
    }
  }
  return s;
}

template <Kind KIND, int G>
int64_t approx_tiles_g(const float* w, int64_t r, const int64_t* comps, const uint8_t* Kt, int64_t sD,
                       const float* kscale, float* e, int64_t S, int64_t s0, int64_t n) {
  constexpr int NV = G <= 4 ? 4 : 2;  // at most 16 accumulators of the 32 registers
  const int64_t s = approx_tiles<KIND, G, NV>(w, r, comps, Kt, sD, kscale, e, S, s0, n, 0);
  return approx_tiles<KIND, G, 1>(w, r, comps, Kt, sD, kscale, e, S, s0, n, s);
}

template <Kind KIND>
int64_t approx_tiles_kind(int64_t G, const float* w, int64_t r, const int64_t* comps, const uint8_t* Kt,
                          int64_t sD, const float* kscale, float* e, int64_t S, int64_t s0, int64_t n) {
  switch (G) {
    case 1: return approx_tiles_g<KIND, 1>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 2: return approx_tiles_g<KIND, 2>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 3: return approx_tiles_g<KIND, 3>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 4: return approx_tiles_g<KIND, 4>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 5: return approx_tiles_g<KIND, 5>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 6: return approx_tiles_g<KIND, 6>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 7: return approx_tiles_g<KIND, 7>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case 8: return approx_tiles_g<KIND, 8>(w, r, comps, Kt, sD, kscale, e, S, s0, n);
    default: return 0;  // larger groups: the plain loop
  }
}

int64_t approx_tiles_any(Kind kind, int64_t G, const float* w, int64_t r, const int64_t* comps, const uint8_t* Kt,
                         int64_t sD, const float* kscale, float* e, int64_t S, int64_t s0, int64_t n) {
  switch (kind) {
    case Kind::F32: return approx_tiles_kind<Kind::F32>(G, w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case Kind::BF16: return approx_tiles_kind<Kind::BF16>(G, w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case Kind::F16: return approx_tiles_kind<Kind::F16>(G, w, r, comps, Kt, sD, kscale, e, S, s0, n);
    case Kind::I8: return approx_tiles_kind<Kind::I8>(G, w, r, comps, Kt, sD, kscale, e, S, s0, n);
  }
  return 0;
}
#endif

// Step 1 for one (row, KV head, column block): approximate logits of the G query heads over the block, then
// exp(logit - block max) in place; `stats` gets the block's max and sum per query head. Kt: the mirror's first
// column of this (row, KV head), rows sD bytes apart, values of `esize` bytes; kscale: its int8 columns' scales.
void approx_block(const Shape& sh, const float* w, const int64_t* comps, Kind kind, const uint8_t* Kt, int64_t sD,
                  int64_t esize, const float* kscale, const float* bias, float* e, float* stats, int64_t s0) {
  const int64_t n = std::min(BLOCK, sh.S - s0), G = sh.G;
#ifdef __AVX512F__
  const int64_t done = approx_tiles_any(kind, G, w, sh.r, comps, Kt, sD, kscale, e, sh.S, s0, n);
#else
  const int64_t done = 0;
#endif
  // the columns the register tiles did not cover (all of them without AVX-512): G score rows kept in L1
  if (done < n) {
    const int64_t m = n - done, c0 = s0 + done;
    float wide[BLOCK];  // a narrow mirror row's columns, widened (L1)
    for (int64_t g = 0; g < G; ++g) {
      float* row = e + g * sh.S + c0;
      std::fill(row, row + m, 0.0f);
    }
    for (int64_t j = 0; j < sh.r; ++j) {
      const uint8_t* src = Kt + comps[j] * sD + c0 * esize;
      const float* krow = reinterpret_cast<const float*>(src);
      if (kind != Kind::F32) {
        widen_run(kind, src, m, wide);
        krow = wide;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float wj = w[g * sh.r + j];
        float* row = e + g * sh.S + c0;
#pragma omp simd
        for (int64_t s = 0; s < m; ++s) row[s] += wj * krow[s];
      }
    }
    if (kscale)  // int8: the column's scale, once for the r rows' sum
      for (int64_t g = 0; g < G; ++g) {
        float* row = e + g * sh.S + c0;
#pragma omp simd
        for (int64_t s = 0; s < m; ++s) row[s] *= kscale[c0 + s];
      }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = e + g * sh.S + s0;
    if (bias)
      for (int64_t s = 0; s < n; ++s) row[s] += bias[s0 + s];
    float m = -BIG;
    for (int64_t s = 0; s < n; ++s) m = std::max(m, row[s]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < n; ++s) {
      row[s] = expf(row[s] - m);
      sum += row[s];
    }
    stats[2 * g] = m;
    stats[2 * g + 1] = sum;
  }
}

// An unsigned key with the order of the float (for the histogram select below).
inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The kk-th largest of v[0, n), 1 <= kk <= n. A histogram of the keys' top 12 bits finds the bucket that holds it
// in one pass; nth_element then runs over that bucket's members only (over all the scores at long context it was
// most of the step at batch 1: docs/performance.md, "Figures behind the code's choices").
float kth_largest(const float* v, int64_t n, int64_t kk, std::vector<float>& scratch) {
  std::array<int32_t, 4096> hist{};
  for (int64_t s = 0; s < n; ++s) hist[order_key(v[s]) >> 20]++;
  int64_t above = 0;
  int b = 4095;
  for (; b > 0 && above + hist[b] < kk; --b) above += hist[b];
  scratch.clear();
  for (int64_t s = 0; s < n; ++s)
    if (static_cast<int>(order_key(v[s]) >> 20) == b) scratch.push_back(v[s]);
  const int64_t need = kk - above;  // in [1, bucket size]
  std::nth_element(scratch.begin(), scratch.begin() + (need - 1), scratch.end(), std::greater<float>());
  return scratch[need - 1];
}

// Exact attention of the G query heads over the kk chosen positions (+ step 3's mean value when given); krows[j]
// and vrows[j]: position pos[j]'s key and value as float32 (in the cache, or widened from it).
void attend_chosen(const Shape& sh, const float* q, const int64_t* pos, const float* const* krows,
                   const float* const* vrows, const float* bias, float scale, const float* alpha, const float* vmean,
                   float* out) {
  std::vector<float> p(sh.kk);
  for (int64_t g = 0; g < sh.G; ++g) {
    const float* qg = q + g * sh.d;
    float m = -BIG;
    for (int64_t j = 0; j < sh.kk; ++j) {
      const float* k = krows[j];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < sh.d; ++c) dot += qg[c] * k[c];
      p[j] = dot * scale + (bias ? bias[pos[j]] : 0.0f);
      m = std::max(m, p[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < sh.kk; ++j) {
      p[j] = expf(p[j] - m);
      sum += p[j];
    }
    float* o = out + g * sh.d;
    std::fill(o, o + sh.d, 0.0f);
    for (int64_t j = 0; j < sh.kk; ++j) {
      const float pj = p[j] / sum;
      const float* v = vrows[j];
#pragma omp simd
      for (int64_t c = 0; c < sh.d; ++c) o[c] += pj * v[c];
    }
    if (vmean) {
      const float a = alpha[g];
      for (int64_t c = 0; c < sh.d; ++c) o[c] = a * o[c] + (1.0f - a) * vmean[c];
    }
  }
}

}  // namespace

// q [B, kvh, G, d] float32; K, V [B, kvh, >=S, width] as the cache stores them (rows contiguous; width = d, or
// d + 4 for int8 rows and their scale); Kt [B, kvh, d, >=S] in the same element type (columns contiguous);
// kt_scale [B, kvh, >=S] float32, the int8 mirror columns' scales (empty for other types); bias [B, >=S] with unit
// column stride (empty: nothing masked); vmean [B, kvh, d] (empty: no step 3).
// Returns out [B, kvh, G, d] and the chosen positions i2 [B, kvh, min(k, S)], in increasing order.
std::vector<torch::Tensor> sparq_decode(torch::Tensor q, torch::Tensor K, torch::Tensor V, torch::Tensor Kt,
                                        torch::Tensor kt_scale, torch::Tensor bias, torch::Tensor vmean, int64_t S,
                                        int64_t r, int64_t k, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 4 && K.dim() == 4 && V.dim() == 4 && Kt.dim() == 4, "sparq_decode: 4-d q, K, V, Kt");
  const Kind kind = kind_of(K);
  TORCH_CHECK(q.scalar_type() == torch::kFloat, "sparq_decode: float32 queries");
  TORCH_CHECK(V.scalar_type() == K.scalar_type() && Kt.scalar_type() == K.scalar_type(),
              "sparq_decode: K, V and the K mirror in one format");
  const int64_t width = q.size(3) + (kind == Kind::I8 ? SCALE_BYTES : 0);
  TORCH_CHECK(K.size(3) == width && V.size(3) == width && Kt.size(2) == q.size(3), "sparq_decode: row width");
  TORCH_CHECK(K.stride(3) == 1 && V.stride(3) == 1 && Kt.stride(3) == 1 && K.stride(2) == V.stride(2) &&
              K.stride(0) == V.stride(0) && K.stride(1) == V.stride(1), "sparq_decode: K/V/Kt layout");
  TORCH_CHECK(K.size(2) >= S && Kt.size(3) >= S && S >= 1 && r >= 1 && r <= q.size(3) && k >= 1,
              "sparq_decode: bad S, r or k");
  TORCH_CHECK(kind != Kind::I8 || (kt_scale.scalar_type() == torch::kFloat && kt_scale.dim() == 3 &&
                                   kt_scale.stride(2) == 1 && kt_scale.size(2) >= S),
              "sparq_decode: an int8 mirror needs its float32 column scales [B, kvh, >=S]");
  const bool masked = bias.numel() > 0, mean = vmean.numel() > 0;
  TORCH_CHECK(!masked || (bias.dim() == 2 && bias.stride(1) == 1 && bias.size(1) >= S), "sparq_decode: bias");
  auto qc = q.contiguous();
  auto vm = mean ? vmean.contiguous() : vmean;
  Shape sh{q.size(0), q.size(1), q.size(2), q.size(3), S, r, std::min(k, S), (S + BLOCK - 1) / BLOCK};
  const int64_t BH = sh.B * sh.kvh, G = sh.G, d = sh.d;
  auto out = torch::empty({sh.B, sh.kvh, G, d}, torch::kFloat);
  auto i2 = torch::empty({sh.B, sh.kvh, sh.kk}, torch::kLong);
  std::vector<int64_t> comps(BH * r);
  std::vector<float> w(BH * G * r);
  // scratch written before it is read, kept between calls: a fresh 2.4 MB (B = 8, S = 8K) buffer per layer and
  // step would be fresh pages every time (calls hold the GIL, so one buffer per calling thread is enough)
  thread_local std::vector<float> e_buf, stats_buf;
  if (e_buf.size() < static_cast<size_t>(BH * G * S)) e_buf.resize(BH * G * S);
  if (stats_buf.size() < static_cast<size_t>(BH * sh.blocks * G * 2)) stats_buf.resize(BH * sh.blocks * G * 2);
  float* const e = e_buf.data();
  float* const stats = stats_buf.data();
  const float* qp = qc.data_ptr<float>();
  const int64_t esize = K.element_size();
  const uint8_t *Kp = static_cast<const uint8_t*>(K.data_ptr()), *Vp = static_cast<const uint8_t*>(V.data_ptr());
  const uint8_t* Ktp = static_cast<const uint8_t*>(Kt.data_ptr());
  const float* ksp = kind == Kind::I8 ? kt_scale.data_ptr<float>() : nullptr;
  const float* bp = masked ? bias.data_ptr<float>() : nullptr;
  const float* vmp = mean ? vm.data_ptr<float>() : nullptr;

  // the r components per (row, KV head): largest |q| summed over the group; Eq. 9's temperature per query head
  std::vector<float> mag(d);
  std::vector<int64_t> order(d);
  for (int64_t bh = 0; bh < BH; ++bh) {
    const float* qh = qp + bh * G * d;
    std::fill(mag.begin(), mag.end(), 0.0f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < d; ++c) mag[c] += std::fabs(qh[g * d + c]);
    for (int64_t c = 0; c < d; ++c) order[c] = c;
    std::nth_element(order.begin(), order.begin() + (r - 1), order.end(),
                     [&](int64_t a, int64_t b) { return mag[a] > mag[b]; });
    std::copy(order.begin(), order.begin() + r, comps.begin() + bh * r);
    for (int64_t g = 0; g < G; ++g) {
      float all = 0.0f, picked = 0.0f;
      for (int64_t c = 0; c < d; ++c) all += std::fabs(qh[g * d + c]);
      for (int64_t j = 0; j < r; ++j) picked += std::fabs(qh[g * d + comps[bh * r + j]]);
      const float ratio = all > 0.0f ? picked / all : 1.0f;
      const float tscale = static_cast<float>(scale) / std::sqrt(std::max(ratio, 1e-30f));
      for (int64_t j = 0; j < r; ++j) w[(bh * G + g) * r + j] = qh[g * d + comps[bh * r + j]] * tscale;
    }
  }

  // step 1, parallel over (row, KV head, column block)
  at::parallel_for(0, BH * sh.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / sh.blocks, blk = t % sh.blocks, b = bh / sh.kvh, h = bh % sh.kvh;
      approx_block(sh, w.data() + bh * G * r, comps.data() + bh * r, kind,
                   Ktp + (b * Kt.stride(0) + h * Kt.stride(1)) * esize, Kt.stride(2) * esize, esize,
                   ksp ? ksp + b * kt_scale.stride(0) + h * kt_scale.stride(1) : nullptr,
                   bp ? bp + b * bias.stride(0) : nullptr, e + bh * G * S, stats + (bh * sh.blocks + blk) * G * 2,
                   blk * BLOCK);
    }
  });

  // per (row, KV head): the group's summed softmax, the top k (window forced in, masked columns last), step 2
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pick(S), scratch, factor(sh.blocks * G), alpha(G);
    scratch.reserve(S);
    std::vector<int64_t> pos(sh.kk);
    std::vector<const float*> krows(sh.kk), vrows(sh.kk);
    std::vector<float> kwide(kind == Kind::F32 ? 0 : sh.kk * d), vwide(kind == Kind::F32 ? 0 : sh.kk * d);
    const int64_t row_bytes = K.stride(2) * esize;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / sh.kvh, h = bh % sh.kvh;
      const float* st = stats + bh * sh.blocks * G * 2;
      const float* brow = bp ? bp + b * bias.stride(0) : nullptr;
      for (int64_t g = 0; g < G; ++g) {  // softmax normaliser from the block maxima and sums
        float m = -BIG, z = 0.0f;
        for (int64_t blk = 0; blk < sh.blocks; ++blk) m = std::max(m, st[(blk * G + g) * 2]);
        for (int64_t blk = 0; blk < sh.blocks; ++blk) z += st[(blk * G + g) * 2 + 1] * expf(st[(blk * G + g) * 2] - m);
        for (int64_t blk = 0; blk < sh.blocks; ++blk) factor[blk * G + g] = expf(st[(blk * G + g) * 2] - m) / z;
      }
      const float* eh = e + bh * G * S;
      for (int64_t blk = 0; blk < sh.blocks; ++blk) {  // the group's summed softmax, block by block (vectorised)
        const int64_t s0 = blk * BLOCK, n = std::min(BLOCK, S - s0);
        float* pk = pick.data() + s0;
        const float f0 = factor[blk * G];
#pragma omp simd
        for (int64_t s = 0; s < n; ++s) pk[s] = eh[s0 + s] * f0;
        for (int64_t g = 1; g < G; ++g) {
          const float fg = factor[blk * G + g];
          const float* eg = eh + g * S + s0;
#pragma omp simd
          for (int64_t s = 0; s < n; ++s) pk[s] += eg[s] * fg;
        }
      }
      if (brow)  // scores are in [0, G]: -BIG sorts after all of them
        for (int64_t s = 0; s < S; ++s) pick[s] = brow[s] != 0.0f ? -BIG : pick[s];
      for (int64_t s = std::max<int64_t>(0, S - window); s < S; ++s)
        if (pick[s] > -1.0f) pick[s] = BIG;
      // the kk-th largest score: take everything above it, then ties in order
      const float thr = sh.kk < S ? kth_largest(pick.data(), S, sh.kk, scratch) : -BIG;
      int64_t above = 0;
      for (int64_t s = 0; s < S; ++s) above += pick[s] > thr;
      int64_t n = 0, ties = sh.kk - above;
      for (int64_t s = 0; s < S && n < sh.kk; ++s)
        if (pick[s] > thr || (pick[s] == thr && ties-- > 0)) pos[n++] = s;
      std::copy(pos.begin(), pos.end(), i2.data_ptr<int64_t>() + bh * sh.kk);
      for (int64_t g = 0; g < G; ++g) {  // alpha: the approximate mass of the chosen positions (step 3)
        float a = 0.0f;
        for (int64_t j = 0; j < sh.kk; ++j) a += eh[g * S + pos[j]] * factor[(pos[j] / BLOCK) * G + g];
        alpha[g] = a;
      }
      // step 2 reads only the chosen rows: float32 in place, a narrow format widened into L1 buffers
      const uint8_t* Kh = Kp + (b * K.stride(0) + h * K.stride(1)) * esize;
      const uint8_t* Vh = Vp + (b * V.stride(0) + h * V.stride(1)) * esize;
      for (int64_t j = 0; j < sh.kk; ++j) {
        const uint8_t *krow = Kh + pos[j] * row_bytes, *vrow = Vh + pos[j] * row_bytes;
        if (kind == Kind::F32) {
          krows[j] = reinterpret_cast<const float*>(krow);
          vrows[j] = reinterpret_cast<const float*>(vrow);
        } else {
          widen_row(kind, krow, d, kwide.data() + j * d);
          widen_row(kind, vrow, d, vwide.data() + j * d);
          krows[j] = kwide.data() + j * d;
          vrows[j] = vwide.data() + j * d;
        }
      }
      attend_chosen(sh, qp + bh * G * d, pos.data(), krows.data(), vrows.data(), brow, static_cast<float>(scale),
                    alpha.data(), vmp ? vmp + bh * d : nullptr, out.data_ptr<float>() + bh * G * d);
    }
  });
  return {out, i2};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparq_decode", &sparq_decode, "SparQ decode attention, steps 1-3, one call per layer");
}
