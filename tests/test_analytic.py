"""The cost model (seed paper Eq. 5-9), calibration profiles, and the runtime choosing T from them."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import bmc
from bmc.analytic import (Constants, ProfileWarning, Shape, best_T, c_prime, load_profile, predicted_time,
                          round_pow2, t_opt, t_opt_simple)
from bmc.analytic import profile as profile_mod
from bmc.kv import whole_score_blocks

SHAPE = Shape(batch=8, layers=30, heads=9, kv_heads=3, head_dim=64, dtype_bytes=4)
CONSTS = Constants(copy_bw=10e9, alloc_s=0.0, attn_flops=20e9, verify_flops=80e9)


def test_known_values():
    # row_bytes = 2*8*30*3*64*4 = 368640; row_flops = 4*8*30*9*64 = 552960
    assert SHAPE.row_bytes == 368640 and SHAPE.row_flops == 552960
    a, f = SHAPE.row_bytes / 10e9, SHAPE.row_flops / 20e9
    n, T = 1024, 16
    expected = a * n * (T + 1) / 2 + f * n * n * (1 + 1 / T) / 2
    assert predicted_time(T, n, SHAPE, CONSTS) == pytest.approx(expected)
    assert c_prime(SHAPE, CONSTS) == pytest.approx(f / a)
    assert t_opt(n, SHAPE, CONSTS) == pytest.approx(math.sqrt(c_prime(SHAPE, CONSTS) * n))


@pytest.mark.parametrize("alloc_s", [0.0, 1e-3, 5e-2])
def test_minimum_is_where_the_derivative_vanishes(alloc_s):
    c = Constants(copy_bw=10e9, alloc_s=alloc_s, attn_flops=20e9)
    n = 4096
    t_star = t_opt(n, SHAPE, c)
    grid = [t_star * (1 + e / 1000) for e in range(-300, 301)]
    times = [predicted_time(T, n, SHAPE, c) for T in grid]
    assert grid[times.index(min(times))] == pytest.approx(t_star, rel=2e-3)
    h = 1e-4 * t_star
    deriv = (predicted_time(t_star + h, n, SHAPE, c) - predicted_time(t_star - h, n, SHAPE, c)) / (2 * h)
    assert abs(deriv) < 1e-6 * predicted_time(t_star, n, SHAPE, c) / t_star
    if alloc_s > 0:  # a real allocation cost means fewer allocations than Eq. 7 says
        assert t_star < t_opt(n, SHAPE, Constants(copy_bw=10e9, alloc_s=0.0, attn_flops=20e9))


def test_T_doubles_when_N_quadruples():
    for n in (128, 512, 2048):
        assert t_opt(4 * n, SHAPE, CONSTS) == pytest.approx(2 * t_opt(n, SHAPE, CONSTS))
        assert best_T(4 * n, SHAPE, CONSTS) == 2 * best_T(n, SHAPE, CONSTS)


def test_paper_example_c_prime_point_one():
    # C' = 0.1, N = 512 -> T = sqrt(51.2) = 7.2 -> 8 (the paper's Fig. 7 optimum)
    assert round_pow2(t_opt_simple(512, 0.1)) == 8 and round_pow2(t_opt_simple(2048, 0.1)) == 16
    assert round_pow2(0.3) == 1 and round_pow2(5.6) == 4 and round_pow2(5.7) == 8


def test_gqa_and_dtype_scale_the_copy_term():
    mha = Shape(batch=8, layers=30, heads=9, kv_heads=9, head_dim=64)
    mqa = Shape(batch=8, layers=30, heads=9, kv_heads=1, head_dim=64)
    bf16 = Shape(batch=8, layers=30, heads=9, kv_heads=3, head_dim=64, dtype_bytes=2)
    base = c_prime(mha, CONSTS)
    assert c_prime(SHAPE, CONSTS) == pytest.approx(3 * base)  # G = 3
    assert c_prime(mqa, CONSTS) == pytest.approx(9 * base)  # G = 9
    assert c_prime(bf16, CONSTS) == pytest.approx(2 * c_prime(SHAPE, CONSTS))  # Q = 2
    # batch cancels: the optimum does not depend on B, only on the machine and the head grouping
    assert c_prime(Shape(batch=1, layers=2, heads=9, kv_heads=3, head_dim=64), CONSTS) == pytest.approx(3 * base)


def test_speculative_variant_scales_as_sqrt_n_over_m():
    n, k = 4096, 26
    t1 = t_opt(n, SHAPE, CONSTS, k=k, m=1.0)
    assert t_opt(n, SHAPE, CONSTS, k=k, m=4.0) == pytest.approx(t1 / 2)
    assert t_opt(4 * n, SHAPE, CONSTS, k=k, m=4.0) == pytest.approx(t1)
    # verify attention runs at the GEMM rate beta'*C: k rows cost k/4 decode rows here
    assert t_opt(n, SHAPE, CONSTS, k=k, m=1.0) == pytest.approx(t_opt(n, SHAPE, CONSTS) * math.sqrt(k / 4))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BMC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BMC_PROFILE", raising=False)
    profile_mod._said.clear()
    return tmp_path / "cache"


def test_calibrate_quick_writes_a_profile_that_generate_uses(cache_dir, tmp_path, gqa_dir, capsys, monkeypatch):
    import bmc.analytic.calibrate as cal
    from bmc.cli.calibrate import main

    # the CLI's whole path on a smaller grid than --quick's (what is measured is the same; fewer points)
    monkeypatch.setattr(cal, "QUICK", dataclasses.replace(cal.QUICK, configs=cal.QUICK.configs[:1], repeats=2))
    out = tmp_path / "profile.json"
    main(["--quick", "--output", str(out), "--threads", "2"])
    printed = capsys.readouterr().out
    assert "alpha*BW" in printed and "beta*C" in printed and str(out) in printed
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["torch"] == torch.__version__ and data["dtype"] == "float32"
    k = data["constants"]
    assert data["attention_kernel"] == profile_mod.attention_kernel(torch.device("cpu"), torch.float32)
    assert k["copy_bw_bytes_per_s"] > 0 and k["attn_flops_per_s"] > 0 and k["alloc_s"] >= 0
    stored = cache_dir / "profile-cpu-float32.json"
    assert json.loads(stored.read_text()) == data
    consts = load_profile(stored, torch.device("cpu"), torch.float32)
    assert consts is not None and consts.copy_bw == k["copy_bw_bytes_per_s"]

    model = bmc.load(str(gqa_dir))
    res = bmc.generate(model, [[5, 6, 7]], max_new_tokens=20, ignore_eos=True)
    st = res.stats
    cfg = model.config
    shape = Shape(batch=1, layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim)
    # a CPU decode cache grows in place: Eq. 5 without its copy term (the profile's C0 against the padding)
    assert st.T_source == f"profile {stored}; growth in place, no copy term"
    free = dataclasses.replace(consts, copy_bw=math.inf)
    n = st.max_length
    assert st.r == whole_score_blocks(math.ceil(n / best_T(n, shape, free)), n)
    sparq = bmc.generate(model, [[5, 6, 7]], max_new_tokens=20, ignore_eos=True, attention="sparq").stats
    assert sparq.T_source == f"profile {stored}"  # SparQ's K mirror is copied at each growth: the copy term stays
    assert sparq.r == whole_score_blocks(math.ceil(n / best_T(n, shape, consts)), n)


def _write(path, **changes):
    data = {"version": 1, **profile_mod.identity(torch.device("cpu"), torch.float32), "threads": 2,
            "constants": {"copy_bw_bytes_per_s": 1e10, "alloc_s": 0.0, "attn_flops_per_s": 2e10,
                          "verify_flops_per_s": 4e10, "verify_rows": 16}}
    data.update(changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("changes,match", [
    ({"device_name": "Some Other CPU"}, "measured elsewhere"),
    ({"torch": "1.0.0"}, "measured elsewhere"),
    ({"device": "cuda"}, "measured elsewhere"),
    ({"version": 99}, "unreadable"),
    ({"constants": {"copy_bw_bytes_per_s": -1, "alloc_s": 0, "attn_flops_per_s": 1}}, "unreadable"),
    ({"constants": {}}, "unreadable"),
    # a launch-bound fit (copy time flat in size) once wrote an infinite bandwidth: never use it
    ({"constants": {"copy_bw_bytes_per_s": float("inf"), "alloc_s": 0, "attn_flops_per_s": 1e9}}, "unreadable"),
])
def test_foreign_or_corrupt_profiles_are_ignored_with_a_warning(cache_dir, gqa_dir, changes, match):
    _write(cache_dir / "profile-cpu-float32.json", **changes)
    model = bmc.load(str(gqa_dir))
    with pytest.warns(ProfileWarning, match=match):
        st = bmc.generate(model, [[5, 6, 7]], max_new_tokens=4, ignore_eos=True).stats
    assert st.T_source.startswith("default")


def test_a_profile_of_the_other_attention_kernel_is_set_aside_without_a_warning(cache_dir, gqa_dir, recwarn, caplog):
    """Measured on this machine for the other kernel (BMC_NATIVE=0, or tensor parallel ranks on the PyTorch path):
    not used, and said as that, not as a profile from elsewhere."""
    import logging

    _write(cache_dir / "profile-cpu-float32.json", attention_kernel="some-other-kernel")
    with caplog.at_level(logging.INFO, logger="bmc"):
        st = bmc.generate(bmc.load(str(gqa_dir)), [[5, 6, 7]], max_new_tokens=4, ignore_eos=True).stats
    assert st.T_source.startswith("default")
    assert not [w for w in recwarn if issubclass(w.category, ProfileWarning)]
    assert "times the some-other-kernel attention kernel" in caplog.text


def test_garbage_profile_file(cache_dir, gqa_dir):
    p = cache_dir / "profile-cpu-float32.json"
    p.parent.mkdir(parents=True)
    p.write_text("{not json")
    with pytest.warns(ProfileWarning, match="unreadable"):
        st = bmc.generate(bmc.load(str(gqa_dir)), [[5, 6]], max_new_tokens=3, ignore_eos=True).stats
    assert st.T_source.startswith("default")


def test_valid_profile_is_used_without_warning(cache_dir, gqa_dir, recwarn):
    _write(cache_dir / "profile-cpu-float32.json")
    st = bmc.generate(bmc.load(str(gqa_dir)), [[5, 6, 7]], max_new_tokens=4, ignore_eos=True).stats
    assert st.T_source.startswith("profile") and not [w for w in recwarn if w.category is ProfileWarning]


def test_calibration_refuses_a_fit_without_slope(monkeypatch):
    """Times that do not grow with size (launch-bound) must fail loudly, not write an infinite bandwidth."""
    from bmc.analytic import calibrate as cal

    monkeypatch.setattr(cal, "_time", lambda fn, device, repeats: 1e-5)  # flat: every size takes the same time
    with pytest.raises(cal.CalibrationError, match="could not be fitted"):
        cal.calibrate(torch.device("cpu"), torch.float32, quick=True)


def test_speculative_runs_choose_T_with_eq_9(cache_dir, gqa_dir):
    """Under speculation T comes from sqrt(C' N k / m): k = verified tokens per step, m = expected emitted ones."""
    from bmc.engine import GenerationConfig, speculation_shape
    from bmc.spec.static_tree import DEFAULT_ACCEPTANCE, expected_accepted

    model = bmc.load(str(gqa_dir))
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    k, m = speculation_shape(GenerationConfig(speculative="ngram", tree="chain:4"))
    assert k == 5 and m == pytest.approx(1 + expected_accepted((-1, 0, 1, 2), DEFAULT_ACCEPTANCE))
    assert speculation_shape(GenerationConfig()) == (1, 1.0)
    plain = bmc.generate(model, prompt, max_new_tokens=100, ignore_eos=True).stats
    assert plain.T_source.startswith("default")  # no profile in this test's cache dir: the paper's C' = 0.1
    spec = bmc.generate(model, prompt, max_new_tokens=100, ignore_eos=True, speculative="ngram", tree="chain:4").stats
    from bmc.analytic.model import round_pow2, t_opt_simple
    from bmc.kv import r_from_T

    n = plain.max_length
    T = round_pow2(t_opt_simple(n, profile_mod.DEFAULT_C_PRIME * k / m))
    assert spec.T == math.ceil(n / whole_score_blocks(r_from_T(n, T), n)) and "Eq. 9" in spec.T_source
    wide = bmc.generate(model, prompt, max_new_tokens=100, ignore_eos=True, speculative="ngram",
                        tree="dynamic:4x6").stats
    assert wide.T > plain.T  # 25 verified rows per ~3.3 emitted tokens: more, smaller chunks (T grows as sqrt(k/m))


def test_one_flat_configuration_does_not_make_the_calibrated_constant_infinite():
    from bmc.analytic.calibrate import median_of_fitted

    assert median_of_fitted([2e10, float("inf")]) == 2e10  # a neighbour's burst flattened one configuration's fit
    assert median_of_fitted([1e10, 3e10, -1.0]) == 2e10
    assert median_of_fitted([float("inf"), 0.0]) == float("inf")  # nothing fitted: calibrate() refuses to write


def test_a_growth_that_copies_nothing_balances_its_fixed_cost_against_the_padding():
    """Eq. 5 without the copy term (a = 0, a cache growing in place): T_opt = N sqrt(f / 2 C0), more growths than
    with the copy, and every token (T = N) where a growth costs nothing at all."""
    from bmc.analytic.model import Constants, coefficients, predicted_time, t_opt

    shape = Shape(batch=8, layers=30, heads=9, kv_heads=3, head_dim=64)
    c = Constants(copy_bw=2e10, alloc_s=2e-4, attn_flops=1.25e11)
    free = dataclasses.replace(c, copy_bw=math.inf)
    n = 1792
    _, f = coefficients(shape, free)
    assert t_opt(n, shape, free) == pytest.approx(n * math.sqrt(f / (2 * c.alloc_s)))
    assert t_opt(n, shape, free) > t_opt(n, shape, c)
    best = min(range(1, n + 1), key=lambda T: predicted_time(T, n, shape, free))  # the discrete optimum
    assert abs(best - t_opt(n, shape, free)) <= 0.01 * best + 1
    assert t_opt(n, shape, dataclasses.replace(free, alloc_s=0.0)) == n


def test_calibrate_times_a_models_rows_for_tree_auto(cache_dir, gqa_dir, capsys, monkeypatch):
    """bmc-calibrate --model: the model's step cost by token rows (1 to 64), measured and stored where tree="auto"
    reads it, so a later speculative run measures nothing."""
    import bmc.analytic.calibrate as cal
    import bmc.spec.auto as auto
    from bmc.cli.calibrate import main

    monkeypatch.setattr(cal, "QUICK", dataclasses.replace(cal.QUICK, configs=cal.QUICK.configs[:1], repeats=2))
    main(["--quick", "--no-save", "--threads", "2", "--model", str(gqa_dir)])
    printed = capsys.readouterr().out
    assert "step by rows" in printed and " 64:" in printed
    assert len(list(cache_dir.glob("rows-*.json"))) == 1

    def measured_again(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(auto, "measure_row_costs", measured_again)
    costs = auto.row_costs(bmc.load(str(gqa_dir)))
    assert costs.rows == auto.MEASURED_ROWS and costs.rows[-1] == 64 and all(s > 0 for s in costs.seconds)
