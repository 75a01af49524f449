// Small ops: argmax over logits, dot / axpy, norms, and tensor helpers.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

static bool is_nan(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// torch.argmax over the last dimension of float32 logits: the first index of the maximum, or of the first NaN
// (torch orders NaN above everything). Why: torch's CPU argmax over a 49k vocabulary cost a visible share of a
// decode step (docs/performance.md, "Figures behind the code's choices"). Two 8-lane states keep each lane's
// maximum and its first index; NaN is found through the bits, since -ffast-math lets the compiler assume float
// compares never see one.
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


}  // namespace
