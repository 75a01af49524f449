// The linear dispatch (float, 16-bit and quantized panels), weight packing and the bindings' linear ops.
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

// A GEMM weight as the bindings hand it over: quantized panels with their block kind's code (block_kinds.h), or,
// with kind NOT_BLOCKS, float32 / 16-bit float panels [ceil(out/16), in, 16] or a float32 [in, out] matrix still to
// be packed. The kind is given, never inferred from the tensor.
struct Weight {
  torch::Tensor data;
  int64_t kind = NOT_BLOCKS;
  bool blocks() const { return kind != NOT_BLOCKS; }
};

// Each row's sum over each block of K (the offsets' factor of float activations), xsum [M, K / QK]. One copy of
// the loop for every caller (not inlined): -ffast-math may order a reduction differently in each place it is
// compiled, and gemm() and gemm_panel_range must give the same bits.
__attribute__((noinline)) void block_sums(const float* x, int64_t ldx, int64_t M, int64_t K, float* xsum) {
  const int64_t nblk = K / QK;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < nblk; ++b) {
      float t = 0.0f;
      for (int64_t k = 0; k < QK; ++k) t += x[i * ldx + b * QK + k];
      xsum[i * nblk + b] = t;
    }
}

// gemm() over quantized panels: the same row and panel blocking (so the same float kernels see the same panel
// values in the same order), each group of panels dequantized into the thread's buffer first.
// Float rows multiply quantized panels as stored, up to 8 rows a kernel call, the scales applied once a block
// (AVX-512 builds; AVX2 ones dequantize each group of panels once for all rows). So a row's sums are the same bits
// at every row count: a decode row beside a prompt chunk, a prompt prefilled whole or in chunks. Dequantizing
// past 64 rows was no faster once x is walked in L2-sized row blocks (docs/performance.md, "Figures behind the
// code's choices").
#ifdef __AVX512F__
constexpr int64_t QUANT_ROWS = QUANT_ROWS_MAX;
#endif

void gemm_quant(const float* x, int64_t ldx, int64_t M, int64_t K, const torch::Tensor& wq, int kind, int64_t N,
                const float* bias, float* y, bool accumulate, bool int8_x) {
  const int64_t np = wq.size(0);
#ifdef __AVX512F__
  const int64_t panel_bytes = K / QK * KIND_BLOCK[kind], nblk = K / QK;
  const uint8_t* base = static_cast<const uint8_t*>(wq.data_ptr());
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (int8_x) {  // activations as int8 blocks: VNNI dot products (a stated bound), 8 rows a pass
    static thread_local std::vector<int8_t> xq_buf;
    static thread_local std::vector<float> dx_buf, xs_buf;
    if (static_cast<int64_t>(xq_buf.size()) < M * K) xq_buf.resize(M * K);
    if (static_cast<int64_t>(dx_buf.size()) < M * nblk) dx_buf.resize(M * nblk), xs_buf.resize(M * nblk);
    int8_t* xq = xq_buf.data();
    float *dx = dx_buf.data(), *xsum = xs_buf.data();
    quantize_rows_split(x, ldx, M, K, xq, dx, xsum);  // the offsets' factor from x~ too: y = w . x~ exactly
    at::parallel_for(0, np, M <= 8 ? 8 : 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
        for (int64_t r0 = 0; r0 < M; r0 += 8) {  // the panel stays in L1/L2 across the row groups
          const int64_t mb = std::min<int64_t>(8, M - r0);
          INT8X_BY_KIND[kind][mb - 1](xq + r0 * K, dx + r0 * nblk, K, base + p * panel_bytes, K,
                                bias == nullptr ? nullptr : bias + n0, y + r0 * N + n0, N, nw, accumulate,
                                xsum + r0 * nblk);
        }
      }
    });
    return;
  }
#endif
  {  // the panel streams through registers, its scales applied once per block
    // each row's sum over each block of K (the offsets' factor), in a buffer kept by the calling thread: no
    // allocation per GEMM on the decode path
    static thread_local std::vector<float> xsum_buf;
    if (static_cast<int64_t>(xsum_buf.size()) < M * nblk) xsum_buf.resize(M * nblk);
    float* xsum = xsum_buf.data();  // taken here: inside the workers the name would be their own thread's buffer
    if (has_offset(kind)) block_sums(x, ldx, M, K, xsum);
    // rows a block of about 256 KB of x, walked by all of a thread's panels while it stays in L2 (the panels stay
    // there too); decode rows are one block
    const int64_t block_rows = std::max<int64_t>(QUANT_ROWS, (65536 / K) / QUANT_ROWS * QUANT_ROWS);
    at::parallel_for(0, np, M <= block_rows ? 8 : 1, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
        const int64_t m1 = std::min(M, m0 + block_rows);
        for (int64_t p = begin; p < end; ++p) {
          const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
          // rows QUANT_ROWS at a time, the panel from L1 after the first: a row's sums are the same whatever its
          // block
          for (int64_t r0 = m0; r0 < m1; r0 += QUANT_ROWS)
            ROWS_BY_KIND[kind][std::min<int64_t>(QUANT_ROWS, m1 - r0) - 1](
                x + r0 * ldx, ldx, base + p * panel_bytes, K, bias == nullptr ? nullptr : bias + n0, y + r0 * N + n0,
                N, nw, accumulate, xsum + r0 * nblk);
        }
      }
    });
    return;
  }
