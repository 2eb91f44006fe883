# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The temperature a PyTorch model owns (open_clip's `logit_scale`: theta = log s, s = 1/tau) under mixed precision.

    clamp_logit_scale(p)           open_clip's clamp of theta to [0, ln 100]
    freeze_then_learn(p, step, n)  the usual warm-up remedy: tau fixed for the first n steps
    RangeGuard(p, optimizer, scaler)
                                   the library's `temperature::range_guard` on the parameter: a ceiling on s from the
                                   dtype's range, lowered by the run's own overflow events (no hand-picked bound)
    CollapseMonitor(scaler, p)     why the GradScaler skips steps, and a warning when the pattern that precedes the
                                   fp16 temperature collapse appears

Each is called once per step after `scaler.step(optimizer)` and `scaler.update()`, where open_clip clamps. The guide
is docs/collapse.md ("Which remedy when").
"""

import collections
import math
import struct
import warnings

import torch

from ._host import NONFINITE_SITES

__all__ = ["clamp_logit_scale", "freeze_then_learn", "RangeGuard", "CollapseMonitor", "CollapseWarning"]

# The domain of every temperature in the library (temperature::theta_limit): |theta| <= 80.
THETA_LIMIT = 80.0
_INT32_MAX = 2**31 - 1
# The dtypes whose range a guard or a monitor reads: the library's element types.
_RANGED = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@torch.no_grad()
def clamp_logit_scale(logit_scale_param, max_scale=100.0, min_scale=1.0):
    """open_clip's clamp, on the user's parameter (log of s): keeps s = exp(param) in [min_scale, max_scale] (tau in
    [1/max_scale, 1/min_scale]); call after optimizer.step()."""
    logit_scale_param.clamp_(min=math.log(min_scale), max=math.log(max_scale))


def freeze_then_learn(logit_scale_param, step, unfreeze_step):
    """The usual warm-up remedy: the temperature stays fixed (requires_grad False) until `unfreeze_step` finite steps."""
    logit_scale_param.requires_grad_(step >= unfreeze_step)


class CollapseWarning(UserWarning):
    """CollapseMonitor's warning: the pattern that precedes the fp16 temperature collapse, or the collapse itself."""


def _f32(x):
    """x rounded to the nearest float32 (what a C++ float holds), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except (OverflowError, struct.error):
        return math.copysign(math.inf, x)


def _number(name, value):
    """A setting as a Python float: a number (not a bool), a NumPy scalar or a one-element tensor; else TypeError."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or hasattr(value, "__float__")):
        raise TypeError(f"{name} must be a number, got {_describe(value)}")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise TypeError(f"{name} must be a number, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return math.inf if value > 0 else -math.inf


def _logit_scale_param(value, name="logit_scale"):
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 0:
        raise TypeError(f"{name} must be a 0-d floating-point tensor (open_clip's model.logit_scale, the log of "
                        f"s = 1/tau), got {_describe(value)}")
    return value


def _range_dtype(value):
    if value not in _RANGED:
        raise ValueError(f"dtype must be the dtype the logits are computed in: torch.float16, torch.bfloat16 or "
                         f"torch.float32 (the library's element types; a guard for another has no range to keep), "
                         f"got {value!r}")
    return value


def _grad_scaler(value, allow_none=True):
    if value is None and allow_none:
        return None
    kinds = tuple(c for c in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                              getattr(getattr(getattr(torch, "cuda", None), "amp", None), "GradScaler", None))
                  if isinstance(c, type))
    if not kinds or not isinstance(value, kinds):
        raise TypeError(f"scaler must be a torch.amp.GradScaler{' or None' if allow_none else ''}, got "
                        f"{_describe(value)}")
    return value


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str)) else type(value).__name__


def _site_name(value, name="site"):
    """A non-finite site as a NONFINITE_SITES name, from a name or its code."""
    if isinstance(value, torch.Tensor):
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(NONFINITE_SITES):
        return NONFINITE_SITES[value]
    if isinstance(value, str) and value in NONFINITE_SITES:
        return value
    raise ValueError(f"{name} must be one of {NONFINITE_SITES} or its index, got {value!r}")


