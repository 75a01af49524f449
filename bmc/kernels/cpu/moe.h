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

// What the experts of the steps since profiling was switched on did: expert GEMM pairs run, rows through them, and
// layers whose experts' panels were spread over the threads in one region.
struct ExpertCounts {
  int64_t runs = 0, rows = 0, spread = 0;
};

// When a layer's chosen experts have their panels spread over the threads in one region: where fewer were chosen
// than there are threads (unset), never (BMC_MOE_SPREAD=0: one after another on all threads), or always where the
// kernels allow (=1). The settings other than unset are A/B switches for benchmarks.
inline bool experts_spread_panels(int64_t chosen) {
  static const int mode = [] {
    const char* env = std::getenv("BMC_MOE_SPREAD");
    return env == nullptr ? -1 : std::string(env) == "0" ? 0 : 1;
  }();
  return mode < 0 ? chosen < at::get_num_threads() : mode == 1;
}

// x[m] += the routed MLP of normed rows h[m] (m < M, rows D apart), as transformers computes it: the router's
// softmax in float32, its top k (the lower index first among equal probabilities), renormalised where the family
// does, and each row's expert outputs weighted and summed in ascending expert order, then the shared expert's
// gated output. `activate(mid, rows, I)` applies the gated activation in place over rows of [gate | up].
template <typename Activate>
void run_experts(const Experts& X, const float* h, int64_t D, int64_t M, float* x, Arith arith,
                 const Activate& activate, ExpertCounts* counts) {
  const int64_t E = X.E, k = X.top_k, I = X.I;
  // the step's buffers, kept by the calling thread across layers and steps: no allocation on the decode path
  static thread_local std::vector<float> logits, weight_of, in, mid, out, acc;
  static thread_local std::vector<int64_t> expert_of, first, order, row_of, hit;
  logits.resize(M * E);
  gemm(h, D, M, D, X.router, E, nullptr, logits.data(), false);
  expert_of.resize(M * k);
  weight_of.resize(M * k);
  order.resize(E);
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
    for (int64_t j = 0; j < k; ++j) total += l[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      expert_of[m * k + j] = order[j];
      weight_of[m * k + j] = X.norm_topk ? l[order[j]] / total : l[order[j]];
    }
  }
  // the (row, slot) pairs grouped by expert, rows ascending within one (a counting sort): expert e's are
  // row_of[first[e] .. first[e + 1]), each an index m * k + j into expert_of / weight_of
  first.assign(E + 1, 0);
  for (int64_t i = 0; i < M * k; ++i) ++first[expert_of[i] + 1];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  row_of.resize(M * k);
  order.assign(first.begin(), first.end() - 1);  // the next free place of each expert
  for (int64_t i = 0; i < M * k; ++i) row_of[order[expert_of[i]]++] = i;
  const int64_t total = M * k;
  in.resize(total * D);
  mid.resize(std::max(total * 2 * I, M * 2 * X.S));
  out.resize(std::max(total, M) * D);
  hit.clear();  // the chosen experts (the unchosen ones' panels are not read)
  for (int64_t e = 0; e < E; ++e)
    if (first[e + 1] > first[e]) hit.push_back(e);
  // this thread's buffers by pointer: inside the parallel region a thread_local's name is the worker's own
  float *in_p = in.data(), *mid_p = mid.data(), *out_p = out.data();
  const int64_t *first_p = first.data(), *row_p = row_of.data(), *hit_p = hit.data();
  auto run_one = [&](int64_t e) {  // gather expert e's rows, gate|up, activation, down
    const int64_t f = first_p[e], n = first_p[e + 1] - f;
    float *xin = in_p + f * D, *xmid = mid_p + f * 2 * I, *y = out_p + f * D;
    for (int64_t r = 0; r < n; ++r) std::memcpy(xin + r * D, h + row_p[f + r] / k * D, D * sizeof(float));
    gemm(xin, D, n, D, X.up[e], 2 * I, nullptr, xmid, false, arith);
    activate(xmid, n, I);
    gemm(xmid, 2 * I, n, I, X.down[e], D, nullptr, y, false, arith);
  };
  const int64_t n_hit = static_cast<int64_t>(hit.size());
  int64_t most_rows = 0;
  for (int64_t e : hit) most_rows = std::max(most_rows, first[e + 1] - first[e]);
  const bool spread = experts_spread_panels(n_hit) &&
                      panel_range_applies(X.up[hit[0]], most_rows, arith) &&
                      panel_range_applies(X.down[hit[0]], most_rows, arith);
  if (spread) {
    // (fewer chosen experts than threads) every chosen expert's gate|up panels in one parallel region, each thread
    // a run of them, then their downs in a second (one hand-off per projection for the layer, not two per expert,
    // and no thread idle while another streams a whole expert). The rows are prepared once for all the panels.
    for (int64_t e : hit)
      for (int64_t r = first[e]; r < first[e + 1]; ++r)
        std::memcpy(in_p + r * D, h + row_p[r] / k * D, D * sizeof(float));
    static thread_local RowBuffers up_buf, down_buf;
    const PreparedRows up_rows = prepare_rows(in_p, D, total, D, X.up[hit[0]], arith, up_buf);
    const int64_t up_panels = X.up[hit[0]].data.size(0), down_panels = X.down[hit[0]].data.size(0);
    auto panels_of_each = [&](int64_t per, const auto& run) {  // run(expert, first panel, end panel)
      at::parallel_for(0, n_hit * per, 8, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin / per; j * per < end; ++j)
          run(hit_p[j], std::max(begin, j * per) - j * per, std::min(end, (j + 1) * per) - j * per);
      });
    };
    panels_of_each(up_panels, [&](int64_t e, int64_t pb, int64_t pe) {
      gemm_panel_range(up_rows.rows_from(first_p[e]), first_p[e + 1] - first_p[e], X.up[e], 2 * I, pb, pe,
                       mid_p + first_p[e] * 2 * I, arith);
    });
    activate(mid_p, total, I);  // every chosen expert's rows, in place
    const PreparedRows down_rows = prepare_rows(mid_p, 2 * I, total, I, X.down[hit[0]], arith, down_buf);
    panels_of_each(down_panels, [&](int64_t e, int64_t pb, int64_t pe) {
      gemm_panel_range(down_rows.rows_from(first_p[e]), first_p[e + 1] - first_p[e], X.down[e], D, pb, pe,
                       out_p + first_p[e] * D, arith);
    });
  } else if (n_hit >= at::get_num_threads()) {
    // whole experts per thread in one parallel region (each expert's GEMMs run inline on its thread): one
    // hand-off for the layer's experts instead of two per expert. An expert's arithmetic is the same on either
    // path: its GEMMs compute each panel alone, whoever runs it.
    at::parallel_for(0, n_hit, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) run_one(hit_p[j]);
    });
  } else {  // fewer experts than threads, rows the panel kernels cannot take: each expert's GEMMs on all threads
    for (int64_t e : hit) run_one(e);
  }
  acc.assign(M * D, 0.0f);
  for (int64_t e : hit)  // ascending expert order, as transformers sums them
    for (int64_t r = first[e]; r < first[e + 1]; ++r) {
      float* a = acc.data() + row_of[r] / k * D;
      const float* y = out.data() + r * D;
      const float w = weight_of[row_of[r]];
      for (int64_t j = 0; j < D; ++j) a[j] += y[j] * w;
    }
  if (counts != nullptr) {
    counts->runs += n_hit;
    counts->rows += total;
    counts->spread += spread;
  }
  if (X.S > 0) {
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
