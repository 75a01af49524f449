// KV formats: how a cache stores its rows (float32, bfloat16, float16, int8 with a scale), read and written.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

// How a cache stores its K/V rows (bmc/kv/formats.py, which writes and reads the same bits): float32 as the
// attention kernels read it, or a narrower format that a task widens a chunk at a time into float32 buffers (from
// L1 then), so every attention path -- decode, verify trees, shared segments -- reads the narrow bytes from DRAM.
//  - bfloat16 / float16: the values cast, rounding to nearest even;
//  - int8: head_dim int8 values q then their float32 scale s = max|x| * fl(1/127); q = round(x * (1/s)), clamped
//    to +-127 (products, not divisions: this file is compiled with -ffast-math, which may rewrite a division by a
//    constant as a product, and the PyTorch side must round alike); the row reads back as q * s.
enum class KVKind { F32, BF16, F16, I8 };
struct KVLayout {
  KVKind kind = KVKind::F32;
  int64_t row_bytes = 0;  // bytes of one (token, KV head) row
};
constexpr int64_t KV_SCALE_BYTES = 4;
// int8 rows are prefetched this many chunks ahead: a chunk's arithmetic is short beside its lines' arrival, and
// 2, 3 and 4 measured alike, 1 a little slower (docs/performance.md, "Figures behind the code's choices")
constexpr int64_t I8_AHEAD = 2;

KVLayout kv_layout(const torch::Tensor& kv, int64_t hd, const char* what) {
  switch (kv.scalar_type()) {
    case torch::kFloat:
      TORCH_CHECK(kv.size(-1) == hd, what, ": float32 rows of head_dim");
      return {KVKind::F32, hd * 4};
    case torch::kBFloat16:
      TORCH_CHECK(kv.size(-1) == hd, what, ": bfloat16 rows of head_dim");
      return {KVKind::BF16, hd * 2};
    case torch::kHalf:
#ifndef __F16C__
      TORCH_CHECK(false, what, ": float16 KV on the native step needs a CPU with F16C (x86); use bfloat16, or "
                  "BMC_NATIVE=0");
#endif
      TORCH_CHECK(kv.size(-1) == hd, what, ": float16 rows of head_dim");
      return {KVKind::F16, hd * 2};
    case torch::kChar:
      TORCH_CHECK(kv.size(-1) == hd + KV_SCALE_BYTES, what, ": int8 rows of head_dim values and a float32 scale");
      return {KVKind::I8, hd + KV_SCALE_BYTES};
    default:
      TORCH_CHECK(false, what, ": KV stored as ", kv.scalar_type(), " is not a KV format (float32, bfloat16, "
                  "float16, int8)");
  }
}

// Rows per (row, KV head) slab of a [L, 2, B, H_kv, cap, width] cache: cap when it is contiguous, more when it is
// a view of a mapping whose slabs have room to grow in place (bmc/kv/base.py, grow_in_place: a growth widens the
// view, nothing is copied). Every other stride must be that of a contiguous tensor of `slab` columns.
int64_t slab_rows(const torch::Tensor& kv, const char* what) {
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2, what, ": a [L, 2, B, H_kv, cap, width] cache");
  const int64_t w = kv.size(5), row = kv.stride(4), slab = row > 0 ? kv.stride(3) / row : 0;
  TORCH_CHECK(kv.stride(5) == 1 && row == w && kv.stride(3) == slab * w && slab >= kv.size(4) &&
                  kv.stride(2) == kv.size(3) * kv.stride(3) && kv.stride(1) == kv.size(2) * kv.stride(2) &&
                  kv.stride(0) == 2 * kv.stride(1),
              what, ": a contiguous [L, 2, B, H_kv, cap, width] cache, or a view of one with more columns per slab");
  return slab;
}

// Whether kv is a [L, 2, B, H_kv, len, width] tensor or a view of one with more columns per slab (slab_rows).
bool slab_view(const torch::Tensor& kv) {
  if (kv.dim() != 6 || kv.stride(5) != 1 || kv.stride(4) != kv.size(5) || kv.stride(4) == 0) return false;
  const int64_t slab = kv.stride(3) / kv.stride(4);
  return kv.stride(3) == slab * kv.size(5) && slab >= kv.size(4) && kv.stride(2) == kv.size(3) * kv.stride(3) &&
         kv.stride(1) == kv.size(2) * kv.stride(2) && kv.stride(0) == 2 * kv.stride(1);
}

