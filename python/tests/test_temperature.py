# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""contrastive_torch.temperature: RangeGuard against the library's C++ range_guard (through the extension) bit for
bit, its reading of a GradScaler, CollapseMonitor's records, counts and warnings, and the errors of both."""

import math
import os
import random
import struct
import warnings

import pytest
import torch

import contrastive_torch as ct
from contrastive_torch import temperature as T
from contrastive_torch.temperature import CollapseMonitor, CollapseWarning, RangeGuard

SITES = ct.NONFINITE_SITES


def bits(x):
    return struct.pack("f", x) if not math.isnan(x) else b"nan"


def random_record(rng, theta, bound, scale):
    """One step's (theta_opt, skipped, site, loss_scale, next_loss_scale) as a GradScaler run produces them, with every
    cause of a skip, overflowing optimiser results, NaN, and scales around the floor."""
    kind = rng.random()
    if kind < 0.45:  # finite step: the optimiser moves theta (sometimes far past the bound, or to inf/NaN)
        move = rng.choice([rng.gauss(0.0, 0.05), rng.gauss(0.0, 0.05), rng.uniform(-3.0, 6.0)])
        theta_opt = rng.choice([theta + move] * 12 + [bound + 1.0, math.nan, math.inf, -math.inf, 95.0, -95.0])
        grow = rng.random() < 0.1
        return theta_opt, False, "none", scale, scale * 2.0 if grow else scale
    site = rng.choice(SITES[1:])
    nxt = scale * 0.5
    if rng.random() < 0.1:  # a dead scale: skipped without a back-off
        scale = nxt = rng.choice([0.0, math.inf])
    return theta, True, site, scale, nxt


@pytest.fixture(scope="module")
def library():
    ext = ct.extension()
    if not hasattr(ext, "range_guard_observe"):
        pytest.fail("the extension has no range_guard_observe: rebuild it")
    return ext


@pytest.mark.parametrize("dtype,settings", [
    (torch.float16, {}),
    (torch.float16, {"headroom": 1.0, "retreat": 0.25, "scale_floor": 0.0, "tau_max": 1.0}),
    (torch.float16, {"headroom": 3.0, "retreat": 2.0, "scale_floor": 512.0, "tau_max": math.inf}),
    (torch.bfloat16, {"retreat": 7.5}),
    (torch.float32, {"headroom": 1.0, "tau_max": 20.0}),
])
def test_range_guard_equals_the_library_policy(library, seed, dtype, settings):
    rng = random.Random(seed)
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    for sequence in range(4):
        param = torch.nn.Parameter(torch.tensor(rng.uniform(-1.0, 12.0), dtype=torch.float32))
        opt = torch.optim.Adam([param], lr=1e-3)
        param.grad = torch.ones_like(param)
        opt.step()  # creates exp_avg
        guard = RangeGuard(param, opt, dtype=dtype, **settings)
        full = {"headroom": 16.0, "retreat": 0.5, "scale_floor": 1.0, "tau_max": 1.0, **settings}
        c_theta, c_ceiling, c_events = T._f32(float(param.detach())), math.inf, 0
        scale = rng.choice([65536.0, 4.0, 1.0, 0.5])
        bound = guard.range_bound()
        for step in range(300):
            c_moment = T._f32(rng.uniform(-1.0, 1.0))  # exp_avg is float32
            opt.state[param]["exp_avg"].fill_(c_moment)
            theta_opt, skipped, site, ls, nls = random_record(rng, c_theta, bound, scale)
            scale = nls if nls > 0 and math.isfinite(nls) else 65536.0
            if not skipped:
                with torch.no_grad():
                    param.fill_(theta_opt)
            event = guard.observe(skipped, site, ls, nls)
            c_theta, c_ceiling, c_events, c_moment = library.range_guard_observe(
                name, full["headroom"], full["retreat"], full["scale_floor"], full["tau_max"], c_ceiling, c_events,
                c_moment, c_theta, theta_opt, skipped, SITES.index(site), ls, nls)
            where = f"seed {seed}, sequence {sequence}, step {step}: {skipped} {site} {ls} -> {nls}, opt {theta_opt}"
            assert bits(float(param.detach())) == bits(c_theta), where
            assert bits(guard.ceiling) == bits(c_ceiling), where
            assert guard.events == c_events, where
            assert float(opt.state[param]["exp_avg"]) == c_moment, where
            assert event == (c_moment == 0.0), where  # the moment drawn is never 0: zeroed exactly on an event
            if step % 97 == 50:  # a restored checkpoint continues the same trajectory
                state = guard.state_dict()
                guard = RangeGuard(param, opt, dtype=torch.float32)
                guard.load_state_dict(state)
        assert float(param.detach()) <= bound


