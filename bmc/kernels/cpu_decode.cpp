// bmc's CPU decode step: one call runs every layer of a Llama or OPT decoder for t <= a few dozen new tokens
// per row (decode, speculative verify), with the GEMMs on weights re-laid into 16-column panels.
//
// Why: a decode step of a small model on a CPU is bound by reading the weights (M = batch rows, so every GEMM
// is matrix-vector-like) and, in eager PyTorch, by ~450 op dispatches a step (docs/performance.md, "Figures
// behind the code's choices"). Here a panel [K][16] is one contiguous stream the hardware prefetcher follows, each
// weight is read once per step for all M rows (up to 8 rows kept in registers), and nothing goes back to Python
// between layers.
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
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// Nothing of this module is visible outside it but its Python entry point. Why: the kernel tables below
// (static constexpr members of NativeDecoder) would otherwise be GNU "unique" symbols, bound once per process, so
// a second build of this file loaded beside the first (an A/B of a kernel change) dispatched through the first
// one's tables and ran its kernels.
#pragma GCC visibility push(hidden)

#include "cpu/simd.h"
#include "cpu/gemm.h"
#include "cpu/quant.h"
#include "cpu/vnni.h"
#include "cpu/gemm_bf16.h"
#include "cpu/linear.h"
#include "cpu/ops.h"
#include "cpu/kv_format.h"
#include "cpu/attend_float.h"
#include "cpu/attend_i8.h"
#include "cpu/attend_bf16.h"
#include "cpu/attention.h"
#include "cpu/moe.h"

namespace {

struct Layer {
  torch::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // *_b undefined for RMSNorm
  Weight qkv, o, up, down;                   // panels; up = fused gate|up (gated MLP) or fc1
  torch::Tensor qkv_b, o_b, up_b, down_b;    // optional biases
  torch::Tensor q_norm, k_norm;              // Qwen3: RMSNorm weights over head_dim of each query / key head
  bool qk_full = false;                      // OLMoE: q_norm / k_norm span all query / key heads at once
  Experts moe;                               // routed experts in place of up / down (cpu/moe.h)
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
        act_(std::move(act)), eps_(eps), attn_(heads, kv_heads, head_dim, scale) {
    TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(act_ == "silu" || act_ == "relu" || act_ == "gelu" || (gated && act_ == "gelu_tanh"), "activation ",
                act_, " not supported");
  }

  void add_layer(const torch::Tensor& ln1_w, const torch::Tensor& ln1_b, const Weight& qkv,
                 const torch::Tensor& qkv_b, const Weight& o, const torch::Tensor& o_b,
                 const torch::Tensor& ln2_w, const torch::Tensor& ln2_b, const Weight& up,
                 const torch::Tensor& up_b, const Weight& down, const torch::Tensor& down_b) {
    const int64_t nq = (h_ + 2 * kvh_) * hd_, nu = gated_ ? 2 * I_ : I_;
    const bool mlp = up.data.numel() > 0;  // empty up and down: the layer's experts come by set_moe
    layers_.push_back(Layer{f32(ln1_w), f32(ln1_b), f32(ln2_w), f32(ln2_b), panels(qkv, D_, nq, "qkv"),
                            panels(o, h_ * hd_, D_, "o"), mlp ? panels(up, D_, nu, "up") : Weight{},
                            mlp ? panels(down, I_, D_, "down") : Weight{}, f32(qkv_b), f32(o_b), f32(up_b),
                            f32(down_b)});
  }

