// A layer's routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on the native step: route every row, then run
// each chosen expert once over all the rows that chose it, so an expert's panels are read once per step however
// many rows picked it, and the experts no row picked are not read at all.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

struct Experts {
  Weight router;             // [D, E] float panels (llama.cpp keeps routers in float too)
  std::vector<Weight> up;    // expert e's fused gate|up panels [D, 2I]: views of the layer's stacked matrix
  std::vector<Weight> down;  // expert e's down panels [I, D]
  int64_t E = 0, I = 0, top_k = 0;
  bool norm_topk = false;    // the top-k probabilities renormalised to sum to 1
  Weight shared_up, shared_down;  // Qwen2-MoE's shared expert [D, 2S] and [S, D], every row through it
  torch::Tensor shared_gate;      // [D] float: the shared expert's output is scaled by sigmoid(gate . h)
  int64_t S = 0;
  bool defined() const { return E > 0; }
};

// What the experts of the steps since profiling was switched on did: expert GEMM pairs run, and rows through them.
struct ExpertCounts {
  int64_t runs = 0, rows = 0;
};

// x[m] += the routed MLP of normed rows h[m] (m < M, rows D apart), as transformers computes it: the router's
// softmax in float32, its top k (the lower index first among equal probabilities), renormalised where the family
// does, and each row's expert outputs weighted and summed in ascending expert order, then the shared expert's
// gated output. `activate(mid, rows, I)` applies the gated activation in place over rows of [gate | up].
template <typename Activate>
void run_experts(const Experts& X, const float* h, int64_t D, int64_t M, float* x, Arith arith,
                 const Activate& activate, ExpertCounts* counts) {
  const int64_t E = X.E, k = X.top_k, I = X.I;
  std::vector<float> logits(M * E);
  gemm(h, D, M, D, X.router, E, nullptr, logits.data(), false);
  std::vector<std::vector<std::pair<int64_t, float>>> chosen(E);  // expert -> (row, weight)
  std::vector<int64_t> order(E);
  std::vector<float> top(k);
  for (int64_t m = 0; m < M; ++m) {
    float* l = logits.data() + m * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (l[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) l[e] /= sum;
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [l](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) total += (top[j] = l[order[j]]);
    for (int64_t j = 0; j < k; ++j) chosen[order[j]].emplace_back(m, X.norm_topk ? top[j] / total : top[j]);
  }
  std::vector<float> acc(M * D, 0.0f), in, mid, out;
  for (int64_t e = 0; e < E; ++e) {
    const auto& rows = chosen[e];
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;  // no row chose it: its panels are not read
    in.resize(n * D);
    mid.resize(n * 2 * I);
    out.resize(n * D);
    for (int64_t r = 0; r < n; ++r) std::memcpy(in.data() + r * D, h + rows[r].first * D, D * sizeof(float));
    gemm(in.data(), D, n, D, X.up[e], 2 * I, nullptr, mid.data(), false, arith);
    activate(mid.data(), n, I);
    gemm(mid.data(), 2 * I, n, I, X.down[e], D, nullptr, out.data(), false, arith);
    for (int64_t r = 0; r < n; ++r) {
      float* a = acc.data() + rows[r].first * D;
      const float* y = out.data() + r * D;
      const float w = rows[r].second;
      for (int64_t j = 0; j < D; ++j) a[j] += y[j] * w;
    }
    if (counts != nullptr) {
      counts->runs += 1;
      counts->rows += n;
    }
  }
  if (X.S > 0) {
    mid.resize(M * 2 * X.S);
    out.resize(M * D);
    gemm(h, D, M, D, X.shared_up, 2 * X.S, nullptr, mid.data(), false, arith);
    activate(mid.data(), M, X.S);
    gemm(mid.data(), 2 * X.S, M, X.S, X.shared_down, D, nullptr, out.data(), false, arith);
    const float* g = X.shared_gate.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      const float gate = 1.0f / (1.0f + std::exp(-dot(h + m * D, g, D)));
      float* a = acc.data() + m * D;
      const float* y = out.data() + m * D;
      for (int64_t j = 0; j < D; ++j) a[j] += gate * y[j];
    }
  }
  for (int64_t i = 0; i < M * D; ++i) x[i] += acc[i];
}

}  // namespace
