// Float attention kernels: the query rows' running softmax state, score blocks (row and column layouts),
// the online softmax of a chunk, and the weighted sums of values, with their register-block tables.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

struct Rows {  // query rows attended together: query, output/accumulator, bias row, running max and sum
  std::vector<const float*> q, bias;
  std::vector<float*> o;
  std::vector<float> m, s, alpha;
  std::vector<float> kt;  // a chunk's keys transposed into 16-key panels [n/16][d][16] (the wide path)
  std::vector<float> col;  // new maxima and sums of the column path
  Rows(int64_t n, int64_t kt_floats) : q(n), bias(n), o(n), m(n), s(n), alpha(n), kt(kt_floats), col(2 * n) {}
};

// st[j][r] = qt[.][r] . K[j] + bias[j] for NK keys x NP 16-row panels (NK * NP accumulators), and the column
// maxima mx[r] raised to cover them, from registers: a separate pass re-read all of st (docs/performance.md,
// "Figures behind the code's choices")
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

// The online softmax over one chunk of query row r's scores pr[0, n): each becomes e^(score - m') with m' the
// row's new running maximum; the running sum follows, and alpha[r] rescales what earlier keys contributed
static void softmax_row(Rows& rows, int64_t r, float* pr, int64_t n, bool prior) {
  float mx = rows.m[r];
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, pr[j]);
  for (int64_t j = 0; j < n; ++j) pr[j] = exp_fast(pr[j] - mx);
  // summed in 16 lanes, a last partial block zero-filled, then one reduction: the same bits for n keys and for n
  // plus masked ones (each exactly 0), so a row's sum does not depend on where its chunk ends
  v16 lanes = v16{};
  int64_t j = 0;
  for (; j + P <= n; j += P) lanes = add16(lanes, load16(pr + j));
  if (j < n) lanes = add16(lanes, load_part(pr + j, n - j));
  const float sum = hsum(lanes);
  rows.alpha[r] = prior ? exp_fast(rows.m[r] - mx) : 0.0f;
  rows.s[r] = rows.s[r] * rows.alpha[r] + sum;
  rows.m[r] = mx;
}

template <int MB, int NB>
static void score_block(const float* const* q, const float* kt, int64_t hd, float* p, int64_t ldp) {
  v16 acc[MB][NB];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = v16{};
  for (int64_t e = 0; e < hd; ++e) {
    v16 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load16(kt + (j * hd + e) * P);
    for (int r = 0; r < MB; ++r) {  // pinned FMAs: a row's scores the same bits at every block size
      const v16 x = bcast16(q[r] + e);
      for (int j = 0; j < NB; ++j) acc[r][j] = fma16(x, w[j], acc[r][j]);
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

#ifdef __AVX512F__
// A key's 16 partial products q . k over its NV vectors, in a pinned order (the same in a whole block and a tail)
template <int NV>
inline v16 key_partial(const v16* qr, const float* k) {
  v16 a = (v16)_mm512_mul_ps((__m512)qr[0], (__m512)load16(k));
  for (int j = 1; j < NV; ++j) a = fma16(qr[j], load16(k + P * j), a);
  return a;
}
#endif

// out[j] = q . K[j] * scale + bias[j] for n keys of head_dim 16 * NV: q in NV registers, 16 keys' partial
// products summed by one transposing reduction
template <int NV>
static void scores(const float* q, const float* K, int64_t n, const float* bias, float scale, float* out,
                   Lines next) {
#ifndef __AVX512F__
  // AVX2: sixteen 16-wide partials are 32 registers of 16 (the block spilled to the stack): 8 keys at a time,
  // each an 8-wide partial over its d/8 products (pinned FMAs), reduced by sum8; the last keys as a block of 8
  // whose missing keys' partials are zero, so a key's score does not depend on where its chunk ends
  v8 q8[2 * NV];
  for (int j = 0; j < 2 * NV; ++j) q8[j] = load8(q + 8 * j) * scale;
  Prefetch pf(next.first, next.second, n / 8);
  auto partial = [&](const float* k) {
    v8 a = q8[0] * load8(k);
    for (int j = 1; j < 2 * NV; ++j) a = fma8(q8[j], load8(k + 8 * j), a);
    return a;
  };
  int64_t s8 = 0;
  for (; s8 + 8 <= n; s8 += 8) {
    pf.advance();
    v8 part[8];
    for (int kk = 0; kk < 8; ++kk) part[kk] = partial(K + (s8 + kk) * P * NV);
    const v8 r = add8(sum8(part), load8(bias + s8));
    std::memcpy(out + s8, &r, 32);
  }
  if (s8 < n) {
    v8 part[8];
    for (int kk = 0; kk < 8; ++kk) part[kk] = s8 + kk < n ? partial(K + (s8 + kk) * P * NV) : v8{};
    v8 b{};
    std::memcpy(&b, bias + s8, (n - s8) * sizeof(float));
    const v8 r = add8(sum8(part), b);
    std::memcpy(out + s8, &r, (n - s8) * sizeof(float));
  }
#else
  v16 qr[NV];
  for (int j = 0; j < NV; ++j) qr[j] = load16(q + P * j) * scale;
  Prefetch pf(next.first, next.second, n / P);
  int64_t s = 0;
  for (; s + P <= n; s += P) {
    pf.advance();
    v16 part[P];
    for (int kk = 0; kk < P; ++kk) part[kk] = key_partial<NV>(qr, K + (s + kk) * P * NV);
    store16(out + s, add16(sum16(part), load16(bias + s)));
  }
  if (s < n) {  // the last keys as a block of 16 whose missing keys' partials are zero: sum16 reduces each key's
               // partial in the same tree as in a whole block, so a key's score does not depend on where the chunk
               // ends (a row alone, its capacity just past its length, against a batch's wider one)
    v16 part[P];
    for (int kk = 0; kk < P; ++kk) {
      if (s + kk >= n) {
        part[kk] = v16{};
        continue;
      }
      part[kk] = key_partial<NV>(qr, K + (s + kk) * P * NV);
    }
    const v16 r = add16(sum16(part), load_part(bias + s, n - s));
    for (int64_t kk = 0; kk < n - s; ++kk) out[s + kk] = r[kk];
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
    for (int r = 0; r < RC; ++r) {  // pinned FMAs: a row's sums the same bits at every row count
      const v16 w = bcast16(COLS ? p + s * ldp + r : p + r * ldp + s);
      for (int j = 0; j < NV; ++j) acc[r][j] = fma16(w, v[j], acc[r][j]);
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

}  // namespace
