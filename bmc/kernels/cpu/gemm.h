// Float GEMM panels: y (+)= x @ W with W packed [ceil(N/16), K, 16], rows kept in registers.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {


// The GEMM kernels' epilogue: a panel's bias (its first `width` columns; none: zero), and one row's result r
// written to (or added into) its first `width` output columns.
inline v16 load_bias(const float* bias, int64_t width) {
  return bias == nullptr ? v16{} : width == P ? load16(bias) : load_part(bias, width);
}
inline void store_out(float* out, v16 r, int64_t width, bool accumulate) {
  if (width == P) {
    store16(out, accumulate ? load16(out) + r : r);
  } else {
    for (int64_t c = 0; c < width; ++c) out[c] = accumulate ? out[c] + r[c] : r[c];
  }
}

// y[MB rows][16] (+)= x[MB rows][K] @ panel[K][16] (+ bias). Each output is one FMA chain over k in order, as in
// block_kernel, so a row's result does not depend on the rows beside it (two partial sums over k here once made
// the 1-4 row calls sum apart from the 5+ row ones; one chain keeps up with the weight stream).
template <int MB, typename W>
void panel_kernel(const float* x, int64_t ldx, const W* wp, int64_t K, const float* bias, float* y,
                  int64_t ldy, int64_t nw, bool accumulate) {
  v16 a[MB];
  for (int i = 0; i < MB; ++i) a[i] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(wp + (k + PREFETCH_ROWS) * P);
    const v16 w = load16(wp + k * P);
    for (int i = 0; i < MB; ++i) a[i] = fma16(bcast16(x + i * ldx + k), w, a[i]);
  }
  const v16 b = load_bias(bias, nw);
  for (int i = 0; i < MB; ++i) store_out(y + i * ldy, add16(a[i], b), nw, accumulate);
}

// 1-4 rows, each panel streamed once with the rows in registers (gemm_panels: 3-4 rows on AVX-512, any on AVX2)
template <typename W>
void rows_kernel(int64_t mb, const float* x, int64_t ldx, const W* wp, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t nw, bool acc) {
  switch (mb) {
    case 1: return panel_kernel<1, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 2: return panel_kernel<2, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    case 3: return panel_kernel<3, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
    default: return panel_kernel<4, W>(x, ldx, wp, K, bias, y, ldy, nw, acc);
  }
}

// MB rows x NB panels of accumulators out to y (+ bias); the last panel has nw valid columns
template <int MB, int NB>
inline void store_block(const v16 (&acc)[MB][NB], const float* bias, float* y, int64_t ldy, int64_t nw,
                        bool accumulate) {
  for (int j = 0; j < NB; ++j) {
    const int64_t width = j == NB - 1 ? nw : P;
    const v16 b = load_bias(bias == nullptr ? nullptr : bias + j * P, width);
    for (int i = 0; i < MB; ++i) store_out(y + i * ldy + j * P, add16(acc[i][j], b), width, accumulate);
  }
}

// y[MB rows][NB panels] (+)= x @ NB consecutive panels (+ bias), MB * NB <= 24 accumulators: per k one load per
// panel and one broadcast per row feed MB * NB FMAs (panel_kernel's 8 x 1 needs 9 loads for 8). For steps of 5 or
// more rows (a batch of 8, a verify step's tree, 32 shared-prefix samples), where the FMAs slow the weight stream
// or bound the GEMM. nw: valid columns of the last panel. PF: prefetch the panels ahead (the block that streams
// them from DRAM). next: lines to prefetch over the k steps (a share of the next group's panels).
template <int MB, int NB, bool PF, typename W = float>
void block_kernel(const float* x, int64_t ldx, const W* wp, int64_t K, const float* bias, float* y, int64_t ldy,
                  int64_t nw, bool accumulate, Lines next) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  Prefetch pf(next.first, next.second, K);
  for (int64_t k = 0; k < K; ++k) {
    if (PF)  // the first row block pulls the panels from DRAM: four streams, each a page apart
      for (int j = 0; j < NB; ++j) __builtin_prefetch(wp + (j * K + k + PREFETCH_ROWS) * P);
    pf.advance();
    v16 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load16(wp + (j * K + k) * P);
    for (int i = 0; i < MB; ++i) {
      const v16 xi = bcast16(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = fma16(xi, w[j], acc[i][j]);
    }
  }
  store_block<MB, NB>(acc, bias, y, ldy, nw, accumulate);
}