class _ScalerWatch:
    """What a GradScaler did in the step that just finished, read after `scaler.update()`: the scale the step used
    (the one seen at the previous read, or at construction), the scale after the update, and whether the step was
    skipped. torch's GradScaler zeroes its growth tracker on a skipped step (and backs off) and on a growth, and counts
    it up on every other step, so a zero tracker without a growth is a skip; that holds at a scale of 0 too, where it
    cannot back off and skips only a step whose scaled gradients are non-finite: it checks them (0 x g: all finite)
    before unscaling by 1/0 = inf, so a step with a finite loss hands the optimizer NaN gradients (measured on the CPU
    with PyTorch 2.15; the library's own step skips it). A scaler without that tracker: a back-off is a skip, and at
    scale 0 `skipped` is None (the caller decides from the loss). Disabled: 1, 1, never skipped. One `get_scale()` and
    one tracker read per step (synchronisations on CUDA). With several optimizers under one scaler, a skip is the
    scaler's verdict: the step is skipped for all of them."""

    def __init__(self, scaler):
        self.scaler = _grad_scaler(scaler)
        self.last = self.scale_now()

    def scale_now(self):
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    def read(self):
        before, now = self.last, self.scale_now()
        self.last = now
        if self.scaler is None or not self.scaler.is_enabled():
            return before, now, False
        tracker = getattr(self.scaler, "_growth_tracker", None)
        if isinstance(tracker, torch.Tensor) and tracker.numel() == 1:
            # (A growth refused because it would overflow float also zeroes the tracker; at 2^127 that reads as a skip.)
            return before, now, int(tracker.item()) == 0 and not now > before
        if before == 0.0:
            return before, now, None
        return before, now, not math.isfinite(before) or now < before


def _step_site(report, loss, skipped):
    """The first non-finite site of a step: the loss's report when there is one, else the loss value (a non-finite
    loss: its logits or its value overflowed), else 'parameters' for a step the scaler skipped for a reason only the
    model's gradients know ('none' otherwise)."""
    site = "none"
    if report is not None:
        if "first_nonfinite_code" in report:
            site = _site_name(report["first_nonfinite_code"], "report['first_nonfinite_code']")
        elif "first_nonfinite" in report:
            site = _site_name(report["first_nonfinite"], "report['first_nonfinite']")
    if site == "none" and loss is not None:
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        if not bool(torch.isfinite(loss.detach()).all()):
            site = "loss"
    if site == "none" and skipped:
        site = "parameters"
    return site


def _read_step(watch, report, loss):
    """(loss scale, next loss scale, skipped, first non-finite site) of the step that just finished."""
    loss_scale, next_loss_scale, skipped = watch.read()
    site = _step_site(report, loss, bool(skipped))
    if skipped is None:  # scale 0: torch skipped it only if the loss (and so its scaled gradients) was not finite
        skipped = site != "none"
    return loss_scale, next_loss_scale, skipped, site