def grad_scaler(scale=65536.0):
    return torch.amp.GradScaler("cpu", init_scale=scale)


def scaler_step(scaler, param, opt, grad):
    """One GradScaler step of `param` with the (unscaled) gradient `grad` (inf: the step is skipped)."""
    opt.zero_grad()
    scaler.scale(param * grad).backward()
    scaler.step(opt)
    scaler.update()


def test_range_guard_reads_the_grad_scaler():
    theta = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    opt = torch.optim.Adam([theta], lr=0.5)
    scaler = grad_scaler(4.0)
    guard = RangeGuard(theta, opt, scaler)
    assert guard.ceiling == math.inf
    for _ in range(40):  # the optimiser drives theta up; the range bound stops it
        scaler_step(scaler, theta, opt, -1.0)
        assert guard.step() is False
    assert float(theta.detach()) == T._f32(math.log(65504.0 / 16.0)) == guard.ceiling
    assert abs(guard.max_scale - 4094.0) < 0.01 and abs(guard.min_tau - 1 / 4094.0) < 1e-9
    before = float(theta.detach())
    # A skip the loss explains (non-finite loss: the logits overflowed) retreats and drops Adam's first moment.
    scaler_step(scaler, theta, opt, math.inf)
    assert guard.step(loss=torch.tensor(math.inf)) is True
    assert guard.events == 1 and float(theta.detach()) == T._f32(before - 0.5) == guard.ceiling
    assert float(opt.state[theta]["exp_avg"]) == 0.0
    # A skip the loss does not explain, above the floor: only the scaler backs off.
    scaler_step(scaler, theta, opt, math.inf)
    assert guard.step(loss=torch.tensor(1.0)) is False and guard.events == 1
    # The report of a contrastive_torch loss names the site.
    scaler_step(scaler, theta, opt, math.inf)
    assert guard.step(report={"first_nonfinite_code": torch.tensor(1, dtype=torch.int32)}) is True
    assert guard.events == 2
    # A back-off below the floor is an event whatever the site; the ceiling never rises again.
    ceiling = guard.ceiling
    scaler_step(scaler, theta, opt, math.inf)
    assert scaler.get_scale() < 1.0
    assert guard.step() is True and guard.events == 3 and guard.ceiling < ceiling
    for _ in range(5):
        scaler_step(scaler, theta, opt, -1.0)
        guard.step()
    assert float(theta.detach()) == guard.ceiling


def test_range_guard_undoes_a_nan_and_keeps_other_dtypes():
    theta = torch.nn.Parameter(torch.tensor(3.0))
    guard = RangeGuard(theta)
    guard.observe(False, "none", 1.0, 1.0)
    with torch.no_grad():
        theta.fill_(math.nan)
    guard.observe(False, "none", 1.0, 1.0)
    assert float(theta.detach()) == 3.0
    half = torch.nn.Parameter(torch.tensor(20.0, dtype=torch.bfloat16))
    g = RangeGuard(half, dtype=torch.float16)
    g.observe(False, "none", 1.0, 1.0)
    assert half.dtype == torch.bfloat16 and float(half.detach()) == float(torch.tensor(g.ceiling).bfloat16())


