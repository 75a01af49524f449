// bfloat16 arithmetic for steps of many rows (activations="bfloat16"): x and W rounded to bfloat16 (nearest even),
// products summed in float32, two k at a time. A stated bound, not float32's values:
// |y - y_exact| <= (2^-7 + 2^-16 + K 2^-23) sum_k |x_k w_k| (docs/design.md, "Precision modes"; bfloat16 keeps 8
// significant bits, so each rounding is within 2^-8 relative).
// Three ISA paths, one layout (pairs of k): AMX-BF16 tiles where the CPU has them and Linux grants them,
// AVX512-BF16's vdpbf16ps, and float32 FMAs on the widened pairs (any other CPU: the same bound, no faster).
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

#if defined(__AVX512BF16__)
constexpr bool HAVE_BF16_DOT = true;
#else
constexpr bool HAVE_BF16_DOT = false;
#endif

// float32 -> bfloat16 bits, nearest even (NaN kept a quiet NaN): the rounding every path shares.
// Branch-free, so the loops over it vectorize.
inline uint32_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16, quiet = (b >> 16) | 0x40u;
  return (b & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
}

// out[c] = (a[c], b[c]) as a pair of bfloat16, for 16 lanes
inline void pair_up(const float* __restrict a, const float* __restrict b, uint32_t* __restrict out) {
  for (int c = 0; c < P; ++c) out[c] = bf16_bits(a[c]) | (bf16_bits(b[c]) << 16);
}

// Pairs of k: 32 bits holding (v[k], v[k+1]) as bfloat16, k even in the low half. A row of x becomes K2 pairs; a
// panel [K][16] becomes [K2][16] pairs (lane c: (w[k][c], w[k+1][c])), AMX's B layout and vdpbf16ps's operand. Rows
// and pairs past the data are zero (AMX reads whole tiles).
inline void x_pairs(const float* __restrict x, int64_t K, int64_t K2p, uint32_t* __restrict out) {
  const int64_t full = K / 2;
  for (int64_t k2 = 0; k2 < full; ++k2) out[k2] = bf16_bits(x[2 * k2]) | (bf16_bits(x[2 * k2 + 1]) << 16);
  for (int64_t k2 = full; k2 < K2p; ++k2) out[k2] = 2 * k2 < K ? bf16_bits(x[2 * k2]) : 0u;
}

template <typename W>
void panel_pairs(const W* wp, int64_t K, int64_t K2p, uint32_t* out) {
  alignas(64) float r0[P], r1[P];
  for (int64_t k2 = 0; k2 < K2p; ++k2) {
    const int64_t k = 2 * k2;
    if (k < K) store16(r0, load16(wp + k * P)); else std::fill(r0, r0 + P, 0.0f);
    if (k + 1 < K) store16(r1, load16(wp + (k + 1) * P)); else std::fill(r1, r1 + P, 0.0f);
    pair_up(r0, r1, out + k2 * P);
  }
}

// The two halves of 16 pairs as float32: k even, k odd (bfloat16 is float32's upper half).
inline void widen_pairs(const uint32_t* p, v16& even, v16& odd) {
#ifdef __AVX512F__
  const __m512i b = _mm512_loadu_si512(p);
  even = (v16)_mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  odd = (v16)_mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#else
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i lo = _mm256_loadu_si256((const __m256i*)p), hi = _mm256_loadu_si256((const __m256i*)(p + 8));
  even = {(v8)_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), (v8)_mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  odd = {(v8)_mm256_castsi256_ps(_mm256_and_si256(lo, mask)), (v8)_mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
#endif
}

// y[MB rows][NB panels] (+)= x @ NB panels of pairs (+ bias): per pair of k, one load per panel and one broadcast per
// row feed MB * NB dot products (block_kernel's blocking, two k a step).
template <int MB, int NB>
void bf16_block(const uint32_t* xb, int64_t ldx, const uint32_t* wb, int64_t K2, const float* bias, float* y,
                int64_t ldy, int64_t nw, bool accumulate) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  for (int64_t k = 0; k < K2; ++k) {
#if defined(__AVX512BF16__)
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wb + (j * K2 + k) * P);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[i * ldx + k]));
      for (int j = 0; j < NB; ++j) acc[i][j] = (v16)_mm512_dpbf16_ps((__m512)acc[i][j], xi, w[j]);
    }
#else
    v16 we[NB], wo[NB];
    for (int j = 0; j < NB; ++j) widen_pairs(wb + (j * K2 + k) * P, we[j], wo[j]);
    for (int i = 0; i < MB; ++i) {
      const uint32_t b = xb[i * ldx + k], hi = b & 0xffff0000u, lo = b << 16;
      float xe, xo;
      std::memcpy(&xe, &lo, 4);
      std::memcpy(&xo, &hi, 4);
      const v16 ve = v16{} + xe, vo = v16{} + xo;
      for (int j = 0; j < NB; ++j) acc[i][j] = fma16(vo, wo[j], fma16(ve, we[j], acc[i][j]));
    }