#endif
  const int64_t per = blocked(M) ? GROUP_PANELS : M >= 5 ? WIDE_PANELS : 1;
  const int64_t groups = (np + per - 1) / per, grain = blocked(M) ? 8 / GROUP_PANELS : M >= 5 ? 3 : 8;
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    float* buf = scratch(per * K * P);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * per, nb = std::min<int64_t>(per, np - p0), n0 = p0 * P;
      const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
      const float* b = bias == nullptr ? nullptr : bias + n0;
      dequant_panels(wq, kind, p0, nb, K, buf);
      if (blocked(M)) {
        const int64_t blocks = (M + 5) / 6;
        for (int64_t blk = 0, m0 = 0; blk < blocks; ++blk) {
          const int64_t mb = (M - m0) / (blocks - blk);
          BLOCK_KERNELS<false>[(mb - 1) * 4 + nb - 1](x + m0 * ldx, ldx, buf, K, b, y + m0 * N + n0, N, nw,
                                                     accumulate, Lines{nullptr, 0});
          m0 += mb;
        }
      } else if (M >= 5) {
        WIDE_ROW_KERNELS<>[(M - 5) * 3 + nb - 1](x, ldx, buf, K, b, y + n0, N, nw, accumulate, Lines{nullptr, 0});
      } else {
        rows_kernel(M, x, ldx, buf, K, b, y + n0, N, nw, accumulate);
      }
    }
  });
}

// gemm() over float panels of element type W (float32, or 16-bit weights widened as they are loaded)
template <typename W>
void gemm_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const W* w, int64_t np, int64_t N,
                 const float* bias, float* y, bool accumulate) {
  constexpr int64_t per_line = sizeof(float) / sizeof(W);  // panel rows of W per 64-byte line of floats: 1 or 2
  if (blocked(M)) {
    const int64_t groups = (np + GROUP_PANELS - 1) / GROUP_PANELS, blocks = (M + 5) / 6;
    at::parallel_for(0, groups, 8 / GROUP_PANELS, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * GROUP_PANELS, nb = std::min<int64_t>(GROUP_PANELS, np - p0), n0 = p0 * P;
        const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
        // the next group's panels are prefetched over this group's row blocks, a share each (when each group's
        // first block streamed its own panels, the memory was busy in 1 of `blocks` passes and that block ran
        // far longer than the others: docs/performance.md, "Figures behind the code's choices")
        const int64_t next_lines =
            g + 1 < end ? std::min<int64_t>(GROUP_PANELS, np - p0 - GROUP_PANELS) * K / per_line : 0;
        const float* next = reinterpret_cast<const float*>(w + (p0 + GROUP_PANELS) * K * P);
        for (int64_t blk = 0, m0 = 0; blk < blocks; ++blk) {
          const int64_t mb = (M - m0) / (blocks - blk);  // near-equal blocks: 17 rows -> 5, 6, 6
          const int64_t lo = next_lines * blk / blocks, hi = next_lines * (blk + 1) / blocks;
          (blk == 0 && g == begin ? BLOCK_KERNELS<true, W> : BLOCK_KERNELS<false, W>)[(mb - 1) * 4 + nb - 1](
              x + m0 * ldx, ldx, w + p0 * K * P, K, bias == nullptr ? nullptr : bias + n0, y + m0 * N + n0, N, nw,
              accumulate, Lines{hi > lo ? next + lo * P : nullptr, hi - lo});
          m0 += mb;
        }
      }
    });
    return;
  }
  if (M >= 5) {  // 5-8 rows: all of them against WIDE_PANELS panels at a time (AVX-512: 24 accumulators at 8 rows)
    const int64_t groups = (np + WIDE_PANELS - 1) / WIDE_PANELS;
    at::parallel_for(0, groups, 3, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * WIDE_PANELS, nb = std::min<int64_t>(WIDE_PANELS, np - p0), n0 = p0 * P;
        const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
        WIDE_ROW_KERNELS<W>[(M - 5) * 3 + nb - 1](x, ldx, w + p0 * K * P, K, bias == nullptr ? nullptr : bias + n0,
                                                  y + n0, N, nw, accumulate, Lines{nullptr, 0});
      }
    });
    return;
  }
