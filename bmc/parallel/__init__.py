"""Tensor parallelism over torch.distributed (gloo on CPU ranks, NCCL on GPUs): seed 004's MQA/GQA sharding
policy (sharding.py), the sharded model a rank runs (shard.py) and the worker processes a caller drives like one
model (tp.py)."""
from .sharding import RankHeads, shard_heads, split_even

__all__ = ["RankHeads", "shard_heads", "split_even"]
