# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""A stand-in for the CUDA extension (contrastive_torch._C_cuda) on the CPU: its `step` and `sigmoid_step` return
gradients of a fixed exact size rounded to the features' dtype at the loss scale they are given, as the device does,
and record each call's loss scale (`calls`) and every other argument (`args`), so that a test can check that a
backward's rerun repeats the forward's call at another loss scale. The CUDA paths' backward logic (the float16 rerun at
a GradScaler's scale) is checked with it where no GPU is."""

import torch


def _described(x):
    """A call argument as a comparable value: a tensor by its dtype, device and values."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.device.type, tuple(x.reshape(-1).tolist()))
    return x


class Ctx:
    """autograd's ctx as the operators' setup_context and autograd formula use it."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors

    def set_materialize_grads(self, value):
        self.materialize_grads = value


class StandIn:
    """dq = +exact * loss_scale, dk = -exact * loss_scale (rounded to the dtype); loss 0.5, d loss / d log s 0.25,
    max logit 1, no non-finite site, d loss / d b -0.125 (sigmoid_step)."""

    def __init__(self, exact):
        self.exact = exact
        self.calls = []
        self.args = []
        self.budgets = []  # step's memory_budget per call

    def clear(self):
        self.calls.clear()
        self.args.clear()
        self.budgets.clear()

    def _out(self, q, k, loss_scale, args):
        self.calls.append(loss_scale)
        self.args.append(tuple(_described(a) for a in (q, k) + args))
        dq = torch.full(q.shape, self.exact * loss_scale).to(q.dtype)
        dk = torch.full(k.shape, -self.exact * loss_scale).to(k.dtype)

        def scalar(v):
            return torch.tensor(v, dtype=torch.float32)

        return [scalar(0.5), dq, dk, scalar(0.25), scalar(1.0), torch.tensor(0, dtype=torch.int32), scalar(-0.125)]

    def sigmoid_step(self, q, k, scale, bias, labels, chunk_rows, loss_scale=1.0):
        return self._out(q, k, loss_scale, ("sigmoid", scale, bias, labels, chunk_rows))

    def step(self, q, k, scale, labels, symmetric, algorithm, chunk_rows, fused_tiles, loss_scale=1.0,
             memory_budget=0):
        self.budgets.append(memory_budget)
        return self._out(q, k, loss_scale, ("softmax", scale, labels, symmetric, algorithm, chunk_rows, fused_tiles))[:6]
