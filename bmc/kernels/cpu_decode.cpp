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
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int P = 16;  // panel width: one AVX-512 register of float32 (GCC splits it on narrower ISAs)
// Software prefetch distance in panel rows (64 B each): at M = 8 the FMAs per cache line slow the stream enough
// that the hardware prefetcher falls behind; 4 KiB ahead measured 12 vs 10 GB/s here (M = 1: 15 either way).
constexpr int64_t PREFETCH_ROWS = 64;
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int i = 0; i < P; ++i) s += v[i];
  return s;
#endif
}
// Sixteen dot-product partials v[0..15] (one per key) -> one vector of their sixteen sums: a transposing
// reduction tree (15 shuffle pairs + adds) instead of sixteen horizontal sums. fold<h> adds lane pairs h apart,
// taking keys from a where (lane mod 2h) < h and from b elsewhere.
inline v16 fold1(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline v16 fold2(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline v16 fold4(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline v16 fold8(v16 a, v16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline v16 sum16(const v16* v) {
  v16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) c[i] = fold1(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) d[i] = fold2(c[2 * i], c[2 * i + 1]);
  for (int i = 0; i < 2; ++i) e[i] = fold4(d[2 * i], d[2 * i + 1]);
  return fold8(e[0], e[1]);
}

inline v16 load_part(const float* p, int64_t n) {  // n < P lanes, the rest zero
  float tmp[P] = {0};
  std::memcpy(tmp, p, n * sizeof(float));
  return load16(tmp);
}

// y[MB rows][16] (+)= x[MB rows][K] @ panel[K][16] (+ bias); two partial sums over k halve the FMA chains.
template <int MB>
void panel_kernel(const float* x, int64_t ldx, const float* wp, int64_t K, const float* bias, float* y,
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
  const v16 b = bias == nullptr ? v16{} : nw == P ? load16(bias) : load_part(bias, nw);
  for (int i = 0; i < MB; ++i) {
    v16 r = (a0[i] + a1[i]) + b;
    float* out = y + i * ldy;
    if (nw == P) {
      store16(out, accumulate ? load16(out) + r : r);
    } else {
      for (int64_t j = 0; j < nw; ++j) out[j] = accumulate ? out[j] + r[j] : r[j];
    }
  }
}

void rows_kernel(int64_t mb, const float* x, int64_t ldx, const float* wp, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t nw, bool acc) {
  switch (mb) {
    case 1: return panel_kernel<1>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 2: return panel_kernel<2>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 3: return panel_kernel<3>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 4: return panel_kernel<4>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 5: return panel_kernel<5>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 6: return panel_kernel<6>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 7: return panel_kernel<7>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    default: return panel_kernel<8>(x, ldx, wp, K, bias, y, ldy, nw, acc);
  }
}

// y[M, N] (+)= x[M, K] @ W (+ bias) with W packed [ceil(N/16), K, 16] and x rows ldx apart; threads split the
// panels, so each streams its own contiguous part of W.
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const torch::Tensor& wp, int64_t N, const float* bias, float* y,
          bool accumulate) {
  const int64_t np = wp.size(0);
  const float* w = wp.data_ptr<float>();
  at::parallel_for(0, np, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_kernel(std::min<int64_t>(8, M - m0), x + m0 * ldx, ldx, w + p * K * P, K,
                    bias == nullptr ? nullptr : bias + n0, y + m0 * N + n0, N, nw, accumulate);
    }
  });
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

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& wp, int64_t N,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && wp.dim() == 3 && wp.size(2) == P, "panel_linear: float32, packed");
  auto xc = x.contiguous();
  const int64_t K = xc.size(-1), M = xc.numel() / K;
  TORCH_CHECK(wp.size(1) == K && wp.size(0) * P >= N, "panel_linear: weight does not match x");
  auto y = torch::empty({M, N}, xc.options());
  gemm(xc.data_ptr<float>(), K, M, K, wp, N, bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
       false);
  return y;
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

struct Segment {  // a shared prefix: KV of `groups` groups, each row reading group[b]
  const float* kv;
  const float* bias;
  const int64_t* group;
  int64_t groups, len;
};

