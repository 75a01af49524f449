// Attention over a step's rows: each row's own cache (float or int8 as stored) and shared segments read once
// for every row that reads them, merged by an online softmax. No decoder needed: the native step holds one,
// and the module's attention_step runs one alone (bmc-calibrate and the benchmarks time it).
// One of the native step's headers: cpu_decode.cpp includes them all, in order, into one translation unit.
#pragma once

namespace {

struct Segment {  // a shared prefix: KV of `groups` groups, each row reading group[b] (-1: none)
  const uint8_t* kv;
  KVLayout lay;
  const float* bias;
  const int64_t* group;
  int64_t groups, len;
  int64_t slab;  // rows per (group, KV head) slab: len, or more for a view of a longer segment (the prefix cache)
};

#if !HAVE_I8_KV_DOTS
struct I8Buffers {};  // no integer int8 KV attention in this build: attend_chunk's i8 is always null
#endif

// A step's holes: columns a decode or verify query's bias masks between its row's first key and the query's own
// column. Speculation leaves them in the cache where rows accepted different counts of a verify step (every row
// writes at the same column), and a branching verify tree has them inside itself: a node's query masks its
// siblings' columns, which sit among its ancestors'. The attention numbers a query's keys without them, so its
// grid falls on the keys it has alone, decoded one token at a time. Found once a step from the full layers' bias
// (the same for every layer), one list for each of its rows' bias rows: query i of row b has the runs
// [at, at + len) from first[list(b, i)] to first[list(b, i) + 1].
struct Holes {
  std::vector<int64_t> at, len, first;
  int64_t rows = 1;        // bias rows a batch row has lists for: 1, or t (a verify step's queries)
  bool per_query = false;  // some query's holes are not its row's first query's (a branching tree's)
  int64_t list(int64_t b, int64_t i) const { return b * rows + (per_query ? i : 0); }
  int64_t keys(int64_t b, int64_t i) const {
    int64_t n = 0;
    for (int64_t h = first[list(b, i)]; h < first[list(b, i) + 1]; ++h) n += len[h];
    return n;
  }
  // bias [B, 1, bias_rows, cap]
  static Holes find(const float* bias, int64_t bias_rows, int64_t cap, int64_t B) {
    Holes out;
    out.rows = bias_rows;
    out.first.assign(B * bias_rows + 1, 0);
    for (int64_t b = 0; b < B; ++b) {
      const float* first_row = bias + b * bias_rows * cap;
      int64_t origin = 0;  // the row's first key: its first query's first open column
      while (origin < cap && !(first_row[origin] > -FLT_MAX)) ++origin;
      for (int64_t i = 0; i < bias_rows; ++i) {
        const float* row = first_row + i * cap;
        int64_t last = cap - 1;
        while (last > origin && !(row[last] > -FLT_MAX)) --last;
        for (int64_t c = origin + 1; c < last;) {
          if (c + P <= last) {  // a block of 16 columns none of which is masked (a min reduction vectorizes)
            float lo = FLT_MAX;
            for (int64_t k = 0; k < P; ++k) lo = std::min(lo, row[c + k]);
            if (lo > -FLT_MAX) {
              c += P;
              continue;
            }
          }
          if (row[c] > -FLT_MAX) {
            ++c;
            continue;
          }
          int64_t e = c;
          while (e < last && !(row[e] > -FLT_MAX)) ++e;
          out.at.push_back(c);
          out.len.push_back(e - c);
          c = e;
        }
        const int64_t n = b * bias_rows + i;
        out.first[n + 1] = static_cast<int64_t>(out.at.size());
        if (i > 0) {  // the same runs as the row's first query's?
          const int64_t a0 = out.first[b * bias_rows], n0 = out.first[b * bias_rows + 1] - a0;
          const int64_t ai = out.first[n], ni = out.first[n + 1] - ai;
          bool same = ni == n0;
          for (int64_t h = 0; same && h < ni; ++h)
            same = out.at[ai + h] == out.at[a0 + h] && out.len[ai + h] == out.len[a0 + h];
          out.per_query = out.per_query || !same;
        }
      }
    }
    return out;
  }
};

// A worker's buffers for Attention::attend_chunk over up to rmax query rows
struct ChunkScratch {
  Rows rows;
  std::vector<float> p, kbuf, vbuf;  // the rows' chunk weights; narrower rows widened
#if HAVE_I8_KV_DOTS
  I8Buffers i8;  // the rows' query digits, where int8 KV is attended in integers
#endif
  bool dots;
  ChunkScratch(int64_t rmax, int64_t hd, bool narrow, bool dots_)
      : rows(rmax, OWN_KEYS * hd), p(rmax * OWN_KEYS), kbuf(narrow ? OWN_KEYS * hd : 0),
        vbuf(narrow ? OWN_KEYS * hd : 0),
#if HAVE_I8_KV_DOTS
        i8(dots_ ? rmax : 0, hd / 64),
#endif
        dots(dots_) {
  }
  I8Buffers* integer_rows() {
#if HAVE_I8_KV_DOTS
    return dots ? &i8 : nullptr;
#else
    return nullptr;
#endif
  }
};

class Attention {
 public:
  Attention(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale)
      : h_(heads), kvh_(kv_heads), hd_(head_dim), scale_(scale) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  }

  void set_softcap(double cap) {  // Gemma 2: scores soft-capped (cap * tanh(s / cap)) before the softmax; 0: none
    TORCH_CHECK(cap >= 0.0, "set_softcap: cap >= 0");
    softcap_ = cap;
  }
  // int8 KV attended in integers (attend_i8, a stated bound beside int8 rows' own) or widened to float32 first
  void set_int8_kv_dots(bool on) {
    TORCH_CHECK(!on || HAVE_I8_KV_DOTS, "integer int8 KV attention needs AVX512-VNNI and AVX512-BW");
    int8_kv_dots_ = on;
  }
  bool int8_kv_dots() const { return int8_kv_dots_; }
  // a prompt's rows attend their own cache in bfloat16 arithmetic (attend_keys_bf16), as their GEMMs do
  void set_bf16_prompts(bool on) { bf16_prompts_ = on; }
  // The thread count the capacity's split into spans is planned for (0: the running count). A split sets the
  // merge order, so fixing it keeps the results the same when fewer threads run the tasks (platform/threads.py).
  void set_split_threads(int64_t threads) { split_threads_ = std::max<int64_t>(0, threads); }
  int64_t split_threads() const { return split_threads_ > 0 ? split_threads_ : at::get_num_threads(); }

