// Quantized panels (GGUF's blocks of 32 along K, re-laid per panel): the block kinds and their kernels.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

// ---- quantized panels (quant="gguf" / "q8_0" / "q4_0"): GGUF's blocks of 32 along K, re-laid per panel ----
// A panel's K rows come in blocks of QK = 32, each holding its 16 columns' scales and quants. Three kinds, told
// apart by the tensor's dtype and block bytes (quant_kind):
//   Q8,  int8  [np, K/32, 576]:  float d[16] | int8 q[32][16]                                        w = d * q
//   Q4,  uint8 [np, K/32, 384]:  float d[16] | float m[16] | uint8 q[16][16], the low nibble row j and the
//                                 high nibble row j + 16 (GGUF's own order within a block)           w = d * q + m
//   Q8X, int8  [np, K/32, 704]:  float d0[16] | float d1[16] | float m[16] | int8 q[32][16]
//                                                                w = d0 * q + m (rows 0-15), d1 * q + m (16-31)
//   Q4H, uint8 [np, K/32, 320]:  fp16 d[16] | fp16 m[16] | Q4's nibbles: Q4_0 and Q4_1, whose scales (and Q4_0's
//                                 -8 d) GGUF stores in fp16 already: 0.625 bytes a weight against Q4's 0.75
// (Q4_0 is Q4 with m = -8 d; Q4_K is Q4 with d = d * sc_j, m = -dmin * m_j per 32-value sub-block. Q8X holds any
// of them: Q5_K (q in 0-31), Q6_K (q - 32 in -32..31, a scale per 16 values), and a fused matrix whose parts are
// of different types.) d * q is exact in float32 (d has at most 18 significant bits: an fp16 times a K-quant's 6-
// or 8-bit sub-block scale; q at most 6 beyond), so these are the very float32 weights the `gguf` package
// dequantizes, and a GEMM over them runs the float kernels above on a panel dequantized into a thread's buffer in
// L1/L2: the same arithmetic as quant="none", bit for bit, reading 4.3x (Q8), 2.9x (Q8X) or 7.1x (Q4) fewer bytes
// from memory.
// Why not torch's int8/int4 ops: measured here (2-core EPYC, AVX-512, the default model's GEMM shapes, 30 layers +
// lm_head, 2 threads), per token at M = 1: this file's fp32 panels 8.2 ms, MKL fp32 33.7, _weight_int8pack_mm 56.6,
// _weight_int4pack_mm_for_cpu 122.6; at M = 8: 12.7, 52.3, 457, 942.
constexpr int64_t QK = 32, Q8_BLOCK = 64 + QK * P, Q4_BLOCK = 128 + QK * P / 2, Q8X_BLOCK = 192 + QK * P;
constexpr int64_t Q4H_BLOCK = 64 + QK * P / 2;
enum QuantKind : int { KQ8 = 0, KQ4 = 1, KQ8X = 2, KQ4H = 3 };
constexpr int64_t KIND_BLOCK[4] = {Q8_BLOCK, Q4_BLOCK, Q8X_BLOCK, Q4H_BLOCK};
constexpr int64_t KIND_QUANTS[4] = {4 * P, 8 * P, 12 * P, 4 * P};  // where a block's quants start (bytes)
constexpr int64_t KIND_OFFSET[4] = {0, 4 * P, 8 * P, 2 * P};       // where its offsets m start (Q8: none)
constexpr bool has_offset(int kind) { return kind != KQ8; }
constexpr bool is_q4(int kind) { return kind == KQ4 || kind == KQ4H; }  // nibbles

// A block's 16 scales (or offsets) at byte `at`: float32, or fp16 in Q4H (widened: exact)
template <int KIND>
inline void scales_of(const uint8_t* blk, int64_t at, float* out) {
  if (KIND == KQ4H) {
    for (int c = 0; c < P; ++c) {
      uint16_t bits;
      std::memcpy(&bits, blk + at + 2 * c, 2);
      out[c] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    }
  } else {
    std::memcpy(out, blk + at, P * sizeof(float));
  }
}

