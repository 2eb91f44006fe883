# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""open_clip's distillation term (DistillClipLoss's distill_loss) in row chunks: the student's and the teacher's
logits exist one chunk of rows at a time, never N x N.

With S = s I T^T the student's logits (s its logit scale, I and T its image and text features) and U = t I' T'^T the
teacher's, the term is

    distill = ( (1/n_i) sum_i CE(softmax(U_i.), log_softmax(S_i.))
              + (1/n_t) sum_j CE(softmax(U_.j), log_softmax(S_.j)) ) / 2,

CE(p, log r) = -sum p log r: the images' rows and the texts' rows (the columns), each against the teacher's
distribution over the same pairs. One process (_both_directions): pass A over the row chunks forms the rows' and the
columns' log-sum-exps of S and U (the columns' merged over the chunks), pass B the terms and the student's gradient
G = (softmax_row(S) - p) / 2n_i + (softmax_col(S) - q) / 2n_t (p, q the teacher's row and column softmax), pass C,
only where the teacher wants gradients, d/dU = -(p / 2n_i) (log_softmax_row(S) + row term) - (q / 2n_t)
(log_softmax_col(S) + column term). With one chunk the logits are formed once and kept (open_clip's products: four
with a frozen teacher), else once per pass (six). Over a process group (global_loss) each rank's share is two
one-directional sums over its rows against every rank's (_one_direction: a row's terms are complete within its chunk,
one pass).

