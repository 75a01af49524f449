"""Decode steps run one ahead of their tokens (the scheduler's `run_ahead`, on by default where decode steps are
CUDA graphs): a greedy batch's next tokens stay on the device, where the next step's graph takes them as its input,
and the host reads them while that step runs. The host's work between two replays (reading the tokens, stop checks,
emission, the next step's bookkeeping: 0.27-0.47 ms a step on the H100 host) then overlaps the GPU's instead of
leaving it idle (docs/performance.md, "Decode steps run one ahead").

Exact: the tokens are the argmax the normal step takes, fed to the same graph. What changes is only when they are
read: a row that finishes has its one next step computed and thrown away, and a request sees its tokens one step
later. Used where every row is greedy with nothing read from the logits on the host (no penalties, grammar or
logprobs), without speculation, and where no row's next step depends on the host (a sliding window, longrope)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .kernels.native import argmax


@dataclass
class Ahead:
    """A launched step's next tokens, not read yet: `rows` (the batch rows they belong to, None for a retired
    slot), `tokens` and `positions` ([B] on the device: the next step's input; a retired slot keeps token 0 at
    position 0, as the plain step feeds it), `picked` (the argmax as taken, on the host once `ready` has fired)."""

    rows: list[Any]
    vocab: int  # the logits' width: an id at or past it is a failed step
    tokens: torch.Tensor
    positions: torch.Tensor
    live: torch.Tensor  # [B] long: 1 for a row, 0 for a retired slot
    picked: torch.Tensor
    ready: torch.cuda.Event | None

    def read(self) -> list[int]:
        """The tokens as the argmax picked them (an id out of range included, for the host's check)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.picked.tolist()


def launch(logits: torch.Tensor, rows: list[Any], positions: torch.Tensor, vocab: int,
           live: torch.Tensor | None = None) -> Ahead:
    """The next tokens of a step's last logits [B, V], taken and copied to the host asynchronously. positions [B]:
    where this step's inputs went (the next go one further for every row). The tokens fed on are clamped into the
    vocabulary, so a non-finite row cannot index past the embedding; its request fails when the host reads it."""
    if live is None:
        live = torch.tensor([int(r is not None) for r in rows], dtype=torch.long, device=logits.device)
    picked = argmax(logits)
    tokens = picked.clamp(0, vocab - 1) * live
    ready = None
    if logits.device.type == "cuda":
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(logits.device))
        picked = host
    return Ahead(list(rows), vocab, tokens, positions + live, live, picked, ready)
