// Quantized panels against int8 activations (AVX512-VNNI dot products), and the int8-KV feature switch.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_I8_KV_DOTS 1  // int8 KV attended in integers (NativeDecoder::attend_i8)
#else
#define HAVE_I8_KV_DOTS 0
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
constexpr bool HAVE_INT8_DOT = true;
// Quantized panels against activations quantized to int8 (int8_activations): each row's block of 32 values x as
// x~ = dx * qx (dx = max|x| / 127, qx = round(x / dx)), and sum_k w_k x~_k = dx (d sum_k q_k qx_k) + m dx sum_k qx_k
// (Q8X: d0 over rows 0-15, d1 over 16-31), the integer sums by VNNI's u8 x s8 dot products (vpdpbusd: 64 products
// an instruction): exactly the weights times the quantized activations, so per output the error is at most
// sum_k |w_k| dx / 2 (plus float rounding), a stated bound (tests/test_quant.py), not quant="none"'s logits.
// (Taking the offsets' factor as the exact sum_k x_k was worse: the error became sum_k d q_k (x~_k - x_k) with q in
// 0..15 all positive, where w's own signs cancel: Q4_0 perplexity 16.925 against 16.578, float activations 16.505.)
// Why: batch-8 decode GEMMs are bound by the float path's dequantizing arithmetic (4 operations per 16 weights),
// which the integer dot products cut; batch 1, bound by memory, gains a little (docs/performance.md, "Figures
// behind the code's choices").
// A block's quants are regrouped per 4 rows with one vpermb, so each 32-bit lane holds one column's 4 consecutive
// rows, as vpdpbusd takes them: w[g] holds rows 4g .. 4g + 3, so w[0..3] are rows 0-15 and w[4..7] rows 16-31.
// Q4's nibbles are unsigned and go in as they are (against the signed activations); Q8 and Q8X quants are signed,
// so the activations go in as qx + 128 (their bytes' sign bits flipped) and 128 times each column's sum of quants
// is taken back out (those sums by the same instruction against ones, once a block for all rows).
struct VnniOrder {
  alignas(64) int8_t idx[64];
};
constexpr VnniOrder make_vnni_order() {  // byte (row r, column c) of 4 rows x 16 columns -> lane c, byte r
  VnniOrder o{};
  for (int c = 0; c < P; ++c)
    for (int r = 0; r < 4; ++r) o.idx[c * 4 + r] = static_cast<int8_t>(r * P + c);
  return o;
}
constexpr VnniOrder VNNI_ORDER = make_vnni_order();