  // One layer's attention alone, the kernel a decode or verify step runs (bmc-calibrate, the benchmarks and
  // the tests call it): q [B, t, H*d] with RoPE applied, kv [L, 2, B, H_kv, cap, d] already holding the step's keys, bias
  // [B, 1, 1 or t, cap], segments as in forward(); prompt: the rows are a prompt chunk's (see attention(); the
  // binding's default is a decode or verify step's). Returns [B, t, H*d].
  torch::Tensor attention_step(torch::Tensor q, torch::Tensor kv, int64_t layer, torch::Tensor bias,
                               std::vector<torch::Tensor> seg_kv, std::vector<torch::Tensor> seg_bias,
                               std::vector<torch::Tensor> seg_group, bool prompt, bool holes = false) const {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "q: float32");
    TORCH_CHECK(q.dim() == 3 && q.size(2) == h_ * hd_, "q: [B, t, heads * head_dim]");
    const int64_t slab = slab_rows(kv, "kv");
    TORCH_CHECK(kv.size(2) == q.size(0) && kv.size(3) == kvh_ && layer >= 0 && layer < kv.size(0),
                "kv: a [L, 2, B, H_kv, cap, d] cache of these heads holding `layer`");
    const KVLayout lay = kv_layout(kv, hd_, "kv");
    const int64_t B = q.size(0), t = q.size(1), cap = kv.size(4);
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(-1) == cap && (bias.size(2) == 1 || bias.size(2) == t), "bias shape");
    q = q.contiguous();
    bias = bias.to(torch::kFloat).contiguous();
    const std::vector<Segment> segs = parse_segments(seg_kv, seg_bias, seg_group, B, kv.size(0));
    auto out = torch::empty_like(q);
    const int64_t layer_bytes = 2 * B * kvh_ * slab * lay.row_bytes;
    const uint8_t* kc = static_cast<const uint8_t*>(kv.data_ptr()) + layer * layer_bytes;
    holes = holes || (!prompt && t > 1 && bias.size(2) == t);  // as the step's parts (settle_holes)
    const Holes found = holes ? Holes::find(bias.data_ptr<float>(), bias.size(2), cap, B) : Holes{};
    attention(layer, q.data_ptr<float>(), h_ * hd_, kc, kc + layer_bytes / 2, lay, cap, slab, bias.data_ptr<float>(),
              bias.size(2), B, t, segs, out.data_ptr<float>(), prompt, nullptr, nullptr, holes ? &found : nullptr);
    return out;
  }

  // Checks the shared segments against the heads and batch and makes them contiguous in place where they are
  // not a view of one with more columns per slab (the vectors keep the tensors alive while the step runs). A row
  // whose group is -1 does not read that segment.
  std::vector<Segment> parse_segments(std::vector<torch::Tensor>& seg_kv, std::vector<torch::Tensor>& seg_bias,
                                      std::vector<torch::Tensor>& seg_group, int64_t B, int64_t L) const {
    TORCH_CHECK(seg_kv.size() == seg_bias.size() && seg_kv.size() == seg_group.size(), "segments: kv, bias, group");
    std::vector<Segment> segs;
    for (size_t n = 0; n < seg_kv.size(); ++n) {
      if (!slab_view(seg_kv[n])) seg_kv[n] = seg_kv[n].contiguous();
      seg_bias[n] = seg_bias[n].to(torch::kFloat).contiguous();
      seg_group[n] = seg_group[n].to(torch::kLong).contiguous();
      const auto& sk = seg_kv[n];
      TORCH_CHECK(sk.dim() == 6 && sk.size(0) == L && sk.size(1) == 2 && sk.size(3) == kvh_ &&
                      seg_bias[n].numel() == sk.size(2) * sk.size(4) && seg_group[n].numel() == B,
                  "segment ", n, ": shapes do not match the heads and batch");
      const KVLayout lay = kv_layout(sk, hd_, "segment");
      const int64_t* grp = seg_group[n].data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(grp[b] >= -1 && grp[b] < sk.size(2), "segment ", n, ": row ", b, " reads group ", grp[b],
                    " of ", sk.size(2));
      segs.push_back(Segment{static_cast<const uint8_t*>(sk.data_ptr()), lay, seg_bias[n].data_ptr<float>(), grp,
                             sk.size(2), sk.size(4), slab_rows(sk, "segment")});
    }
    return segs;
  }


  // softmax(q K^T * scale + bias) V for every query row, in two passes over one running softmax state per query
  // row (max m, sum s, and the unnormalised output, kept in the output row itself):
  //  1. shared segments (Hydragen's prefixes, stored once per group) that several rows read: the whole spans of
  //     them walked together (walk_shared_spans), so a chunk comes from memory once per step for many rows and
  //     from L1/L2 for the rest, each row with its own walk's arithmetic; a row reading a segment stored in
  //     another layout walks it in the segment's own order (attend_segment);
  //  2. the row's own walk: its remaining segment keys as its first keys, then its own cache over its whole
  //     capacity with the additive bias (padding rows cost compute, as in the dense path), merged into the same
  //     state, then normalised: the exact softmax over all keys.
  // The G*t query rows of a KV head share each K/V row read (GQA/MQA never repeat KV heads).
  // prompt: the rows are a prompt's, whose scores of 8 or more rows a KV head are one matrix product. Other rows
  // (decode, a verify tree) score each row by dot products, whatever their count, so that a verify step's row is
  // the bits of the same token decoded alone (the two sum in other orders), and speculation gives plain decoding's
  // tokens in every arithmetic.
  // grid_bias: where given (a window layer's call, with the full layers' bias, shaped as bias), each row's grid
  // origin is taken from it rather than from bias (see origin below). grid_origin: where given ([B]; a window on
  // every layer), each row's origin column itself, that of its position 0: negative where the cache has dropped
  // the row's first keys (columns below 0 are read as masked keys). holes: where given (the cache has them), the
  // rows' holes (Holes), left out of a decode or verify row's key numbering.
  void attention(int64_t l, const float* qkv, int64_t nq, const uint8_t* kc, const uint8_t* vc, const KVLayout& lay,
                 int64_t cap, int64_t slab, const float* bias, int64_t bias_rows, int64_t B, int64_t t,
                 const std::vector<Segment>& segs, float* out, bool prompt, const float* grid_bias = nullptr,
                 const int64_t* grid_origin = nullptr, const Holes* holes = nullptr) const {
    const int64_t G = h_ / kvh_, R = G * t;
    const float scale = static_cast<float>(scale_);
    const bool prior = !segs.empty();
    TORCH_CHECK(!prior || softcap_ == 0.0, "soft-capped attention reads no shared segments");
    std::vector<float> run_m, run_s;
    // Rows whose segments are read as their first keys by the walk below (inline), on the grid a row alone has
    // over the same keys in its own cache: the same bits as that row alone. That is every row whose segments no
    // other decode row reads (a request's own long prompt, a hit no running row shares) and a prompt chunk's. A
    // segment several rows read goes through attend_segment (Hydragen: each chunk read once for all of them; its
    // sums in their own order), as does a row reading one stored in another layout. pre[b]: the keys of row b's
    // inline segments.
    // A row that shares a segment with other decode rows of the step (Hydragen's case) has the whole spans of
    // its segment keys (joint[b] of them) walked once for every row whose keys there are the same: each chunk read
    // once for all of them, each row's arithmetic that of its own walk (walk_shared_spans); its walk below starts
    // after them, from the state they leave.
    constexpr int64_t span_keys = SPAN_CHUNKS * OWN_KEYS;
    static thread_local std::vector<int64_t> pre_buf, joint_buf;
    static thread_local std::vector<char> inline_buf;
    pre_buf.assign(B, 0);
    joint_buf.assign(B, 0);
    inline_buf.assign(B, 0);
    int64_t* pre = pre_buf.data();
    int64_t* joint = joint_buf.data();
    char* inline_row = inline_buf.data();
    if (prior) {
      std::vector<char> shared(segs.size());
      for (size_t n = 0; n < segs.size(); ++n) {
        int64_t members = 0;
        for (int64_t b = 0; b < B; ++b) members += segs[n].group[b] >= 0;
        shared[n] = !prompt && members > 1;
      }
      for (int64_t b = 0; b < B; ++b) {
        bool reads = false, same_layout = true, shares = false;
        int64_t keys = 0;
        for (size_t n = 0; n < segs.size(); ++n) {
          if (segs[n].group[b] < 0) continue;
          reads = true;
          shares = shares || shared[n];
          same_layout = same_layout && segs[n].lay.kind == lay.kind && segs[n].lay.row_bytes == lay.row_bytes;
          keys += segs[n].len;
        }
        if (reads && same_layout) inline_row[b] = 1, pre[b] = keys, joint[b] = shares ? keys / span_keys : 0;
      }
      run_m.assign(B * t * h_, -FLT_MAX);
      run_s.assign(B * t * h_, 0.0f);
      std::fill(out, out + B * t * h_ * hd_, 0.0f);
      for (const Segment& sg : segs)
        attend_segment(l, qkv, nq, B, t, sg, scale, run_m.data(), run_s.data(), out, inline_row);
      walk_shared_spans(l, qkv, nq, B, t, segs, lay, scale, joint, run_m.data(), run_s.data(), out);
    }
    // Every row's capacity is attended in spans of SPAN_CHUNKS chunks, whatever the batch, capacity or threads
    // (flash-decoding's split-K): each span into a fresh state, the spans folded in order, exactly by their maxima
    // and sums (into nothing yet, a span is copied). So a row's sums are its own: the same bits alone or in any
    // batch (spans past its length are all masked and add nothing), at any thread count, and for a prompt's row
    // however the prompt is chunked. Only the spreading of the work varies: with enough (row, KV head, query
    // block) items for the threads a task walks its spans, folding as it goes; with few (a decode step at batch
    // 1), each span is a task and the partial states are folded after. Each key is read once.
    // A prompt's query positions are taken QUERY_BLOCK at a time (each block a task of its own: a prompt of 512
    // tokens at batch 1 has only H_kv pairs), and a block skips the key chunks that every one of its rows has
    // masked once each row has seen a key: those add exactly nothing (see skip below).
    // (with a window on every layer, grid_origin, the masked columns inside a row are also keys that left the
    // window, which alone it has too: there holes are not left out, a gap design.md names)
    const bool holed = holes != nullptr && !prompt && grid_origin == nullptr;
    // queries whose holes differ (a branching verify tree's nodes) number their keys apart: a task each
    const bool per_query = holed && holes->per_query;
    const int64_t qb = per_query ? 1 : std::min(t, QUERY_BLOCK), qblocks = (t + qb - 1) / qb, Rmax = G * qb;
    const int64_t pairs = B * kvh_, threads = split_threads();
    // Each row's grid of spans and chunks starts at its first key (the first its first query's bias does not
    // mask): the batch cache left-pads a shorter row, so its keys sit at other columns than alone, and a grid from
    // column 0 would fall on other keys. A window layer's first open key is its first query's window start, which
    // moves with the prompt's chunking: there the full layers' bias gives the row's first key (grid_bias), and the
    // spans before a query's window are masked whole (skipped) or in part (their masked keys add exactly nothing)
    static thread_local std::vector<int64_t> origin_buf;  // the calling thread's: no allocation a layer
    if (static_cast<int64_t>(origin_buf.size()) < B) origin_buf.resize(B);
    int64_t* origin = origin_buf.data();  // taken here: inside the workers the name would be their own buffer
    int64_t spans = 1;
    for (int64_t b = 0; b < B; ++b) {
      if (grid_origin != nullptr) {
        origin[b] = std::min(grid_origin[b], cap);
      } else {
        const float* row = (grid_bias != nullptr ? grid_bias : bias) + b * bias_rows * cap;
        int64_t j = 0;
        while (j < cap && !(row[j] > -FLT_MAX)) ++j;
        origin[b] = j < cap ? j : 0;
      }
      int64_t hole_keys = holed ? holes->keys(b, 0) : 0;  // the fewest of the row's queries
      for (int64_t i = 1; per_query && i < t; ++i) hole_keys = std::min(hole_keys, holes->keys(b, i));
      spans = std::max(spans, (pre[b] + cap - origin[b] - hole_keys + span_keys - 1) / span_keys);
    }
    const bool split = spans > 1 && pairs * qblocks < 2 * threads;  // a task per span, partial states in part_*
    const int64_t span_tasks = split ? spans : 1;
    const bool walks = !split && (spans > 1 || prior);  // a task folds each span's state into the output row
    std::vector<float> part_m, part_s, part_o;  // [pair, span, R] (and [.., d]) when split
    if (split) {
      part_m.resize(pairs * spans * R);
      part_s.resize(pairs * spans * R);
      part_o.resize(pairs * spans * R * hd_);
    }
    auto state_of = [&](int64_t b, int64_t kh, int64_t r) { return (b * t + r % t) * h_ + kh * G + r / t; };
    const bool narrow = lay.kind != KVKind::F32;  // rows widened a chunk at a time into kbuf / vbuf
    const bool dots = integer_dots(lay);           // int8 rows attended in integers (attend_i8)
    const bool bf16 = prompt && bf16_chunks(lay);  // a prompt's chunks in bfloat16 arithmetic (attend_keys_bf16)
    at::parallel_for(0, pairs * qblocks * span_tasks, 1, [&](int64_t begin, int64_t end) {
      ChunkScratch sc(Rmax, hd_, narrow, dots);
      Rows& rows = sc.rows;
      std::vector<const float*> bias0(Rmax);
      std::vector<int64_t> row_of(Rmax);  // the block's rows, as rows r = g * t + i of the pair
      std::vector<char> seen(Rmax);       // whether row rr has met a key its bias does not mask
      std::vector<float*> out_row(Rmax);
      // walking: a span's state in span_o, the rows' folded state in acc_m, acc_s and their output rows
      std::vector<float> span_o(walks ? Rmax * hd_ : 0), acc_m(walks ? Rmax : 0), acc_s(walks ? Rmax : 0);
      std::unique_ptr<Bf16Chunk> bc(bf16 ? new Bf16Chunk(Rmax, hd_) : nullptr);
      std::vector<int64_t> seg_of;  // the task row's inline segments, in path order
      std::vector<uint8_t> kraw, vraw;  // a chunk across a segment's end, gathered
      std::vector<float> braw;          // and its bias, [Rmax][OWN_KEYS]
      for (int64_t task = begin; task < end; ++task) {
        // query blocks in the order 0, n-1, 1, n-2, ...: a causal prompt's block i reads i + 1 chunks of keys, so
        // the contiguous runs of tasks at::parallel_for hands each thread carry near-equal work (in order, 16
        // threads on a 512-token prompt's 32 tasks gave one thread blocks 6 and 7, 15 chunks, another 0 and 1, 3)
        const int64_t pair = task / (qblocks * span_tasks), q = task / span_tasks % qblocks;
        const int64_t qbk = q % 2 == 0 ? q / 2 : qblocks - 1 - q / 2;
        const int64_t kh = pair / B, b = pair % B, i0 = qbk * qb, nt = std::min(qb, t - i0), Rb = G * nt;
        const int64_t sp0 = split ? task % span_tasks : joint[b], sp1 = split ? sp0 + 1 : spans;
        // the row's keys: its inline segments' (pre[b]), then its own columns from its first; v indexes them
        const int64_t hl = holed ? holes->list(b, i0) : 0;  // the task's queries' holes (one query where per_query)
        const int64_t preb = pre[b], total = preb + cap - origin[b] - (holed ? holes->keys(b, i0) : 0);
        const int64_t kend = std::min(total, sp1 * span_keys);  // where this task's reading ends
        // where this thread's next task starts reading (its first chunk is prefetched during this task's last)
        const int64_t next_pair = (task + 1) / (qblocks * span_tasks), next_b = next_pair % B;
        const int64_t next_k0 = origin[next_b] + (split ? (task + 1) % span_tasks * span_keys : 0);
        const int64_t next_task = task + 1 < end && next_k0 >= 0 && next_k0 < cap && pre[next_b] == 0  // a row index
                                      ? (next_b * kvh_ + next_pair / B) * slab + next_k0
                                      : -1;
        for (int64_t rr = 0; rr < Rb; ++rr) {  // row r = g * t + i: query i of the KV head's g-th query head
          const int64_t i = i0 + rr % nt, r = rr / nt * t + i, state = state_of(b, kh, r);
          row_of[rr] = r;
          rows.q[rr] = qkv + (b * t + i) * nq + (kh * G + r / t) * hd_;
          bias0[rr] = bias + (b * bias_rows + (bias_rows > 1 ? i : 0)) * cap;
          out_row[rr] = out + state * hd_;
          rows.s[rr] = 0.0f;
          if (walks) {
            acc_m[rr] = prior ? run_m[state] : -FLT_MAX;
            acc_s[rr] = prior ? run_s[state] : 0.0f;
          }
        }
#if HAVE_I8_KV_DOTS
        if (dots)
          for (int64_t rr = 0; rr < Rb; ++rr) split_query(rows.q[rr], hd_, scale, sc.i8.q[rr]);
#endif
        if (bf16) bc->set_queries(rows.q.data(), Rb);
        const int64_t own = (b * kvh_ + kh) * slab;  // the pair's first row
        const int64_t rb = lay.row_bytes;
        seg_of.clear();
        if (preb > 0)
          for (size_t n = 0; n < segs.size(); ++n)
            if (segs[n].group[b] >= 0) seg_of.push_back(static_cast<int64_t>(n));
        auto own_col = [&](int64_t v) {  // own key v's column: past the row's holes before it
          int64_t c = origin[b] + v - preb;
          if (holed)
            for (int64_t h = holes->first[hl]; h < holes->first[hl + 1] && c >= holes->at[h]; ++h) c += holes->len[h];
          return c;
        };
        // segment si's key row `off` (K and V) and its bias there, for this task's KV head
        auto seg_at = [&](int64_t si, int64_t off, const uint8_t*& kp, const uint8_t*& vp, const float*& bp) {
          segment_row(segs[si], l, segs[si].group[b], kh, off, kp, vp, bp);
        };
        // the rows of keys [v0, v0 + n): own columns (col >= 0, bias bias0[rr] + col), one segment's (its bias
        // `shared` for every query row), or, across a segment's end, gathered into kraw / vraw and braw
        struct ChunkAt {
          const uint8_t *k, *v;
          int64_t col;
          const float *shared, *per_row;
        };
        auto locate = [&](int64_t v0, int64_t n) -> ChunkAt {
          // (own keys in one run of columns: no hole among them)
          if (v0 >= preb && own_col(v0) >= 0 && own_col(v0 + n - 1) - own_col(v0) == n - 1) {
            const int64_t c = own_col(v0);
            return {kc + (own + c) * rb, vc + (own + c) * rb, c, nullptr, nullptr};
          }
          int64_t at = 0;
          for (int64_t si : seg_of) {
            const int64_t len = segs[si].len;
            if (v0 < at + len) {
              if (v0 + n > at + len) break;
              ChunkAt ch{nullptr, nullptr, -1, nullptr, nullptr};
              seg_at(si, v0 - at, ch.k, ch.v, ch.shared);
              return ch;
            }
            at += len;
          }
          kraw.resize(OWN_KEYS * rb);
          vraw.resize(OWN_KEYS * rb);
          braw.resize(Rmax * OWN_KEYS);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t v = v0 + j;
            const uint8_t *kp = nullptr, *vp = nullptr;
            if (v >= preb && own_col(v) < 0) {  // a key the cache dropped (before column 0): masked, zero rows
              std::memset(kraw.data() + j * rb, 0, rb);
              std::memset(vraw.data() + j * rb, 0, rb);
              for (int64_t rr = 0; rr < Rb; ++rr) braw[rr * OWN_KEYS + j] = -FLT_MAX;
              continue;
            }
            if (v >= preb) {
              const int64_t c = own_col(v);
              kp = kc + (own + c) * rb, vp = vc + (own + c) * rb;
              for (int64_t rr = 0; rr < Rb; ++rr) braw[rr * OWN_KEYS + j] = bias0[rr][c];
            } else {
              int64_t a = 0;
              for (int64_t si : seg_of) {
                if (v < a + segs[si].len) {
                  const float* bp = nullptr;
                  seg_at(si, v - a, kp, vp, bp);
                  for (int64_t rr = 0; rr < Rb; ++rr) braw[rr * OWN_KEYS + j] = *bp;
                  break;
                }
                a += segs[si].len;
              }
            }
            std::memcpy(kraw.data() + j * rb, kp, rb);
            std::memcpy(vraw.data() + j * rb, vp, rb);
          }
          return {kraw.data(), vraw.data(), -1, nullptr, braw.data()};
        };
        auto bias_of = [&](const ChunkAt& ch, int64_t rr) -> const float* {
          return ch.col >= 0 ? bias0[rr] + ch.col : ch.shared != nullptr ? ch.shared : ch.per_row + rr * OWN_KEYS;
        };
        for (int64_t sp = sp0; sp < sp1; ++sp) {
          const int64_t k0 = sp * span_keys, k1 = std::min(total, k0 + span_keys);
          if (sp < joint[b]) {  // walked jointly (walk_shared_spans): already in the row's prior state
            for (int64_t rr = 0; rr < Rb; ++rr) part_s[(pair * spans + sp) * R + row_of[rr]] = 0.0f;
            continue;
          }
          bool open_span = false;  // whether a row has a key of the span its bias does not mask
          for (int64_t rr = 0; rr < Rb && !open_span; ++rr) {
            if (rr > 0 && bias0[rr] == bias0[rr - 1]) continue;
            float top = -FLT_MAX;
            int64_t at = 0;
            for (int64_t si : seg_of) {  // the span's keys in segments, then in the row's own columns
              const int64_t lo = std::max(k0, at), hi = std::min(k1, at + segs[si].len);
              const float* bp = segs[si].bias + segs[si].group[b] * segs[si].len;
              for (int64_t j = lo; j < hi; ++j) top = std::max(top, bp[j - at]);
              at += segs[si].len;
            }
            const int64_t c1 = own_col(k1);  // (columns below 0: dropped keys, masked)
            for (int64_t j = std::max<int64_t>(0, own_col(std::max(k0, preb))); j < c1; ++j)
              top = std::max(top, bias0[rr][j]);
            open_span = top > -FLT_MAX;
          }
          if (!open_span) {  // every row masks the whole span (past a shorter row's length): it adds nothing
            if (split)
              for (int64_t rr = 0; rr < Rb; ++rr) part_s[(pair * spans + sp) * R + row_of[rr]] = 0.0f;
            continue;
          }
          for (int64_t rr = 0; rr < Rb; ++rr) {
            seen[rr] = 0;
            rows.m[rr] = -FLT_MAX;
            rows.s[rr] = 0.0f;
            rows.o[rr] = split ? part_o.data() + ((pair * spans + sp) * R + row_of[rr]) * hd_
                         : walks ? span_o.data() + rr * hd_ : out_row[rr];
          }
          bool started = false;  // the rows' state holds keys (else the first chunk starts it)
          for (int64_t c0 = k0; c0 < k1; c0 += OWN_KEYS) {  // chunks: K/V come from DRAM once, then from L1/L2
            const int64_t nc = std::min<int64_t>(OWN_KEYS, k1 - c0);
            const ChunkAt ch = locate(c0, nc);
            // skip: every row of the block masks the whole chunk and has met an unmasked key before it, so the
            // chunk's weights would be exp_fast(masked - max) = 0 and its max would leave the state scaled by
            // exp_fast(0) = 1: nothing changes, not a bit (a causal prompt's upper triangle; the padding past a
            // decode row's length)
            bool skip = started;
            for (int64_t rr = 0; rr < Rb; ++rr) {
              const float* bb = bias_of(ch, rr);
              float top = -FLT_MAX;  // a max reduction vectorizes; `open |= bb[j] > -FLT_MAX` ran a compare a key
              for (int64_t j = 0; j < nc; ++j) top = std::max(top, bb[j]);
              const bool open = top > -FLT_MAX;
              skip = skip && !open && seen[rr];
              seen[rr] |= open;
            }
            if (skip) continue;
            for (int64_t rr = 0; rr < Rb; ++rr) rows.bias[rr] = bias_of(ch, rr);
            // the next chunk is prefetched while this one is attended, spread over the passes (see Prefetch): on
            // the hardware prefetcher alone the KV stream ran well below the weights' (docs/performance.md,
            // "Figures behind the code's choices")
            const int64_t next = c0 + OWN_KEYS >= kend ? next_task
                                 : c0 + OWN_KEYS >= preb && own_col(c0 + OWN_KEYS) >= 0 ? own + own_col(c0 + OWN_KEYS)
                                 : -1;
            const bool more = started;
            started = true;
            const uint8_t *next_k = next >= 0 ? kc + next * lay.row_bytes : nullptr,
                          *next_v = next >= 0 ? vc + next * lay.row_bytes : nullptr;
            if (weighs_int8(lay)) {  // the values weighed straight from their int8 rows (see weigh_int8)
              // two chunks ahead: a chunk's arithmetic is short beside the time its 136 lines take to arrive
              // (docs/performance.md, "Figures behind the code's choices"); a span's second chunk is prefetched at
              // its start, its first during the chunks read before it
              constexpr int64_t D = I8_AHEAD;
              int64_t ahead = c0 + D * OWN_KEYS < k1 && c0 + D * OWN_KEYS >= preb &&
                                      own_col(c0 + D * OWN_KEYS) >= 0
                                  ? own + own_col(c0 + D * OWN_KEYS) : -1;
              if (ahead < 0 && c0 + D * OWN_KEYS >= k1) {  // the span's last chunks: the first chunk read after
                if (k1 < kend && k1 >= preb && own_col(k1) >= 0)  // it, the task's next span's
                  ahead = own + own_col(k1);
                else if (k1 >= kend)  // or the thread's next task's (a new row's stream: no hardware prefetch yet)
                  ahead = next_task;
              }
              if (c0 == k0 && ch.col >= 0) {  // the chunks before the first `ahead` one, at once
                const int64_t n = std::min((D - 1) * OWN_KEYS, k1 - c0 - OWN_KEYS);
                const LinePrefetch pk{kc + (own + ch.col + OWN_KEYS) * lay.row_bytes, (n * lay.row_bytes + 63) / 64, 1};
                const LinePrefetch pv{vc + (own + ch.col + OWN_KEYS) * lay.row_bytes, pk.lines, 1};
                if (n > 0) pk.share(0), pv.share(0);
              }
              next_k = ahead >= 0 ? kc + ahead * lay.row_bytes : nullptr;
              next_v = ahead >= 0 ? vc + ahead * lay.row_bytes : nullptr;
            }
            attend_chunk(sc, Rb, lay, ch.k, ch.v, nc, scale, prompt, more, bf16 ? bc.get() : nullptr, next_k, next_v);
          }
          for (int64_t rr = 0; rr < Rb; ++rr) {  // a row that met no key it does not mask leaves an empty state
            if (!seen[rr]) rows.s[rr] = 0.0f;
            if (split) {
              part_m[(pair * spans + sp) * R + row_of[rr]] = rows.m[rr];
              part_s[(pair * spans + sp) * R + row_of[rr]] = rows.s[rr];
            } else if (walks && rows.s[rr] > 0.0f) {
              fold_or_copy(acc_m[rr], acc_s[rr], out_row[rr], rows.m[rr], rows.s[rr], rows.o[rr]);
            }
          }
        }
        if (split) continue;
        for (int64_t rr = 0; rr < Rb; ++rr) normalize(out_row[rr], walks ? acc_s[rr] : rows.s[rr]);
      }
    });
    if (!split) return;
    at::parallel_for(0, pairs * R, 16, [&](int64_t begin, int64_t end) {  // the spans folded in order
      for (int64_t n = begin; n < end; ++n) {
        const int64_t pair = n / R, r = n % R, state = state_of(pair % B, pair / B, r);
        float* o = out + state * hd_;
        float m = prior ? run_m[state] : -FLT_MAX, sum = prior ? run_s[state] : 0.0f;
        for (int64_t sp = 0; sp < spans; ++sp) {
          const int64_t at = (pair * spans + sp) * R + r;
          if (part_s[at] > 0.0f) fold_or_copy(m, sum, o, part_m[at], part_s[at], part_o.data() + at * hd_);
        }
        normalize(o, sum);
      }
    });
  }

  // A span's state (m2, s2, o2) folded into a row's (m, s, o), exactly by their maxima and sums; into an empty
  // state (s = 0), copied. Explicit FMAs: both callers (a task walking its spans, the fold after split spans)
  // round alike.
  void fold_or_copy(float& m, float& s, float* o, float m2, float s2, const float* o2) const {
    if (s == 0.0f) {
      m = m2, s = s2;
      std::copy(o2, o2 + hd_, o);
      return;
    }
    fold_state(m, s, o, m2, s2, o2);
  }
  // o / s; a row that met no key at all (every key masked) reads zeros
  void normalize(float* o, float s) const {
    if (s == 0.0f) {
      std::fill(o, o + hd_, 0.0f);
      return;
    }
    const float inv = 1.0f / s;
    for (int64_t e = 0; e < hd_; ++e) o[e] *= inv;
  }

  // Segment sg's key row `off` of group grp, KV head kh, layer l ([L, 2, groups, H, slab, d]): its K and V rows
  // (as stored) and its bias there
  void segment_row(const Segment& sg, int64_t l, int64_t grp, int64_t kh, int64_t off, const uint8_t*& kp,
                   const uint8_t*& vp, const float*& bp) const {
    const int64_t k_row = ((sg.groups * 2 * l) * kvh_ + grp * kvh_ + kh) * sg.slab;
    const int64_t v_row = k_row + sg.groups * kvh_ * sg.slab;
    kp = sg.kv + (k_row + off) * sg.lay.row_bytes;
    vp = sg.kv + (v_row + off) * sg.lay.row_bytes;
    bp = sg.bias + grp * sg.len + off;
  }

  // One chunk of n stored keys and values (rows at k and v, in layout lay) merged into the running state of R
  // query rows (sc.rows): the one dispatch both walks use, so a row's arithmetic is the same in each. bc: a
  // prompt's bfloat16 chunk buffers, else null. next_k / next_v: stored rows prefetched meanwhile (null: none).
  void attend_chunk(ChunkScratch& sc, int64_t R, const KVLayout& lay, const uint8_t* k, const uint8_t* v, int64_t n,
                    float scale, bool prompt, bool more, Bf16Chunk* bc, const uint8_t* next_k,
                    const uint8_t* next_v) const {
    Rows& rows = sc.rows;
    float *p = sc.p.data(), *kbuf = sc.kbuf.data(), *vbuf = sc.vbuf.data();
    I8Buffers* i8 = sc.integer_rows();
    if (lay.kind == KVKind::F32) {
      const float *K = reinterpret_cast<const float*>(k), *V = reinterpret_cast<const float*>(v);
      if (bc != nullptr)
        attend_keys_bf16(rows, R, *bc, K, V, n, scale, p, OWN_KEYS, more);
      else
        attend_keys(rows, R, prompt, K, V, n, scale, p, OWN_KEYS, more, reinterpret_cast<const float*>(next_k),
                    reinterpret_cast<const float*>(next_v));
      return;
    }
    // narrower rows: widened into L1-sized buffers, the next rows prefetched meanwhile
    if (weighs_int8(lay)) {  // the values weighed straight from their int8 rows (see weigh_int8)
#if HAVE_I8_KV_DOTS
      if (i8 != nullptr) {
        attend_i8(rows, R, *i8, k, v, lay.row_bytes, n, p, OWN_KEYS, more, next_k, next_v);
        return;
      }
#endif
      widen_rows(lay, k, n, hd_, kbuf, next_k, next_v);
      attend_keys(rows, R, prompt, kbuf, nullptr, n, scale, p, OWN_KEYS, more, nullptr, nullptr, v, lay.row_bytes);
      return;
    }
    widen_rows(lay, k, n, hd_, kbuf, next_k);
    widen_rows(lay, v, n, hd_, vbuf, next_v);
    if (bc != nullptr)
      attend_keys_bf16(rows, R, *bc, kbuf, vbuf, n, scale, p, OWN_KEYS, more);
    else
      attend_keys(rows, R, prompt, kbuf, vbuf, n, scale, p, OWN_KEYS, more);
  }

  // The first joint[b] spans of row b's keys (all in its segments) for every row at once: a task is (span, KV
  // head, the rows whose keys up to the span's end are the same segments' groups), reading each chunk once for
  // its rows. Each row's arithmetic is its own walk's over the same keys (attention(): the same 256-key spans from
  // its first key, chunks of OWN_KEYS, a chunk across a segment's end gathered, the same masked-chunk skips, the
  // same kernels, whose rows sum alike at any row count), and the spans' states are folded in order into the
  // row's state (run_m, run_s, out: empty before), as its walk folds them: the bits the row gets alone.
  void walk_shared_spans(int64_t l, const float* qkv, int64_t nq, int64_t B, int64_t t,
                         const std::vector<Segment>& segs, const KVLayout& lay, float scale, const int64_t* joint,
                         float* run_m, float* run_s, float* out) const {
    constexpr int64_t span_keys = SPAN_CHUNKS * OWN_KEYS;
    const int64_t G = h_ / kvh_, Gt = G * t;
    int64_t nspan = 0;
    for (int64_t b = 0; b < B; ++b) nspan = std::max(nspan, joint[b]);
    if (nspan == 0) return;
    std::vector<std::vector<int64_t>> seg_of(B);  // each row's segments in path order
    for (int64_t b = 0; b < B; ++b)
      for (size_t n = 0; n < segs.size(); ++n)
        if (segs[n].group[b] >= 0) seg_of[b].push_back(static_cast<int64_t>(n));
    auto same_keys = [&](int64_t a, int64_t b, int64_t end) {  // rows a and b read the same keys before `end`
      int64_t at = 0;
      for (size_t i = 0; at < end; ++i) {
        if (i >= seg_of[a].size() || i >= seg_of[b].size()) return false;
        const int64_t n = seg_of[a][i];
        if (seg_of[b][i] != n || segs[n].group[a] != segs[n].group[b]) return false;
        at += segs[n].len;
      }
      return true;
    };
    struct Task { int64_t span, kh; std::vector<int64_t> rows; };
    std::vector<Task> tasks;
    int64_t most = 1;  // rows of the largest task
    for (int64_t sp = 0; sp < nspan; ++sp) {
      std::vector<char> placed(B, 0);
      for (int64_t b = 0; b < B; ++b) {
        if (joint[b] <= sp || placed[b]) continue;
        std::vector<int64_t> members{b};
        for (int64_t c = b + 1; c < B; ++c)
          if (joint[c] > sp && !placed[c] && same_keys(b, c, (sp + 1) * span_keys)) members.push_back(c), placed[c] = 1;
        most = std::max<int64_t>(most, static_cast<int64_t>(members.size()));
        for (int64_t kh = 0; kh < kvh_; ++kh) tasks.push_back({sp, kh, members});
      }
    }
    const int64_t Rmax = most * Gt, states = B * t * h_, rb = lay.row_bytes;
    // each (row state, span)'s state: [state][span] (and [.., d]); a span's m and o are written before they are
    // read (its first chunk starts them), s stays 0 for a span that holds no key of the row
    std::unique_ptr<float[]> span_m(new float[states * nspan]), span_o(new float[states * nspan * hd_]);
    std::vector<float> span_s(states * nspan, 0.0f);
    auto state_of = [&](int64_t b, int64_t kh, int64_t r) { return (b * t + r % t) * h_ + kh * G + r / t; };
    const bool narrow = lay.kind != KVKind::F32;
    const bool dots = integer_dots(lay);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      ChunkScratch sc(Rmax, hd_, narrow, dots);
      Rows& rows = sc.rows;
      std::vector<char> seen(Rmax);
      std::vector<int64_t> state(Rmax);
      std::vector<uint8_t> kraw(OWN_KEYS * rb), vraw(OWN_KEYS * rb);
      std::vector<float> braw(OWN_KEYS);
      for (int64_t ti = begin; ti < end; ++ti) {
        const Task& task = tasks[ti];
        const int64_t Rb = static_cast<int64_t>(task.rows.size()) * Gt, b0 = task.rows[0], kh = task.kh;
        const int64_t k0 = task.span * span_keys, k1 = k0 + span_keys;
        for (int64_t rr = 0; rr < Rb; ++rr) {
          const int64_t b = task.rows[rr / Gt], r = rr % Gt;
          state[rr] = state_of(b, kh, r);
          rows.q[rr] = qkv + (b * t + r % t) * nq + (kh * G + r / t) * hd_;
          rows.o[rr] = span_o.get() + (state[rr] * nspan + task.span) * hd_;
          rows.m[rr] = -FLT_MAX;
          rows.s[rr] = 0.0f;
          seen[rr] = 0;
        }
        // the segment keys [v0, v0 + n) of row b0 (every row of the task's): K, V and bias rows in place, or
        // gathered key by key where they cross a segment's end
        auto key_at = [&](int64_t v, const uint8_t*& kp, const uint8_t*& vp, const float*& bp) {
          int64_t at = 0;
          for (int64_t si : seg_of[b0]) {
            const Segment& sg = segs[si];
            if (v < at + sg.len) {
              segment_row(sg, l, sg.group[b0], kh, v - at, kp, vp, bp);
              return sg.len - (v - at);  // keys left in this segment from v
            }
            at += sg.len;
          }
          TORCH_CHECK(false, "walk_shared_spans: a joint span past the row's segments");
          return int64_t{0};
        };
        auto locate = [&](int64_t v0, int64_t n, const uint8_t*& kp, const uint8_t*& vp, const float*& bp) {
          if (key_at(v0, kp, vp, bp) >= n) return;
          for (int64_t j = 0; j < n; ++j) {
            const uint8_t *kj = nullptr, *vj = nullptr;
            const float* bj = nullptr;
            key_at(v0 + j, kj, vj, bj);
            std::memcpy(kraw.data() + j * rb, kj, rb);
            std::memcpy(vraw.data() + j * rb, vj, rb);
            braw[j] = *bj;
          }
          kp = kraw.data(), vp = vraw.data(), bp = braw.data();
        };
#if HAVE_I8_KV_DOTS
        if (dots)
          for (int64_t rr = 0; rr < Rb; ++rr) split_query(rows.q[rr], hd_, scale, sc.i8.q[rr]);
#endif
        bool started = false;
        for (int64_t c0 = k0; c0 < k1; c0 += OWN_KEYS) {
          const int64_t nc = std::min<int64_t>(OWN_KEYS, k1 - c0);
          const uint8_t *kp = nullptr, *vp = nullptr;
          const float* bp = nullptr;
          locate(c0, nc, kp, vp, bp);
          float ctop = -FLT_MAX;  // as the own walk's skip: the same bias for every row here
          for (int64_t j = 0; j < nc; ++j) ctop = std::max(ctop, bp[j]);
          const bool open = ctop > -FLT_MAX;
          bool skip = started;
          for (int64_t rr = 0; rr < Rb; ++rr) {
            skip = skip && !open && seen[rr];
            seen[rr] |= open;
          }
          if (skip) continue;
          for (int64_t rr = 0; rr < Rb; ++rr) rows.bias[rr] = bp;
          const bool more = started;
          started = true;
          attend_chunk(sc, Rb, lay, kp, vp, nc, scale, false, more, nullptr, nullptr, nullptr);
        }
        // (a row that met no key its bias does not mask keeps an empty state, as a span its own walk skips)
        for (int64_t rr = 0; rr < Rb; ++rr) {
          const int64_t at = state[rr] * nspan + task.span;
          span_m[at] = rows.m[rr];
          span_s[at] = seen[rr] ? rows.s[rr] : 0.0f;
        }
      }
    });
    at::parallel_for(0, states, 16, [&](int64_t begin, int64_t end) {  // the spans folded in order
      for (int64_t st = begin; st < end; ++st) {
        const int64_t b = st / h_ / t;
        for (int64_t sp = 0; sp < joint[b]; ++sp) {
          const int64_t at = st * nspan + sp;
          if (span_s[at] > 0.0f)
            fold_or_copy(run_m[st], run_s[st], out + st * hd_, span_m[at], span_s[at], span_o.get() + at * hd_);
        }
      }
    });
  }

  // Tasks are (KV head, group, a slice of up to SEG_QUERY_ROWS of the group's query rows, a span of the segment):
  // the rows of a slice read each chunk of their span once, and with few (KV head, group, slice) triples the
  // segment is split into spans so every thread has work; spans are merged by fold_state.
  void attend_segment(int64_t l, const float* qkv, int64_t nq, int64_t B, int64_t t, const Segment& sg, float scale,
                      float* run_m, float* run_s, float* out, const char* inline_row) const {
    const int64_t G = h_ / kvh_;
    std::vector<std::vector<int64_t>> members(sg.groups);
    for (int64_t b = 0; b < B; ++b)
      if (sg.group[b] >= 0 && !inline_row[b]) members[sg.group[b]].push_back(b);  // inline rows: attention()
    const int64_t slice = std::max<int64_t>(1, SEG_QUERY_ROWS / (G * t)), rmax = slice * G * t;
    const int64_t rpad = (rmax + P - 1) / P * P;
    struct Task { int64_t kh, grp, first, count; };
    std::vector<Task> row_tasks;
    for (int64_t kh = 0; kh < kvh_; ++kh)
      for (int64_t grp = 0; grp < sg.groups; ++grp)
        for (int64_t first = 0; first < static_cast<int64_t>(members[grp].size()); first += slice)
          row_tasks.push_back({kh, grp, first, std::min<int64_t>(slice, members[grp].size() - first)});
    const int64_t nrt = static_cast<int64_t>(row_tasks.size()), chunks = (sg.len + SEG_KEYS - 1) / SEG_KEYS;
    if (nrt == 0) return;  // no row of this batch reads the segment
    const int64_t spans = split_spans(nrt, chunks, split_threads());
    const int64_t span_chunks = (chunks + spans - 1) / spans;
    // [row task, span, row] (and [.., d]) when spans > 1, written by the tasks (the outputs zeroed there, in
    // parallel: zeroing all up front here, outside the parallel loop, was a large share of a short step;
    // docs/performance.md, "Figures behind the code's choices")
    std::unique_ptr<float[]> part_m, part_s, part_o;
    if (spans > 1) {
      part_m.reset(new float[nrt * spans * rmax]);
      part_s.reset(new float[nrt * spans * rmax]);
      part_o.reset(new float[nrt * spans * rmax * hd_]);
    }
    auto state_of = [&](const Task& task, int64_t r) {  // row r = (member c, head g, query i)
      const int64_t b = members[task.grp][task.first + r / (G * t)], g = r / t % G, i = r % t;
      return (b * t + i) * h_ + task.kh * G + g;
    };
    const bool narrow = sg.lay.kind != KVKind::F32;  // rows widened a chunk at a time into kbuf / vbuf
    at::parallel_for(0, nrt * spans, 1, [&](int64_t begin, int64_t end) {
      Rows rows(rpad, 0);
      std::vector<float> p(rpad * SEG_KEYS), qt(hd_ * rpad);
      std::vector<float> kbuf(narrow ? SEG_KEYS * hd_ : 0), vbuf(narrow ? SEG_KEYS * hd_ : 0);
      for (int64_t n = begin; n < end; ++n) {
        const Task& task = row_tasks[n / spans];
        const int64_t span = n % spans, R = task.count * G * t, Rp = (R + P - 1) / P * P;
        const bool cols = R >= WIDE_ROWS && hd_ % P == 0;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t state = state_of(task, r), b = state / h_ / t, i = state / h_ % t;
          rows.q[r] = qkv + (b * t + i) * nq + (state % h_) * hd_;
          if (spans == 1) {
            rows.o[r] = out + state * hd_;
            rows.m[r] = run_m[state];
            rows.s[r] = run_s[state];
          } else {
            rows.o[r] = part_o.get() + (n * rmax + r) * hd_;
            std::fill(rows.o[r], rows.o[r] + hd_, 0.0f);
            rows.m[r] = -FLT_MAX;
            rows.s[r] = 0.0f;
          }
        }
        if (cols) {
          for (int64_t r = R; r < Rp; ++r) {  // padding rows of the 16-row panels: an empty state, never read back
            rows.m[r] = -FLT_MAX;
            rows.s[r] = 0.0f;
          }
          transpose_queries(rows, R, Rp, scale, qt.data());
        }
        const int64_t head = (sg.groups * 2 * l) * kvh_;  // [L, 2, groups, H, slab, d]
        const int64_t k_row = (head + task.grp * kvh_ + task.kh) * sg.slab, v_row = k_row + sg.groups * kvh_ * sg.slab;
        const float* Kf = reinterpret_cast<const float*>(sg.kv) + k_row * hd_;
        const float* Vf = reinterpret_cast<const float*>(sg.kv) + v_row * hd_;
        const int64_t k1 = std::min(sg.len, (span + 1) * span_chunks * SEG_KEYS);
        for (int64_t c0 = span * span_chunks * SEG_KEYS; c0 < k1; c0 += SEG_KEYS) {
          const int64_t nc = std::min<int64_t>(SEG_KEYS, k1 - c0);
          const float* bias = sg.bias + task.grp * sg.len + c0;
          const bool more = c0 + SEG_KEYS < k1;
          const float *K = Kf + c0 * hd_, *V = Vf + c0 * hd_;
          const float *K_next = more ? K + SEG_KEYS * hd_ : nullptr, *V_next = more ? V + SEG_KEYS * hd_ : nullptr;
          if (narrow) {  // widened into L1-sized buffers, the next chunk's stored rows prefetched meanwhile
            const uint8_t* k_at = sg.kv + (k_row + c0) * sg.lay.row_bytes;
            const uint8_t* v_at = sg.kv + (v_row + c0) * sg.lay.row_bytes;
            const int64_t skip = SEG_KEYS * sg.lay.row_bytes;
            widen_rows(sg.lay, k_at, nc, hd_, kbuf.data(), more ? k_at + skip : nullptr);
            widen_rows(sg.lay, v_at, nc, hd_, vbuf.data(), more ? v_at + skip : nullptr);
            K = kbuf.data(), V = vbuf.data(), K_next = nullptr, V_next = nullptr;
          }
          if (cols) {
            // the next chunk of this span is prefetched while this one is attended (K over the score blocks, V
            // over the weighing passes), as in the own-cache path
            attend_columns(rows, R, Rp, qt.data(), K, V, nc, bias, p.data(), K_next, V_next,
                           more ? std::min<int64_t>(SEG_KEYS, k1 - c0 - SEG_KEYS) : 0);
          } else {
            for (int64_t r = 0; r < R; ++r) rows.bias[r] = bias;
            attend_keys(rows, R, false, K, V, nc, scale, p.data(), SEG_KEYS, true);  // (cols takes 8+ rows)
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          if (spans == 1) {
            const int64_t state = state_of(task, r);
            run_m[state] = rows.m[r];
            run_s[state] = rows.s[r];
          } else {
            part_m[n * rmax + r] = rows.m[r];
            part_s[n * rmax + r] = rows.s[r];
          }
        }
      }
    });
    if (spans == 1) return;
    at::parallel_for(0, nrt * rmax, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const Task& task = row_tasks[n / rmax];
        const int64_t r = n % rmax;
        if (r >= task.count * G * t) continue;
        const int64_t state = state_of(task, r);
        for (int64_t sp = 0; sp < spans; ++sp) {
          const int64_t at = ((n / rmax) * spans + sp) * rmax + r;
          fold_state(run_m[state], run_s[state], out + state * hd_, part_m[at], part_s[at], part_o.get() + at * hd_);
        }
      }
    });
  }

  // The shared-segment path for R >= WIDE_ROWS rows of one group and KV head (all reading the same keys with the
  // same bias): the queries are transposed once per task into qt [d][Rp] (pre-scaled, Rp = R rounded up to 16),
  // so a chunk's scores come out as st [key][row] -- one broadcast per key, one load per 16 rows, no transpose of
  // the keys per chunk -- and the softmax runs down the columns, 16 rows per instruction.
  void transpose_queries(const Rows& rows, int64_t R, int64_t Rp, float scale, float* qt) const {
    for (int64_t e = 0; e < hd_; ++e) {
      float* dst = qt + e * Rp;
      for (int64_t r = 0; r < R; ++r) dst[r] = rows.q[r][e] * scale;
      std::fill(dst + R, dst + Rp, 0.0f);
    }
  }

  // Merges keys [0, n) into the running state of the R rows whose queries are qt: scores into st [n][Rp], the
  // online softmax per column, then the value rows weighed by columns of st. The next chunk's n_next keys and
  // values (K_next, V_next; null for none) are prefetched over the score blocks and the weighing passes.
  void attend_columns(Rows& rows, int64_t R, int64_t Rp, const float* qt, const float* K, const float* V, int64_t n,
                      const float* bias, float* st, const float* K_next, const float* V_next, int64_t n_next) const {
    const int64_t panels = Rp / P;
    int64_t blocks = 0;  // score blocks below, over which the next chunk's keys are prefetched
    for (int64_t i0 = 0; i0 < panels; i0 += COL_PANELS)
      blocks += n / COL_KEYS[std::min<int64_t>(COL_PANELS, panels - i0) - 1];
    const Lines kn = share(K_next, n_next, 0, 1);
    Prefetch pf(kn.first, kn.second, blocks);
    float* m = rows.m.data();
    float* s = rows.s.data();
    float* alpha = rows.alpha.data();
    float* mx = rows.col.data();  // the column maxima, folded in by the score blocks as they store
    float* sum = mx + Rp;
    std::copy(m, m + Rp, mx);
    std::fill(sum, sum + Rp, 0.0f);
    for (int64_t i0 = 0; i0 < panels; i0 += COL_PANELS) {
      const int64_t np = std::min<int64_t>(COL_PANELS, panels - i0), nk = COL_KEYS[np - 1];
      int64_t j = 0;
      for (; j + nk <= n; j += nk) {
        pf.advance();
        COL_BLOCKS[np - 1](K + j * hd_, bias + j, hd_, qt + i0 * P, Rp, st + j * Rp + i0 * P, mx + i0 * P);
      }
#ifdef __AVX512F__
      for (; j < n; ++j)
        COL_TAILS[np - 1](K + j * hd_, bias + j, hd_, qt + i0 * P, Rp, st + j * Rp + i0 * P, mx + i0 * P);
#else  // the < 6 keys left in one block: one key alone is a chain of d dependent FMAs
      if (j < n) COL_REST[n - j - 1](K + j * hd_, bias + j, hd_, qt + i0 * P, Rp, st + j * Rp + i0 * P, mx + i0 * P);
#endif
    }
    for (int64_t j = 0; j < n; ++j) {
      float* row = st + j * Rp;
      for (int64_t r = 0; r < Rp; ++r) {
        row[r] = exp_fast(row[r] - mx[r]);
        sum[r] += row[r];
      }
    }
    for (int64_t r = 0; r < Rp; ++r) {
      alpha[r] = exp_fast(m[r] - mx[r]);  // rescales what earlier keys contributed
      s[r] = s[r] * alpha[r] + sum[r];
      m[r] = mx[r];
    }
    weigh_rows(rows, R, st, Rp, true, V, n, true, V_next, n_next);
  }

  // (m, s, o) := the softmax state over the keys of both (m, s, o) and (m2, s2, o2): running maxima, sums of
  // exp(score - max), and unnormalised outputs. Empty states are (-FLT_MAX, 0, 0).
  void fold_state(float& m, float& s, float* o, float m2, float s2, const float* o2) const {
    const float mx = std::max(m, m2), a = std::exp(m - mx), b = std::exp(m2 - mx);
    s = std::fma(s2, b, s * a);
    for (int64_t e = 0; e < hd_; ++e) o[e] = std::fma(o2[e], b, o[e] * a);
    m = mx;
  }

  // Part i of `parts` of the lines of n key or value rows starting at `next` (the next chunk's), for a Prefetch
  Lines share(const float* next, int64_t n, int64_t i, int64_t parts) const {
    if (next == nullptr) return {nullptr, 0};
    const int64_t lines = n * hd_ / P, lo = lines * i / parts;
    return {next + lo * P, lines * (i + 1) / parts - lo};
  }

  // p[j] = cap * tanh(p[j] / cap) + bias[j] (Gemma 2's soft-capped attention scores, in HF's order)
  void cap_scores(float* p, const float* bias, int64_t n) const {
    const float cap = static_cast<float>(softcap_);
    for (int64_t j = 0; j < n; ++j) p[j] = tanh_fast(p[j] / cap) * cap + bias[j];
  }

  // Merges keys [0, n) (K/V rows of hd floats; rows.bias[r][j] added to query r's score of key j) into the running
  // state of R query rows. Without `prior` the state is empty and the output rows are not read.
  // With `vq` (int8 rows row_bytes apart, weighs_int8), the values are read from there instead of V.
  // matrix: 8 or more rows may score as one matrix product (else each row by dot products: see attention()).
  void attend_keys(Rows& rows, int64_t R, bool matrix, const float* K, const float* V, int64_t n, float scale,
                   float* p, int64_t ldp, bool prior, const float* K_next = nullptr, const float* V_next = nullptr,
                   const uint8_t* vq = nullptr, int64_t row_bytes = 0) const {
    const bool wide = matrix && hd_ % P == 0;  // a prompt's rows at any count: a row's scores its own
    if (wide) wide_scores(rows, R, K, n, scale, p, ldp);
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p + r * ldp;
      if (!wide) {
        // soft-capped scores (Gemma 2): q.k * scale first (a zero bias), then capped and biased
        const float* bias = softcap_ > 0.0 ? zeros_.data() : rows.bias[r];
        switch (hd_) {
          case 64: scores<4>(rows.q[r], K, n, bias, scale, pr, share(K_next, n, r, R)); break;
          case 128: scores<8>(rows.q[r], K, n, bias, scale, pr, share(K_next, n, r, R)); break;
          default:
            for (int64_t j = 0; j < n; ++j) pr[j] = dot(rows.q[r], K + j * hd_, hd_) * scale + bias[j];
        }
        if (softcap_ > 0.0) cap_scores(pr, rows.bias[r], n);
      }
      softmax_row(rows, r, pr, n, prior);
    }
    if (vq != nullptr) {
      weigh_int8(rows, R, p, ldp, vq, row_bytes, n, prior);
      return;
    }
    weigh_rows(rows, R, p, ldp, false, V, n, prior, V_next);
  }

  // attend_keys for a prompt's rows in bfloat16 arithmetic (attend_bf16.h): the chunk's keys and values become
  // panels of pairs, the scores one product of the rows' query pairs (set_queries, once a task) with the keys, the
  // online softmax as attend_keys's, then the weights as pairs times the values, added to the rescaled outputs.
  void attend_keys_bf16(Rows& rows, int64_t R, Bf16Chunk& bc, const float* K, const float* V, int64_t n, float scale,
                        float* p, int64_t ldp, bool prior) const {
    bc.set_keys(K, n);
    bf16_products(bc.q.data(), R, bc.q2, bc.kt.data(), n, p, ldp);
    constexpr int64_t K2 = OWN_KEYS / 2;
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p + r * ldp;
      const float* br = rows.bias[r];
      const v16 sc = bcast16(&scale);  // pinned, and the last keys as a zero-filled block: a key's score is the
                                       // same bits wherever its chunk ends
      int64_t j = 0;
      for (; j + P <= n; j += P) store16(pr + j, fma16(load16(pr + j), sc, load16(br + j)));
      if (j < n) {
        const v16 r = fma16(load_part(pr + j, n - j), sc, load_part(br + j, n - j));
        for (int64_t c = 0; c < n - j; ++c) pr[j + c] = r[c];
      }
      softmax_row(rows, r, pr, n, prior);
      x_pairs(pr, n, K2, bc.w.data() + r * K2);
    }
    bc.set_values(V, n);
    float* y = bc.y.data();
    bf16_products(bc.w.data(), R, K2, bc.vt.data(), hd_, y, hd_);
    for (int64_t r = 0; r < R; ++r) {
      float* o = rows.o[r];
      const float* yr = y + r * hd_;
      if (prior) {
        const float a = rows.alpha[r];
        for (int64_t e = 0; e < hd_; e += P) store16(o + e, load16(o + e) * a + load16(yr + e));
      } else {
        std::copy(yr, yr + hd_, o);
      }
    }
  }

  // Whether a prompt's own-cache chunks in this layout take attend_keys_bf16: set_bf16_prompts on, float32 or
  // 16-bit rows (int8 rows keep their own arithmetic), head_dim a multiple of 32, no soft-capping
  bool bf16_chunks(const KVLayout& lay) const {
    return bf16_prompts_ && hd_ % 32 == 0 && softcap_ == 0.0 && lay.kind != KVKind::I8;
  }

  // Whether this step's own-cache chunks of an int8 cache are attended in integers (attend_i8): with VNNI, at
  // head_dim 64 or 128 and without soft-capping, unless set_int8_kv_dots turned it off
  bool integer_dots(const KVLayout& lay) const {
    return HAVE_I8_KV_DOTS && int8_kv_dots_ && lay.kind == KVKind::I8 && (hd_ == 64 || hd_ == 128) &&
           softcap_ == 0.0;
  }

  // Whether int8 values are weighed straight from their rows: AVX-512 at head_dim 64 or 128 (elsewhere they are
  // widened first, as every other format is)
  bool weighs_int8(const KVLayout& lay) const {
#ifdef __AVX512F__
    return lay.kind == KVKind::I8 && (hd_ == 64 || hd_ == 128);
#else
    return false;
#endif
  }

  // weigh_rows for int8 values: each row's weights p[r][j] take the value row's scale s_j first (p * (q * s) =
  // (p * s) * q), then the values are converted in registers as they are read, so a chunk of values is neither
  // written out as float32 nor read back: widening the values into a buffer first cost as much as weighing them
  // (docs/performance.md, "Figures behind the code's choices").
  void weigh_int8(Rows& rows, int64_t R, float* p, int64_t ldp, const uint8_t* vq, int64_t row_bytes, int64_t n,
                  bool prior) const {
#ifdef __AVX512F__
    float sv[std::max(OWN_KEYS, SEG_KEYS)];
    for (int64_t j = 0; j < n; ++j) std::memcpy(sv + j, vq + j * row_bytes + hd_, 4);
    for (int64_t r = 0; r < R; ++r) {
      float* pr = p + r * ldp;
      for (int64_t j = 0; j < n; ++j) pr[j] *= sv[j];
    }
    const int64_t rstep = hd_ == 64 ? 6 : 4;
    for (int64_t r0 = 0; r0 < R; r0 += rstep) {
      const int64_t rc = std::min<int64_t>(rstep, R - r0);
      (hd_ == 64 ? WEIGH_I8_64 : WEIGH_I8_128)[rc - 1](p + r0 * ldp, ldp, vq, row_bytes, n, rows.alpha.data() + r0,
                                                       prior, rows.o.data() + r0);
    }
#else
    TORCH_CHECK(false, "weigh_int8 is built for AVX-512 only");
#endif
  }

