"""A draft model as drafter: another checkpoint with the target's vocabulary, or the target's own weights truncated
to its first layers or quantized to int8 (models/derive.py).

The draft keeps its own KV cache (a BMCCache) with one row per batch row and only ever commits verified tokens:

- catch-up: the tokens a row accepted since its last proposal (drafts + the target's next token; the whole prompt
  the first time) are fed in one batched forward. Rows have different counts, so each row's tokens are right-aligned
  in the block (its last token is the block's last column, whose logits give the root distribution) and then moved
  to the front by `KVCache.accept`; the rest of the block becomes masked holes.
- drafting: the tree grows one level per forward; each level's nodes are fed as a block that sees the committed
  context and, through an explicit bias, only its own ancestors among the earlier levels. Afterwards the drafted
  columns are cropped. Re-feeding accepted drafts at the next catch-up costs one slightly wider forward and never
  needs a per-row crop.
- rows join and leave as the engine's batch does: rows started since the last proposal are prefilled in a cache
  of their own and joined, forgotten rows dropped, in one `KVCache.regroup`.

Greedy: a node's children are the draft's top-ranked tokens (point masses for verification). Sampling: they are
drawn without replacement from the draft's distribution q (the target's temperature / top-k / top-p applied to the
draft logits) by Gumbel-top-k with the run's seeded generator, and q is returned so verification stays lossless.
Trees: `chain:K` and `dynamic:KxD` keep, per level, the K children of the level's nodes with the highest path
(log-)probability, a child of rank r counting with its parent's r-th largest draft probability; `static:SIZE` fills
a fixed shape, the r-th child of a node being its r-th ranked (greedy) or r-th drawn (sampling) token."""
from __future__ import annotations

import torch

from ..attention import dense_attention
from ..kv import BMCCache, KVCache
from ..models import Model
from ..sampling import Sampler
from .drafters import Drafter, Proposal
from .tree import TreeSpec