template <int MB, int KIND>
void quant_int8x_kernel(const int8_t* xq, const float* dx, int64_t ldq, const uint8_t* wq, int64_t K,
                        const float* bias, float* y, int64_t ldy, int64_t nw, bool accumulate, const float* xsum) {
  const __m512i order = _mm512_load_si512(VNNI_ORDER.idx), low = _mm512_set1_epi8(15);
  // Q4 at one or two rows: the high nibbles stay in place, as 16 times their value (one operation fewer a group than
  // shifting them down, where the block's shared work is most of the arithmetic); their sums come out 16 times too
  // large and are scaled by 1/16 exactly below, so the result is the same bits as the shifted form's (kept for more
  // rows, where the extra constant measured slower)
  constexpr bool HIGH16 = KIND_NIBBLES[KIND] && MB <= 2;
  const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
  constexpr int64_t bb = KIND_BLOCK[KIND];
  v16 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = v16{};
  const int64_t nblk = K / QK;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = wq + b * bb;
    if (prefetches_ahead(MB))
      for (int64_t line = 0; line < bb; line += 64) __builtin_prefetch(blk + 8 * bb + line);
    __m512i w[8], c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    if (KIND_NIBBLES[KIND]) {  // 16 rows of bytes: row j's low nibbles are row j, its high nibbles row j + 16
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + KIND_QUANTS[KIND] + g * 64));
        w[g] = _mm512_and_si512(v, low);
        w[4 + g] = HIGH16 ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int g = 0; g < 8; ++g)
        w[g] = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + KIND_QUANTS[KIND] + g * 64));
      for (int g = 0; g < 4; ++g) {
        c0 = _mm512_dpbusd_epi32(c0, ones, w[g]);
        c1 = _mm512_dpbusd_epi32(c1, ones, w[4 + g]);
      }
      c0 = _mm512_slli_epi32(c0, 7);
      c1 = _mm512_slli_epi32(c1, 7);
    }
    const v16 d0 = scale_vec<KIND>(blk, 0);
    // (HIGH16: the high half's scale over 16, exact for a power of two, so d1 * hi is the same product)
    const v16 d1 = has_scale_hi(KIND) ? (HIGH16 ? scale_vec<KIND>(blk, KIND_SCALE_HI[KIND]) * 0.0625f
                                                : scale_vec<KIND>(blk, KIND_SCALE_HI[KIND])) : d0;
    const v16 m = has_offset(KIND) ? offset_vec<KIND>(blk, d0) : v16{};
    for (int i = 0; i < MB; ++i) {
      // the row's activations 4 at a time, each group broadcast straight from memory (four(g) matches w[g]): copied
      // out as one 32-byte array first, the compiler took every group apart in general registers (shifts and
      // moves) before broadcasting it (docs/performance.md, "Quantized prompts with int8 activations")
      const int8_t* xr = xq + i * ldq + b * QK;
      auto four = [xr](int g) { return _mm512_broadcastd_epi32(_mm_loadu_si32(xr + 4 * g)); };
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        if (KIND_NIBBLES[KIND]) {
          s0 = _mm512_dpbusd_epi32(s0, w[g], four(g));
          s1 = _mm512_dpbusd_epi32(s1, w[4 + g], four(4 + g));
        } else {
          s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(four(g), flip), w[g]);
          s1 = _mm512_dpbusd_epi32(s1, _mm512_xor_si512(four(4 + g), flip), w[4 + g]);
        }
      }
      // The epilogue's roundings pinned, each product apart from the sum it joins (the empty asm): written as plain
      // vector arithmetic, -ffast-math fused products and sums differently in different row counts' kernels (Q4_K:
      // the second of 3 rows 1 ulp from the same row alone), so a row's result depended on the rows beside it.
      __m512 part;
      if (has_scale_hi(KIND)) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(s0, c0));  // rows 0-15's exact sum
        __m512 p1 = _mm512_mul_ps((__m512)d1, _mm512_cvtepi32_ps(_mm512_sub_epi32(s1, c1)));  // rows 16-31's
        asm("" : "+v"(p1));
        part = _mm512_fmadd_ps((__m512)d0, lo, p1);
      } else {
        // one scale a block: the two halves' integer sums added as integers and converted once. Each half is below
        // 2^18 in magnitude (16 products of |q| <= 128 and |qx| <= 127 a lane), so the float sum of the two
        // converted halves, which this was, is exact too: the same bits, one conversion and the float add fewer
        // (HIGH16: the high half is 16 times its sum, an exact arithmetic shift)
        const __m512i hi = HIGH16 ? _mm512_srai_epi32(s1, 4) : _mm512_sub_epi32(s1, c1);
        part = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_sub_epi32(s0, c0), hi));
      }
      asm("" : "+v"(part));
      part = _mm512_mul_ps(part, _mm512_set1_ps(dx[i * nblk + b]));
      asm("" : "+v"(part));
      if (!has_scale_hi(KIND)) {
        part = _mm512_mul_ps((__m512)d0, part);
        asm("" : "+v"(part));
      }
      if (has_offset(KIND)) part = _mm512_fmadd_ps((__m512)m, _mm512_set1_ps(xsum[i * nblk + b]), part);
      acc[i] = (v16)_mm512_add_ps((__m512)acc[i], part);
      asm("" : "+v"(acc[i]));
    }
  }
  const v16 bv = load_bias(bias, nw);
  for (int i = 0; i < MB; ++i) store_out(y + i * ldy, acc[i] + bv, nw, accumulate);
}

using Int8xKernel = void (*)(const int8_t*, const float*, int64_t, const uint8_t*, int64_t, const float*, float*,
                             int64_t, int64_t, bool, const float*);
template <int KIND>
constexpr Int8xKernel INT8X_KERNELS[8] = {
    quant_int8x_kernel<1, KIND>, quant_int8x_kernel<2, KIND>, quant_int8x_kernel<3, KIND>,
    quant_int8x_kernel<4, KIND>, quant_int8x_kernel<5, KIND>, quant_int8x_kernel<6, KIND>,
    quant_int8x_kernel<7, KIND>, quant_int8x_kernel<8, KIND>};
#define BMC_INT8X_ENTRY(K) INT8X_KERNELS<K>,
constexpr const Int8xKernel* INT8X_BY_KIND[NUM_BLOCK_KINDS] = {BMC_FOR_EACH_BLOCK_KIND(BMC_INT8X_ENTRY)};
#undef BMC_INT8X_ENTRY

// _mm512_shuffle_ps on integer lanes (within each 128-bit lane: two of a's, then two of b's)
template <int IMM>
__m512i shuffle_ps(__m512i a, __m512i b) {
  return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), IMM));
}