def test_range_guard_errors_name_the_argument():
    p = torch.nn.Parameter(torch.tensor(2.0))
    for bad in (torch.zeros(1), torch.tensor(2), 2.0, torch.zeros(2, 2)):
        with pytest.raises(TypeError, match="logit_scale must be a 0-d floating-point tensor"):
            RangeGuard(bad)
    with pytest.raises(ValueError, match="dtype must be .*float64"):
        RangeGuard(p, dtype=torch.float64)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        RangeGuard(p, scaler=object())
    with pytest.raises(TypeError, match="optimizer must be"):
        RangeGuard(p, optimizer="adam")
    for key, value in (("headroom", 0.5), ("headroom", math.inf), ("retreat", 0.0), ("retreat", 80.0),
                       ("scale_floor", -1.0), ("scale_floor", math.nan), ("tau_max", 0.0), ("tau_max", 1e-40)):
        with pytest.raises(ValueError, match=key):
            RangeGuard(p, **{key: value})
    guard = RangeGuard(p)
    guard.observe(False, "none", 1.0, 1.0)
    state = guard.state_dict()
    for change in ({"events": -1}, {"retreat": 100.0}, {"ceiling": -1.0}, {"dtype": "float64"}, {"theta": "x"}):
        with pytest.raises(ValueError):
            guard.load_state_dict({**state, **change})
        assert guard.state_dict() == state
    with pytest.raises(ValueError, match="state must be"):
        guard.load_state_dict({"ceiling": 1.0})
    with pytest.raises(ValueError, match="site"):
        guard.observe(True, "elsewhere", 1.0, 0.5)
    with pytest.raises(TypeError, match="skipped"):
        guard.observe(1, "none", 1.0, 1.0)
    assert guard.state_dict() == state


def test_a_dead_scale_as_torch_has_it():
    # PyTorch's GradScaler at scale 0 skips a step only when its loss is not finite: it checks the scaled gradients
    # (0 x g: finite) before unscaling them by 1/0, so a finite loss hands the optimizer NaN gradients. The monitor
    # says so; the guard undoes the NaN on its parameter (the library's own step skips such a step:
    # tests/errors_test.cpp, DeadLossScale).
    theta = torch.nn.Parameter(torch.tensor(3.0))
    opt = torch.optim.SGD([theta], lr=0.1)
    scaler = grad_scaler(0.0)
    guard = RangeGuard(theta, opt, scaler)
    monitor = CollapseMonitor(scaler, theta, warn=False)
    scaler_step(scaler, theta, opt, math.inf)  # a non-finite loss: skipped, and a range event for the guard
    rec = monitor.step(loss=torch.tensor(math.inf))
    assert rec["skipped"] and rec["first_nonfinite"] == "loss" and rec["loss_scale"] == 0.0
    assert guard.step(loss=torch.tensor(math.inf)) is True and float(theta.detach()) == 2.5
    scaler_step(scaler, theta, opt, 1.0)  # a finite loss: not skipped, and the optimizer wrote NaN
    assert math.isnan(float(theta.detach()))
    rec = monitor.step(loss=torch.tensor(2.0))
    assert not rec["skipped"] and rec["first_nonfinite"] == "none" and rec["loss_scale"] == 0.0
    assert guard.step(loss=torch.tensor(2.0)) is False and float(theta.detach()) == 2.5
    assert "optimizer received NaN gradients" in monitor.summary()["warnings"][0]
    # +inf skips every step, whatever the loss.
    scaler = grad_scaler(math.inf)
    monitor = CollapseMonitor(scaler, warn=False)
    scaler_step(scaler, theta, opt, 1.0)
    assert monitor.step(loss=torch.tensor(1.0))["skipped"] and float(theta.detach()) == 2.5


def collapse_run(monitor, scaler, theta, opt, steps_up=30, skipped=12):
    """theta rises, then every step is skipped (logits overflowed), as in the fp16 collapse (docs/collapse.md)."""
    for _ in range(steps_up):
        scaler_step(scaler, theta, opt, -1.0)
        monitor.step(loss=torch.tensor(1.0))
    for _ in range(skipped):
        scaler_step(scaler, theta, opt, math.inf)
        monitor.step(loss=torch.tensor(math.nan))


