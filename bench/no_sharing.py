"""The prefix cache's cost where nothing is shared: the scheduler in this process (no HTTP noise) serves a closed loop
of 8 over 24 random 128-token prompts, 64 generated each, on the default model, with the prefix cache's budget
from $BUDGET (bytes; 0 = no cache). Prints nothing: time it whole-process, e.g. two commands as A/B pairs

    BUDGET=536870912 python bench/no_sharing.py   against   BUDGET=0 python bench/no_sharing.py

(or against another checkout with PYTHONPATH pointing at it)."""
import os
import random

import torch

import bmc
from bmc.engine import GenerationConfig
from bmc.scheduler import Request, Scheduler

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
model = bmc.load()
rng = random.Random(int(os.environ.get("SEED", "0")))
V = model.config.vocab_size
prompts = [[rng.randrange(100, V) for _ in range(128)] for _ in range(24)]
sched = Scheduler(model, max_num_seqs=8, max_num_batched_tokens=256, prefix_cache_bytes=int(os.environ["BUDGET"]))
done: list[int] = []
todo = list(prompts)


def submit() -> None:
    sched.add(Request(todo.pop(), GenerationConfig(max_new_tokens=64, ignore_eos=True),
                      lambda o: done.append(1) if not isinstance(o, BaseException) and o.finish_reason else None))


for _ in range(8):
    submit()
seen = 0
while sched.has_work():
    sched.step()
    while seen < len(done):
        seen += 1
        if todo:
            submit()
assert len(done) == len(prompts)