#if HAVE_I8_KV_DOTS
  // One chunk of a row's own int8 cache (n <= OWN_KEYS keys at K and V, row_bytes apart) merged into the running
  // state of R query rows, in integers (see QueryI8; buf.q holds their digits); the lines at K_next / V_next are
  // prefetched meanwhile. Up to I8_SCORE_ROWS rows transpose each key block as they score it; more read the chunk
  // transposed once.
  void attend_i8(Rows& rows, int64_t R, I8Buffers& buf, const uint8_t* K, const uint8_t* V, int64_t row_bytes,
                 int64_t n, float* p, int64_t ldp, bool prior, const uint8_t* K_next, const uint8_t* V_next) const {
    const int NG = static_cast<int>(hd_ / 64);
    alignas(64) float sk[OWN_KEYS], sv[OWN_KEYS];  // the rows' scales, zero past n
    gather_scales(K, row_bytes, n, hd_, sk);
    gather_scales(V, row_bytes, n, hd_, sv);
    const int64_t blocks = (n + 15) / 16, lines = (n * row_bytes + 63) / 64;
    const LinePrefetch pk{K_next, lines, blocks}, pv{V_next, lines, blocks};
    const QueryI8* qs = buf.q.data();
    if (R <= I8_SCORE_ROWS) {
      (NG == 1 ? I8_SCORES<1, false> : I8_SCORES<2, false>)[R - 1](qs, K, row_bytes, nullptr, n, sk,
                                                                   rows.bias.data(), p, ldp, pk, pv);
    } else {
      (NG == 1 ? key_blocks<1> : key_blocks<2>)(K, row_bytes, n, buf.keys.data(), pk, pv);
      for (int64_t r0 = 0; r0 < R; r0 += I8_SCORE_ROWS) {
        const int64_t rc = std::min<int64_t>(I8_SCORE_ROWS, R - r0);
        (NG == 1 ? I8_SCORES<1, true> : I8_SCORES<2, true>)[rc - 1](qs + r0, nullptr, 0, buf.keys.data(), n, sk,
                                                                     rows.bias.data() + r0, p + r0 * ldp, ldp, pk,
                                                                     pv);
      }
    }
    for (int64_t r = 0; r < R; ++r) softmax_row(rows, r, p + r * ldp, n, prior);
    // the weights p_j s_j of each row as 16 bits of their maximum, two u8 digits (buf.w: [R][2][ldw] bytes)
    const int64_t ldw = OWN_KEYS + 4;
    uint8_t* wq = buf.w.data();
    float* wstep = buf.wstep.data();
    for (int64_t r = 0; r < R; ++r) {  // 16 weights a vector; those past n are zero (sv is)
      float* pr = p + r * ldp;
      __m512 vmax = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(pr + j), _mm512_load_ps(sv + j));
        _mm512_storeu_ps(pr + j, w);
        vmax = _mm512_max_ps(vmax, w);
      }
      const float wmax = _mm512_reduce_max_ps(vmax);
      wstep[r] = wmax / 65535.0f;
      const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 65535.0f / wmax : 0.0f);
      uint8_t *hi = wq + 2 * r * ldw, *lo = hi + ldw;
      for (int64_t j = 0; j < n; j += 16) {  // rounded to nearest even, as nearbyint
        const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pr + j), inv)),
                                           _mm512_set1_epi32(65535));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + j), _mm512_cvtepi32_epi8(_mm512_srli_epi32(v, 8)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + j),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(255))));
      }
    }
    for (int64_t r0 = 0; r0 < R; r0 += I8_WEIGH_ROWS) {
      const int64_t rc = std::min<int64_t>(I8_WEIGH_ROWS, R - r0);
      for (int g = 0; g < NG; ++g) {
        __m512i sums[I8_WEIGH_ROWS][4];  // a 64-value group's sums, 4 registers a row (see i8_weigh)
        for (int h = 0; h < 2; ++h)
          I8_WEIGH[h][rc - 1](wq + 2 * r0 * ldw, wq + (2 * r0 + 1) * ldw, 2 * ldw, V + 64 * g, row_bytes, n, sums);
        for (int64_t r = 0; r < rc; ++r)
          i8_finish(sums[r], wstep[r0 + r], rows.alpha[r0 + r], prior, rows.o[r0 + r] + 64 * g);
      }
    }
  }
