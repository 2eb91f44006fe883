# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The CUDA step's host reads, on the CPU: the operators' CUDA kernels run with the stand-in extension
(cuda_standin.py) in place of the device, and the value checks that would synchronise are replaced by ones that fail
the test. The default algorithms ('automatic', 'chunked', SigLIP's) read no value on the host: logit_scale and
logit_bias reach the extension as one-element float32 tensors, labels as int32 without a range read; 'fused' and
'materialized' still check the values (and raise, naming the argument)."""

import pytest
import torch

from contrastive_torch import _device, _ops
from cuda_standin import StandIn

SCALE, BIAS = 14.3, -10.0


def _forbid_reads(monkeypatch):
    """Every host read of the device step fails the test; device_values may run its shape checks only."""

    def read(*_args, **_kwargs):
        raise AssertionError("a value was read on the host")

    shapes_only = _device.device_values

    def device_values(q, k, labels32, objective, read=True):
        assert not read, "device_values read the features' values"
        return shapes_only(q, k, labels32, objective, read=False)

    monkeypatch.setattr(_device, "scale_value", read)
    monkeypatch.setattr(_device, "labels_int32", read)
    monkeypatch.setattr(_device, "device_values", device_values)


def _draw(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)


def _scalar_arg(described):
    """The stand-in's record of a scalar argument: it must be a one-element float32 tensor; returns its value."""
    assert isinstance(described, tuple) and described[0] == "tensor", described
    assert described[1] == torch.float32 and len(described[3]) == 1, described
    return described[3][0]


@pytest.mark.parametrize("algorithm", ["automatic", "chunked"])
def test_default_softmax_step_reads_no_value(monkeypatch, algorithm):
    ext = StandIn(1.0e-3)
    monkeypatch.setattr(_device, "cuda_extension", lambda: ext)
    _forbid_reads(monkeypatch)
    q, k = _draw(8, 4, 1), _draw(8, 4, 2)
    s = torch.tensor(SCALE)
    out = _ops.softmax_step_cuda(q, k, s, None, True, algorithm, 0, False, True)
    assert out[0].dtype == torch.float32
    seen = ext.args[0]
    assert _scalar_arg(seen[3]) == float(torch.tensor(SCALE))
    assert seen[6] == algorithm
    # InfoNCE labels: int64 in, int32 out, clamped (never read): 2**40 stays out of range as n_k, -5 as -1.
    ext.clear()
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 2**40, -5])
    _ops.softmax_step_cuda(q, k, s, labels, False, algorithm, 0, False, True)
    sent = ext.args[0][4]
    assert sent[1] == torch.int32
    assert list(sent[3]) == [0, 1, 2, 3, 4, 5, 8, -1]


def test_default_sigmoid_step_reads_no_value(monkeypatch):
    ext = StandIn(1.0e-3)
    monkeypatch.setattr(_device, "cuda_extension", lambda: ext)
    _forbid_reads(monkeypatch)
    q, k = _draw(8, 4, 3), _draw(12, 4, 4)
    _ops.sigmoid_step_cuda(q, k, torch.tensor(SCALE), torch.tensor(BIAS), "chunked", 0, True)
    seen = ext.args[0]
    assert _scalar_arg(seen[3]) == float(torch.tensor(SCALE))
    assert _scalar_arg(seen[4]) == BIAS
    # No bias: None reaches the extension (b = 0 on the device).
    ext.clear()
    _ops.sigmoid_step_cuda(q, k, torch.tensor(SCALE), None, "chunked", 0, True)
    assert ext.args[0][4] is None


@pytest.mark.parametrize("algorithm", ["fused", "materialized"])
def test_fused_and_materialized_check_values_and_raise(monkeypatch, algorithm):
    ext = StandIn(1.0e-3)
    monkeypatch.setattr(_device, "cuda_extension", lambda: ext)
    q, k = _draw(8, 4, 5), _draw(8, 4, 6)
    with pytest.raises(ValueError, match="logit_scale"):
        _ops.softmax_step_cuda(q, k, torch.tensor(-1.0), None, True, algorithm, 0, False, True)
    bad = q.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        _ops.softmax_step_cuda(bad, k, torch.tensor(SCALE), None, True, algorithm, 0, False, True)
    with pytest.raises(ValueError, match="labels"):
        _ops.softmax_step_cuda(q, k, torch.tensor(SCALE), torch.tensor([0, 1, 2, 3, 4, 5, 6, 9]), False, algorithm,
                               0, False, True)
    assert ext.args == []  # refused before the extension
    # The sync-free path would have sent these on (the device reports them in the step's record).
    _forbid_reads(monkeypatch)
    _ops.softmax_step_cuda(bad, k, torch.tensor(-1.0), None, True, "automatic", 0, False, True)
    assert len(ext.args) == 1


def test_memory_budget_reaches_the_device_automatic(monkeypatch):
    # set_memory_budget governs algorithm=None on CUDA too: 'automatic' keeps every row in one chunk where that
    # workspace fits the budget (0: a quarter of the free device memory); 'chunked' sizes its chunks by itself.
    import contrastive_torch as ct

    ext = StandIn(1.0e-3)
    monkeypatch.setattr(_device, "cuda_extension", lambda: ext)
    q, k = _draw(8, 4, 7), _draw(8, 4, 8)
    try:
        for budget in (0, 3 << 30):
            ct.set_memory_budget(budget)
            for algorithm, want in (("automatic", budget), ("chunked", 0)):
                ext.clear()
                _ops.softmax_step_cuda(q, k, torch.tensor(SCALE), None, True, algorithm, 0, False, True)
                assert ext.budgets == [want], (algorithm, budget)
    finally:
        ct.set_memory_budget(0)
