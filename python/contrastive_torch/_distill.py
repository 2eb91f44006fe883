# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""open_clip's distillation term (DistillClipLoss's distill_loss) in row chunks: the student's and the teacher's
logits exist one chunk of rows at a time, never N x N.

With S = s I T^T the student's logits (s its logit scale, I and T its image and text features) and U = t I' T'^T the
teacher's, the term is

    distill = ( (1/n_i) sum_i CE(softmax(U_i.), log_softmax(S_i.))
              + (1/n_t) sum_j CE(softmax(U_.j), log_softmax(S_.j)) ) / 2,

CE(p, log r) = -sum p log r: the images' rows and the texts' rows (the columns), each against the teacher's
distribution over the same pairs. Each direction is a sum over complete rows (a text's row is a column of S, formed
from the texts' side as s T I^T), so one pass per direction needs no statistics that span chunks:
`row_distill(q, k, s, tq, tk, t)` = sum over the rows i of q of CE(softmax(U_i), log_softmax(S_i)).

Its gradient: d/dS_ij = softmax(S_i)_j - p_ij with p = softmax(U_i); d/dU_ij = -p_ij (log_softmax(S_i)_j - sum_k
p_ik log_softmax(S_i)_k); dq = s dS k, dk = s dS^T q, ds = sum dS (q k^T), and the teacher's likewise (only where it
wants gradients; open_clip_train computes the teacher's features without them). The forward keeps nothing but the
inputs; the backward forms each chunk's logits again (twice the products of open_clip's, in O(chunk x n) memory).

Arithmetic: the logits in float32 from the features (16-bit products exact in float32), the terms summed in float64,
the gradients rounded once to the features' dtype. Runs outside autocast (float32 features under autocast are cast
to its dtype first, as the library's losses are)."""

import torch

from . import _checks
from . import _distributed as D
from ._grouped import _product
from ._ops import autocast_dtype, autocast_features

# Logits per chunk of rows: 64 MiB per float32 chunk-sized buffer; the backward holds about six of them.
CHUNK_ELEMENTS = 1 << 24