class RangeGuard:
    """The library's `temperature::range_guard` rule (include/contrastive/policy/range_guard.hpp, the specification)
    on a PyTorch parameter theta = log s (open_clip's `logit_scale`), trained by the user's optimizer.

        guard = RangeGuard(model.logit_scale, optimizer, scaler)   # dtype: the logits' dtype, float16 by default
        ...
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
        guard.step(loss=loss)                                      # where open_clip calls clamp_logit_scale

    After every step, skipped ones included:
      1. range bound: theta <= log(max_finite(dtype) / headroom) (float16, headroom 16: s <= 4094, tau >= 2.44e-4;
         bfloat16 and float32: no practical bound);
      2. retreat: a step the scaler skipped whose first non-finite value is a logit or the loss, or whose back-off left
         the loss scale below `scale_floor`, lowers the ceiling to theta - retreat, moves theta there and zeroes the
         optimizer's first moment for theta (Adam's `exp_avg`, SGD's `momentum_buffer`: it points the way that
         overflowed). The ceiling never rises again.
    theta is also kept >= log(1/tau_max) and, as the library's learnable policies, within [-80, 80]; an optimizer
    step that made it NaN is undone (theta returns to its value after the previous guard step).

    The site comes from `report` (a contrastive_torch loss's `last_step` or `report=` dict) when given, else from
    `loss` (a non-finite loss value: open_clip's logits or loss overflowed); with neither, a skipped step counts as an
    event only through the scale floor. Arithmetic is float32 as in C++: for a float32 parameter the trajectory of
    theta, the ceiling and the event count equal the C++ policy's bit for bit (tests/test_temperature.py checks it
    through the extension). Checkpoint it with `state_dict()` beside the scaler's and the optimizer's.
    """

    def __init__(self, logit_scale, optimizer=None, scaler=None, *, dtype=torch.float16, headroom=16.0, retreat=0.5,
                 scale_floor=1.0, tau_max=1.0):
        self.param = _logit_scale_param(logit_scale)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {_describe(optimizer)}")
        self.optimizer = optimizer
        self.dtype = _range_dtype(dtype)
        self._watch = _ScalerWatch(scaler)
        self.headroom = _f32(_number("headroom", headroom))
        self.retreat = _f32(_number("retreat", retreat))
        self.scale_floor = _f32(_number("scale_floor", scale_floor))
        given = _number("tau_max", tau_max)
        tau = _f32(given)
        if tau == math.inf:
            self.min_theta = -math.inf
        elif tau > 0.0 and math.isfinite(tau) and abs(_f32(-math.log(tau))) <= THETA_LIMIT:
            self.min_theta = _f32(-math.log(tau))
        else:
            raise ValueError(f"tau_max must be a tau with |log(1/tau)| <= {THETA_LIMIT:g}, or inf for no bound, "
                             f"got {tau_max!r}")
        self.ceiling = math.inf
        self.events = 0
        self._check_settings()
        self._theta = _f32(float(self.param.detach()))

    # The settings' domains, as range_guard::validate.
    def _check_settings(self):
        for name, value, ok, domain in (
                ("headroom", self.headroom, lambda v: 1.0 <= v < 3.0e38, "finite and >= 1"),
                ("retreat", self.retreat, lambda v: 0.0 < v < 80.0, "in (0, 80)"),
                ("scale_floor", self.scale_floor, lambda v: 0.0 <= v < 3.0e38, "finite and >= 0")):
            if not isinstance(value, float) or not ok(value):
                raise ValueError(f"{name} must be {domain}, got {value!r}")
        if isinstance(self.events, bool) or not isinstance(self.events, int) or not 0 <= self.events <= _INT32_MAX:
            raise ValueError(f"events must be an int in [0, 2^31 - 1], got {self.events!r}")
        if not (self.min_theta == -math.inf or abs(self.min_theta) <= THETA_LIMIT):
            raise ValueError(f"min_theta must be log(1/tau_max) within +-{THETA_LIMIT:g}, or -inf, got "
                             f"{self.min_theta!r}")
        if not (self.min_theta <= self.ceiling and self.ceiling >= -THETA_LIMIT):
            raise ValueError(f"ceiling must not be below log(1/tau_max) = {self.min_theta} nor below "
                             f"-{THETA_LIMIT:g}, got {self.ceiling!r}")

    @property
    def max_scale(self):
        """The bound on s = exp(theta) now (inf before the first step)."""
        return math.exp(self.ceiling) if self.ceiling < 709.0 else math.inf

    @property
    def min_tau(self):
        """The bound on tau = exp(-theta) now (0 before the first step)."""
        return math.exp(-self.ceiling)

    def range_bound(self):
        """theta's bound from the dtype's range: log(max_finite / headroom), computed in double, stored as float."""
        return _f32(math.log(torch.finfo(self.dtype).max / self.headroom))

    def _clamp(self, t):
        return self.min_theta if t < self.min_theta else (self.ceiling if t > self.ceiling else t)

    def _lower_ceiling(self, bound):
        floor = self.min_theta if self.min_theta > -THETA_LIMIT else -THETA_LIMIT
        if bound < self.ceiling:
            self.ceiling = floor if bound < floor else bound

    def step(self, loss=None, report=None):
        """Apply the rule after this step's `scaler.update()`, reading the scaler (one `get_scale()`), the `report`
        and the `loss`. Returns True when the step was an overflow event (the guard retreated)."""
        loss_scale, next_loss_scale, skipped, site = _read_step(self._watch, report, loss)
        return self.observe(skipped, site, loss_scale, next_loss_scale)

    @torch.no_grad()
    def observe(self, skipped, site, loss_scale, next_loss_scale):
        """The rule on one step's record, as the C++ policy's `observe` (for a training loop without a GradScaler, or
        one that knows better): `skipped`, the first non-finite `site` (a NONFINITE_SITES name or index), the loss
        scale the step used and the one after the scaler's update. Returns True on an overflow event."""
        if not isinstance(skipped, bool):
            raise TypeError(f"skipped must be a bool, got {_describe(skipped)}")
        site = _site_name(site)
        # The library's step record holds the scales as floats.
        loss_scale = _f32(_number("loss_scale", loss_scale))
        next_loss_scale = _f32(_number("next_loss_scale", next_loss_scale))
        theta = _f32(float(self.param.detach()))
        if not skipped:
            # What the library's learnable advance does with the optimiser's result.
            theta = self._theta if theta != theta else min(max(theta, -THETA_LIMIT), THETA_LIMIT)
            theta = self._clamp(theta)
        self._lower_ceiling(self.range_bound())
        scale_distress = next_loss_scale < loss_scale and next_loss_scale < self.scale_floor
        event = skipped and (site in ("logits", "loss") or scale_distress)
        if event:
            self._lower_ceiling(_f32(theta - self.retreat))
            self._drop_first_moment()
            self.events = min(self.events + 1, _INT32_MAX)
        theta = self._clamp(theta)
        value = torch.tensor(theta, dtype=self.param.dtype)
        if float(value) > self.ceiling:  # a 16-bit parameter rounded up past the ceiling: the next value below
            value = torch.nextafter(value, torch.tensor(-math.inf, dtype=value.dtype))
        self._theta = _f32(float(value))
        if _f32(float(self.param.detach())) != self._theta or self.param.dtype != torch.float32:
            self.param.fill_(value.item())
        return event

    def _drop_first_moment(self):
        if self.optimizer is None:
            return
        state = self.optimizer.state.get(self.param, {})
        for key in ("exp_avg", "momentum_buffer"):
            moment = state.get(key)
            if isinstance(moment, torch.Tensor):
                moment.zero_()

    def state_dict(self):
        """The guard's state (settings, ceiling, events, the scale it last read); save it beside the scaler's."""
        return {"dtype": _RANGED[self.dtype], "headroom": self.headroom, "retreat": self.retreat,
                "scale_floor": self.scale_floor, "min_theta": self.min_theta, "ceiling": self.ceiling,
                "events": self.events, "theta": self._theta, "loss_scale": self._watch.last}

    def load_state_dict(self, state):
        """Restore `state_dict()`'s result; a state outside the settings' domains is refused and changes nothing."""
        keys = set(self.state_dict())
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"state must be a RangeGuard.state_dict() (keys {sorted(keys)}), got "
                             f"{sorted(state) if isinstance(state, dict) else _describe(state)}")
        by_name = {v: k for k, v in _RANGED.items()}
        if state["dtype"] not in by_name:
            raise ValueError(f"state['dtype'] must be one of {sorted(by_name)}, got {state['dtype']!r}")
        saved = dict(self.__dict__)
        try:
            self.dtype = by_name[state["dtype"]]
            for key in ("headroom", "retreat", "scale_floor", "min_theta", "ceiling", "theta", "loss_scale", "events"):
                if not isinstance(state[key], (int, float)) or isinstance(state[key], bool):
                    raise ValueError(f"state['{key}'] must be a number, got {_describe(state[key])}")
            self.headroom, self.retreat = float(state["headroom"]), float(state["retreat"])
            self.scale_floor, self.min_theta = float(state["scale_floor"]), float(state["min_theta"])
            self.ceiling, self.events, self._theta = float(state["ceiling"]), state["events"], float(state["theta"])
            self._check_settings()
            if not abs(self._theta) <= THETA_LIMIT:
                raise ValueError(f"state['theta'] must be within +-{THETA_LIMIT:g}, got {state['theta']!r}")
            if not float(state["loss_scale"]) >= 0.0:
                raise ValueError(f"state['loss_scale'] must be >= 0, got {state['loss_scale']!r}")
            self._watch.last = float(state["loss_scale"])
        except Exception:
            self.__dict__.update(saved)
            raise


