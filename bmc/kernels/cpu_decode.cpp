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

#include "cpu/simd.h"
#include "cpu/gemm.h"
#include "cpu/quant.h"
#include "cpu/vnni.h"
#include "cpu/linear.h"
#include "cpu/ops.h"
#include "cpu/kv_format.h"

namespace {

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