def test_monitor_warns_once_per_episode_and_counts_skips():
    theta = torch.nn.Parameter(torch.tensor(7.0))
    opt = torch.optim.SGD([theta], lr=0.05)
    scaler = grad_scaler(16.0)
    monitor = CollapseMonitor(scaler, theta, window=20, backoffs=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collapse_run(monitor, scaler, theta, opt)
    messages = [str(w.message) for w in caught if issubclass(w.category, CollapseWarning)]
    assert len(messages) == 2, messages
    assert "precedes the fp16 temperature collapse" in messages[0] and "tau fell" in messages[0]
    assert "the run is collapsing" in messages[1]
    s = monitor.summary()
    assert s["steps"] == 42 and s["skipped"] == 12 and s["skipped_by_site"] == {"loss": 12}
    assert s["backoffs"] == 12 and s["consecutive_skipped"] == 12 and s["loss_scale"] == 16.0 / 2**12
    assert s["min_tau"] == pytest.approx(math.exp(-float(theta.detach())), rel=1e-6) and s["warnings"] == messages
    assert s["max_logit"] == pytest.approx(math.exp(float(theta.detach())), rel=1e-6)
    assert len(monitor.records) == 42 and monitor.records[-1]["max_logit_is_bound"]


def test_monitor_stays_quiet_on_an_ordinary_run():
    # Start-up back-offs with tau rising and small logits are the scaler's ordinary life: no warning.
    theta = torch.nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.SGD([theta], lr=0.01)
    scaler = grad_scaler()
    monitor = CollapseMonitor(scaler, theta, window=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollapseWarning)
        for step in range(60):
            scaler_step(scaler, theta, opt, math.inf if step % 7 == 0 else 1.0)
            monitor.step(report={"max_logit": torch.tensor(30.0), "first_nonfinite_code": torch.tensor(0)})
    s = monitor.summary()
    assert s["skipped"] == 9 and s["skipped_by_site"] == {"parameters": 9} and s["max_logit"] == 30.0
    assert s["warnings"] == []


def test_monitor_errors_name_the_argument():
    with pytest.raises(TypeError, match="scaler must be"):
        CollapseMonitor(scaler=torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=1.0))
    with pytest.raises(TypeError, match="logit_scale"):
        CollapseMonitor(None, torch.zeros(3))
    with pytest.raises(ValueError, match="dtype"):
        CollapseMonitor(None, dtype=torch.float64)
    for key, value in (("near", 0.0), ("near", 2.0), ("backoffs", 0), ("window", 1.5), ("history", -1)):
        with pytest.raises(ValueError, match=key):
            CollapseMonitor(None, **{key: value})
    with pytest.raises(ValueError, match="first_nonfinite"):
        CollapseMonitor(None).step(report={"first_nonfinite": "nowhere"})


def test_the_collapse_example_runs(tmp_path):
    # examples/python/collapse.py end to end on a few steps: open_clip's factory model and loss, the guard, the fused
    # loss (ours, under the custom-ops requirement of every loss call) and bfloat16, one row each and their CSVs.
    import importlib.util
    import subprocess
    import sys

    from conftest import require

    require("open_clip", importlib.util.find_spec("open_clip") is not None, "open-clip-torch is not installed")
    require("custom_ops", ct.HAS_CUSTOM_OPS, f"PyTorch {torch.__version__} < 2.4 has no torch.library.custom_op")
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python", "collapse.py")
    out = subprocess.run([sys.executable, example, "--steps", "8", "--eval-every", "4", "--warmup", "2",
                          "--runs", "fp16_guard,fp16_fused,bf16", "--seeds", "3", "--jobs", "1",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["fp16_guard"], ["fp16_fused"],
                                                                                     ["bf16"])]
    assert [r[0] for r in rows] == ["fp16_guard", "fp16_fused", "bf16"], out.stdout
    for run in ("fp16_guard", "fp16_fused", "bf16"):
        with open(tmp_path / f"{run}-3.csv") as f:
            lines = f.read().splitlines()
        assert lines[0].startswith("step,loss,tau,loss_scale,skipped") and len(lines) == 9, lines
    assert (tmp_path / "index.txt").read_text().split() == ["fp16_guard-3", "fp16_fused-3", "bf16-3"]