// -1: not a quantized panel layout
inline int quant_kind_or_none(const torch::Tensor& w) {
  if (w.dim() != 3) return -1;
  const int64_t bytes = w.size(2);
  if (w.scalar_type() == torch::kChar) return bytes == Q8_BLOCK ? KQ8 : bytes == Q8X_BLOCK ? KQ8X : -1;
  if (w.scalar_type() == torch::kByte) return bytes == Q4_BLOCK ? KQ4 : bytes == Q4H_BLOCK ? KQ4H : -1;
  return -1;
}
inline QuantKind quant_kind(const torch::Tensor& w) { return static_cast<QuantKind>(quant_kind_or_none(w)); }
inline bool is_quant(const torch::Tensor& w) { return quant_kind_or_none(w) >= 0; }

template <int KIND>
inline void dequant_block(const uint8_t* blk, float* out) {  // out [32][16]
  float d[P], d1[P], m[P];
  scales_of<KIND>(blk, 0, d);
  if (KIND == KQ8X) std::memcpy(d1, blk + 4 * P, sizeof d1);
  if (has_offset(KIND)) scales_of<KIND>(blk, KIND_OFFSET[KIND], m);
  if (is_q4(KIND)) {
    const uint8_t* q = blk + KIND_QUANTS[KIND];
    for (int64_t j = 0; j < QK / 2; ++j)
      for (int64_t c = 0; c < P; ++c) {
        const uint8_t b = q[j * P + c];
        out[j * P + c] = d[c] * static_cast<float>(b & 15) + m[c];
        out[(j + QK / 2) * P + c] = d[c] * static_cast<float>(b >> 4) + m[c];
      }
    return;
  }
  const int8_t* q = reinterpret_cast<const int8_t*>(blk + KIND_QUANTS[KIND]);
  for (int64_t k = 0; k < QK; ++k)
    for (int64_t c = 0; c < P; ++c) {
      const float s = KIND == KQ8X && k >= QK / 2 ? d1[c] : d[c];
      out[k * P + c] = has_offset(KIND) ? s * static_cast<float>(q[k * P + c]) + m[c] : s * static_cast<float>(q[k * P + c]);
    }
}

inline void dequant_any(QuantKind kind, const uint8_t* blk, float* out) {
  switch (kind) {
    case KQ8: return dequant_block<KQ8>(blk, out);
    case KQ4: return dequant_block<KQ4>(blk, out);
    case KQ8X: return dequant_block<KQ8X>(blk, out);
    case KQ4H: return dequant_block<KQ4H>(blk, out);
  }
}

// Panels [p0, p0 + nb) of a quantized weight as float32 panels [nb][K][16] in `out`.
void dequant_panels(const torch::Tensor& wq, int64_t p0, int64_t nb, int64_t K, float* out) {
  const QuantKind kind = quant_kind(wq);
  const int64_t nblk = K / QK, bb = KIND_BLOCK[kind];
  const uint8_t* base = static_cast<const uint8_t*>(wq.data_ptr()) + p0 * nblk * bb;
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* blk = base + (j * nblk + b) * bb;
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk + 8 * bb + line);
      dequant_any(kind, blk, out + (j * K + b * QK) * P);
    }
}

#ifdef __AVX512F__
// 1-4 rows (decode) on AVX-512: the panel streams through registers, no buffer. Measured on the default model's
// GEMMs at M = 1 (30 layers + LM head, 2 threads, AVX-512 EPYC): dequantizing into a buffer first took 10.3 ms a
// token, dequantizing each weight in registers 3.3-3.6 ms. Applying each block's scale once (quant_panel_kernel
// below) instead of per weight made batch-4 decode 10-15 % faster (426-476 -> 473-531 tok/s over Q4_0, Q8_0 and
// Q4_1, two alternating runs each) and left batch 1 where it was (bound elsewhere). 5-8 rows (quant_block_kernel)
// keep the per-weight dequantization: bit for bit the float kernels' arithmetic.
inline v16 q8_ints(const uint8_t* q) {
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
template <int HIGH>
inline v16 q4_ints(const uint8_t* q) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  v = HIGH ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
  return (v16)_mm512_cvtepi32_ps(v);
}
// Row k of a block's quants as integers in float lanes: for Q4, rows 0-15 are the low nibbles of bytes 0-15 and
// rows 16-31 their high nibbles.
template <int KIND>
inline v16 block_ints(const uint8_t* blk, int k) {
  constexpr int64_t q = KIND_QUANTS[KIND];
  if (is_q4(KIND)) return k < QK / 2 ? q4_ints<0>(blk + q + k * P) : q4_ints<1>(blk + q + (k - QK / 2) * P);
  return q8_ints(blk + q + k * P);
}
// A block's 16 scales or offsets at byte `at`, in a register (Q4H's fp16 widened: exact)
template <int KIND>
inline v16 scale_vec(const uint8_t* blk, int64_t at) {
  if (KIND == KQ4H) return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + at)));
  return load16(reinterpret_cast<const float*>(blk + at));
}