class CollapseMonitor:
    """Follows a GradScaler's life step by step and says why steps are skipped and when a collapse is coming.

        monitor = CollapseMonitor(scaler, model.logit_scale)       # dtype: the logits' dtype, float16 by default
        ...
        scaler.update()
        monitor.step(loss=loss)                                     # or report=loss_fn.last_step (ours)
        ...
        print(monitor.summary())

    Per step it records: skipped or not, the first non-finite site (from a contrastive_torch `report`; with open_clip's
    loss only 'loss' for a non-finite loss, else 'parameters' for a skipped step), the largest logit (the report's;
    without one its bound s = exp(logit_scale), exact for L2-normalised features), the loss scale before and after
    the update, and tau. It warns (CollapseWarning, once per episode) when
      - the pattern that precedes the fp16 collapse appears: at least `backoffs` back-offs within the last `window`
        steps while tau fell over that window and the largest logit passed `near` of the dtype's largest finite value
        (float16: 65504 / 16 = 4094 by default); the episode ends after `window` steps without a back-off;
      - the collapse itself: the loss scale fell below 1 after `backoffs` or more consecutive skipped steps (from there
        a GradScaler without a floor halves it to 0, where every step is skipped).
    `records` keeps the last `history` steps (dicts); `summary()` counts every step.
    """

    def __init__(self, scaler=None, logit_scale=None, *, dtype=torch.float16, near=1.0 / 16.0, backoffs=3,
                 window=100, history=100000, warn=True):
        self._watch = _ScalerWatch(scaler)
        self.logit_scale = None if logit_scale is None else _logit_scale_param(logit_scale)
        self.dtype = _range_dtype(dtype)
        for name, value, ok, domain in (("near", near, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
                                        ("backoffs", backoffs, lambda v: v >= 1, ">= 1"),
                                        ("window", window, lambda v: v >= 1, ">= 1"),
                                        ("history", history, lambda v: v >= 0, ">= 0")):
            kinds = (int, float) if name == "near" else (int,)
            if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
                raise ValueError(f"{name} must be {'a number' if name == 'near' else 'an int'} {domain}, "
                                 f"got {value!r}")
        self.near, self.backoffs, self.window, self.warn = float(near), backoffs, window, bool(warn)
        self.records = collections.deque(maxlen=history)
        self._recent = collections.deque(maxlen=window + 1)  # (backed_off, tau) of the last window + 1 steps
        self._steps = self._skipped = self._backoffs = self._growths = self._consecutive = 0
        self._by_site = collections.Counter()
        self._min_scale, self._min_tau, self._max_logit = math.inf, math.inf, -math.inf
        self._warned = {"pattern": False, "collapse": False}
        self.warnings = []

    def step(self, loss=None, report=None):
        """Record the step that just finished (after `scaler.update()`); returns its record."""
        loss_scale, next_loss_scale, skipped, site = _read_step(self._watch, report, loss)
        tau = None
        if self.logit_scale is not None:
            tau = math.exp(min(-float(self.logit_scale.detach()), 709.0))
        bound = False
        if report is not None and report.get("max_logit") is not None:
            max_logit = float(report["max_logit"])
        elif self.logit_scale is not None:
            max_logit, bound = math.exp(min(float(self.logit_scale.detach()), 709.0)), True
        else:
            max_logit = None
        loss_value = None
        if loss is not None:
            loss_value = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
        backed_off = next_loss_scale < loss_scale
        rec = {"step": self._steps, "skipped": skipped, "first_nonfinite": site, "loss": loss_value,
               "loss_scale": loss_scale, "next_loss_scale": next_loss_scale, "tau": tau, "max_logit": max_logit,
               "max_logit_is_bound": bound}
        self.records.append(rec)
        self._count(rec, backed_off)
        self._check(rec, backed_off)
        return rec

    def _count(self, rec, backed_off):
        self._steps += 1
        self._skipped += rec["skipped"]
        self._consecutive = self._consecutive + 1 if rec["skipped"] else 0
        if rec["skipped"]:
            self._by_site[rec["first_nonfinite"]] += 1
        self._backoffs += backed_off
        self._growths += rec["next_loss_scale"] > rec["loss_scale"]
        self._min_scale = min(self._min_scale, rec["next_loss_scale"])
        if rec["tau"] is not None:
            self._min_tau = min(self._min_tau, rec["tau"])
        if rec["max_logit"] is not None and not math.isnan(rec["max_logit"]):
            self._max_logit = max(self._max_logit, rec["max_logit"])
        self._recent.append((backed_off or rec["skipped"], rec["tau"]))

    def _check(self, rec, backed_off):
        limit = torch.finfo(self.dtype).max
        recent = list(self._recent)[1:]
        backoffs = sum(b for b, _ in recent)
        if backoffs == 0 and len(recent) >= self.window:
            self._warned["pattern"] = False
        if rec["next_loss_scale"] >= 1.0:
            self._warned["collapse"] = False
        first_tau, last_tau = self._recent[0][1], rec["tau"]
        falling = first_tau is None or last_tau is None or last_tau < first_tau
        near = rec["max_logit"] is not None and not (rec["max_logit"] < self.near * limit)
        name = _RANGED[self.dtype]
        if backed_off and backoffs >= self.backoffs and falling and near and not self._warned["pattern"]:
            self._warned["pattern"] = True
            tau_text = "" if first_tau is None or last_tau is None else \
                f" while tau fell from {first_tau:.3g} to {last_tau:.3g}"
            self._emit(f"step {rec['step']}: {backoffs} loss-scale back-offs in the last {len(recent)} steps"
                       f"{tau_text}, "
                       f"and the largest logit{' (bound s = 1/tau)' if rec['max_logit_is_bound'] else ''} "
                       f"{rec['max_logit']:.4g} is at {100.0 * rec['max_logit'] / limit:.3g}% of {name}'s range "
                       f"({limit:.6g}): the pattern that precedes the fp16 temperature collapse. Remedies: "
                       f"contrastive_torch.temperature.RangeGuard, clamp_logit_scale, a fused loss whose logits stay "
                       f"in float32, or bfloat16 (docs/collapse.md)")
        if rec["loss_scale"] == 0.0 and not rec["skipped"] and not self._warned["collapse"]:
            self._warned["collapse"] = True
            self._emit(f"step {rec['step']}: the loss scale is 0 and the step was not skipped: torch's GradScaler "
                       f"checks the scaled gradients (0 x g, finite) before unscaling them by 1/0 = inf, so the "
                       f"optimizer received NaN gradients; the run has collapsed")
        if (rec["skipped"] and rec["next_loss_scale"] < 1.0 and self._consecutive >= self.backoffs
                and not self._warned["collapse"]):
            self._warned["collapse"] = True
            self._emit(f"step {rec['step']}: the loss scale is {rec['next_loss_scale']:.3g} after {self._consecutive} "
                       f"consecutive skipped steps (last site: {rec['first_nonfinite']}): the run is collapsing; a "
                       f"GradScaler without a floor halves it to 0, where every step is skipped")

    def _emit(self, message):
        message = "contrastive_torch.CollapseMonitor: " + message
        self.warnings.append(message)
        if self.warn:
            warnings.warn(message, CollapseWarning, stacklevel=3)

    def summary(self):
        """Counts over every step seen: steps, skipped (and by first non-finite site), back-offs, growths, the
        smallest loss scale, the scale now, the smallest tau, the largest logit, the warnings issued."""
        return {"steps": self._steps, "skipped": self._skipped, "skipped_by_site": dict(self._by_site),
                "backoffs": self._backoffs, "growths": self._growths,
                "min_loss_scale": self._min_scale if self._steps else None, "loss_scale": self._watch.last,
                "min_tau": self._min_tau if self._min_tau < math.inf else None,
                "max_logit": self._max_logit if self._max_logit > -math.inf else None,
                "consecutive_skipped": self._consecutive, "warnings": list(self.warnings)}