template <typename W>
using BlockKernelOf = void (*)(const float*, int64_t, const W*, int64_t, const float*, float*, int64_t, int64_t, bool,
                               Lines);
using BlockKernel = BlockKernelOf<float>;
template <bool PF, typename W = float>
constexpr BlockKernelOf<W> BLOCK_KERNELS[24] = {
    block_kernel<1, 1, PF, W>, block_kernel<1, 2, PF, W>, block_kernel<1, 3, PF, W>, block_kernel<1, 4, PF, W>,
    block_kernel<2, 1, PF, W>, block_kernel<2, 2, PF, W>, block_kernel<2, 3, PF, W>, block_kernel<2, 4, PF, W>,
    block_kernel<3, 1, PF, W>, block_kernel<3, 2, PF, W>, block_kernel<3, 3, PF, W>, block_kernel<3, 4, PF, W>,
    block_kernel<4, 1, PF, W>, block_kernel<4, 2, PF, W>, block_kernel<4, 3, PF, W>, block_kernel<4, 4, PF, W>,
    block_kernel<5, 1, PF, W>, block_kernel<5, 2, PF, W>, block_kernel<5, 3, PF, W>, block_kernel<5, 4, PF, W>,
    block_kernel<6, 1, PF, W>, block_kernel<6, 2, PF, W>, block_kernel<6, 3, PF, W>, block_kernel<6, 4, PF, W>};

template <typename W = float>
constexpr BlockKernelOf<W> WIDE_ROW_KERNELS[12] = {  // 5-8 rows x 1-3 panels, streaming (first-block prefetch)
    block_kernel<5, 1, true, W>, block_kernel<5, 2, true, W>, block_kernel<5, 3, true, W>,
    block_kernel<6, 1, true, W>, block_kernel<6, 2, true, W>, block_kernel<6, 3, true, W>,
    block_kernel<7, 1, true, W>, block_kernel<7, 2, true, W>, block_kernel<7, 3, true, W>,
    block_kernel<8, 1, true, W>, block_kernel<8, 2, true, W>, block_kernel<8, 3, true, W>};

// y[M, N] (+)= x[M, K] @ W (+ bias) with W packed [ceil(N/16), K, 16] and x rows ldx apart; threads split the
// panels, so each streams its own contiguous part of W. 1-2 rows: groups of 4 panels streamed with the rows in
// registers (a chain per output needs others beside it); 3-4 rows, each panel streamed once with all rows in
// registers; 5-8 rows, groups of 3 panels with all rows in registers (bound by the weight stream, which the FMAs
// slowed at 8 rows on one panel); beyond, groups of 4 panels are walked by blocks of <= 6 rows of near-equal size
// (bound by FMAs: the group stays in L2 between row blocks).
// The register blocks above are sized for AVX-512's 32 registers, where a v16 is one register. With AVX2 a v16 is
// two of 16, so there each panel goes alone: 3-4 rows and more than 8 in row blocks of <= 6 (12 accumulator
// registers; the later blocks read the panel from L2), 5-8 rows in one pass (16 at 8 rows, a register spilled, but
// the panel is streamed once, which beat two blocks of 4). Figures: docs/performance.md, "Figures behind the code's
// choices".
#ifdef __AVX512F__
constexpr int64_t GROUP_PANELS = 4, WIDE_PANELS = 3;
constexpr bool blocked(int64_t M) { return M > 8; }
#else
constexpr int64_t GROUP_PANELS = 1, WIDE_PANELS = 1;
constexpr bool blocked(int64_t M) { return M > 8 || M == 3 || M == 4; }
#endif


}  // namespace