// Software prefetch 8 blocks ahead only where a block has enough arithmetic to hide it (3 or more rows): at 1-2
// rows it competed with the hardware prefetcher. Measured on the 2-core EPYC, default model (Q4_1 layers, Q8_0
// head), batch-1 decode, 5 whole-process A/B pairs, medians: int8 activations 189 -> 211 tok/s without it, float
// activations 199 -> 207; at batch 8 (int8 activations) dropping it cost 8 % (688 -> 630), so it stays there.
constexpr bool prefetches_ahead(int rows) { return rows > 2; }

// The block's scale (and offset) is applied once per 32 rows (Q8X's scales once per 16): sum_k x_k (d q_k + m) =
// d sum_k x_k q_k + m sum_k x_k, with the row sums of x per block computed once per GEMM (xsum). One operation
// fewer per 16 weights than dequantizing each; the same value up to float rounding (activations stay float32).
// Two accumulator chains per row: even/odd k, or for Q8X the two 16-row halves, interleaved.
template <int MB, int KIND>
void quant_panel_kernel(const float* x, int64_t ldx, const uint8_t* wq, int64_t K, const float* bias, float* y,
                        int64_t ldy, int64_t nw, bool accumulate, const float* xsum) {
  v16 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = v16{};
  constexpr int64_t bb = KIND_BLOCK[KIND];
  const int64_t nblk = K / QK;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = wq + b * bb;
    if (prefetches_ahead(MB))
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk + 8 * bb + line);
    const v16 d = scale_vec<KIND>(blk, 0);
    const float* xb = x + b * QK;
    v16 s0[MB], s1[MB];
    for (int i = 0; i < MB; ++i) s0[i] = s1[i] = v16{};
    if (KIND == KQ8X) {
      for (int k = 0; k < QK / 2; ++k) {
        const v16 w0 = block_ints<KIND>(blk, k), w1 = block_ints<KIND>(blk, k + QK / 2);
        for (int i = 0; i < MB; ++i) {
          s0[i] += xb[i * ldx + k] * w0;
          s1[i] += xb[i * ldx + k + QK / 2] * w1;
        }
      }
      const v16 d1 = load16(reinterpret_cast<const float*>(blk + 4 * P));
      const v16 m = load16(reinterpret_cast<const float*>(blk + 8 * P));
      for (int i = 0; i < MB; ++i) acc[i] += d * s0[i] + d1 * s1[i] + m * xsum[i * nblk + b];
      continue;
    }
    for (int k = 0; k < QK; k += 2) {
      const v16 w0 = block_ints<KIND>(blk, k), w1 = block_ints<KIND>(blk, k + 1);
      for (int i = 0; i < MB; ++i) {
        s0[i] += xb[i * ldx + k] * w0;
        s1[i] += xb[i * ldx + k + 1] * w1;
      }
    }
    if (has_offset(KIND)) {
      const v16 m = scale_vec<KIND>(blk, KIND_OFFSET[KIND]);
      for (int i = 0; i < MB; ++i) acc[i] += d * (s0[i] + s1[i]) + m * xsum[i * nblk + b];
    } else {
      for (int i = 0; i < MB; ++i) acc[i] += d * (s0[i] + s1[i]);
    }
  }
  const v16 bv = load_bias(bias, nw);
  for (int i = 0; i < MB; ++i) store_out(y + i * ldy, acc[i] + bv, nw, accumulate);
}