// Lane b of the result: the max (MAX) or the sum of v[b]'s 16 lanes, for 16 vectors at once: a transposed reduction,
// 15 shuffle pairs where one vector at a time takes 4 each. Max and integer sums are exact in any order, so each lane
// is what _mm512_reduce_max_ps / _mm512_reduce_add_epi32 gives.
template <bool MAX>
__m512i reduce16(__m512i* v) {
  auto op = [](__m512i a, __m512i b) {
    return MAX ? _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)))
               : _mm512_add_epi32(a, b);
  };
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1: v[2i]'s halves folded, 2-3: v[2i + 1]'s
    v[i] = op(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane k: vector 4i + k's quarter
    v[i] = op(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x88), _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // in lane k, elements 0-1: vector 8i + k, 2-3: vector 8i + 4 + k
    v[i] = op(shuffle_ps<0x44>(v[2 * i], v[2 * i + 1]), shuffle_ps<0xEE>(v[2 * i], v[2 * i + 1]));
  const __m512i r = op(shuffle_ps<0x88>(v[0], v[1]), shuffle_ps<0xDD>(v[0], v[1]));  // element 4k + e: vector 4e + k
  const __m512i to_vector_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(to_vector_order, r);
}

// a / b correctly rounded, lane by lane: written as a division, -ffast-math (-freciprocal-math) made it a * (1 / b),
// two roundings (until session 44 every dx was amax times the float nearest 1/127)
inline __m512 div_ieee(__m512 a, __m512 b) {
  __m512 r;
  asm("vdivps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}

// 127 / amax where amax > 0, else 0
inline __m512 inv_scale(__m512 amax, __m512 c127) {
  const __mmask16 pos = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_maskz_mov_ps(pos, div_ieee(c127, _mm512_mask_mov_ps(c127, pos, amax)));
}

// Rows of x as int8 blocks of 32 (qx), their scales dx and dx * sum_k qx_k (the offsets' factor): dx = max|x| / 127
// and qx = x * (127 / max|x|) rounded to nearest even (cvtps_epi32), both divisions IEEE (div_ieee; the CUDA mode,
// quant_i8x.py, rounds the same: tests/test_quant.py and tests/test_gpu.py hold both to that formula). It runs before
// every GEMM, and a scalar loop with nearbyint per value was a large share of a batch-1 decode step (docs/
// performance.md, "Figures behind the code's choices"); 16 blocks at a time share their reductions and divisions.
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  const int64_t nblk = K / QK;
  const __m512 c127 = _mm512_set1_ps(127.0f);
  for (int64_t i = 0; i < M; ++i) {
    const float* xr = x + i * ldx;
    int8_t* qr = xq + i * K;
    int64_t b0 = 0;
    for (; b0 + 16 <= nblk; b0 += 16) {
      __m512i m[16];
      for (int b = 0; b < 16; ++b) {
        const float* xb = xr + (b0 + b) * QK;
        m[b] = _mm512_castps_si512(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)),
                                                 _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
      }
      const __m512 amax = _mm512_castsi512_ps(reduce16<true>(m));
      const __m512 d = div_ieee(amax, c127);
      alignas(64) float inv[16];
      _mm512_store_ps(inv, inv_scale(amax, c127));
      __m512i s[16];
      for (int b = 0; b < 16; ++b) {
        const float* xb = xr + (b0 + b) * QK;
        const __m512 iv = _mm512_set1_ps(inv[b]);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), iv));
        const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), iv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + (b0 + b) * QK), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + (b0 + b) * QK + 16), _mm512_cvtepi32_epi8(qc));
        s[b] = _mm512_add_epi32(qa, qc);
      }
      _mm512_storeu_ps(dx + i * nblk + b0, d);
      _mm512_storeu_ps(xsum + i * nblk + b0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(reduce16<false>(s))));
    }
    for (int64_t b = b0; b < nblk; ++b) {  // the last blocks one at a time, the same arithmetic
      const float* xb = xr + b * QK;
      const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
      const __m512 amax = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c))));
      const __m512 d = div_ieee(amax, c127);
      const __m512 iv = inv_scale(amax, c127);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv));
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, iv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * QK), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * QK + 16), _mm512_cvtepi32_epi8(qc));
      const float dv = _mm512_cvtss_f32(d);
      dx[i * nblk + b] = dv;
      xsum[i * nblk + b] = dv * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc)));
    }
  }
}

// quantize_rows over the threads where the rows are many (a prompt's chunk, a full decode batch's wider inputs): run
// on the calling thread alone, it held the other threads waiting before every GEMM. A row's bits are the same.
void quantize_rows_split(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  if (M < 2 || M * K < 16384) return quantize_rows(x, ldx, M, K, xq, dx, xsum);  // 2048 measured the same
  const int64_t nblk = K / QK;
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    quantize_rows(x + b * ldx, ldx, e - b, K, xq + b * K, dx + b * nblk, xsum + b * nblk);
  });
}
#else
constexpr bool HAVE_INT8_DOT = false;
#endif

float* scratch(int64_t floats) {  // a thread's panel buffer, grown as needed and kept
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf.data();
}


}  // namespace