The forward forms the gradients with the term (dq = s G k, dk = s G^T q, ds = sum G (q k^T), the teacher's likewise;
open_clip_train computes the teacher's features without gradients), keeps them in float32 and the backward scales
them by the incoming gradient: nothing N x N outlives the forward, whose memory is O(chunk x n).

Arithmetic: the logits in float32 from the features (16-bit products exact in float32), the terms summed in float64,
the gradients rounded once to the features' dtype. Runs outside autocast (float32 features under autocast are cast
to its dtype first, as the library's losses are)."""

import torch

from . import _checks
from . import _distributed as D
from ._grouped import _product
from ._ops import autocast_dtype, autocast_features, not_twice

# Logits per chunk of rows: 64 MiB per float32 chunk-sized buffer; a call holds up to eight such buffers (the
# workspace's: the logits, their products kept for the scales, and four for the passes' element-wise work).
CHUNK_ELEMENTS = 1 << 24


def _bounds(n_q, n_k):
    """The chunks of rows: as many rows as CHUNK_ELEMENTS logits hold, at least one."""
    rows = max(1, min(n_q, CHUNK_ELEMENTS // max(n_k, 1)))
    return [(r0, min(n_q, r0 + rows)) for r0 in range(0, n_q, rows)]


class _Workspace:
    """Chunk-sized float32 buffers (rows x n), made on first use and reused by every chunk of a call: a fresh
    buffer per operation would cost a page-faulted allocation per chunk and pass."""

    def __init__(self, rows, n, device):
        self.shape, self.device, self.free = (rows, n), device, {}

    def __call__(self, name, rows):
        if name not in self.free:
            self.free[name] = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return self.free[name][:rows]


def _product_into(a, b, out):
    """a @ b in float32 into `out` (float32 operands), else _product's result copied there."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    return out.copy_(_product(a, b))


class _Logits:
    """The student's and the teacher's logits of a chunk of rows in float32: (raw_s, S, raw_u, U), raw = q k^T (kept
    only where the scale wants its gradient, else None), S = s raw. With one chunk they are formed once and kept;
    with several, each chunk's are formed into the workspace's buffers (valid until the next chunk's)."""

    def __init__(self, q, k, s, tq, tk, t, keep_raw_s, keep_raw_u, single, work):
        self.args = (q, k.t(), s, tq, tk.t(), t)
        self.keep = (keep_raw_s, keep_raw_u)
        self.kept = None if not single else ()
        self.work = None if single else work

    def __call__(self, r0, r1):
        if self.kept:
            return self.kept
        q, kt, s, tq, tkt, t = self.args
        out = []
        for name, x, yt, scale, keep in (("s", q, kt, s, self.keep[0]), ("u", tq, tkt, t, self.keep[1])):
            if self.work is None:
                raw = _product(x[r0:r1], yt)
                out += [raw, raw * scale] if keep else [None, raw.mul_(scale)]
                continue
            raw = _product_into(x[r0:r1], yt, self.work("raw_" + name, r1 - r0))
            out += [raw, torch.mul(raw, scale, out=self.work(name, r1 - r0))] if keep else [None, raw.mul_(scale)]
        if self.kept is not None:
            self.kept = tuple(out)
        return tuple(out)


def _lse_merge(state, m, total):
    """(max, sum of exp(x - max)) of two disjoint parts as that of their union (state None: the first part)."""
    if state is None:
        return m, total
    m0, total0 = state
    top = torch.maximum(m0, m)
    return top, total0 * torch.exp(m0 - top) + total * torch.exp(m - top)


def _finite_or_zero(m):
    """A max to shift exponentials by: 0 where it is not finite (a row of -inf, +inf or NaN keeps
    torch.logsumexp's result: -inf, +inf or NaN)."""
    return m.masked_fill(~torch.isfinite(m), 0.0)


def _lse_parts(x, dim, tmp):
    """(shift, sum of exp(x - shift)) along `dim` of a chunk x, exp formed in `tmp` (x's shape)."""
    m = _finite_or_zero(x.amax(dim))
    torch.sub(x, m.unsqueeze(dim), out=tmp).exp_()
    return m, tmp.sum(dim)


def _forward_with_grads(ctx, kernel, args, want):
    """Runs kernel(*args, need) (need: which of args want gradients, as autograd says and the caller's grad mode
    allows) outside autocast; keeps the float32 gradients it returns for the backward. Returns its loss."""
    need = tuple(bool(n and want) for n in ctx.needs_input_grad[2:2 + len(args)])
    with torch.autocast(args[0].device.type, enabled=False):
        loss, grads = kernel(*args, need)
    ctx.grads = grads
    # Not saved tensors: only the anchors of a refused second derivative (not_twice), so only those autograd
    # differentiates (a frozen teacher's features, gathered over a group, are freed after the forward).
    ctx.inputs = tuple(x for x, n in zip(args, ctx.needs_input_grad[2:2 + len(args)]) if n)
    ctx.meta = [(x.dtype, x.shape) for x in args]
    return loss


def _scaled_grads(ctx, grad):
    """The kept gradients times the incoming gradient, each rounded once to its input's dtype and shape."""
    g = grad.float()
    return tuple(None if d is None else (d * g).to(dtype).reshape(shape)
                 for (dtype, shape), d in zip(ctx.meta, ctx.grads))


def _grad_buffers(need, q, k, tq, tk):
    """The gradients' float32 accumulators for (q, k, s, tq, tk, t) where `need` asks (the scales' in float64)."""
    f32 = dict(dtype=torch.float32, device=q.device)
    f64 = dict(dtype=torch.float64, device=q.device)
    return [torch.empty(q.shape, **f32) if need[0] else None, torch.zeros(k.shape, **f32) if need[1] else None,
            torch.zeros((), **f64) if need[2] else None, torch.empty(tq.shape, **f32) if need[3] else None,
            torch.zeros(tk.shape, **f32) if need[4] else None, torch.zeros((), **f64) if need[5] else None]


def _add_gradient(G, raw, scale, x_rows, y, grads, i, r0, r1, tmp=None):
    """G = d term / d(scale x y^T) on rows r0:r1 of x (x_rows): its share of the gradients of x (grads[i], those
    rows), y (grads[i + 1]) and the scale (grads[i + 2], from raw = x_rows y^T), where they are asked for. G is
    scaled in place; `tmp` (G's shape, or None) may take G raw."""
    if grads[i + 2] is not None:
        prod = torch.mul(G, raw) if tmp is None else torch.mul(G, raw, out=tmp)
        grads[i + 2] += prod.sum(1).double().sum()
    G = G.mul_(scale)
    if grads[i] is not None:
        grads[i][r0:r1] = _product(G, y.float())
    if grads[i + 1] is not None:
        grads[i + 1] += _product(G.t(), x_rows.float())


def _both_directions(img, txt, s, t_img, t_txt, t, need):
    """The one-process term (both directions) and the gradients `need` asks for (float32, None elsewhere). Passes
    over the chunks: A the rows' and the columns' log-sum-exps of S and U; B the terms and the student's gradients;
    C (only for the teacher's gradients, which need every column's term) the teacher's. With one chunk the logits
    are formed once (the products of open_clip's, four with a frozen teacher), else once per pass."""
    n_i, n_t = img.shape[0], txt.shape[0]
    a, b = 0.5 / n_i, 0.5 / n_t
    bounds = _bounds(n_i, n_t)
    work = _Workspace(bounds[0][1], n_t, img.device)
    logits = _Logits(img, txt, s, t_img, t_txt, t, need[2], need[5], len(bounds) == 1, work)
    f32 = dict(dtype=torch.float32, device=img.device)
    # Each log-sum-exp as (shift, log of the sum) of the shifted exponentials, subtracted one after the other: their
    # float32 sum would carry the shift's rounding (|logit| eps) into every probability.
    row_s, row_u = [torch.empty(n_i, **f32) for _ in range(2)], [torch.empty(n_i, **f32) for _ in range(2)]
    col_s = col_u = None
    for r0, r1 in bounds:  # A
        _, S, _, U = logits(r0, r1)
        tmp = work("tmp", r1 - r0)
        for X, row in ((S, row_s), (U, row_u)):
            m, total = _lse_parts(X, 1, tmp)
            row[0][r0:r1], row[1][r0:r1] = m, total.log_()
        col_s = _lse_merge(col_s, *_lse_parts(S, 0, tmp))
        col_u = _lse_merge(col_u, *_lse_parts(U, 0, tmp))
    col_s, col_u = (col_s[0], torch.log(col_s[1])), (col_u[0], torch.log(col_u[1]))

    def shifted(X, lse, r0, r1, out):
        """X - lse into `out`: lse the rows' (r0:r1 of them) or, with r0 None, the columns'."""
        m, log = (lse[0][r0:r1, None], lse[1][r0:r1, None]) if r0 is not None else (lse[0][None, :], lse[1][None, :])
        return torch.sub(X, m, out=out).sub_(log)

    row_terms = torch.empty(n_i, **f32)
    col_terms = torch.zeros(n_t, dtype=torch.float64, device=img.device)
    student, teacher = any(need[:3]), any(need[3:])
    grads = _grad_buffers(need, img, txt, t_img, t_txt)
    s32, t32 = s.float(), t.float()

    def teacher_probabilities(r0, r1, U):
        """p and q: the teacher's row and column softmax of the chunk, in the workspace's buffers."""
        p, q = work("p", r1 - r0), work("q", r1 - r0)
        shifted(U, row_u, r0, r1, p).exp_()
        shifted(U, col_u, None, None, q).exp_()
        return p, q

    for r0, r1 in bounds:  # B, in the workspace's buffers: lsm (a log_softmax), p, q, G and the columns' softmax
        raw_s, S, _, U = logits(r0, r1)
        rows = r1 - r0
        lsm, G = work("tmp", rows), work("G", rows)
        p, q = teacher_probabilities(r0, r1, U)
        shifted(S, row_s, r0, r1, lsm)
        if student:  # G = a (softmax_row(S) - p) + b (softmax_col(S) - q): d distill / d S
            torch.exp(lsm, out=G).sub_(p).mul_(a)
        row_terms[r0:r1] = lsm.mul_(p).sum(1).neg_()
        shifted(S, col_s, None, None, lsm)
        if student:
            G.add_(torch.exp(lsm, out=p).sub_(q), alpha=b)
        col_terms -= lsm.mul_(q).sum(0).double()
        if student:
            _add_gradient(G, raw_s, s32, img[r0:r1], txt, grads, 0, r0, r1, lsm)
    if teacher:
        col_terms32 = col_terms.float()
        for r0, r1 in bounds:  # C: d distill / d U = -a p (lsm_r - sum p lsm_r) - b q (lsm_c - sum q lsm_c)
            _, S, raw_u, U = logits(r0, r1)
            lsm, dU = work("tmp", r1 - r0), work("G", r1 - r0)
            p, q = teacher_probabilities(r0, r1, U)
            torch.add(shifted(S, row_s, r0, r1, lsm), row_terms[r0:r1, None], out=dU).mul_(p).mul_(-a)
            shifted(S, col_s, None, None, lsm)
            dU.sub_(lsm.add_(col_terms32[None, :]).mul_(q).mul_(b))
            _add_gradient(dU, raw_u, t32, t_img[r0:r1], t_txt, grads, 3, r0, r1, lsm)
    loss = (a * row_terms.double().sum() + b * col_terms.sum()).float()
    return loss, grads


def _one_direction(q, k, s, tq, tk, t, need):
    """sum over q's rows of CE(softmax(t tq tk^T)_i, log_softmax(s q k^T)_i) (float32) and the gradients `need` asks
    for: one pass over the chunks (a row's terms are complete within its chunk)."""
    bounds = _bounds(q.shape[0], k.shape[0])
    work = _Workspace(bounds[0][1], k.shape[0], q.device)
    logits = _Logits(q, k, s, tq, tk, t, need[2], need[5], False, work)
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    grads = _grad_buffers(need, q, k, tq, tk)
    for r0, r1 in bounds:
        raw_s, S, raw_u, U = logits(r0, r1)
        p, lsm, G = (work(name, r1 - r0) for name in ("p", "tmp", "G"))
        m, sums = _lse_parts(U, 1, p)
        p.div_(sums[:, None])  # softmax(U)
        m, sums = _lse_parts(S, 1, lsm)
        torch.sub(S, m[:, None], out=lsm).sub_(sums.log_()[:, None])  # log_softmax(S)
        terms = torch.mul(lsm, p, out=G).sum(1).neg_()
        total += terms.double().sum()
        if any(need[3:]):  # d/dU = -p (lsm - sum_k p_k lsm_k)
            torch.add(lsm, terms[:, None], out=G).mul_(p).neg_()
            _add_gradient(G, raw_u, t.float(), tq[r0:r1], tk, grads, 3, r0, r1, work("q", r1 - r0))
        if any(need[:3]):  # d/dS = softmax(S) - p
            torch.exp(lsm, out=G).sub_(p)
            _add_gradient(G, raw_s, s.float(), q[r0:r1], k, grads, 0, r0, r1, work("q", r1 - r0))
    return total.float(), grads


class Precomputed(torch.autograd.Function):
    """A term whose forward forms its gradients too: forward(kernel, want, *inputs) runs kernel(*inputs, need)
    (`want` the caller's grad mode; _both_directions for one process, _one_direction for a rank's share) and returns
    its float32 loss (a 0-dim tensor); the backward scales the kept gradients by the incoming one."""

    @staticmethod
    def forward(ctx, kernel, want, *inputs):
        return _forward_with_grads(ctx, kernel, inputs, want)

    @staticmethod
    def backward(ctx, grad):
        # Under create_graph=True the gradients come behind not_twice: differentiating them again raises, as for the
        # library's operators, where it would otherwise drop the kept gradients' own dependence on the inputs.
        return (None, None, *not_twice("DistillClipLoss's distillation term", _scaled_grads(ctx, grad), ctx.inputs))


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
    if device.type == "cpu" and not _checks.compiling():  # the values the student's are refused for (host reads)
        value = float(t.detach().reshape(()))
        if not (value > 0.0 and value < float("inf")):
            raise ValueError(f"dist_logit_scale: must be finite and > 0 (it is the teacher's 1/tau), got {value}")
        for name, x in (("dist_image_features", dist_image_features), ("dist_text_features", dist_text_features)):
            bad = torch.isfinite(x).logical_not_().nonzero()
            if bad.shape[0]:
                raise ValueError(f"{name}: {name}[{int(bad[0, 0])}][{int(bad[0, 1])}] is not finite")
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
    return Precomputed.apply(_both_directions, torch.is_grad_enabled(), img, txt, s, t_img, t_txt, t)


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
    share = (Precomputed.apply(_one_direction, grad_on, img, every[1], s, t_img, every[3], t) +
             Precomputed.apply(_one_direction, grad_on, txt, every[0], s, t_txt, every[2], t)) / (2 * sum(counts))
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    return total + (share - share.detach())
