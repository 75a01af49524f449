"""The bmc-bench harness: a seconds-long smoke run that checks the report's schema and that every engine (the
three bmc strategies and HF transformers with DynamicCache and StaticCache) produced identical greedy tokens."""
from __future__ import annotations

import json
import mmap
import time

import pytest

from bmc.bench.engines import PeakRSS
from bmc.bench.harness import main

from .conftest import transformers  # noqa: F401  (skips the module when transformers is absent)

ENGINES = ["bmc", "bmc-iterative", "bmc-upfront", "hf-dynamic", "hf-static"]


def test_smoke_report_schema_and_identical_tokens(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["--smoke", "--model", "opt-tiny-random", "--out", str(out), "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "bench.json").read_text())
    for key in ("model", "dtype", "threads", "device", "cpu", "torch", "read_gb_per_s", "results", "engines"):
        assert key in report, key
    assert report["engines"] == ENGINES and report["threads"] == 1 and report["dtype"] == "float32"
    (res,) = report["results"]
    assert (res["batch"], res["prompt_len"], res["gen_len"]) == (2, 16, 8)
    assert res["tokens_identical"] is True and set(res["first_divergence"].values()) == {None}
    assert set(res["engines"]) == set(ENGINES)
    for name, r in res["engines"].items():
        assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["peak_rss_mb"] > 0, name
        assert len(r["step_latency_ms"]) == 7, name  # 8 tokens: the prefill's plus 7 decode steps
    for name in ("bmc", "bmc-iterative", "bmc-upfront"):
        assert 0 < res["engines"][name]["roofline_fraction"], name
        assert set(res["ratios"][name]) == set(ENGINES) - {name}
    assert res["engines"]["bmc-iterative"]["kv_allocations"] == 8  # prefill + one per decode step
    assert res["engines"]["bmc-upfront"]["kv_allocations"] == 1
    assert (tmp_path / "bench-throughput.png").stat().st_size > 0
    assert (tmp_path / "bench-latency.png").stat().st_size > 0


def test_decode_split_is_measured_per_strategy(tmp_path):
    rc = main(["--model", "opt-tiny-random", "--batch", "1", "--prompt-len", "4", "--gen-len", "6",
               "--engines", "bmc,bmc-iterative", "--out", str(tmp_path / "b"), "--threads", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "b.json").read_text())["results"][0]
    for name in ("bmc", "bmc-iterative"):
        split = res["decode_split"][name]
        assert split["kv_update_s"] > 0 and split["attention_s"] > 0 and split["other_s"] > 0
    assert (tmp_path / "b-split.png").stat().st_size > 0


def test_unknown_engine_is_a_clear_error(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        main(["--engines", "bmc,nope", "--model", "opt-tiny-random"])
    assert e.value.code == 2 and "unknown engine" in capsys.readouterr().err


def test_rounds_alternate_engines_and_keep_each_ones_fastest_run(tmp_path):
    rc = main(["--model", "opt-tiny-random", "--batch", "1", "--prompt-len", "4", "--gen-len", "6", "--rounds", "3",
               "--engines", "bmc,bmc-iterative,hf-dynamic", "--no-split", "--out", str(tmp_path / "r"), "--threads", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert res["rounds"] == 3 and res["tokens_identical"] is True
    assert set(res["first_divergence"]) == {"bmc", "bmc-iterative", "hf-dynamic"}  # bmc's later rounds checked too
    for name, r in res["engines"].items():
        assert len(r["rounds_tokens_per_s"]) == 3, name
        assert r["decode_tokens_per_s"] == max(r["rounds_tokens_per_s"]), name
    by_round = res["ratios_by_round"]["bmc"]["hf-dynamic"]
    assert len(by_round) == 3
    tps = {n: r["rounds_tokens_per_s"] for n, r in res["engines"].items()}
    assert by_round == [a / b for a, b in zip(tps["bmc"], tps["hf-dynamic"])]
    assert res["ratios"]["bmc"]["hf-dynamic"] == max(tps["bmc"]) / max(tps["hf-dynamic"])


def test_rounds_must_be_positive(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        main(["--rounds", "0", "--model", "opt-tiny-random"])
    assert e.value.code == 2 and "--rounds" in capsys.readouterr().err


def touched_mapping(mib: int) -> mmap.mmap:
    """Fresh anonymous memory with every page written: resident for sure (a freed tensor's memory may be reused
    from the allocator's pool without raising the RSS)."""
    m = mmap.mmap(-1, mib * 2**20)
    for off in range(0, mib * 2**20, mmap.PAGESIZE):
        m[off] = 1
    return m


@pytest.mark.parametrize("kernel_mark", [True, False])
def test_peak_rss_sees_memory_freed_inside_the_run(monkeypatch, kernel_mark):
    """Both ways of measuring the peak (the kernel's high-water mark; the sampling thread where it is missing)
    see 64 MiB that were touched and freed inside the block, and not memory freed before it."""
    if not kernel_mark:
        monkeypatch.setattr(PeakRSS, "_high_water_mark", staticmethod(lambda: None))
    touched_mapping(128).close()  # a peak before the block: not counted
    start = PeakRSS.rss()
    with PeakRSS() as r:
        m = touched_mapping(64)
        time.sleep(0.05)  # the thread samples every 5 ms
        m.close()
    assert r.peak - start >= 56 * 2**20
    assert r.peak - start < 120 * 2**20
    assert (r._thread is None) == kernel_mark