struct Layer {
  torch::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // *_b undefined for RMSNorm
  torch::Tensor qkv, o, up, down;            // panels; up = fused gate|up (gated MLP) or fc1
  torch::Tensor qkv_b, o_b, up_b, down_b;    // optional biases
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
    TORCH_CHECK(act_ == "silu" || act_ == "relu" || act_ == "gelu", "activation ", act_, " not supported");
  }

  void add_layer(const torch::Tensor& ln1_w, const torch::Tensor& ln1_b, const torch::Tensor& qkv,
                 const torch::Tensor& qkv_b, const torch::Tensor& o, const torch::Tensor& o_b,
                 const torch::Tensor& ln2_w, const torch::Tensor& ln2_b, const torch::Tensor& up,
                 const torch::Tensor& up_b, const torch::Tensor& down, const torch::Tensor& down_b) {
    const int64_t nq = (h_ + 2 * kvh_) * hd_, nu = gated_ ? 2 * I_ : I_;
    TORCH_CHECK(qkv.size(0) == D_ && qkv.size(1) == nq && o.size(0) == h_ * hd_ && o.size(1) == D_ &&
                    up.size(0) == D_ && up.size(1) == nu && down.size(0) == I_ && down.size(1) == D_,
                "add_layer: weight shapes do not match the decoder");
    layers_.push_back(Layer{f32(ln1_w), f32(ln1_b), f32(ln2_w), f32(ln2_b), pack_panels(qkv), pack_panels(o),
                            pack_panels(up), pack_panels(down), f32(qkv_b), f32(o_b), f32(up_b), f32(down_b)});
  }

  void set_head(const torch::Tensor& norm_w, const torch::Tensor& norm_b, const torch::Tensor& lm_head) {
    TORCH_CHECK(lm_head.size(0) == D_, "lm_head: [hidden, vocab]");
    norm_w_ = f32(norm_w);
    norm_b_ = f32(norm_b);
    vocab_ = lm_head.size(1);
    head_ = pack_panels(lm_head);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Seconds per phase over the decode steps (t = 1) run since profiling was switched on (the paper's Table IV).
  void set_profiling(bool on) {
    profiling_ = on;
    std::fill(std::begin(phase_s_), std::end(phase_s_), 0.0);
  }
  std::map<std::string, double> profile() const {
    return {{"kv_write_s", phase_s_[0]}, {"attention_s", phase_s_[1]}, {"other_s", phase_s_[2]}};
  }

  // x [B, t, D] (embedded inputs, overwritten), kv [L, 2, B, H_kv, cap, d] written at columns [start, start+t),
  // bias [B, 1, 1 or t, cap] additive, cos / sin_signed [B, t, d] or empty (no RoPE). Returns logits
  // [B, t or 1, vocab].
  // Shared segments (optional): seg_kv[i] [L, 2, groups, H_kv, len, d], seg_bias[i] [groups, 1, 1, len],
  // seg_group[i] [B] int64, the group each row reads.
  torch::Tensor forward(torch::Tensor x, torch::Tensor kv, torch::Tensor bias, torch::Tensor cos, torch::Tensor sin,
                        int64_t start, bool all_logits, std::vector<torch::Tensor> seg_kv,
                        std::vector<torch::Tensor> seg_bias, std::vector<torch::Tensor> seg_group) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat && kv.scalar_type() == torch::kFloat, "float32 only");
    TORCH_CHECK(kv.is_contiguous() && kv.dim() == 6 && kv.size(0) == num_layers() && kv.size(1) == 2 &&
                    kv.size(3) == kvh_ && kv.size(5) == hd_,
                "kv: a contiguous [L, 2, B, H_kv, cap, d] cache of this decoder");
    const int64_t B = x.size(0), t = x.size(1), M = B * t, cap = kv.size(4);
    TORCH_CHECK(kv.size(2) == B && start + t <= cap, "kv: batch or capacity does not fit the step");
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(-1) == cap && (bias.size(2) == 1 || bias.size(2) == t), "bias shape");
    x = x.contiguous();
    bias = bias.to(torch::kFloat).contiguous();
    TORCH_CHECK(seg_kv.size() == seg_bias.size() && seg_kv.size() == seg_group.size(), "segments: kv, bias, group");
    std::vector<Segment> segs;
    for (size_t n = 0; n < seg_kv.size(); ++n) {
      seg_kv[n] = seg_kv[n].contiguous();
      seg_bias[n] = seg_bias[n].to(torch::kFloat).contiguous();
      seg_group[n] = seg_group[n].to(torch::kLong).contiguous();
      const auto& sk = seg_kv[n];
      TORCH_CHECK(sk.scalar_type() == torch::kFloat && sk.dim() == 6 && sk.size(0) == num_layers() &&
                      sk.size(3) == kvh_ && sk.size(5) == hd_ && seg_bias[n].numel() == sk.size(2) * sk.size(4) &&
                      seg_group[n].numel() == B,
                  "segment ", n, ": shapes do not match the decoder and batch");
      segs.push_back(Segment{sk.data_ptr<float>(), seg_bias[n].data_ptr<float>(), seg_group[n].data_ptr<int64_t>(),
                             sk.size(2), sk.size(4)});
    }
    const bool rope = cos.numel() > 0;
    if (rope) {
      TORCH_CHECK(cos.numel() == M * hd_ && sin.numel() == M * hd_, "cos / sin: [B, t, head_dim]");
      cos = cos.contiguous();
      sin = sin.contiguous();
    }
    const int64_t nq = (h_ + 2 * kvh_) * hd_, nu = gated_ ? 2 * I_ : I_;
    auto opts = x.options();
    auto hbuf = torch::empty({M, D_}, opts), qkv = torch::empty({M, nq}, opts);
    auto attn = torch::empty({M, h_ * hd_}, opts), mid = torch::empty({M, nu}, opts);
    float *xp = x.data_ptr<float>(), *hp = hbuf.data_ptr<float>(), *qp = qkv.data_ptr<float>();
    float *ap = attn.data_ptr<float>(), *mp = mid.data_ptr<float>();
    const int64_t layer_stride = 2 * B * kvh_ * cap * hd_;
    Clock clock(profiling_ && t == 1, phase_s_);  // decode steps only
    for (int64_t l = 0; l < num_layers(); ++l) {
      const Layer& L = layers_[l];
      norm(xp, L.ln1_w, L.ln1_b, hp, M);
      gemm(hp, D_, M, D_, L.qkv, nq, ptr(L.qkv_b), qp, false);
      if (rope) apply_rope(qp, M, nq, cos.data_ptr<float>(), sin.data_ptr<float>());
      float* kc = kv.data_ptr<float>() + l * layer_stride;
      float* vc = kc + layer_stride / 2;
      clock.lap(2);
      write_kv(qp, nq, kc, vc, B, t, cap, start);
      clock.lap(0);
      attention(l, qp, nq, kc, vc, cap, bias.data_ptr<float>(), bias.size(2), B, t, segs, ap);
      clock.lap(1);
      gemm(ap, h_ * hd_, M, h_ * hd_, L.o, D_, ptr(L.o_b), xp, true);
      norm(xp, L.ln2_w, L.ln2_b, hp, M);
      gemm(hp, D_, M, D_, L.up, nu, ptr(L.up_b), mp, false);
      activate(mp, M);
      gemm(mp, nu, M, I_, L.down, D_, ptr(L.down_b), xp, true);
    }
    const int64_t t_out = all_logits ? t : 1;
    auto last = torch::empty({B * t_out, D_}, opts);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < t_out; ++i) {
        const float* row = xp + (b * t + (all_logits ? i : t - 1)) * D_;
        float* out = last.data_ptr<float>() + (b * t_out + i) * D_;
        if (norm_w_.defined())
          norm(row, norm_w_, norm_b_, out, 1);
        else
          std::memcpy(out, row, D_ * sizeof(float));
      }
    auto logits = torch::empty({B * t_out, vocab_}, opts);
    gemm(last.data_ptr<float>(), D_, B * t_out, D_, head_, vocab_, nullptr, logits.data_ptr<float>(), false);
    clock.lap(2);
    return logits.view({B, t_out, vocab_});
  }

 private:
  void norm(const float* x, const torch::Tensor& w, const torch::Tensor& b, float* out, int64_t rows) const {
    for (int64_t m = 0; m < rows; ++m) {
      if (rms_)
        rms_norm(x + m * D_, w.data_ptr<float>(), out + m * D_, D_, eps_);
      else
        layer_norm(x + m * D_, w.data_ptr<float>(), b.data_ptr<float>(), out + m * D_, D_, eps_);
    }
  }

  // x*cos + roll(x, d/2)*sin_signed on every query and key head (values follow them in each row)
  void apply_rope(float* qkv, int64_t M, int64_t nq, const float* cos, const float* sin) const {
    const int64_t half = hd_ / 2;
    std::vector<float> tmp(hd_);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t head = 0; head < h_ + kvh_; ++head) {
        float* v = qkv + m * nq + head * hd_;
        std::memcpy(tmp.data(), v, hd_ * sizeof(float));
        const float *c = cos + m * hd_, *s = sin + m * hd_;
        for (int64_t j = 0; j < hd_; ++j) v[j] = tmp[j] * c[j] + tmp[(j + half) % hd_] * s[j];
      }
  }

  void write_kv(const float* qkv, int64_t nq, float* kc, float* vc, int64_t B, int64_t t, int64_t cap,
                int64_t start) const {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < t; ++i) {
        const float* row = qkv + (b * t + i) * nq;
        for (int64_t kh = 0; kh < kvh_; ++kh) {
          const int64_t at = ((b * kvh_ + kh) * cap + start + i) * hd_;
          std::memcpy(kc + at, row + (h_ + kh) * hd_, hd_ * sizeof(float));
          std::memcpy(vc + at, row + (h_ + kvh_ + kh) * hd_, hd_ * sizeof(float));
        }
      }
  }

  // softmax(q K^T * scale + bias) V per (KV head, row) over the row's shared segments (Hydragen's prefixes,
  // stored once per group) followed by its own cache's whole capacity: one softmax over all of them, so no
  // log-sum-exp merge is needed. The G*t query rows of a KV head share each K/V row read; rows of a group are
  // visited one after the other for a head, so its prefix block is read from DRAM once and then from cache.
  void attention(int64_t l, const float* qkv, int64_t nq, const float* kc, const float* vc, int64_t cap,
                 const float* bias, int64_t bias_rows, int64_t B, int64_t t, const std::vector<Segment>& segs,
                 float* out) const {
    const int64_t G = h_ / kvh_, R = G * t;
    const float scale = static_cast<float>(scale_);
    int64_t total = cap;
    for (const Segment& sg : segs) total += sg.len;
    at::parallel_for(0, B * kvh_, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(R * total);
      std::vector<const float*> q(R);
      std::vector<float*> o(R);
      std::vector<int64_t> query(R);
      std::vector<Block> blocks(segs.size() + 1);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kh = task / B, b = task % B;  // rows of one head consecutively: shared blocks stay cached
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < t; ++i) {
            q[g * t + i] = qkv + (b * t + i) * nq + (kh * G + g) * hd_;
            o[g * t + i] = out + (b * t + i) * h_ * hd_ + (kh * G + g) * hd_;
            query[g * t + i] = i;
          }
        for (size_t n = 0; n < segs.size(); ++n) {
          const Segment& sg = segs[n];
          const int64_t grp = sg.group[b], head = (sg.groups * 2 * l) * kvh_;  // [L, 2, groups, H, len, d]
          const float* k = sg.kv + ((head + grp * kvh_ + kh) * sg.len) * hd_;
          blocks[n] = Block{k, k + sg.groups * kvh_ * sg.len * hd_, sg.len, sg.bias + grp * sg.len, 0};
        }
        const int64_t own = (b * kvh_ + kh) * cap * hd_;
        blocks.back() = Block{kc + own, vc + own, cap, bias + b * bias_rows * cap, bias_rows > 1 ? cap : 0};
        switch (hd_) {
          case 64: attend<4>(q.data(), query.data(), o.data(), R, blocks, total, scale, p.data()); break;
          case 128: attend<8>(q.data(), query.data(), o.data(), R, blocks, total, scale, p.data()); break;
          default: attend_any(q.data(), query.data(), o.data(), R, blocks, total, scale, p.data());
        }
      }
    });
  }

  struct Block {  // K/V rows [n, d] and the additive bias of query i at bias + i * bias_stride
    const float *K, *V;
    int64_t n;
    const float* bias;
    int64_t bias_stride;
  };

  // head_dim = 16 * NV: q and each K/V row held in NV registers, up to 4 output rows accumulated in registers
  template <int NV>
  static void attend(const float* const* q, const int64_t* query, float* const* o, int64_t R,
                     const std::vector<Block>& blocks, int64_t total, float scale, float* p) {
    for (int64_t r = 0; r < R; ++r) {
      v16 qr[NV];
      for (int j = 0; j < NV; ++j) qr[j] = load16(q[r] + P * j) * scale;
      float* pr = p + r * total;
      for (const Block& blk : blocks) {
        const float* br = blk.bias + query[r] * blk.bias_stride;
        int64_t s = 0;
        for (; s + P <= blk.n; s += P) {  // 16 keys at a time, summed by one transposing reduction
          v16 part[P];
          for (int kk = 0; kk < P; ++kk) {
            const float* k = blk.K + (s + kk) * P * NV;
            part[kk] = qr[0] * load16(k);
            for (int j = 1; j < NV; ++j) part[kk] += qr[j] * load16(k + P * j);
          }
          store16(pr + s, sum16(part) + load16(br + s));
        }
        for (; s < blk.n; ++s) {
          const float* k = blk.K + s * P * NV;
          v16 a = qr[0] * load16(k);
          for (int j = 1; j < NV; ++j) a += qr[j] * load16(k + P * j);
          pr[s] = hsum(a) + br[s];
        }
        pr += blk.n;
      }
    }
    std::vector<float> inv(R);
    softmax_rows(p, R, total, inv.data());
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      switch (std::min<int64_t>(4, R - r0)) {
        case 1: weigh<NV, 1>(p + r0 * total, total, blocks, inv.data() + r0, o + r0); break;
        case 2: weigh<NV, 2>(p + r0 * total, total, blocks, inv.data() + r0, o + r0); break;
        case 3: weigh<NV, 3>(p + r0 * total, total, blocks, inv.data() + r0, o + r0); break;
        default: weigh<NV, 4>(p + r0 * total, total, blocks, inv.data() + r0, o + r0);
      }
    }
  }

  template <int NV, int RC>  // o[r] = inv[r] * sum_s p[r][s] V[s] for RC rows
  static void weigh(const float* p, int64_t total, const std::vector<Block>& blocks, const float* inv,
                    float* const* o) {
    v16 acc[RC][NV];
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = v16{};
    for (const Block& blk : blocks) {
      for (int64_t s = 0; s < blk.n; ++s) {
        v16 v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load16(blk.V + s * P * NV + P * j);
        for (int r = 0; r < RC; ++r) {
          const float w = p[r * total + s];
          for (int j = 0; j < NV; ++j) acc[r][j] += w * v[j];
        }
      }
      p += blk.n;
    }
    for (int r = 0; r < RC; ++r)
      for (int j = 0; j < NV; ++j) store16(o[r] + P * j, acc[r][j] * inv[r]);
  }

  void attend_any(const float* const* q, const int64_t* query, float* const* o, int64_t R,
                  const std::vector<Block>& blocks, int64_t total, float scale, float* p) const {  // any head_dim
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p + r * total;
      for (const Block& blk : blocks) {
        const float* br = blk.bias + query[r] * blk.bias_stride;
        for (int64_t s = 0; s < blk.n; ++s) pr[s] = dot(q[r], blk.K + s * hd_, hd_) * scale + br[s];
        pr += blk.n;
      }
    }
    std::vector<float> inv(R);
    softmax_rows(p, R, total, inv.data());
    for (int64_t r = 0; r < R; ++r) {
      std::fill(o[r], o[r] + hd_, 0.0f);
      const float* pr = p + r * total;
      for (const Block& blk : blocks) {
        for (int64_t s = 0; s < blk.n; ++s) axpy(o[r], pr[s], blk.V + s * hd_, hd_);
        pr += blk.n;
      }
      for (int64_t j = 0; j < hd_; ++j) o[r][j] *= inv[r];
    }
  }

  static void softmax_rows(float* p, int64_t R, int64_t cap, float* inv) {
    for (int64_t r = 0; r < R; ++r) {
      float* row = p + r * cap;
      float mx = row[0];
      for (int64_t s = 1; s < cap; ++s) mx = std::max(mx, row[s]);
      float sum = 0.0f;
      for (int64_t s = 0; s < cap; ++s) {
        row[s] = std::exp(row[s] - mx);
        sum += row[s];
      }
      inv[r] = 1.0f / sum;
    }
  }

  void activate(float* mid, int64_t M) const {
    const int64_t n = gated_ ? 2 * I_ : I_;
    for (int64_t m = 0; m < M; ++m) {
      float* row = mid + m * n;
      if (gated_) {  // silu(gate) * up, written over the gate half (the down GEMM reads rows of stride 2I)
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
  double phase_s_[3] = {0.0, 0.0, 0.0};  // KV writes, attention, the rest (norms, GEMMs, RoPE, lm_head)
  int64_t D_, h_, kvh_, hd_, I_;
  bool rms_, gated_;
  std::string act_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  torch::Tensor norm_w_, norm_b_, head_;
  int64_t vocab_ = 0;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "[in, out] float32 -> [ceil(out/16), in, 16] panels");
  m.def("panel_linear", &panel_linear, "x @ W (+ b) with W packed by pack_panels");
  pybind11::class_<NativeDecoder>(m, "NativeDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, std::string, double, double>())
      .def("add_layer", &NativeDecoder::add_layer)
      .def("set_head", &NativeDecoder::set_head)
      .def("num_layers", &NativeDecoder::num_layers)
      .def("set_profiling", &NativeDecoder::set_profiling)
      .def("profile", &NativeDecoder::profile)
      .def("forward", &NativeDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
