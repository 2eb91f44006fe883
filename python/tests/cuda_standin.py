# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""A stand-in for the CUDA extension (contrastive_torch._C_cuda) on the CPU: its `step` and `sigmoid_step` return
gradients of a fixed exact size rounded to the features' dtype at the loss scale they are given, as the device does,
and record each call's loss scale. The CUDA paths' backward logic (the float16 rerun at a GradScaler's scale) is
checked with it where no GPU is."""

import torch


class StandIn:
    """dq = +exact * loss_scale, dk = -exact * loss_scale (rounded to the dtype); loss 0.5, d loss / d log s 0.25,
    max logit 1, no non-finite site, d loss / d b -0.125 (sigmoid_step)."""

    def __init__(self, exact):
        self.exact = exact
        self.calls = []

    def _out(self, q, k, loss_scale):
        self.calls.append(loss_scale)
        dq = torch.full(q.shape, self.exact * loss_scale).to(q.dtype)
        dk = torch.full(k.shape, -self.exact * loss_scale).to(k.dtype)

        def scalar(v):
            return torch.tensor(v, dtype=torch.float32)

        return [scalar(0.5), dq, dk, scalar(0.25), scalar(1.0), torch.tensor(0, dtype=torch.int32), scalar(-0.125)]

    def sigmoid_step(self, q, k, scale, bias, labels, chunk_rows, loss_scale=1.0):
        return self._out(q, k, loss_scale)

    def step(self, q, k, scale, labels, symmetric, algorithm, chunk_rows, fused_tiles, loss_scale=1.0):
        return self._out(q, k, loss_scale)[:6]