// 5-8 rows against NB panels, dequantized in registers: one accumulator chain per (row, column) over k in order,
// as block_kernel runs it (which panels share a pass does not change any sum), so again bit for bit.
template <int MB, int NB, int KIND>
void quant_block_kernel(const float* x, int64_t ldx, const uint8_t* wq, int64_t panel_bytes, int64_t K,
                        const float* bias, float* y, int64_t ldy, int64_t nw, bool accumulate) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  constexpr int64_t bb = KIND_BLOCK[KIND];
  const int64_t nblk = K / QK;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk[NB];
    v16 d[NB], m[NB];  // Q8X: rows 0-15's scales, then 16-31's
    for (int j = 0; j < NB; ++j) {
      blk[j] = wq + j * panel_bytes + b * bb;
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk[j] + 4 * bb + line);
      d[j] = scale_vec<KIND>(blk[j], 0);
      m[j] = has_offset(KIND) ? scale_vec<KIND>(blk[j], KIND_OFFSET[KIND]) : v16{};
    }
    const float* xb = x + b * QK;
    for (int k = 0; k < QK; ++k) {
      if (KIND == KQ8X && k == QK / 2)
        for (int j = 0; j < NB; ++j) d[j] = load16(reinterpret_cast<const float*>(blk[j] + 4 * P));
      v16 w[NB];
      for (int j = 0; j < NB; ++j) {
        const v16 q = block_ints<KIND>(blk[j], k);
        if (has_offset(KIND))
          w[j] = (v16)_mm512_fmadd_ps((__m512)d[j], (__m512)q, (__m512)m[j]);  // d q is exact: one rounding
        else
          w[j] = d[j] * q;
      }
      for (int i = 0; i < MB; ++i) {
        const float xi = xb[i * ldx + k];
        for (int j = 0; j < NB; ++j) acc[i][j] += xi * w[j];
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t width = j == NB - 1 ? nw : P;
    const v16 bv = load_bias(bias == nullptr ? nullptr : bias + j * P, width);
    for (int i = 0; i < MB; ++i) store_out(y + i * ldy + j * P, acc[i][j] + bv, width, accumulate);
  }
}

using QuantBlockKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*,
                                  int64_t, int64_t, bool);
// 5-8 rows x 1-3 panels: Q8 takes three panels a pass (24 accumulators, 3 weight rows, 3 scales), the others two
// (their offsets or second scales take registers too)
template <int KIND>
constexpr QuantBlockKernel QUANT_WIDE_KERNELS[12] = {
    quant_block_kernel<5, 1, KIND>, quant_block_kernel<5, 2, KIND>, quant_block_kernel<5, 3, KIND>,
    quant_block_kernel<6, 1, KIND>, quant_block_kernel<6, 2, KIND>, quant_block_kernel<6, 3, KIND>,
    quant_block_kernel<7, 1, KIND>, quant_block_kernel<7, 2, KIND>, quant_block_kernel<7, 3, KIND>,
    quant_block_kernel<8, 1, KIND>, quant_block_kernel<8, 2, KIND>, quant_block_kernel<8, 3, KIND>};
constexpr const QuantBlockKernel* WIDE_BY_KIND[4] = {QUANT_WIDE_KERNELS<KQ8>, QUANT_WIDE_KERNELS<KQ4>,
                                                     QUANT_WIDE_KERNELS<KQ8X>, QUANT_WIDE_KERNELS<KQ4H>};

using QuantPanelKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                                  int64_t, bool, const float*);
template <int KIND>
constexpr QuantPanelKernel QUANT_ROW_KERNELS[4] = {quant_panel_kernel<1, KIND>, quant_panel_kernel<2, KIND>,
                                                   quant_panel_kernel<3, KIND>, quant_panel_kernel<4, KIND>};
constexpr const QuantPanelKernel* ROWS_BY_KIND[4] = {QUANT_ROW_KERNELS<KQ8>, QUANT_ROW_KERNELS<KQ4>,
                                                     QUANT_ROW_KERNELS<KQ8X>, QUANT_ROW_KERNELS<KQ4H>};
#endif

}  // namespace