  // Layer `layer`'s routed experts: the router [D, E] (float), every expert's gate|up stacked along the output
  // axis [D, E * 2I] and every down projection [I, E * D], top_k chosen per row.
  void set_moe(int64_t layer, const Weight& router, const Weight& up, const Weight& down, int64_t experts,
               int64_t inter, int64_t top_k, bool norm_topk) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_moe: no layer ", layer);
    TORCH_CHECK(gated_ && experts > 0 && top_k > 0 && top_k <= experts && inter > 0 && inter % P == 0 && D_ % P == 0,
                "set_moe: gated experts, 1 <= top_k <= experts, widths of whole panels");
    TORCH_CHECK(!router.blocks(), "set_moe: a float router");
    Experts& X = layers_[layer].moe;
    X.router = panels(router, D_, experts, "router");
    const Weight stacked_up = panels(up, D_, experts * 2 * inter, "experts_up");
    const Weight stacked_down = panels(down, inter, experts * D_, "experts_down");
    X.up.clear();
    X.down.clear();
    for (int64_t e = 0; e < experts; ++e) {
      X.up.push_back(Weight{stacked_up.data.narrow(0, e * 2 * inter / P, 2 * inter / P), stacked_up.kind});
      X.down.push_back(Weight{stacked_down.data.narrow(0, e * D_ / P, D_ / P), stacked_down.kind});
    }
    X.E = experts;
    X.I = inter;
    X.top_k = top_k;
    X.norm_topk = norm_topk;
  }