DRAFT_CHUNK = 64  # rows per BMC allocation of the draft's cache
NO_CAP = 1 << 40  # the draft cache's length is not bounded by a context: holes and drafted columns come and go


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, draft: Model, sampler: Sampler) -> None:
        """sampler: the sampling of rows started without one of their own (a row's sampler picks greedy children
        or draws them from its q with its generator)."""
        self.model, self.sampler = draft, sampler
        self.cache: KVCache | None = None
        self.order: list[int] = []  # row ids in the cache's batch order
        self.pending: dict[int, list[int]] = {}  # tokens not fed to the draft yet
        self.pos: dict[int, int] = {}  # next position per row (= tokens fed so far)
        self.samplers: dict[int, Sampler] = {}
        self.gone: set[int] = set()  # rows forgotten, dropped from the cache at the next proposal
        self.pad = draft.config.pad_token_id if draft.config.pad_token_id is not None else 0

    def start(self, row: int, context: list[int], sampler: Sampler | None = None) -> None:
        self.pending[row], self.pos[row] = list(context), 0
        self.samplers[row] = sampler if sampler is not None else self.sampler
        self.gone.discard(row)

    def extend(self, row: int, tokens: list[int]) -> None:
        self.pending[row].extend(tokens)

    def forget(self, row: int) -> None:
        if row in self.pending:
            self.gone.add(row)

    @torch.inference_mode()
    def propose_batch(self, rows: list[int], specs: list[TreeSpec | None]) -> list[Proposal]:
        """Drafts for `rows` (every started row not forgotten is caught up, whether asked for or not)."""
        if all(s is None for s in specs):  # every row emits its last token this step: nothing left to draft for
            return [Proposal() for _ in rows]
        self._sync_rows()
        # a row with nothing new since its last proposal has no root to draft from (its logits were not kept)
        want = {r: s for r, s in zip(rows, specs) if s is not None and self.pending.get(r)}
        if not want:
            return [Proposal() for _ in rows]
        order = self.order
        root_logits = self._catch_up(order)
        drafted = dict(zip(order, self._draft(order, [want.get(r) for r in order], root_logits)))
        return [drafted[r] if r in want else Proposal() for r in rows]

    # ---- cache upkeep ------------------------------------------------------------------------------
    def _new_cache(self, batch: int) -> KVCache:
        cfg = self.model.config
        return BMCCache(r=DRAFT_CHUNK, num_layers=cfg.num_layers, batch_size=batch, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, max_length=NO_CAP, dtype=self.model.dtype, device=self.model.device)

    def _sync_rows(self) -> None:
        """Forgotten rows leave the cache and rows started since the last proposal join it: their contexts but
        the last token are prefilled in a cache of their own and joined in one regroup (the last token is fed
        with every row's catch-up, whose logits are the roots)."""
        for r in self.gone:
            del self.pending[r], self.pos[r], self.samplers[r]
        kept = [i for i, r in enumerate(self.order) if r not in self.gone]
        self.gone = set()
        known = set(self.order)
        new = [r for r in self.pending if r not in known]
        if self.cache is None:
            self.cache, self.order = self._new_cache(0), []
            kept = []
        joins: list[tuple[KVCache, list[int]]] = []
        if new:
            fresh = self._new_cache(len(new))
            last = {r: self.pending[r][-1:] for r in new}
            for r in new:
                self.pending[r] = self.pending[r][:-1]
            if any(self.pending[r] for r in new):
                self._catch_up(new, fresh)
            for r in new:
                self.pending[r] = self.pending[r] + last[r]
            joins.append((fresh, list(range(len(new)))))
        if new or len(kept) < len(self.order):
            self.cache.regroup(kept, joins)
            self.order = [self.order[i] for i in kept] + new

    def _catch_up(self, rows: list[int], cache: KVCache | None = None) -> torch.Tensor:
        """Feed every row's pending tokens (into `cache`, default the draft's); returns the logits after each row's
        last token [B, V]."""
        cache, dev = cache if cache is not None else self.cache, self.model.device
        assert cache is not None
        counts = [len(self.pending[r]) for r in rows]
        m = max(counts)
        toks = [[self.pad] * (m - k) + self.pending[r] for r, k in zip(rows, counts)]
        tokens = torch.tensor(toks, dtype=torch.long, device=dev)
        first = torch.tensor([m - k for k in counts], device=dev)  # each row's first real column
        pos = torch.tensor([self.pos[r] for r in rows], device=dev)
        col = torch.arange(m, device=dev)
        positions = torch.maximum(pos[:, None] + col[None, :] - first[:, None], pos[:, None])  # pads: any valid pos
        visible = None
        if min(counts) < m:  # causal among a row's real tokens; a padding column sees only itself
            causal = col[None, :, None] >= col[None, None, :]
            visible = (causal & (col[None, None, :] >= first[:, None, None])) | torch.eye(m, dtype=torch.bool,
                                                                                          device=dev)
        cache.reserve(m)
        logits = self.model.net(tokens, positions, cache, dense_attention, cache.attention_bias(m, visible))
        cache.accept([list(range(m - k, m)) for k in counts], m)
        for r, k in zip(rows, counts):
            self.pos[r] += k
            self.pending[r] = []
        return logits[:, -1]

    # ---- drafting ----------------------------------------------------------------------------------
    def _draft(self, rows: list[int], specs: list[TreeSpec | None], root_logits: torch.Tensor) -> list[Proposal]:
        cache, dev = self.cache, self.model.device
        assert cache is not None
        spec = max((s for s in specs if s is not None), key=lambda s: s.depth)  # one shape, capped per row
        static = spec.static_levels()  # per level: (parent's slot in the previous level, child rank); None: dynamic
        sizes = [len(level) for level in static] if static is not None else [spec.width] * spec.depth
        B, start, n_max = len(rows), cache.length, sum(sizes)
        pos = torch.tensor([self.pos[r] for r in rows], device=dev)  # the root sits at pos - 1
        ancestors = torch.zeros(B, n_max, n_max, dtype=torch.bool, device=dev)  # node -> its ancestors and itself
        toks: list[torch.Tensor] = []
        pars: list[torch.Tensor] = []
        oks: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []
        q_maps: list[dict[int, torch.Tensor]] = [{} for _ in rows]
        logits = root_logits[:, None]  # [B, F, V] at the frontier: the root, then each level in turn
        front_ids = torch.full((B, 1), -1, dtype=torch.long, device=dev)  # node index of each frontier slot
        front_score = torch.zeros(B, 1, device=dev)  # path log-probability (-inf: an invalid node)
        done = 0
        for d, n in enumerate(sizes):
            width = max(rank for _, rank in static[d]) + 1 if static is not None else spec.width
            cand_tok, rank_lp, q = self._candidates(logits, width, rows)
            score = front_score[:, :, None] + rank_lp  # non-increasing along each node's ranked children
            if static is not None:  # fixed (parent slot, rank) pairs
                pick = torch.tensor([f * width + rank for f, rank in static[d]], device=dev).expand(B, n)
            else:  # the best n by (rank) path probability; a stable sort keeps a prefix of each node's children
                pick = torch.sort(score.flatten(1), dim=1, descending=True, stable=True).indices[:, :n]
            slot = pick // width
            tok = cand_tok.flatten(1).gather(1, pick)
            sel_score = score.flatten(1).gather(1, pick)
            parent = front_ids.gather(1, slot)
            ok = sel_score > float("-inf")
            if q is not None:  # the distribution each valid node's siblings were drawn from, keyed by the parent
                for b, (slots, valid, ids) in enumerate(zip(slot.tolist(), ok.tolist(), front_ids.tolist())):
                    if q[b] is None:  # a greedy row: fixed children
                        continue
                    for f, v in zip(slots, valid):
                        if v:
                            q_maps[b][ids[f]] = q[b][f]
            ids = torch.arange(done, done + n, device=dev)
            has = parent >= 0
            anc = torch.zeros(B, n, n_max, dtype=torch.bool, device=dev)
            anc[has] = ancestors[torch.nonzero(has, as_tuple=True)[0], parent[has]]
            anc[:, torch.arange(n, device=dev), ids] = True
            ancestors[:, done : done + n] = anc
            toks.append(tok)
            pars.append(parent)
            oks.append(ok)
            scores.append(sel_score)
            if d + 1 < len(sizes):  # feed this level so that its children can be drafted
                logits = self._feed(tok, pos + d, anc[:, :, : done + n], start)
                front_ids, front_score = ids.expand(B, n), sel_score
            done += n
        cache.crop(start)
        return self._proposals(specs, toks, pars, oks, scores, q_maps)

    def _candidates(self, logits: torch.Tensor, width: int, rows: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None] | None]:
        """Ranked children of every frontier node: tokens [B, F, width]; the log of the r-th largest draft probability
        for the r-th child (-inf: the distribution has fewer tokens), which scores it; and per row, when it samples,
        the distributions q [F, V] its children were drawn from without replacement (in drawing order), by its own
        sampler's parameters and generator (None: every row is greedy).

        Sampled children are scored by their rank, never by the probability of the token actually drawn: whether a
        drawn child is kept (dynamic selection, trimming to the chunk) must not depend on its own value, or the kept
        children would no longer be draws from q and rejection sampling would be biased."""
        B, F, V = logits.shape
        by_sampler: dict[int, list[int]] = {}
        for b, r in enumerate(rows):
            if not self.samplers[r].params.greedy:
                by_sampler.setdefault(id(self.samplers[r]), []).append(b)
        rank_lp, tok = torch.topk(torch.log_softmax(logits.float(), dim=-1), width, dim=-1)
        if not by_sampler:
            return tok, rank_lp, None
        qs: list[torch.Tensor | None] = [None] * B
        for idx in by_sampler.values():
            sampler = self.samplers[rows[idx[0]]]
            at = torch.tensor(idx, device=logits.device)
            q = sampler.probs(logits.index_select(0, at).reshape(len(idx) * F, V).float()).view(len(idx), F, V)
            lq = q.log()
            u = torch.rand(q.shape, generator=sampler.generator, device=q.device).clamp_(min=1e-20)
            tok[at] = torch.topk(lq - torch.log(-torch.log(u)), width, dim=-1).indices  # Gumbel-top-k: drawing order
            rank_lp[at] = torch.topk(lq, width, dim=-1).values
            for j, b in enumerate(idx):
                qs[b] = q[j]
        return tok, rank_lp, qs

    def _feed(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
              start: int) -> torch.Tensor:
        """Run one tree level ([B, n] tokens at position `positions`) on top of the drafted columns from `start`;
        `visible` [B, n, drafted + n] says which drafted nodes each one sees. Returns logits [B, n, V]."""
        cache = self.cache
        assert cache is not None
        n = tokens.shape[1]
        cache.reserve(n)
        bias = cache.bias.repeat(1, 1, n, 1)
        block = torch.zeros(visible.shape, dtype=cache.dtype, device=cache.device)
        bias[:, 0, :, start : start + visible.shape[2]] = block.masked_fill_(~visible, cache.min_value)
        logits = self.model.net(tokens, positions[:, None].expand(-1, n), cache, dense_attention, bias,
                                all_logits=True)
        cache.commit(n)
        return logits

    @staticmethod
    def _proposals(specs: list[TreeSpec | None], toks: list[torch.Tensor], pars: list[torch.Tensor],
                   oks: list[torch.Tensor], scores: list[torch.Tensor],
                   q_maps: list[dict[int, torch.Tensor]]) -> list[Proposal]:
        """Per row: the valid nodes of its first spec.depth levels, best first (by rank path probability, so that
        trimming the tree to the chunk's free rows keeps its most likely nodes). A child never scores above its
        parent and ties keep the drafting order, so parents still come before children and siblings stay in
        drawing order."""
        order = torch.sort(torch.cat(scores, dim=1), dim=1, descending=True, stable=True).indices.tolist()
        tok, par, ok = (torch.cat(x, dim=1).tolist() for x in (toks, pars, oks))
        depth_of = [d for d, t in enumerate(toks) for _ in range(t.shape[1])]
        out = []
        for b, spec in enumerate(specs):
            prop = Proposal()
            if spec is not None:
                new = {-1: -1}
                for i in order[b]:
                    if ok[b][i] and depth_of[i] < spec.depth and par[b][i] in new:
                        new[i] = len(prop.tokens)
                        prop.tokens.append(tok[b][i])
                        prop.parents.append(new[par[b][i]])
                prop.q = {new[i]: q for i, q in q_maps[b].items() if i in new}
            out.append(prop)
        return out
