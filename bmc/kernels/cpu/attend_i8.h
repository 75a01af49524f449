// Int8 attention kernels: int8 KV rows attended in integers (VNNI dot products on the stored bytes), and
// weighted sums over int8 values widened in registers.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

#if HAVE_I8_KV_DOTS
// Integer attention over an int8 cache (int8_kv_dots): a chunk's scores and its weighted values as VNNI u8 x s8
// dot products (vpdpbusd, 64 products an instruction) on the stored bytes, where the widening path converts
// every key and value to float32 and spends 16 FMAs on each 16 products: widened, int8 attention was bound by
// that arithmetic, not by its reads (docs/performance.md, "Figures behind the code's choices").
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
// zeros up to the next 16: gathered 16 at a time (two scalar loads and stores a key were a visible share of
// attend_i8: docs/performance.md, "Figures behind the code's choices")
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

}  // namespace