#endif
  }
  store_block<MB, NB>(acc, bias, y, ldy, nw, accumulate);
}

using Bf16Kernel = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const float*, float*, int64_t, int64_t,
                            bool);
constexpr Bf16Kernel BF16_KERNELS[24] = {
    bf16_block<1, 1>, bf16_block<1, 2>, bf16_block<1, 3>, bf16_block<1, 4>, bf16_block<2, 1>, bf16_block<2, 2>,
    bf16_block<2, 3>, bf16_block<2, 4>, bf16_block<3, 1>, bf16_block<3, 2>, bf16_block<3, 3>, bf16_block<3, 4>,
    bf16_block<4, 1>, bf16_block<4, 2>, bf16_block<4, 3>, bf16_block<4, 4>, bf16_block<5, 1>, bf16_block<5, 2>,
    bf16_block<5, 3>, bf16_block<5, 4>, bf16_block<6, 1>, bf16_block<6, 2>, bf16_block<6, 3>, bf16_block<6, 4>};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
// Linux hands AMX's tile state to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// BMC_AMX=0 keeps the vdpbf16ps path (an A/B, or the no-AMX run of the tests).
bool amx_ready() {
  static const bool ok = [] {
    const char* env = std::getenv("BMC_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C[MT * 16 rows][NT * 16] = x @ NT panels of pairs (K2p each, a multiple of 16), stored to c (NT * 16 floats a
// row). x's tile (rows 16 s.., pairs k..k+15) starts at xa + s * xs + k * xk, its rows xr pairs apart: rows of pairs
// (xs = 16 ld, xk = 1, xr = ld) or 1 KB tiles (xs = 16 K2p, xk = 16, xr = 16). Tiles: C 0-3, x 4-5, W 6-7.
template <int MT, int NT>
void amx_block(const uint32_t* xa, int64_t xs, int64_t xk, int64_t xr, const uint32_t* wb, int64_t K2p, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K2p; k += 16) {
    _tile_loadd(4, xa + k * xk, xr * 4);
    if (MT == 2) _tile_loadd(5, xa + xs + k * xk, xr * 4);
    _tile_loadd(6, wb + k * P, P * 4);
    if (NT == 2) _tile_loadd(7, wb + (K2p + k) * P, P * 4);
    _tile_dpbf16ps(0, 4, 6);
    if (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, NT * P * 4);
  if (NT == 2) _tile_stored(1, c + P, NT * P * 4);
  if (MT == 2) _tile_stored(2, c + 16 * NT * P, NT * P * 4);
  if (MT == 2 && NT == 2) _tile_stored(3, c + 16 * NT * P + P, NT * P * 4);
}
using AmxKernel = void (*)(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, float*);
constexpr AmxKernel AMX_KERNELS[4] = {amx_block<1, 1>, amx_block<1, 2>, amx_block<2, 1>, amx_block<2, 2>};
#else
bool amx_ready() { return false; }
#endif

uint32_t* pair_scratch(int64_t pairs) {  // a thread's buffer of bfloat16 pairs, grown as needed and kept
  static thread_local std::vector<uint32_t> buf;
  if (static_cast<int64_t>(buf.size()) < pairs) buf.resize(pairs);
  return buf.data();
}

// Panels [p0, p0 + nb) of any weight gemm() takes (float, 16-bit, quantized: dequantized into fb first) as pairs.
void group_pairs(const torch::Tensor& wp, int kind, int64_t p0, int64_t nb, int64_t K, int64_t K2p, float* fb,
                 uint32_t* out) {
  if (kind != NOT_BLOCKS) dequant_panels(wp, kind, p0, nb, K, fb);
  for (int64_t j = 0; j < nb; ++j) {
    uint32_t* o = out + j * K2p * P;
    const int64_t at = (p0 + j) * K * P;
    if (kind != NOT_BLOCKS)
      panel_pairs(fb + j * K * P, K, K2p, o);
    else if (wp.scalar_type() == torch::kFloat)
      panel_pairs(wp.data_ptr<float>() + at, K, K2p, o);
    else if (wp.scalar_type() == torch::kBFloat16)
      panel_pairs(static_cast<const BHalf16*>(wp.data_ptr()) + at, K, K2p, o);
    else
      panel_pairs(static_cast<const Half16*>(wp.data_ptr()) + at, K, K2p, o);
  }
}

// Row i of x as pairs into 16 x 16 tiles of pairs ([ceil(M / 16)][K2p / 16][16 rows][16 pairs], 1 KB each): a tile
// load then reads one contiguous kilobyte, where rows of pairs ld apart made it 16 streams (32 for a 2 x 2 block)
inline void x_pairs_tiled(const float* x, int64_t K, int64_t K2p, int64_t i, uint32_t* xt) {
  alignas(64) uint32_t row[P];
  uint32_t* at = xt + i / 16 * 16 * K2p + i % 16 * P;
  const int64_t full = K / 32;  // whole tiles' worth of k (16 pairs)
  for (int64_t kb = 0; kb < full; ++kb) {
    for (int c = 0; c < P; ++c) row[c] = bf16_bits(x[32 * kb + 2 * c]) | (bf16_bits(x[32 * kb + 2 * c + 1]) << 16);
    std::memcpy(at + kb * 16 * P, row, sizeof(row));
  }
  for (int64_t kb = full; kb < K2p / 16; ++kb) {
    for (int c = 0; c < P; ++c) {
      const int64_t k = 32 * kb + 2 * c;
      row[c] = (k < K ? bf16_bits(x[k]) : 0u) | (k + 1 < K ? bf16_bits(x[k + 1]) << 16 : 0u);
    }
    std::memcpy(at + kb * 16 * P, row, sizeof(row));
  }
}

// y[M, N] (+)= x[M, K] @ W (+ bias) in bfloat16 arithmetic. x is rounded to pairs once (1 KB tiles for AMX); each
// thread takes an equal run of panels (at::parallel_for's chunks: 160 panels on 16 threads are 10 each, where
// groups of 4 as tasks were 3 on some threads and 2 on others), made pairs 4 at a time in the thread's buffer, then
// walked by row blocks while they stay in L2: tiles of 32 x 32 with AMX, blocks of <= 6 rows x 4 panels otherwise.
void gemm_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const torch::Tensor& wp, int kind, int64_t N,
               const float* bias, float* y, bool accumulate) {
  const bool amx = amx_ready();
  (void)amx;
  const int64_t np = wp.size(0), per = 4;
  const int64_t K2 = (K + 1) / 2, K2p = amx ? (K2 + 15) / 16 * 16 : K2, Mp = amx ? (M + 15) / 16 * 16 : M;
  const int64_t ld = K2p;
  static thread_local std::vector<uint32_t> xb_buf;
  if (static_cast<int64_t>(xb_buf.size()) < Mp * ld) xb_buf.resize(Mp * ld);
  uint32_t* xb = xb_buf.data();  // taken here: inside the workers the name would be their own thread's buffer
  at::parallel_for(0, Mp, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (amx) {
        if (i < M)
          x_pairs_tiled(x + i * ldx, K, K2p, i, xb);
        else
          for (int64_t kb = 0; kb < K2p / 16; ++kb) std::fill_n(xb + i / 16 * 16 * K2p + kb * 16 * P + i % 16 * P, P, 0u);
      } else {
        x_pairs(x + i * ldx, K, K2p, xb + i * ld);
      }
    }
  });
  at::parallel_for(0, np, 1, [&](int64_t begin, int64_t end) {
    uint32_t* wb = pair_scratch(per * K2p * P);
    float* fb = kind == NOT_BLOCKS ? nullptr : scratch(per * K * P);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
    if (amx) {
      TileConfig cfg;
      for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
      _tile_loadconfig(&cfg);
      alignas(64) float c[32 * 32];
      for (int64_t p0 = begin; p0 < end; p0 += per) {
        const int64_t nb = std::min<int64_t>(per, end - p0);
        group_pairs(wp, kind, p0, nb, K, K2p, fb, wb);
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
          const int64_t mt = M - m0 > 16 ? 2 : 1, rows = std::min<int64_t>(32, M - m0);
          for (int64_t j = 0; j < nb; j += 2) {
            const int64_t nt = nb - j > 1 ? 2 : 1;
            AMX_KERNELS[(mt - 1) * 2 + nt - 1](xb + m0 * K2p, 16 * K2p, 16, 16, wb + j * K2p * P, K2p, c);
            for (int64_t t = 0; t < nt; ++t) {
              const int64_t n0 = (p0 + j + t) * P, width = std::min<int64_t>(P, N - n0);
              const v16 b = load_bias(bias == nullptr ? nullptr : bias + n0, width);
              for (int64_t i = 0; i < rows; ++i)
                store_out(y + (m0 + i) * N + n0, load16(c + i * nt * P + t * P) + b, width, accumulate);
            }
          }
        }
      }
      _tile_release();
      return;
    }
#endif
    const int64_t blocks = (M + 5) / 6;
    for (int64_t p0 = begin; p0 < end; p0 += per) {
      const int64_t nb = std::min<int64_t>(per, end - p0), n0 = p0 * P;
      const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
      group_pairs(wp, kind, p0, nb, K, K2p, fb, wb);
      for (int64_t blk = 0, m0 = 0; blk < blocks; ++blk) {
        const int64_t mb = (M - m0) / (blocks - blk);  // near-equal blocks, as gemm_panels
        BF16_KERNELS[(mb - 1) * 4 + nb - 1](xb + m0 * ld, ld, wb, K2p, bias == nullptr ? nullptr : bias + n0,
                                            y + m0 * N + n0, N, nw, accumulate);
        m0 += mb;
      }
    }
  });
}

}  // namespace
