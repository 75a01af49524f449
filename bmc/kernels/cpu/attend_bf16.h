// bfloat16 arithmetic for a prompt's attention (activations="bfloat16"): a chunk's scores q.k and weighted values
// sum_j p_j v_j as products of bfloat16 pairs summed in float32, on gemm_bf16.h's kernels (AMX tiles, vdpbf16ps,
// or float32 FMAs on the widened pairs); the softmax, its running state and the outputs stay float32.
// Bound (docs/design.md, "Precision modes"): a score within (2^-7 + 2^-16 + d 2^-24) sum_e |q_e k_e| (times the
// scale) of exact, each weight and value rounded once more (2^-8 relative each) before their products.
// A row's arithmetic is its own: the same bits whatever rows, and how many, are attended beside it.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

// A thread's buffers for one task's rows: their query pairs (set once a task), a chunk's keys and values as panels
// of pairs, the chunk's weights as pairs and the weighed values.
struct Bf16Chunk {
  int64_t hd = 0, q2 = 0, rows = 0;  // head_dim, query pairs a row (hd / 2), rows the buffers hold (16s)
  std::vector<uint32_t> q, kt, w, vt;
  std::vector<float> y;
  Bf16Chunk(int64_t rmax, int64_t head_dim)
      : hd(head_dim), q2(head_dim / 2), rows((rmax + P - 1) / P * P), q(rows * q2), kt(OWN_KEYS / P * q2 * P),
        w(rows * (OWN_KEYS / 2)), vt(head_dim / P * (OWN_KEYS / 2) * P), y(rows * std::max<int64_t>(OWN_KEYS, head_dim)) {}

  // The task's query rows as pairs; rows past R zero (AMX reads whole tiles)
  void set_queries(const float* const* q_rows, int64_t R) {
    for (int64_t r = 0; r < rows; ++r) {
      if (r < R)
        x_pairs(q_rows[r], hd, q2, q.data() + r * q2);
      else
        std::fill(q.data() + r * q2, q.data() + (r + 1) * q2, 0u);
    }
  }

  // Keys [n][hd] as OWN_KEYS / 16 panels [q2][16] of pairs (lane c: key c's dims 2e, 2e + 1); keys past n zero.
  // Each key row is paired where it lies, then 16 x 16 blocks of pairs are transposed in registers.
  void set_keys(const float* K, int64_t n) {
    alignas(64) uint32_t tmp[P * 64];  // 16 keys x 64 pairs: head_dim 128 at a time
    for (int64_t j0 = 0; j0 < OWN_KEYS; j0 += P) {
      uint32_t* panel = kt.data() + j0 * q2;
      for (int64_t e0 = 0; e0 < q2; e0 += 64) {
        const int64_t width = std::min<int64_t>(64, q2 - e0);
        for (int64_t c = 0; c < P; ++c) {
          if (j0 + c < n)
            x_pairs(K + (j0 + c) * hd + 2 * e0, 2 * width, width, tmp + c * 64);
          else
            std::fill(tmp + c * 64, tmp + c * 64 + width, 0u);
        }
        for (int64_t b = 0; b < width; b += P) {
          v16 x[P];
          for (int c = 0; c < P; ++c) x[c] = load16(reinterpret_cast<const float*>(tmp + c * 64 + b));
          transpose16(x);  // lane shuffles only: the bits move as they are
          for (int e = 0; e < P; ++e) store16(reinterpret_cast<float*>(panel + (e0 + b + e) * P), x[e]);
        }
      }
    }
  }

  // Values [n][hd] as hd / 16 panels [OWN_KEYS / 2][16] of pairs (lane c: dim c of keys 2j, 2j + 1); past n zero
  void set_values(const float* V, int64_t n) {
    constexpr int64_t K2 = OWN_KEYS / 2;
    alignas(64) static const float zero[P] = {};
    for (int64_t d0 = 0; d0 < hd; d0 += P) {
      uint32_t* panel = vt.data() + d0 / P * K2 * P;
      for (int64_t j2 = 0; j2 < K2; ++j2) {
        const float* a = 2 * j2 < n ? V + 2 * j2 * hd + d0 : zero;
        const float* b = 2 * j2 + 1 < n ? V + (2 * j2 + 1) * hd + d0 : zero;
        pair_up(a, b, panel + j2 * P);
      }
    }
  }
};

// y[M][N] = x pairs [M][K2] @ panels [ceil(N / 16)][K2][16] of pairs, one thread: AMX tiles where the CPU has them
// (x holds M rounded up to 16 rows, K2 a multiple of 16), else blocks of up to 6 rows x 4 panels. Each y element
// sums its pairs in one order whatever M (the tiles and blocks keep rows apart).
inline void bf16_products(const uint32_t* x, int64_t M, int64_t K2, const uint32_t* w, int64_t N, float* y,
                          int64_t ldy) {
  const int64_t panels = (N + P - 1) / P;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
  if (amx_ready()) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    alignas(64) float c[32 * 32];
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int64_t mt = M - m0 > 16 ? 2 : 1, rows = std::min<int64_t>(32, M - m0);
      for (int64_t j = 0; j < panels; j += 2) {
        const int64_t nt = panels - j > 1 ? 2 : 1;
        AMX_KERNELS[(mt - 1) * 2 + nt - 1](x + m0 * K2, 16 * K2, 1, K2, w + j * K2 * P, K2, c);
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t n0 = (j + t) * P, width = std::min<int64_t>(P, N - n0);
          for (int64_t i = 0; i < rows; ++i) std::memcpy(y + (m0 + i) * ldy + n0, c + i * nt * P + t * P, width * 4);
        }
      }
    }
    _tile_release();
    return;
  }
#endif
  for (int64_t j0 = 0; j0 < panels; j0 += 4) {
    const int64_t nb = std::min<int64_t>(4, panels - j0), nw = std::min<int64_t>(P, N - (j0 + nb - 1) * P);
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const int64_t mb = std::min<int64_t>(6, M - m0);
      BF16_KERNELS[(mb - 1) * 4 + nb - 1](x + m0 * K2, K2, w + j0 * K2 * P, K2, nullptr, y + m0 * ldy + j0 * P, ldy,
                                          nw, false);
    }
  }
}

}  // namespace