def test_a_guard_built_before_the_scaler_state_is_loaded():
    # open_clip's resume order: the tools exist before scaler.load_state_dict. A finite step is still read as finite
    # (the scaler's growth tracker says so), a skipped one as skipped.
    theta = torch.nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.SGD([theta], lr=0.1)
    scaler = grad_scaler()
    guard, monitor = RangeGuard(theta, opt, scaler), CollapseMonitor(scaler, theta, warn=False)
    scaler.load_state_dict(grad_scaler(0.5).state_dict())
    scaler_step(scaler, theta, opt, -1.0)
    assert not monitor.step(loss=torch.tensor(1.0))["skipped"]
    assert guard.step(loss=torch.tensor(1.0)) is False and guard.events == 0
    assert float(theta.detach()) == pytest.approx(2.1, rel=1e-6)
    scaler_step(scaler, theta, opt, math.inf)
    assert monitor.step(loss=torch.tensor(math.inf))["skipped"]
    assert guard.step(loss=torch.tensor(math.inf)) is True


def test_observe_rounds_the_scales_as_the_library_does(library):
    # The library's step record holds the loss scales as floats: 1 - 1e-10 is 1 there, so no back-off and no event.
    theta = torch.nn.Parameter(torch.tensor(3.0))
    guard = RangeGuard(theta)
    assert guard.observe(True, "parameters", 1.0, 1.0 - 1e-10) is False
    c_theta, _, c_events, _ = library.range_guard_observe("float16", 16.0, 0.5, 1.0, 1.0, math.inf, 0, 0.5, 3.0, 3.0,
                                                          True, SITES.index("parameters"), 1.0, 1.0 - 1e-10)
    assert c_events == 0 and float(theta.detach()) == c_theta == 3.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_parameter_stays_under_the_ceiling(dtype):
    for retreat in (0.3, 0.5, 0.7):
        theta = torch.nn.Parameter(torch.tensor(20.0, dtype=dtype))
        guard = RangeGuard(theta, retreat=retreat)
        guard.observe(False, "none", 1.0, 1.0)
        assert float(theta.detach()) <= guard.ceiling
        guard.observe(True, "logits", 1.0, 0.5)
        assert float(theta.detach()) <= guard.ceiling and theta.dtype == dtype


def test_settings_as_numbers_and_bad_states():
    import numpy as np

    p = torch.nn.Parameter(torch.tensor(2.0))
    assert RangeGuard(p, headroom=np.float32(16)).headroom == 16.0
    assert RangeGuard(p, headroom=torch.tensor(8.0)).headroom == 8.0
    with pytest.raises(TypeError, match="headroom must be a number"):
        RangeGuard(p, headroom=True)
    with pytest.raises(ValueError, match="retreat must be in"):
        RangeGuard(p, retreat=10**400)
    with pytest.raises(ValueError, match="tau_max .* got 1e-50"):
        RangeGuard(p, tau_max=1e-50)
    guard = RangeGuard(p)
    with pytest.raises(TypeError, match="loss_scale must be a number"):
        guard.observe(True, "loss", None, 1.0)
    guard.observe(False, "none", 1.0, 1.0)
    state = guard.state_dict()
    for change in ({"min_theta": 90.0}, {"min_theta": math.inf}, {"theta": math.nan}, {"events": True},
                   {"events": 2**40}, {"loss_scale": -5.0}, {"loss_scale": math.nan}):
        with pytest.raises(ValueError):
            guard.load_state_dict({**state, **change})
        assert guard.state_dict() == state
    monitor = CollapseMonitor(None, torch.nn.Parameter(torch.tensor(-800.0)), warn=False)
    assert monitor.step(report={"max_logit": None})["tau"] == math.exp(709.0)