#ifdef __AVX512F__
  if (M <= 2) {  // 4 panels at a time, streamed: each output's one FMA chain has 3 or more others beside it to hide
                 // its latency (one panel alone, 1 row: 0.83-0.95x)
    const int64_t groups = (np + 3) / 4;
    at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * 4, nb = std::min<int64_t>(4, np - p0), n0 = p0 * P;
        const int64_t nw = std::min<int64_t>(P, N - (p0 + nb - 1) * P);
        BLOCK_KERNELS<true, W>[(M - 1) * 4 + nb - 1](x, ldx, w + p0 * K * P, K,
                                                     bias == nullptr ? nullptr : bias + n0, y + n0, N, nw, accumulate,
                                                     Lines{nullptr, 0});
      }
    });
    return;
  }
#endif
  at::parallel_for(0, np, 8, [&](int64_t begin, int64_t end) {  // 3-4 rows: a panel at a time (as fast as 2-4)
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
      rows_kernel(M, x, ldx, w + p * K * P, K, bias == nullptr ? nullptr : bias + n0, y + n0, N, nw, accumulate);
    }
  });
}

// 16-bit float panels (F16 / BF16 weights kept as stored): dtype half or bfloat16, [ceil(N/16), K, 16]
inline bool is_half_panels(const torch::Tensor& w) {
  return w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16;
}

// The arithmetic a GEMM runs in: float32 (exact: the weights' float values), int8 activation blocks against quantized
// panels (VNNI), or bfloat16 (gemm_bf16). Each a row's own: no row's result depends on the others in the GEMM.
struct Arith {
  bool int8_x = false;
  bool bf16 = false;
};

void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const Weight& w, int64_t N, const float* bias,
          float* y, bool accumulate, Arith arith = {}) {
  const torch::Tensor& wp = w.data;
  const int64_t np = wp.size(0);
  if (arith.bf16)
    return gemm_bf16(x, ldx, M, K, wp, w.blocks() ? static_cast<int>(w.kind) : NOT_BLOCKS, N, bias, y, accumulate);
  const bool int8_x = arith.int8_x;
  if (w.blocks()) return gemm_quant(x, ldx, M, K, wp, static_cast<int>(w.kind), N, bias, y, accumulate, int8_x);
  switch (wp.scalar_type()) {
    case torch::kFloat:
      return gemm_panels(x, ldx, M, K, wp.data_ptr<float>(), np, N, bias, y, accumulate);
    case torch::kHalf:
      return gemm_panels(x, ldx, M, K, static_cast<const Half16*>(wp.data_ptr()), np, N, bias, y, accumulate);
    case torch::kBFloat16:
      return gemm_panels(x, ldx, M, K, static_cast<const BHalf16*>(wp.data_ptr()), np, N, bias, y, accumulate);
    default:
      TORCH_CHECK(false, "gemm: float panels of dtype ", wp.scalar_type());
  }
}

// Several small GEMMs in one parallel region (a layer's routed experts at small batch): each thread takes a run of
// panels of one GEMM or the next, on rows prepared once before the region. The panel kernels and the rows' preparation
// are gemm()'s own for the same rows, so every output is gemm()'s bit for bit. For what gemm() streams a panel at a
// time: 1-4 rows (or int8 activations against blocks) on AVX-512 builds, not bf16 arithmetic.
struct PreparedRows {
  const float* x = nullptr;  // the rows, ldx apart
  int64_t ldx = 0, K = 0;
  const int8_t* xq = nullptr;  // int8 activations: the rows as int8 blocks and their scales
  const float* dx = nullptr;
  const float* xsum = nullptr;  // each row's sum over each block (kinds with offsets; int8: from the int8 rows)
  PreparedRows rows_from(int64_t r) const {  // the rows from row r on
    const int64_t nblk = K / QK;
    return {x + r * ldx, ldx, K, xq == nullptr ? nullptr : xq + r * K, dx == nullptr ? nullptr : dx + r * nblk,
            xsum == nullptr ? nullptr : xsum + r * nblk};
  }
};

struct RowBuffers {  // the caller's: prepare_rows sizes them
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum;
};