// One row of hd float32 values x stored as `kind` at dst (the PyTorch side's encode, bit for bit).
void encode_row(KVKind kind, const float* x, int64_t hd, uint8_t* dst) {
  switch (kind) {
    case KVKind::F32:
      std::memcpy(dst, x, hd * sizeof(float));
      return;
    case KVKind::BF16:
      for (int64_t e = 0; e < hd; ++e) {
        uint32_t u;
        std::memcpy(&u, x + e, 4);
        const uint16_t h = std::isnan(x[e]) ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        std::memcpy(dst + 2 * e, &h, 2);
      }
      return;
    case KVKind::F16:
#ifdef __F16C__  // else kv_layout refused the format
      for (int64_t e = 0; e < hd; ++e) {
        const uint16_t h = _cvtss_sh(x[e], _MM_FROUND_TO_NEAREST_INT);
        std::memcpy(dst + 2 * e, &h, 2);
      }
#endif
      return;
    case KVKind::I8: {
      static const float inv127 = 1.0f / 127.0f;  // fl(1/127), as formats.INV_127
      float amax = 0.0f;
      for (int64_t e = 0; e < hd; ++e) amax = std::max(amax, std::fabs(x[e]));
      const float scale = amax * inv127;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      int8_t* q = reinterpret_cast<int8_t*>(dst);
      for (int64_t e = 0; e < hd; ++e)
        q[e] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[e] * inv))));
      std::memcpy(dst + hd, &scale, 4);
      return;
    }
  }
}

// One int8 row (hd values, then its scale) -> hd float32 values. Explicit vector code: GCC's loop over the row's
// bytes, the scale read between, was a scalar loop that cost as much as weighing the values (docs/performance.md,
// "Figures behind the code's choices").
inline void widen_i8_row(const uint8_t* row, int64_t hd, float* out) {
  float s;
  std::memcpy(&s, row + hd, 4);
  int64_t e = 0;
#ifdef __AVX512F__
  const __m512 vs = _mm512_set1_ps(s);
  for (; e + 16 <= hd; e += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + e));
    _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs));
  }
#elif defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(s);
  for (; e + 8 <= hd; e += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + e));
    _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs));
  }
#endif
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  for (; e < hd; ++e) out[e] = static_cast<float>(q[e]) * s;
}

// The lines of n rows of row_bytes at `base` (null: none), prefetched a share at a time: share(r) issues the r-th
// of `parts` even shares. Every line: one prefetch per row start skipped one line in 17 of 68-byte int8 rows,
// and each skipped line was a demand miss in the middle of the attention, which held int8 attention's stream far
// below float32's until the lines were counted (docs/performance.md, "Figures behind the code's choices").
struct LinePrefetch {
  const uint8_t* base;
  int64_t lines, parts;
  void share(int64_t r) const {
    if (base == nullptr) return;
    for (int64_t i = r * lines / parts, end = (r + 1) * lines / parts; i < end; ++i) __builtin_prefetch(base + 64 * i, 0, 2);
  }
};

// n stored rows from src (row_bytes apart) -> n rows of hd float32 values at dst; the n rows at `next_a` and at
// `next_b` (the next chunk's keys and values, or null) are prefetched over the rows meanwhile
void widen_rows(const KVLayout& lay, const uint8_t* src, int64_t n, int64_t hd, float* dst,
                const uint8_t* next_a = nullptr, const uint8_t* next_b = nullptr) {
  const int64_t lines = (n * lay.row_bytes + 63) / 64;
  const LinePrefetch pa{next_a, lines, n}, pb{next_b, lines, n};
  if (lay.kind == KVKind::I8) {
    for (int64_t r = 0; r < n; ++r) {
      pa.share(r);
      pb.share(r);
      widen_i8_row(src + r * lay.row_bytes, hd, dst + r * hd);
    }
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = src + r * lay.row_bytes;
    pa.share(r);
    pb.share(r);
    float* out = dst + r * hd;
    switch (lay.kind) {
      case KVKind::F32:
        std::memcpy(out, row, hd * sizeof(float));
        break;
      case KVKind::BF16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
        int64_t e = 0;
#ifdef __AVX512F__
        for (; e + 16 <= hd; e += 16) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + e));
          _mm512_storeu_si512(out + e, _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        }
#endif
        uint32_t* o = reinterpret_cast<uint32_t*>(out);
        for (; e < hd; ++e) o[e] = static_cast<uint32_t>(h[e]) << 16;
        break;
      }
      case KVKind::F16: {
#ifdef __F16C__  // else kv_layout refused the format
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
        int64_t e = 0;
#ifdef __AVX512F__
        for (; e + 16 <= hd; e += 16)
          _mm512_storeu_ps(out + e, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + e))));
#endif
        for (; e < hd; ++e) out[e] = _cvtsh_ss(h[e]);
#endif
        break;
      }
      case KVKind::I8:
        widen_i8_row(row, hd, out);
        break;
    }
  }
}

// x [N, hd] float32 -> its rows stored as `like` stores them (a tensor of the format's dtype): what the decode
// step writes into a cache, for the tests to compare with formats.py's encode
torch::Tensor encode_kv(const torch::Tensor& x, const torch::Tensor& like) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x: float32 [N, head_dim]");
  const int64_t N = x.size(0), hd = x.size(1);
  const int64_t width = like.scalar_type() == torch::kChar ? hd + KV_SCALE_BYTES : hd;
  auto out = torch::empty({N, width}, like.options());
  const KVLayout lay = kv_layout(out, hd, "like");
  auto xc = x.contiguous();
  for (int64_t n = 0; n < N; ++n)
    encode_row(lay.kind, xc.data_ptr<float>() + n * hd, hd, static_cast<uint8_t*>(out.data_ptr()) + n * lay.row_bytes);
  return out;
}


}  // namespace
