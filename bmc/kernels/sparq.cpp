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
#include <torch/extension.h>
#include <ATen/Parallel.h>
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

// Step 1 for one (row, KV head, column block): approximate logits of the G query heads over the block, then
// exp(logit - block max) in place; `stats` gets the block's max and sum per query head.
void approx_block(const Shape& sh, const float* w, const int64_t* comps, const float* Kt, int64_t sD,
                  const float* bias, float* e, float* stats, int64_t s0) {
  const int64_t n = std::min(BLOCK, sh.S - s0), G = sh.G;
  for (int64_t g = 0; g < G; ++g) {
    float* row = e + g * sh.S + s0;
    std::fill(row, row + n, 0.0f);
  }
  for (int64_t j = 0; j < sh.r; ++j) {
    const float* krow = Kt + comps[j] * sD + s0;
    for (int64_t g = 0; g < G; ++g) {
      const float wj = w[g * sh.r + j];
      float* row = e + g * sh.S + s0;
#pragma omp simd
      for (int64_t s = 0; s < n; ++s) row[s] += wj * krow[s];
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
// in one pass; nth_element then runs over that bucket's members only (measured: nth_element over all 8K scores
// was most of the step at batch 1).
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

// Exact attention of the G query heads over the kk chosen positions (+ step 3's mean value when given).
void attend_chosen(const Shape& sh, const float* q, const int64_t* pos, const float* K, const float* V, int64_t ld,
                   const float* bias, float scale, const float* alpha, const float* vmean, float* out) {
  std::vector<float> p(sh.kk);
  for (int64_t g = 0; g < sh.G; ++g) {
    const float* qg = q + g * sh.d;
    float m = -BIG;
    for (int64_t j = 0; j < sh.kk; ++j) {
      const float* k = K + pos[j] * ld;
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
      const float* v = V + pos[j] * ld;
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

// q [B, kvh, G, d]; K, V [B, kvh, >=S, d] (rows contiguous); Kt [B, kvh, d, >=S] (columns contiguous);
// bias [B, >=S] with unit column stride (empty: nothing masked); vmean [B, kvh, d] (empty: no step 3).
// Returns out [B, kvh, G, d] and the chosen positions i2 [B, kvh, min(k, S)], in increasing order.
std::vector<torch::Tensor> sparq_decode(torch::Tensor q, torch::Tensor K, torch::Tensor V, torch::Tensor Kt,
                                        torch::Tensor bias, torch::Tensor vmean, int64_t S, int64_t r, int64_t k,
                                        int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 4 && K.dim() == 4 && V.dim() == 4 && Kt.dim() == 4, "sparq_decode: 4-d q, K, V, Kt");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && K.scalar_type() == torch::kFloat &&
              V.scalar_type() == torch::kFloat && Kt.scalar_type() == torch::kFloat, "sparq_decode: float32 only");
  TORCH_CHECK(K.stride(3) == 1 && V.stride(3) == 1 && Kt.stride(3) == 1 && K.stride(2) == V.stride(2) &&
              K.stride(0) == V.stride(0) && K.stride(1) == V.stride(1), "sparq_decode: K/V/Kt layout");
  TORCH_CHECK(K.size(2) >= S && Kt.size(3) >= S && S >= 1 && r >= 1 && r <= q.size(3) && k >= 1,
              "sparq_decode: bad S, r or k");
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
  const float *Kp = K.data_ptr<float>(), *Vp = V.data_ptr<float>(), *Ktp = Kt.data_ptr<float>();
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
      approx_block(sh, w.data() + bh * G * r, comps.data() + bh * r,
                   Ktp + b * Kt.stride(0) + h * Kt.stride(1), Kt.stride(2), bp ? bp + b * bias.stride(0) : nullptr,
                   e + bh * G * S, stats + (bh * sh.blocks + blk) * G * 2, blk * BLOCK);
    }
  });

  // per (row, KV head): the group's summed softmax, the top k (window forced in, masked columns last), step 2
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pick(S), scratch, factor(sh.blocks * G), alpha(G);
    scratch.reserve(S);
    std::vector<int64_t> pos(sh.kk);
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
      attend_chosen(sh, qp + bh * G * d, pos.data(), Kp + b * K.stride(0) + h * K.stride(1),
                    Vp + b * V.stride(0) + h * V.stride(1), K.stride(2), brow, static_cast<float>(scale),
                    alpha.data(), vmp ? vmp + bh * d : nullptr, out.data_ptr<float>() + bh * G * d);
    }
  });
  return {out, i2};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparq_decode", &sparq_decode, "SparQ decode attention, steps 1-3, one call per layer");
}
