"""CUDA graphs of the decode step, one per BMC capacity bucket.

A BMC cache changes shape only T times per generation: between two chunk boundaries every decode step runs the
same kernels on the same buffers. So the step is captured once per bucket (the KV buffer, the batch) and replayed
for the rest of the chunk: the per-kernel launch cost of a step (hundreds of small kernels) disappears. Iterative
allocation gets no such chance (a new shape every token); upfront gets one graph for the whole run.

What changes from step to step lives in device tensors the graph reads: the token and position (static input
buffers), the column the step writes its K/V to (`cache.write_at`, an index tensor the cache's update uses instead
of a Python slice) and the bias column opened by `cache.reserve` (an eager write before the replay). Replay runs
the same kernels on the same data as the eager step, so tokens are identical (tested on the GPU)."""
from __future__ import annotations

import torch

from .attention import AttentionFn
from .kv import KVCache
from .models import Model

MIN_BUCKET_STEPS = 16  # capture only when the chunk has this many free rows left: a capture costs a few steps


class DecodeGraphs:
    def __init__(self, model: Model, attention: AttentionFn) -> None:
        self.model, self.attention = model, attention
        self.key: tuple[int, ...] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tok = self.pos = self.logits = None
        self.captures = 0
        self.replays = 0
        self.write_at: torch.Tensor | None = None  # the device index every captured step writes its K/V column at
        self.captured_attention: AttentionFn | None = None  # what the graph reads (kept alive with it)

    def step(self, cache: KVCache, tok: torch.Tensor, pos: torch.Tensor,
             attention: AttentionFn | None = None) -> torch.Tensor:
        """One decode step (the cache has reserved its column): logits [B, 1, V]. Replays the bucket's graph, or
        runs the step eagerly (capturing a graph for the bucket when enough steps remain in it). The cache's
        write_at is this object's index tensor during the step only, so an eager step between two replays (the
        scheduler's, with shared segments) writes at its Python column. attention: this step's (default: the
        one given at construction); another one is another graph (the scheduler's segments: their tensors are
        read in place, so the graph holds the attention, and with it them, until drop())."""
        if self.write_at is None:
            self.write_at = torch.zeros(1, dtype=torch.long, device=cache.device)
        cache.write_at = self.write_at
        try:
            return self._step(cache, tok, pos, self.attention if attention is None else attention)
        finally:
            cache.write_at = None

    def drop(self) -> None:
        """Forget the graph (and the attention it reads, with its tensors)."""
        self.key, self.graph, self.captured_attention = None, None, None

    def _step(self, cache: KVCache, tok: torch.Tensor, pos: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        assert cache.write_at is not None
        cache.write_at.fill_(cache.length)
        key = (cache.kv.data_ptr(), cache.bias.data_ptr(), tok.shape[0], cache.capacity, id(attention))
        if key == self.key and attention is self.captured_attention:
            self.tok.copy_(tok[:, None])
            self.pos.copy_(pos[:, None])
            self.graph.replay()
            self.replays += 1
            return self.logits
        self.drop()  # the old bucket's graph is done: its private memory pool goes with it
        tok_in, pos_in = tok[:, None].clone(), pos[:, None].clone()
        if cache.capacity - cache.length < MIN_BUCKET_STEPS:
            return self.model.net(tok_in, pos_in, cache, attention, cache.bias)
        # the eager step on a side stream is also the warm-up capture needs; its logits are this step's result
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.model.net(tok_in, pos_in, cache, attention, cache.bias)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # recorded, not run (the K/V written above stay as they are); a private memory pool, freed with the graph
        with torch.cuda.graph(graph):
            self.logits = self.model.net(tok_in, pos_in, cache, attention, cache.bias)
        self.tok, self.pos, self.graph, self.key = tok_in, pos_in, graph, key
        self.captured_attention = attention
        self.captures += 1
        return logits
