"""SparQ steps 1-2 fused into one C++ pass per (row, KV head) on CPU, built on first use with torch's
cpp_extension (g++ and ninja; cached under ~/.cache/torch_extensions).

Why: in eager PyTorch steps 1-2 are ~10 passes over the S approximate scores (gather of r K rows, matmul, bias,
softmax, group sum, top-k) plus ~40 op dispatches; measured at 8K context they cost as much as dense attention
(bench/sparq_speed.py). Here the r selected rows of the dimension-major K are read once, the G softmaxes, the
group sum, the window and the top-k (nth_element, O(S)) run on data in cache, in parallel over (row, KV head).
The same arithmetic as sparq_select (tests compare the two); if the build fails, SparQ falls back to it."""
from __future__ import annotations

from typing import Any

from ..kernels import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

static constexpr float BIG = 3.0e38f;

// qg [B,H,G,d]; Kt [B,H,d,cap] (last dim contiguous, rows `row_stride` apart); i1 [B,H,r]; qscale [B,H,G];
// bias [B,S] (empty: nothing masked). Returns i2 [B,H,k'] (k' = min(k,S)) and alpha [B,H,G] (the approximate
// softmax mass of the chosen positions per query head).
std::vector<torch::Tensor> sparq_select_fused(torch::Tensor qg, torch::Tensor Kt, torch::Tensor i1,
                                              torch::Tensor qscale, torch::Tensor bias, int64_t S, int64_t k,
                                              int64_t window) {
  const int64_t B = qg.size(0), H = qg.size(1), G = qg.size(2), d = qg.size(3), r = i1.size(2);
  const int64_t kk = std::min(k, S);
  auto q = qg.contiguous(); auto idx1 = i1.contiguous(); auto qs = qscale.contiguous();
  const bool has_bias = bias.numel() > 0;
  auto bs = has_bias ? bias.contiguous() : bias;
  auto i2 = torch::empty({B, H, kk}, torch::kLong);
  auto alpha = torch::empty({B, H, G}, torch::kFloat);
  const float* qp = q.data_ptr<float>(); const int64_t* i1p = idx1.data_ptr<int64_t>();
  const float* qsp = qs.data_ptr<float>(); const float* bp = has_bias ? bs.data_ptr<float>() : nullptr;
  const float* kp = Kt.data_ptr<float>();
  const int64_t sB = Kt.stride(0), sH = Kt.stride(1), sD = Kt.stride(2);
  int64_t* i2p = i2.data_ptr<int64_t>(); float* ap = alpha.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(G * S), pick(S);
    std::vector<int64_t> order(S);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      std::fill(p.begin(), p.end(), 0.0f);
      for (int64_t j = 0; j < r; ++j) {  // step 1: the r chosen components, one contiguous K row each
        const int64_t c = i1p[bh * r + j];
        const float* krow = kp + b * sB + h * sH + c * sD;
        for (int64_t g = 0; g < G; ++g) {
          const float w = qp[(bh * G + g) * d + c] * qsp[bh * G + g];
          float* row = p.data() + g * S;
          for (int64_t s = 0; s < S; ++s) row[s] += w * krow[s];
        }
      }
      std::fill(pick.begin(), pick.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g) {  // softmax per query head, summed over the group
        float* row = p.data() + g * S;
        if (bp) for (int64_t s = 0; s < S; ++s) row[s] += bp[b * S + s];
        float m = -BIG;
        for (int64_t s = 0; s < S; ++s) m = std::max(m, row[s]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < S; ++s) { row[s] = expf(row[s] - m); sum += row[s]; }
        const float inv = 1.0f / sum;
        for (int64_t s = 0; s < S; ++s) { row[s] *= inv; pick[s] += row[s]; }
      }
      // finite sentinels (the build uses -ffast-math): scores are in [0, G], so -BIG / BIG sort last / first
      if (bp) for (int64_t s = 0; s < S; ++s) if (bp[b * S + s] != 0.0f) pick[s] = -BIG;  // padding: never first
      for (int64_t s = std::max<int64_t>(0, S - window); s < S; ++s) if (pick[s] > -1.0f) pick[s] = BIG;
      for (int64_t s = 0; s < S; ++s) order[s] = s;
      if (kk < S)
        std::nth_element(order.begin(), order.begin() + kk, order.end(),
                         [&](int64_t a, int64_t c) { return pick[a] > pick[c]; });
      for (int64_t j = 0; j < kk; ++j) i2p[bh * kk + j] = order[j];
      for (int64_t g = 0; g < G; ++g) {
        float a = 0.0f;
        for (int64_t j = 0; j < kk; ++j) a += p[g * S + order[j]];
        ap[bh * G + g] = a;
      }
    }
  });
  return {i2, alpha};
}
"""

def fused_select() -> Any:
    """The compiled kernel, or None (BMC_SPARQ_KERNEL=0, or the build failed: logged once)."""
    mod = build("bmc_sparq_select_v3", _SOURCE, ["sparq_select_fused"], "BMC_SPARQ_KERNEL")
    return None if mod is None else mod.sparq_select_fused