#endif

  // o[r] = alpha[r] * o[r] (or 0 without prior) + sum_j p[r][j] V[j] for R rows, a few rows per register pass;
  // p is [row][key] with row stride ldp, or with `cols` [key][row] with key stride ldp (the shared-segment path)
  void weigh_rows(Rows& rows, int64_t R, const float* p, int64_t ldp, bool cols, const float* V, int64_t n,
                  bool prior, const float* V_next = nullptr, int64_t n_next = -1) const {
    if (n_next < 0) n_next = n;  // the next chunk's keys (to prefetch), by default as many as this one's
#ifndef __AVX512F__
    // AVX2: the blocks below are 24-48 accumulators of 16 ymm registers (they spilled on every key). Instead 12
    // accumulators a pass: 6 rows x 16 dims (a shared segment's columns, a verify tree), else 3 rows x 32 dims
    // (decode's G = 3 query heads of a KV head); the value rows are re-read from L1 by the passes.
    if (hd_ % 32 == 0) {
      const bool many = R >= 6;
      const int64_t rstep = many ? 6 : 3, dstep = many ? 16 : 32;
      const int64_t passes = (R + rstep - 1) / rstep * (hd_ / dstep);
      for (int64_t r0 = 0, pass = 0; r0 < R; r0 += rstep) {
        const int64_t rc = std::min<int64_t>(rstep, R - r0);
        for (int64_t d0 = 0; d0 < hd_; d0 += dstep, ++pass)
          (many ? WEIGH_PART16[cols][rc - 1] : WEIGH_PART32[cols][rc - 1])(
              cols ? p + r0 : p + r0 * ldp, ldp, V + d0, hd_, n, rows.alpha.data() + r0, prior, rows.o.data() + r0,
              d0, share(V_next, n_next, pass, passes));
      }
      return;
    }
#endif
    const int64_t rstep = hd_ == 64 ? 6 : 4;  // rows per pass: rstep * d/16 accumulators + d/16 value registers
    const int64_t passes = (R + rstep - 1) / rstep;
    for (int64_t r0 = 0; r0 < R; r0 += rstep) {
      const int64_t rc = std::min<int64_t>(rstep, R - r0);
      const float* pr = cols ? p + r0 : p + r0 * ldp;
      float* const* o = rows.o.data() + r0;
      const float* alpha = rows.alpha.data() + r0;
      if (hd_ == 64) {
        WEIGH_64[cols][rc - 1](pr, ldp, V, n, alpha, prior, o, share(V_next, n_next, r0 / rstep, passes));
      } else if (hd_ == 128) {
        WEIGH_128[cols][rc - 1](pr, ldp, V, n, alpha, prior, o, share(V_next, n_next, r0 / rstep, passes));
      } else {
        for (int64_t r = 0; r < rc; ++r) {
          if (prior)
            for (int64_t j = 0; j < hd_; ++j) o[r][j] *= alpha[r];
          else
            std::fill(o[r], o[r] + hd_, 0.0f);
          for (int64_t j = 0; j < n; ++j) axpy(o[r], cols ? pr[j * ldp + r] : pr[r * ldp + j], V + j * hd_, hd_);
        }
      }
    }
  }

  // Scores of R >= WIDE_ROWS query rows against n keys as a matrix product (a verify step's tree, a shared
  // segment's group): the chunk's keys are transposed once into 16-key panels, then blocks of up to 6 query rows x
  // 4 panels (24 accumulators) take one broadcast per row and one load per panel for every FMA row -- instead of
  // one dot product per (row, key) and a reduction across lanes.
  void wide_scores(Rows& rows, int64_t R, const float* K, int64_t n, float scale, float* p, int64_t ldp) const {
    const int64_t panels = (n + P - 1) / P;
    float* kt = rows.kt.data();
    for (int64_t j = 0; j < panels; ++j) {
      float* panel = kt + j * hd_ * P;
      const int64_t nk = std::min<int64_t>(P, n - j * P);
      if (nk == P) {  // 16 x 16 blocks through registers
        for (int64_t e0 = 0; e0 < hd_; e0 += P) {
          v16 x[P];
          for (int kk = 0; kk < P; ++kk) x[kk] = load16(K + (j * P + kk) * hd_ + e0);
          transpose16(x);
          for (int e = 0; e < P; ++e) store16(panel + (e0 + e) * P, x[e]);
        }
        continue;
      }
      for (int64_t kk = 0; kk < nk; ++kk) {
        const float* key = K + (j * P + kk) * hd_;
        for (int64_t e = 0; e < hd_; ++e) panel[e * P + kk] = key[e];
      }
      for (int64_t kk = nk; kk < P; ++kk)
        for (int64_t e = 0; e < hd_; ++e) panel[e * P + kk] = 0.0f;
    }
#ifdef __AVX512F__
    constexpr int64_t key_panels = 4;
#else
    constexpr int64_t key_panels = 1;  // AVX2: 6 rows x 1 panel, 12 accumulators of 16 registers
#endif
    for (int64_t r0 = 0; r0 < R; r0 += 6)
      for (int64_t j0 = 0; j0 < panels; j0 += key_panels) {
        const int64_t mb = std::min<int64_t>(6, R - r0), nb = std::min<int64_t>(key_panels, panels - j0);
        SCORE_BLOCKS[(mb - 1) * 4 + nb - 1](rows.q.data() + r0, kt + j0 * hd_ * P, hd_, p + r0 * ldp + j0 * P, ldp);
      }
    for (int64_t r = 0; r < R; ++r) {  // scale and bias, over the n valid keys only
      float* pr = p + r * ldp;
      const float* br = rows.bias[r];
      if (softcap_ > 0.0) {  // Gemma 2's cap * tanh(score / cap), before the bias
        for (int64_t j = 0; j < n; ++j) pr[j] *= scale;
        cap_scores(pr, br, n);
        continue;
      }
      const v16 sc = bcast16(&scale);  // pinned, and the last keys as a zero-filled block: a key's score is the
                                       // same bits wherever its chunk ends
      int64_t j = 0;
      for (; j + P <= n; j += P) store16(pr + j, fma16(load16(pr + j), sc, load16(br + j)));
      if (j < n) {
        const v16 r = fma16(load_part(pr + j, n - j), sc, load_part(br + j, n - j));
        for (int64_t c = 0; c < n - j; ++c) pr[j + c] = r[c];
      }
    }
  }

 private:
  int64_t h_, kvh_, hd_;
  double scale_;
  double softcap_ = 0.0;
  bool int8_kv_dots_ = HAVE_I8_KV_DOTS;
  bool bf16_prompts_ = false;
  int64_t split_threads_ = 0;
  std::vector<float> zeros_ = std::vector<float>(std::max(OWN_KEYS, SEG_KEYS), 0.0f);  // a bias that adds nothing
};

}  // namespace