inline bool panel_range_applies(const Weight& w, int64_t max_rows, Arith arith) {
#ifdef __AVX512F__
  if (arith.bf16) return false;
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (w.blocks() && arith.int8_x) return true;
#endif
  return max_rows <= 4 && (w.blocks() || w.data.scalar_type() == torch::kFloat || is_half_panels(w.data));
#else
  (void)w, (void)max_rows, (void)arith;
  return false;
#endif
}

// What gemm() makes of M rows before it reads `w`'s panels (where panel_range_applies)
PreparedRows prepare_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const Weight& w, Arith arith,
                          RowBuffers& buf) {
  PreparedRows r{x, ldx, K};
  if (!w.blocks()) return r;
  const int64_t nblk = K / QK;
  if (static_cast<int64_t>(buf.xsum.size()) < M * nblk) buf.xsum.resize(M * nblk), buf.dx.resize(M * nblk);
  r.xsum = buf.xsum.data();
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  if (arith.int8_x) {
    if (static_cast<int64_t>(buf.xq.size()) < M * K) buf.xq.resize(M * K);
    r.xq = buf.xq.data(), r.dx = buf.dx.data();
    quantize_rows(x, ldx, M, K, buf.xq.data(), buf.dx.data(), buf.xsum.data());
    return r;
  }
#endif
  if (has_offset(static_cast<int>(w.kind))) block_sums(x, ldx, M, K, buf.xsum.data());
  return r;
}

// y[M, N] = the prepared rows times panels [pb, pe) of w, on the calling thread (no bias: the experts have none)
void gemm_panel_range(const PreparedRows& r, int64_t M, const Weight& w, int64_t N, int64_t pb, int64_t pe, float* y,
                      Arith arith) {
#ifdef __AVX512F__
  const int64_t K = r.K;
  if (w.blocks()) {
    const int kind = static_cast<int>(w.kind);
    const int64_t nblk = K / QK, panel_bytes = nblk * KIND_BLOCK[kind];
    const uint8_t* base = static_cast<const uint8_t*>(w.data.data_ptr());
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    if (arith.int8_x) {
      for (int64_t p = pb; p < pe; ++p) {
        const int64_t n0 = p * P, nw = std::min<int64_t>(P, N - n0);
        for (int64_t r0 = 0; r0 < M; r0 += 8)
          INT8X_BY_KIND[kind][std::min<int64_t>(8, M - r0) - 1](r.xq + r0 * K, r.dx + r0 * nblk, K,
                                                                base + p * panel_bytes, K, nullptr, y + r0 * N + n0, N,
                                                                nw, false, r.xsum + r0 * nblk);
      }
      return;
    }
#endif
    const QuantPanelKernel kernel = ROWS_BY_KIND[kind][M - 1];
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * P;
      kernel(r.x, r.ldx, base + p * panel_bytes, K, nullptr, y + n0, N, std::min<int64_t>(P, N - n0), false, r.xsum);
    }
    return;
  }
  auto panels = [&](const auto* w0) {
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * P;
      rows_kernel(M, r.x, r.ldx, w0 + p * K * P, K, nullptr, y + n0, N, std::min<int64_t>(P, N - n0), false);
    }
  };
  switch (w.data.scalar_type()) {
    case torch::kFloat: return panels(w.data.data_ptr<float>());
    case torch::kHalf: return panels(static_cast<const Half16*>(w.data.data_ptr()));
    default: return panels(static_cast<const BHalf16*>(w.data.data_ptr()));
  }
#else
  (void)r, (void)M, (void)w, (void)N, (void)pb, (void)pe, (void)y, (void)arith;
  TORCH_CHECK(false, "gemm_panel_range: an AVX-512 build only (panel_range_applies says so)");
#endif
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

// A quantized weight's panels, checked against its block kind and its [in K, out N] shape.
void check_quant(const Weight& w, int64_t K, int64_t N, const char* name) {
  TORCH_CHECK(w.kind >= 0 && w.kind < NUM_BLOCK_KINDS, name, ": no block kind ", w.kind);
  const torch::Tensor& wq = w.data;
  TORCH_CHECK(wq.dim() == 3 && wq.scalar_type() == KIND_STORAGE[w.kind] && wq.size(2) == KIND_BLOCK[w.kind],
              name, ": not ", KIND_NAME[w.kind], " panels (", KIND_STORAGE[w.kind], " [.., .., ", KIND_BLOCK[w.kind],
              "]), got ", wq.scalar_type(), " ", wq.sizes());
  TORCH_CHECK(wq.is_contiguous() && K % QK == 0 && wq.size(0) == (N + P - 1) / P && wq.size(1) == K / QK,
              name, ": quantized panels do not match the weight's shape");
}

