"""bench/sweep_T.py's end-to-end window logic, with a fake clock instead of the model: rounds, widening towards the
fastest T, and the noise summary (which T the measured spread cannot tell apart from the best)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("sweep_T", Path(__file__).resolve().parents[1] / "bench" / "sweep_T.py")
sweep_T = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(sweep_T)


def fake_clock(curve: dict[int, float], jitter: list[float]):
    """e2e_seconds stand-in: curve[T] times the next jitter factor; records the order of the calls."""
    calls: list[int] = []

    def e2e_seconds(model, n, batch, T):
        calls.append(T)
        return curve[T] * jitter[(len(calls) - 1) % len(jitter)]
    return e2e_seconds, calls


def test_rounds_visit_every_T_of_the_window_and_keep_the_fastest_run(monkeypatch):
    curve = {2**i: 10.0 + abs(i - 4) for i in range(10)}  # best at T = 16
    fake, calls = fake_clock(curve, [1.0, 1.05, 1.02])
    monkeypatch.setattr(sweep_T, "e2e_seconds", fake)
    row = {"predicted_T": 16}
    sweep_T.e2e_window(None, 512, 1, 16, 1, 1e9, 3, row)
    assert sorted(set(calls)) == [8, 16, 32] and len(calls) == 1 + 3 * 3 - 1  # the first point counts for round 1
    assert calls[:4] == [16, 8, 32, 8]  # round 2 runs backwards
    pts = {p["T"]: p for p in row["e2e_points"]}
    for T, p in pts.items():
        assert len(p["e2e_runs_s"]) == 3 and p["e2e_decode_s"] == min(p["e2e_runs_s"]) == pytest.approx(curve[T])
    s = sweep_T.summarise(row, row["e2e_points"], "e2e_decode_s", "e2e_runs_s")
    assert s["best_T"] == 16 and s["ratio_at_predicted"] == 1.0 and s["within_one_pow2"]
    assert s["noise"] == pytest.approx(0.05) and s["T_within_noise"] == [16]


def test_the_window_widens_towards_a_best_T_on_its_edge(monkeypatch):
    curve = {2**i: 10.0 + abs(i - 1) for i in range(10)}  # best at T = 2, predicted 16
    fake, calls = fake_clock(curve, [1.0])
    monkeypatch.setattr(sweep_T, "e2e_seconds", fake)
    row = {"predicted_T": 16}
    sweep_T.e2e_window(None, 512, 1, 16, 1, 1e9, 2, row)
    assert sorted({p["T"] for p in row["e2e_points"]}) == [1, 2, 4, 8, 16, 32]  # widened down until 2 is inside
    assert all(len(p["e2e_runs_s"]) == 2 for p in row["e2e_points"])
    s = sweep_T.summarise(row, row["e2e_points"], "e2e_decode_s", "e2e_runs_s")
    assert s["best_T"] == 2 and not s["within_one_pow2"] and s["ratio_at_predicted"] == pytest.approx(13 / 10)
    assert s["noise"] == 0.0 and s["T_within_noise"] == [2]


def test_a_flat_curve_leaves_every_T_within_the_noise(monkeypatch):
    curve = {2**i: 10.0 * (1 + 0.01 * (i % 2)) for i in range(10)}  # 1 % apart, runs spread by 3 %
    fake, _ = fake_clock(curve, [1.03, 1.0, 1.0])
    monkeypatch.setattr(sweep_T, "e2e_seconds", fake)
    row = {"predicted_T": 16}
    sweep_T.e2e_window(None, 512, 1, 16, 1, 1e9, 2, row)
    s = sweep_T.summarise(row, row["e2e_points"], "e2e_decode_s", "e2e_runs_s")
    assert s["noise"] == pytest.approx(0.03) and s["T_within_noise"] == [8, 16, 32]
    plain = sweep_T.summarise(row, row["e2e_points"], "e2e_decode_s")  # as the attention block is summarised
    assert "noise" not in plain and plain["best_T"] == s["best_T"]


def test_a_point_over_the_budget_stops_the_configuration(monkeypatch):
    fake, calls = fake_clock({16: 500.0}, [1.0])
    monkeypatch.setattr(sweep_T, "e2e_seconds", fake)
    row = {"predicted_T": 16}
    sweep_T.e2e_window(None, 512, 1, 16, 1, 100.0, 3, row)
    assert calls == [16] and "e2e_skipped" in row and row["e2e_points"][0]["e2e_runs_s"] == [500.0]