def _rows(n_q, n_k):
    return max(1, min(n_q, CHUNK_ELEMENTS // max(n_k, 1)))


def _logits(q, k, scale):
    """(raw, scaled): q k^T in float32, and that times the scalar tensor `scale`."""
    raw = _product(q, k.t())
    return raw, raw * scale


class RowDistill(torch.autograd.Function):
    """sum over q's rows of CE(softmax(t tq tk^T)_i, log_softmax(s q k^T)_i), float32 (a 0-dim tensor)."""

    @staticmethod
    def forward(ctx, q, k, s, tq, tk, t):
        ctx.save_for_backward(q, k, s, tq, tk, t)
        total = torch.zeros((), dtype=torch.float64, device=q.device)
        rows = _rows(q.shape[0], k.shape[0])
        with torch.autocast(q.device.type, enabled=False):
            for r0 in range(0, q.shape[0], rows):
                r1 = min(q.shape[0], r0 + rows)
                _, S = _logits(q[r0:r1], k, s)
                _, U = _logits(tq[r0:r1], tk, t)
                p = torch.softmax(U, 1)
                total = total - p.mul_(torch.log_softmax(S, 1)).sum(1).double().sum()
        return total.float()

    @staticmethod
    def backward(ctx, grad):
        q, k, s, tq, tk, t = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = grad.float()
        out = [None] * 6
        if need[0]:
            out[0] = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device) if need[1] else None
        ds = torch.zeros((), dtype=torch.float64, device=q.device) if need[2] else None
        if need[3]:
            out[3] = torch.empty_like(tq)
        dtk = torch.zeros(tk.shape, dtype=torch.float32, device=tk.device) if need[4] else None
        dt = torch.zeros((), dtype=torch.float64, device=q.device) if need[5] else None
        rows = _rows(q.shape[0], k.shape[0])
        with torch.autocast(q.device.type, enabled=False):
            for r0 in range(0, q.shape[0], rows):
                r1 = min(q.shape[0], r0 + rows)
                raw_s, S = _logits(q[r0:r1], k, s)
                raw_t, U = _logits(tq[r0:r1], tk, t)
                p = torch.softmax(U, 1)
                lsm = torch.log_softmax(S, 1)
                if need[3] or need[4] or need[5]:
                    # d/dU = -g p (lsm - sum_k p_k lsm_k)
                    mean = (p * lsm).sum(1, keepdim=True)
                    dU = (lsm - mean).mul_(p).mul_(-g)
                    if need[5]:
                        dt = dt + (dU * raw_t).sum(1).double().sum()
                    dU = dU.mul_(t.float())
                    if need[3]:
                        out[3][r0:r1] = _product(dU, tk.float()).to(tq.dtype)
                    if need[4]:
                        dtk.add_(_product(dU.t(), tq[r0:r1].float()))
                if need[0] or need[1] or need[2]:
                    dS = lsm.exp_().sub_(p).mul_(g)  # g (softmax(S) - p)
                    if need[2]:
                        ds = ds + (dS * raw_s).sum(1).double().sum()
                    dS = dS.mul_(s.float())
                    if need[0]:
                        out[0][r0:r1] = _product(dS, k.float()).to(q.dtype)
                    if need[1]:
                        dk.add_(_product(dS.t(), q[r0:r1].float()))
        if need[1]:
            out[1] = dk.to(k.dtype)
        if need[2]:
            out[2] = ds.to(s.dtype).reshape(s.shape)
        if need[4]:
            out[4] = dtk.to(tk.dtype)
        if need[5]:
            out[5] = dt.to(t.dtype).reshape(t.shape)
        return tuple(out)


def check(image_features, text_features, logit_scale, dist_image_features, dist_text_features, dist_logit_scale):
    """The arguments of DistillClipLoss.forward, checked (the names are open_clip's): the student's first, then the
    teacher's against them. Returns the student's and the teacher's features as the step runs them
    (autocast_features; the teacher's made contiguous) and both scales as float tensors on their device."""
    _checks.feature_pair(image_features, text_features, ("image_features", "text_features"))
    if image_features.shape[0] != text_features.shape[0]:
        raise ValueError(f"text_features: {text_features.shape[0]} rows where image_features has "
                         f"{image_features.shape[0]}; each image needs its text")
    # The teacher's features only meet PyTorch operations here: any dense layout is taken (made contiguous).
    for name, x in (("dist_image_features", dist_image_features), ("dist_text_features", dist_text_features)):
        if isinstance(x, torch.Tensor):
            _checks.dense(name, x)
            x = x.contiguous()
        _checks.features(name, x)
    if dist_image_features.dtype != dist_text_features.dtype:
        raise TypeError(f"dist_text_features: dtype {dist_text_features.dtype} where dist_image_features has "
                        f"{dist_image_features.dtype}")
    if dist_image_features.shape[1] != dist_text_features.shape[1]:
        raise ValueError(f"dist_text_features: embedding size {dist_text_features.shape[1]} where "
                         f"dist_image_features has {dist_image_features.shape[1]} (the teacher's may differ from "
                         "the student's, not between its towers)")
    for name, x, student in (("dist_image_features", dist_image_features, image_features),
                             ("dist_text_features", dist_text_features, text_features)):
        if x.shape[0] != student.shape[0]:
            raise ValueError(f"{name}: {x.shape[0]} rows where the student has {student.shape[0]}; the teacher "
                             "embeds the same batch")
        if x.device != student.device:
            raise ValueError(f"{name}: on {x.device} where the student's features are on {student.device}")
    device = image_features.device
    s = _checks.scalar("logit_scale", logit_scale, device)
    t = _checks.scalar("dist_logit_scale", dist_logit_scale, device)
    img, txt = autocast_features(image_features, text_features)
    t_img, t_txt = autocast_features(dist_image_features.contiguous(), dist_text_features.contiguous())
    return img, txt, s, t_img, t_txt, t


def open_clip_dtype(loss, student, teacher):
    """open_clip's dtype of the distillation term: inside autocast its logits take the region's dtype, whose softmax
    CUDA's autocast runs in float32 and the CPU's at that dtype; outside, the promotion of the student's and the
    teacher's feature dtypes. The value is computed in float32 and rounded once."""
    region = autocast_dtype(student.device.type)
    if region is not None:
        dtype = torch.float32 if student.device.type == "cuda" else region
    else:
        dtype = torch.promote_types(student.dtype, teacher.dtype)
    return loss if loss.dtype == dtype else loss.to(dtype)


def loss(img, txt, s, t_img, t_txt, t):
    """The one-process distillation term of checked arguments (check), float32."""
    n_i, n_t = img.shape[0], txt.shape[0]
    return (RowDistill.apply(img, txt, s, t_img, t_txt, t) / n_i + RowDistill.apply(txt, img, s, t_txt, t_img, t) /
            n_t) / 2


@D._eager_only
def global_loss(image_features, text_features, logit_scale, dist_image_features, dist_text_features,
                dist_logit_scale, group, grad_ranks):
    """The distillation term of the global batch over `group`, on every rank (each rank passes its own rows, student
    and teacher). Every rank's checks are agreed on first (a refusal on one rank is raised on every rank). This rank's
    share is its images' rows and its texts' rows against every rank's (gathered with their gradients, as the 'gather'
    exchange of the losses does); the shares are summed over the ranks. Gradients as the library's distributed losses
    give them: grad_ranks (None: the group's size) x d(global term)/d(this rank's rows) on the features, d(global
    term)/d(scale) on each scale."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    rank, size = group.rank(), group.size()
    codes = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
    names = {code: str(dtype) for dtype, code in codes.items()}
    error, values = None, []
    try:
        args = check(image_features, text_features, logit_scale, dist_image_features, dist_text_features,
                     dist_logit_scale)
        c = size if grad_ranks is None else _checks.index("grad_ranks", grad_ranks)
        grad_on = torch.is_grad_enabled()
        wants = sum(int(grad_on and x.requires_grad) << i for i, x in enumerate(args))
        values = [codes[args[0].dtype], codes[args[3].dtype], args[0].shape[0], args[0].shape[1], args[3].shape[1],
                  wants, float(args[5].detach().reshape(()))]  # a host read, as the student's scale's
    except Exception as e:  # raised below on every rank, after the agreement
        error = e
    got = D.agree(group, error, values)
    said = (("image_features", "dtype", lambda v: names[int(v)]), ("dist_image_features", "dtype",
                                                                  lambda v: names[int(v)]),
            None, ("image_features", "embedding size", int), ("dist_image_features", "embedding size", int),
            ("image_features", "gradients wanted for (image_features, text_features, logit_scale, "
             "dist_image_features, dist_text_features, dist_logit_scale)",
             lambda v: tuple(bool(int(v) >> b & 1) for b in range(6))),
            ("dist_logit_scale", "value", repr))
    for i, how in enumerate(said):
        r = None if how is None else D._first_other(got, i)
        if r is not None:
            name, what, show = how
            raise ValueError(f"{name}: rank {r}: {what} {show(got[r][i])} where rank 0 has {show(got[0][i])}; every "
                             "rank must pass the same (the backward is a collective of every rank)")
    img, txt, s, t_img, t_txt, t = args
    counts = [int(v[2]) for v in got]
    grad_on = torch.is_grad_enabled()

    def features(x):
        return D._ScaleGrad.apply(x, float(c)) if grad_on and x.requires_grad and c != 1 else x

    def scalar(x):
        return D._SumGradOverRanks.apply(x, group, 1.0) if grad_on and x.requires_grad else x

    every = [features(D._gather_rows(x, group, counts, rank)) for x in (img, txt, t_img, t_txt)]
    img, txt, t_img, t_txt = (features(x) for x in (img, txt, t_img, t_txt))
    s, t = scalar(s), scalar(t)
    share = (RowDistill.apply(img, every[1], s, t_img, every[3], t) +
             RowDistill.apply(txt, every[0], s, t_txt, every[2], t)) / (2 * sum(counts))
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    return total + (share - share.detach())