// A quantized weight's panels dequantized: float32 [ceil(N/16), K, 16] (pack_panels' layout).
torch::Tensor dequantize_panels(const Weight& w, int64_t K) {
  check_quant(w, K, w.data.size(0) * P, "dequantize_panels");
  const torch::Tensor& wq = w.data;
  auto out = torch::empty({wq.size(0), K, P}, torch::kFloat);
  at::parallel_for(0, wq.size(0), 16, [&](int64_t begin, int64_t end) {
    dequant_panels(wq, static_cast<int>(w.kind), begin, end - begin, K, out.data_ptr<float>() + begin * K * P);
  });
  return out;
}

// Rows `ids` of the [N, K] matrix a quantized weight holds (a tied embedding table looked up from the LM head's
// panels): float32 [len(ids), K].
torch::Tensor quant_rows(const Weight& w, int64_t K, const torch::Tensor& ids) {
  check_quant(w, K, w.data.size(0) * P, "quant_rows");
  const torch::Tensor& wq = w.data;
  auto idx = ids.to(torch::kLong).contiguous();
  const int kind = static_cast<int>(w.kind);
  const int64_t n = idx.numel(), nblk = K / QK, bb = KIND_BLOCK[kind];
  auto out = torch::empty({n, K}, torch::kFloat);
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < wq.size(0) * P, "quant_rows: id out of range");
  float panel_block[QK * P];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = id[i] / P, c = id[i] % P;
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* blk = static_cast<const uint8_t*>(wq.data_ptr()) + (p * nblk + b) * bb;
      dequant_any(kind, blk, panel_block);
      for (int64_t k = 0; k < QK; ++k) out.data_ptr<float>()[i * K + b * QK + k] = panel_block[k * P + c];
    }
  }
  return out;
}

torch::Tensor panel_linear(const torch::Tensor& x, const Weight& w, int64_t N,
                           const c10::optional<torch::Tensor>& bias, bool int8_activations, bool bf16) {
  const torch::Tensor& wp = w.data;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && wp.dim() == 3, "panel_linear: float32 x, packed weight");
  auto xc = x.contiguous();
  const int64_t K = xc.size(-1), M = xc.numel() / K;
  if (w.blocks())
    check_quant(w, K, N, "panel_linear");
  else
    TORCH_CHECK((wp.scalar_type() == torch::kFloat || is_half_panels(wp)) && wp.size(2) == P && wp.size(1) == K &&
                    wp.size(0) * P >= N,
                "panel_linear: float panels do not match x (quantized panels need their block kind)");
  auto y = torch::empty({M, N}, xc.options());
  gemm(xc.data_ptr<float>(), K, M, K, w, N, bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
       false, Arith{int8_activations, bf16});
  return y;
}

// Reads every byte of x once, as a decode step streams its weights (threads over contiguous halves, 64-byte loads
// OR-ed into four accumulators: next to no arithmetic per line), and returns a value that depends on all of them.
// The read-bandwidth probe of the benchmarks' rooflines: torch's sum, the probe before, was bound by its additions
// on one 2-core EPYC, so a decode step could "beat" it (docs/performance.md, "Figures behind the code's choices").
int64_t stream_read(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "stream_read: a contiguous CPU tensor");
  const uint8_t* p = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t lines = x.numel() * x.element_size() / 256;  // 4 lines a step; a ragged tail is not read
  std::atomic<int64_t> folded{0};
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* q = p + i * 256;
      a0 = _mm512_or_si512(a0, _mm512_loadu_si512(q));
      a1 = _mm512_or_si512(a1, _mm512_loadu_si512(q + 64));
      a2 = _mm512_or_si512(a2, _mm512_loadu_si512(q + 128));
      a3 = _mm512_or_si512(a3, _mm512_loadu_si512(q + 192));
    }
    const __m512i a = _mm512_or_si512(_mm512_or_si512(a0, a1), _mm512_or_si512(a2, a3));
    folded.fetch_or(_mm512_reduce_or_epi64(a));
#else
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t i = begin; i < end; ++i)
      for (int j = 0; j < 256; j += 64) {
        a0 = _mm256_or_si256(a0, _mm256_loadu_si256((const __m256i*)(p + i * 256 + j)));
        a1 = _mm256_or_si256(a1, _mm256_loadu_si256((const __m256i*)(p + i * 256 + j + 32)));
      }
    alignas(32) int64_t v[4];
    _mm256_store_si256((__m256i*)v, _mm256_or_si256(a0, a1));
    folded.fetch_or(v[0] | v[1] | v[2] | v[3]);
#endif
  });
  return folded.load();
}