  // Qwen2-MoE's shared expert of layer `layer`: gate|up [D, 2S], down [S, D] and its sigmoid gate [D].
  void set_shared_expert(int64_t layer, const Weight& up, const Weight& down, const torch::Tensor& gate,
                         int64_t inter) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && layers_[layer].moe.defined(), "set_shared_expert: a routed layer");
    TORCH_CHECK(gate.numel() == D_, "set_shared_expert: a [hidden] gate");
    Experts& X = layers_[layer].moe;
    X.shared_up = panels(up, D_, 2 * inter, "shared_up");
    X.shared_down = panels(down, inter, D_, "shared_down");
    X.shared_gate = f32(gate);
    X.S = inter;
  }

  // OLMoE: q, k and v clamped to [-clip, clip] after the q / k norms (0: off)
  void set_clip_qkv(double clip) { clip_qkv_ = static_cast<float>(clip); }

  // int8 caches' key channel scales (kv/smoothing.py): [L, H_kv, d] float32 powers of two, keys written as k / s and
  // queries taken as q * s where a part's cache is int8; empty: none. Called before every step with its cache's.
  void set_key_scales(const torch::Tensor& s) {
    if (s.numel() == 0) {
      key_scales_ = key_inv_scales_ = torch::Tensor();
      return;
    }
    if (key_scales_.defined() && key_src_.defined() && key_src_.is_same(s)) return;
    TORCH_CHECK(s.scalar_type() == torch::kFloat && s.dim() == 3 && s.size(0) == num_layers() && s.size(1) == kvh_ &&
                    s.size(2) == hd_, "key scales: float32 [layers, KV heads, head_dim]");
    key_src_ = s;
    key_scales_ = s.contiguous();
    key_inv_scales_ = key_scales_.reciprocal();
  }

  // lm_head: [hidden, vocab], or its panels with `vocab` given
  void set_head(const torch::Tensor& norm_w, const torch::Tensor& norm_b, const Weight& lm_head, int64_t vocab) {
    vocab_ = lm_head.data.dim() == 3 ? vocab : lm_head.data.size(1);  // panels carry no exact width
    norm_w_ = f32(norm_w);
    norm_b_ = f32(norm_b);
    head_ = panels(lm_head, D_, vocab_, "lm_head");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Qwen3's per-head RMSNorm of queries and keys (before RoPE) for layer `layer`: [head_dim] weights each; or
  // OLMoE's over all heads at once: [heads * head_dim] and [kv_heads * head_dim] weights.
  void set_qk_norm(int64_t layer, const torch::Tensor& q_norm, const torch::Tensor& k_norm) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_qk_norm: no layer ", layer);
    const bool full = q_norm.numel() == h_ * hd_ && k_norm.numel() == kvh_ * hd_ && h_ > 1;
    TORCH_CHECK(full || (q_norm.numel() == hd_ && k_norm.numel() == hd_),
                "set_qk_norm: [head_dim] weights, or [heads * head_dim] and [kv_heads * head_dim]");
    layers_[layer].qk_full = full;
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

  // Prompt rows (the parts forward / forward_parts are told are a prompt's) in bfloat16 arithmetic, a stated bound;
  // decode and verify rows, and the LM head, stay in float32.
  void set_bf16_prompts(bool on) {  // a prompt's GEMMs and the attention of its rows in bfloat16 arithmetic
    bf16_prompts_ = on;
    attn_.set_bf16_prompts(on);
  }

  void set_int8_kv_dots(bool on) { attn_.set_int8_kv_dots(on); }  // see Attention
  bool int8_kv_dots() const { return attn_.int8_kv_dots(); }
  void set_softcap(double cap) { attn_.set_softcap(cap); }
  void set_split_threads(int64_t threads) { attn_.set_split_threads(threads); }  // see Attention

  // A weight as the GEMMs read it: [in, out] float32 packed here, or panels packed beforehand by pack_panels
  // ([ceil(out/16), in, 16]: a memory-mapped file shared by several processes hands them over as they are).
  static Weight panels(const Weight& weight, int64_t in, int64_t out, const char* name) {
    if (weight.blocks()) {
      check_quant(weight, in, out, name);
      return weight;
    }
    const torch::Tensor& w = weight.data;
    if (w.dim() == 3) {
      TORCH_CHECK((w.scalar_type() == torch::kFloat || is_half_panels(w)) && w.is_contiguous() &&
                      w.size(0) == (out + P - 1) / P &&
                      w.size(1) == in && w.size(2) == P,
                  name, ": panels do not match the decoder (quantized panels need their block kind)");
      return weight;
    }
    TORCH_CHECK(w.dim() == 2 && w.size(0) == in && w.size(1) == out, name, ": weight shape does not match the decoder");
    return Weight{pack_panels(w), NOT_BLOCKS};
  }

  // Seconds per phase over the decode steps (t = 1) run since profiling was switched on (the paper's Table IV);
  // prompts=true: over the single-part prompt steps instead (where a prefill's time goes).
  void set_profiling(bool on, bool prompts) {
    profiling_ = on;
    profile_prompts_ = prompts;
    std::fill(std::begin(phase_s_), std::end(phase_s_), 0.0);
    expert_counts_ = ExpertCounts{};
  }
  std::map<std::string, double> profile() const {
    return {{"kv_write_s", phase_s_[0]}, {"attention_s", phase_s_[1]}, {"other_s", phase_s_[2]},
            {"gemm_s", phase_s_[3]}, {"lm_head_s", phase_s_[4]},
            {"expert_runs", static_cast<double>(expert_counts_.runs)},
            {"expert_rows", static_cast<double>(expert_counts_.rows)},
            {"expert_layers_spread", static_cast<double>(expert_counts_.spread)}};
  }

  // x [B, t, D] (embedded inputs, overwritten), kv [L, 2, B, H_kv, cap, d] written at columns [start, start+t),
  // bias [B, 1, 1 or t, cap] additive, cos / sin_signed [B, t, d] or empty (no RoPE). Returns logits
  // [B, t or 1, vocab].
  // Shared segments (optional): seg_kv[i] [L, 2, groups, H_kv, len, d], seg_bias[i] [groups, 1, 1, len],
  // seg_group[i] [B] int64, the group each row reads. local: empty, or the window layers' (set_local) bias (empty:
  // the main one), cos and sin, shaped as the main ones, and optionally each row's grid origin ([B] int64, see
  // Attention::attention) and a non-empty tensor where the cache has holes.
  torch::Tensor forward(torch::Tensor x, torch::Tensor kv, torch::Tensor bias, torch::Tensor cos, torch::Tensor sin,
                        int64_t start, bool all_logits, std::vector<torch::Tensor> seg_kv,
                        std::vector<torch::Tensor> seg_bias, std::vector<torch::Tensor> seg_group,
                        std::vector<torch::Tensor> local, bool prompt) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.size(2) == D_, "x: float32 [B, t, hidden]");
    const int64_t B = x.size(0), t = x.size(1);
    std::vector<Part> parts{make_part(kv, bias, cos, sin, start, B, t, local)};
    parts[0].prompt = prompt;
    settle_holes(parts[0]);
    parts[0].segs = attn_.parse_segments(seg_kv, seg_bias, seg_group, B, num_layers());
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
                              std::vector<std::vector<torch::Tensor>> seg_groups, std::vector<bool> prompts) {
    const size_t n = xs.size();
    TORCH_CHECK(n > 0 && kvs.size() == n && biases.size() == n && coss.size() == n && sins.size() == n &&
                    starts.size() == n && locals.size() == n && seg_kvs.size() == n && seg_biases.size() == n &&
                    seg_groups.size() == n && prompts.size() == n,
                "forward_parts: one x, kv, bias, cos, sin, start, local, segment list and prompt flag per part");
    std::vector<Part> parts;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(xs[i].scalar_type() == torch::kFloat && xs[i].dim() == 3 && xs[i].size(2) == D_,
                  "x: float32 [B, t, hidden]");
      parts.push_back(make_part(kvs[i], biases[i], coss[i], sins[i], starts[i], xs[i].size(0), xs[i].size(1),
                                locals[i]));
      parts.back().segs = attn_.parse_segments(seg_kvs[i], seg_biases[i], seg_groups[i], xs[i].size(0), num_layers());
      parts.back().prompt = prompts[i];
      settle_holes(parts.back());
      TORCH_CHECK((coss[i].numel() > 0) == (coss[0].numel() > 0), "forward_parts: RoPE on every part or none");
    }
    std::vector<torch::Tensor> flat;
    for (auto& x : xs) flat.push_back(x.reshape({-1, D_}));
    auto x = torch::cat(flat, 0);
    return run(x, parts, false);
  }

 private:
  struct Part {  // one batch of a step: B rows of t new tokens each, over its own cache
    int64_t B, t, cap, start;
    int64_t slab;  // rows per (row, KV head) slab: cap, or more in a cache that grows in place
    KVLayout lay;  // how the cache stores its rows
    torch::Tensor kv, bias, cos, sin;  // bias made contiguous float32; cos / sin contiguous or empty
    torch::Tensor local_bias, local_cos, local_sin;  // the window layers' (set_local), or empty: the main ones
    torch::Tensor grid_origin;  // [B] int64: each row's column of its position 0 (a window on every layer), or empty
    Holes holes;                // the rows' holes, found once a step (settle_holes)
    bool holed = false;         // the cache has holes (speculation's), or the step is a verify tree's
    std::vector<Segment> segs;
    bool prompt = false;  // a prompt's rows (set_bf16_prompts)
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

  // A part's holes (see Holes), found once for every layer: where its cache has them, and in every verify step,
  // whose tree's nodes mask their siblings' columns (a chain's hold none: nothing changes there).
  static void settle_holes(Part& part) {
    part.holed = part.holed || (!part.prompt && part.t > 1 && part.bias.size(2) == part.t);
    if (part.holed) part.holes = Holes::find(part.bias.data_ptr<float>(), part.bias.size(2), part.cap, part.B);
  }

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
      TORCH_CHECK(local.size() >= 3 && local.size() <= 5,
                  "local: [bias, cos, sin] of the window layers[, grid origin[, holes]]");
      if (local.size() >= 4 && local[3].numel() > 0) {
        TORCH_CHECK(local[3].numel() == B, "local grid origin: one column a row");
        part.grid_origin = local[3].to(torch::kLong).contiguous();
      }
      if (local.size() == 5 && local[4].numel() > 0) part.holed = true;  // found in settle_holes
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
    // consecutive parts of one arithmetic, as (first row, rows, arithmetic): one GEMM call each
    std::vector<std::tuple<int64_t, int64_t, Arith>> runs;
    int64_t run_row = 0;
    for (const Part& part : parts) {
      const Arith a{int8_x_, bf16_prompts_ && part.prompt};
      if (!runs.empty() && std::get<2>(runs.back()).bf16 == a.bf16)
        std::get<1>(runs.back()) += part.B * part.t;
      else
        runs.emplace_back(run_row, part.B * part.t, a);
      run_row += part.B * part.t;
    }
    // y = x @ W (+ b) over the step's rows, each run in its own arithmetic; x rows ldx apart, y rows N apart
    auto step_gemm = [&](const float* x, int64_t ldx, int64_t K, const Weight& w, int64_t N, const float* b, float* y,
                         bool accumulate) {
      for (const auto& [r0, rows, a] : runs) gemm(x + r0 * ldx, ldx, rows, K, w, N, b, y + r0 * N, accumulate, a);
    };
    const bool profiled = parts.size() == 1 && (profile_prompts_ ? parts[0].prompt : decode_only);
    Clock clock(profiling_ && profiled, phase_s_);
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Layer& L = layers_[l];
      norm(xp, L.ln1_w, L.ln1_b, hp, M);
      clock.lap(2);
      step_gemm(hp, D_, D_, L.qkv, nq, ptr(L.qkv_b), qp, false);
      clock.lap(3);
      if (L.q_norm.defined() && L.qk_full) {  // OLMoE: all q heads as one vector, all k heads as another
        for (int64_t m = 0; m < M; ++m) {
          float* v = qp + m * nq;
          rms_norm(v, L.q_norm.data_ptr<float>(), v, h_ * hd_, eps_);
          rms_norm(v + h_ * hd_, L.k_norm.data_ptr<float>(), v + h_ * hd_, kvh_ * hd_, eps_);
        }
      } else if (L.q_norm.defined()) {  // in place, each head of each row: q heads, then the k heads after them
        const float *qn = L.q_norm.data_ptr<float>(), *kn = L.k_norm.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
          for (int64_t head = 0; head < h_ + kvh_; ++head) {
            float* v = qp + m * nq + head * hd_;
            rms_norm(v, head < h_ ? qn : kn, v, hd_, eps_);
          }
      }
      if (clip_qkv_ > 0.0f)
        for (int64_t i = 0; i < M * nq; ++i) qp[i] = std::min(std::max(qp[i], -clip_qkv_), clip_qkv_);
      int64_t row = 0;
      for (const Part& part : parts) {
        const int64_t rows = part.B * part.t, layer_bytes = 2 * part.B * kvh_ * part.slab * part.lay.row_bytes;
        float* q = qp + row * nq;
        if (part.cos.numel() > 0) apply_rope(q, rows, nq, part.cos_of(L), part.sin_of(L));
        if (key_scales_.defined() && part.lay.kind == KVKind::I8) scale_keys(q, rows, nq, l);
        uint8_t* kc = static_cast<uint8_t*>(part.kv.data_ptr()) + l * layer_bytes;
        uint8_t* vc = kc + layer_bytes / 2;
        clock.lap(2);
        write_kv(q, nq, kc, vc, part.lay, part.B, part.t, part.slab, part.start);
        clock.lap(0);
        const torch::Tensor& bias = part.bias_of(L);
        const bool window = L.local && part.local_bias.numel() > 0;  // its grid from the full layers' bias
        attn_.attention(l, q, nq, kc, vc, part.lay, part.cap, part.slab, bias.data_ptr<float>(), bias.size(2), part.B,
                        part.t, part.segs, ap + row * h_ * hd_, part.prompt,
                        window ? part.bias.data_ptr<float>() : nullptr,
                        part.grid_origin.numel() > 0 ? part.grid_origin.data_ptr<int64_t>() : nullptr,
                        part.holed ? &part.holes : nullptr);
        clock.lap(1);
        row += rows;
      }
      if (L.post_attn.defined()) {  // Gemma 2/3: x += norm(o(attn)); hp is free again
        clock.lap(2);
        step_gemm(ap, h_ * hd_, h_ * hd_, L.o, D_, ptr(L.o_b), hp, false);
        clock.lap(3);
        add_normed(hp, L.post_attn, xp, M);
      } else {
        clock.lap(2);
        step_gemm(ap, h_ * hd_, h_ * hd_, L.o, D_, ptr(L.o_b), xp, true);
        clock.lap(3);
      }
      norm(xp, L.ln2_w, L.ln2_b, hp, M);
      clock.lap(2);
      if (L.moe.defined()) {  // each run of one arithmetic routes and runs its own rows
        auto act = [this](float* mid, int64_t rows, int64_t inter) { activate(mid, rows, inter); };
        for (const auto& [r0, rows, a] : runs)
          run_experts(L.moe, hp + r0 * D_, D_, rows, xp + r0 * D_, a, act, profiling_ ? &expert_counts_ : nullptr);
        clock.lap(3);
        continue;
      }
      step_gemm(hp, D_, D_, L.up, nu, ptr(L.up_b), mp, false);
      clock.lap(3);
      activate(mp, M, I_);
      if (L.post_mlp.defined()) {
        clock.lap(2);
        step_gemm(mp, nu, I_, L.down, D_, ptr(L.down_b), hp, false);
        clock.lap(3);
        add_normed(hp, L.post_mlp, xp, M);
      } else {
        clock.lap(2);
        step_gemm(mp, nu, I_, L.down, D_, ptr(L.down_b), xp, true);
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
    gemm(last.data_ptr<float>(), D_, n_out, D_, head_, vocab_, nullptr, logits.data_ptr<float>(), false,
         Arith{int8_x_, false});
    clock.lap(4);
    return logits;
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

  // fn(m0, m1) over rows [0, M), split over the threads where rows x width pays for a parallel region (a prompt's
  // chunk, a full batch's MLP): run on the calling thread alone, the other threads waited (docs/performance.md, "The
  // rounding of x split over the threads"). Each row is computed by the same code either way: the same bits.
  template <typename F>
  static void over_rows(int64_t M, int64_t width, const F& fn) {
    if (M < 2 || M * width < 16384) return fn(int64_t{0}, M);
    at::parallel_for(0, M, 1, fn);
  }

  void norm(const float* x, const torch::Tensor& w, const torch::Tensor& b, float* out, int64_t rows) const {
    over_rows(rows, D_, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        if (rms_)
          rms_norm(x + m * D_, w.data_ptr<float>(), out + m * D_, D_, eps_);
        else
          layer_norm(x + m * D_, w.data_ptr<float>(), b.data_ptr<float>(), out + m * D_, D_, eps_);
      }
    });
  }

  // x*cos + roll(x, d/2)*sin_signed on every query and key head (values follow them in each row). The two halves
  // are separate loops so that both vectorise: with the roll as `(j + half) % d` in one loop it did not, and was a
  // visible share of a decode step (docs/performance.md, "Figures behind the code's choices").
  void apply_rope(float* qkv, int64_t M, int64_t nq, const float* cos, const float* sin) const {
    const int64_t half = hd_ / 2;
    over_rows(M, nq, [&](int64_t m0, int64_t m1) {
      std::vector<float> lo_buf(half);
      float* lo = lo_buf.data();
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t head = 0; head < h_ + kvh_; ++head) {
          float* v = qkv + m * nq + head * hd_;
          const float *c = cos + m * hd_, *s = sin + m * hd_;
          std::memcpy(lo, v, half * sizeof(float));
          for (int64_t j = 0; j < half; ++j) v[j] = v[j] * c[j] + v[j + half] * s[j];
          for (int64_t j = half; j < hd_; ++j) v[j] = v[j] * c[j] + lo[j - half] * s[j];
        }
    });
  }

  // queries * s and keys / s of an int8 cache's layer (set_key_scales): powers of two, so exact
  void scale_keys(float* qkv, int64_t M, int64_t nq, int64_t l) const {
    const int64_t group = h_ / kvh_;
    const float* s = key_scales_.data_ptr<float>() + l * kvh_ * hd_;
    const float* inv = key_inv_scales_.data_ptr<float>() + l * kvh_ * hd_;
    for (int64_t m = 0; m < M; ++m) {
      float* row = qkv + m * nq;
      for (int64_t head = 0; head < h_; ++head) {
        float* v = row + head * hd_;
        const float* sh = s + (head / group) * hd_;
        for (int64_t j = 0; j < hd_; ++j) v[j] *= sh[j];
      }
      for (int64_t kh = 0; kh < kvh_; ++kh) {
        float* v = row + (h_ + kh) * hd_;
        const float* ih = inv + kh * hd_;
        for (int64_t j = 0; j < hd_; ++j) v[j] *= ih[j];
      }
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

  // the MLP's activation over M rows of width I (gated: rows of [gate | up], 2I wide, written over the gate half)
  void activate(float* mid, int64_t M, int64_t inter) const {
    const int64_t n = gated_ ? 2 * inter : inter;
    over_rows(M, inter, [&](int64_t m0, int64_t m1) { activate_rows(mid, m0, m1, n, inter); });
  }

  void activate_rows(float* mid, int64_t m0, int64_t m1, int64_t n, int64_t inter) const {
    for (int64_t m = m0; m < m1; ++m) {
      float* row = mid + m * n;
      if (gated_ && act_ == "gelu_tanh") {  // Gemma's GeGLU: torch's gelu(approximate="tanh")(gate) * up
        for (int64_t j = 0; j < inter; ++j) {
          const float g = row[j];
          row[j] = 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * row[inter + j];
        }
      } else if (gated_) {  // silu(gate) * up, written over the gate half (the down GEMM reads rows of stride 2I)
        for (int64_t j = 0; j < inter; ++j) row[j] = row[j] / (1.0f + std::exp(-row[j])) * row[inter + j];
      } else if (act_ == "relu") {
        for (int64_t j = 0; j < inter; ++j) row[j] = std::max(row[j], 0.0f);
      } else {
        for (int64_t j = 0; j < inter; ++j) row[j] = 0.5f * row[j] * (1.0f + std::erf(row[j] * 0.70710678118654752f));
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

  bool profiling_ = false, profile_prompts_ = false;
  double phase_s_[5] = {};  // KV writes, attention, the rest (norms, RoPE, activation), layer GEMMs, LM head
  int64_t D_, h_, kvh_, hd_, I_;
  bool rms_, gated_;
  std::string act_;
  double eps_;
  bool int8_x_ = false;  // set_int8_activations
  bool bf16_prompts_ = false;  // set_bf16_prompts
  float clip_qkv_ = 0.0f;  // set_clip_qkv
  torch::Tensor key_src_, key_scales_, key_inv_scales_;  // set_key_scales
  ExpertCounts expert_counts_;  // since set_profiling(true)
  Attention attn_;  // the step's attention over own rows and shared segments (cpu/attention.h)
  std::vector<Layer> layers_;
  torch::Tensor norm_w_, norm_b_;
  Weight head_;
  int64_t vocab_ = 0;
};

#pragma GCC visibility pop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Weight>(m, "Weight", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, int64_t>(), "panels (or a float32 [in, out] matrix) and their block kind "
           "(bmc/kernels/block_kinds.py; -1: float)", py::arg("data"), py::arg("kind") = NOT_BLOCKS)
      .def_readonly("data", &Weight::data)
      .def_readonly("kind", &Weight::kind);
  m.def("block_kinds", []() {
    std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, bool, bool>> rows;
    for (int k = 0; k < NUM_BLOCK_KINDS; ++k)
      rows.emplace_back(KIND_NAME[k], KIND_BLOCK[k], KIND_QUANTS[k], KIND_SCALE_HI[k], KIND_OFFSET[k],
                        KIND_HALF_SCALES[k], KIND_NIBBLES[k]);
    return rows;
  }, "the block kinds this build was compiled with: (name, block bytes, quants at, d_hi at, m at, fp16, nibbles)");
  m.def("pack_panels", &pack_panels, "[in, out] float32 -> [ceil(out/16), in, 16] panels");
  m.def("panel_linear", &panel_linear, "x @ W (+ b) with W packed by pack_panels (int8_activations: Q4 panels "
        "against int8 activation blocks, where the CPU has VNNI; bf16: in bfloat16 arithmetic)",
        py::arg("x"), py::arg("w"), py::arg("N"), py::arg("bias"), py::arg("int8_activations") = false,
        py::arg("bf16") = false);
  m.def("has_int8_dot", []() { return HAVE_INT8_DOT; }, "whether int8 activations can run (AVX512-VNNI and VBMI)");
  m.def("quantize_activations", [](const torch::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 && x.size(1) % QK == 0,
                "x: float32 [M, K], K a multiple of 32, rows contiguous");
    const int64_t M = x.size(0), K = x.size(1);
    auto xq = torch::empty({M, K}, torch::kInt8);
    auto dx = torch::empty({M, K / QK}, torch::kFloat32), xsum = torch::empty({M, K / QK}, torch::kFloat32);
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                  xsum.data_ptr<float>());
#else
    TORCH_CHECK(false, "int8 activations need AVX512-VNNI and VBMI");
#endif
    return std::make_tuple(xq, dx, xsum);
  }, "int8 activations' rounding of x: (qx [M, K] int8, dx [M, K/32], dx * sum qx [M, K/32]), as the GEMMs take it");
  m.def("experts_spread", []() { return panel_range_applies(Weight{torch::zeros({1}), NOT_BLOCKS}, 1, Arith{}); },
        "whether a layer's few chosen experts can have their panels spread over the threads (AVX-512 builds)");
  m.def("bf16_path", []() { return std::string(amx_ready() ? "amx" : HAVE_BF16_DOT ? "avx512-bf16" : "emulated"); },
        "how bfloat16 arithmetic runs here: AMX tiles, vdpbf16ps, or float32 FMAs on bfloat16 values (no faster)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) for float32 x, NaN included");
  m.def("stream_read", &stream_read, "read every byte of x once (the read-bandwidth probe)");
  m.def("dequantize_panels", &dequantize_panels, "quantized panels -> float32 [ceil(out/16), in, 16] panels");
  m.def("encode_kv", &encode_kv, "float32 [N, head_dim] rows stored as a KV format (the dtype of `like`)");
  m.def("quant_rows", &quant_rows, "rows `ids` of the [out, in] matrix quantized panels hold, float32");
  // module_local: two builds of this file (an A/B of a kernel change) can be loaded into one process
  pybind11::class_<NativeDecoder>(m, "NativeDecoder", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, std::string, double, double>())
      .def("add_layer", &NativeDecoder::add_layer)
      .def("set_moe", &NativeDecoder::set_moe)
      .def("set_shared_expert", &NativeDecoder::set_shared_expert)
      .def("set_clip_qkv", &NativeDecoder::set_clip_qkv)
      .def("set_key_scales", &NativeDecoder::set_key_scales)
      .def("set_head", &NativeDecoder::set_head)
      .def("set_qk_norm", &NativeDecoder::set_qk_norm)
      .def("set_post_norms", &NativeDecoder::set_post_norms)
      .def("set_local", &NativeDecoder::set_local)
      .def("set_softcap", &NativeDecoder::set_softcap)
      .def("set_int8_activations", &NativeDecoder::set_int8_activations)
      .def("set_bf16_prompts", &NativeDecoder::set_bf16_prompts)
      .def("set_int8_kv_dots", &NativeDecoder::set_int8_kv_dots)
      .def("set_split_threads", &NativeDecoder::set_split_threads)
      .def("int8_kv_dots", &NativeDecoder::int8_kv_dots)
      .def("num_layers", &NativeDecoder::num_layers)
      .def("set_profiling", &NativeDecoder::set_profiling, pybind11::arg("on"), pybind11::arg("prompts") = false)
      .def("profile", &NativeDecoder::profile)
      .def("forward", &NativeDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_parts", &NativeDecoder::forward_parts, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Attention>(m, "Attention", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, double>(), "heads, kv_heads, head_dim, scale")
      .def("set_softcap", &Attention::set_softcap)
      .def("set_int8_kv_dots", &Attention::set_int8_kv_dots)
      .def("set_bf16_prompts", &Attention::set_bf16_prompts)
      .def("set_split_threads", &Attention::set_split_threads)
      .def("int8_kv_dots", &Attention::int8_kv_dots)
      .def("attention_step", &Attention::attention_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
           py::arg("q"), py::arg("kv"), py::arg("layer"), py::arg("bias"), py::arg("seg_kv"), py::arg("seg_bias"),
           py::arg("seg_group"), py::arg("prompt") = false, py::arg("holes") = false);
}
