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
from ._ops import autocast_dtype, autocast_features

# Logits per chunk of rows: 64 MiB per float32 chunk-sized buffer; a chunk holds about seven such buffers at once.
CHUNK_ELEMENTS = 1 << 24


def _bounds(n_q, n_k):
    """The chunks of rows: as many rows as CHUNK_ELEMENTS logits hold, at least one."""
    rows = max(1, min(n_q, CHUNK_ELEMENTS // max(n_k, 1)))
    return [(r0, min(n_q, r0 + rows)) for r0 in range(0, n_q, rows)]


class _Logits:
    """The student's and the teacher's logits of a chunk of rows in float32: (raw_s, S, raw_u, U), raw = q k^T (kept
    only where the scale wants its gradient, else None), S = s raw. With one chunk they are formed once and kept."""

    def __init__(self, q, k, s, tq, tk, t, keep_raw_s, keep_raw_u, single):
        self.args = (q, k.t(), s, tq, tk.t(), t)
        self.keep = (keep_raw_s, keep_raw_u)
        self.kept = None if not single else ()

    def __call__(self, r0, r1):
        if self.kept:
            return self.kept
        q, kt, s, tq, tkt, t = self.args
        out = []
        for x, yt, scale, keep in ((q, kt, s, self.keep[0]), (tq, tkt, t, self.keep[1])):
            raw = _product(x[r0:r1], yt)
            out += [raw, raw * scale] if keep else [None, raw.mul_(scale)]
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


def _column_lse(x):
    m = x.max(0).values
    return m, torch.exp(x - m).sum(0)


def _forward_with_grads(ctx, kernel, args, want):
    """Runs kernel(*args, need) (need: which of args want gradients, as autograd says and the caller's grad mode
    allows) outside autocast; keeps the float32 gradients it returns for the backward. Returns its loss."""
    need = tuple(bool(n and want) for n in ctx.needs_input_grad[2:2 + len(args)])
    with torch.autocast(args[0].device.type, enabled=False):
        loss, grads = kernel(*args, need)
    ctx.grads = grads
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


def _add_gradient(G, raw, scale, x_rows, y, grads, i, r0, r1):
    """G = d term / d(scale x y^T) on rows r0:r1 of x (x_rows): its share of the gradients of x (grads[i], those
    rows), y (grads[i + 1]) and the scale (grads[i + 2], from raw = x_rows y^T), where they are asked for. G is
    scaled in place."""
    if grads[i + 2] is not None:
        grads[i + 2] += torch.linalg.vecdot(G, raw, dim=1).double().sum()
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
    logits = _Logits(img, txt, s, t_img, t_txt, t, need[2], need[5], len(bounds) == 1)
    f32 = dict(dtype=torch.float32, device=img.device)
    row_lse_s, row_lse_u = torch.empty(n_i, **f32), torch.empty(n_i, **f32)
    col_s = col_u = None
    for r0, r1 in bounds:  # A
        _, S, _, U = logits(r0, r1)
        row_lse_s[r0:r1], row_lse_u[r0:r1] = torch.logsumexp(S, 1), torch.logsumexp(U, 1)
        col_s, col_u = _lse_merge(col_s, *_column_lse(S)), _lse_merge(col_u, *_column_lse(U))
    col_lse_s, col_lse_u = col_s[0] + torch.log(col_s[1]), col_u[0] + torch.log(col_u[1])
    row_terms = torch.empty(n_i, **f32)
    col_terms = torch.zeros(n_t, dtype=torch.float64, device=img.device)
    student, teacher = any(need[:3]), any(need[3:])
    grads = _grad_buffers(need, img, txt, t_img, t_txt)
    s32, t32 = s.float(), t.float()

    def parts(r0, r1, S, U):
        """(log_softmax of the rows, p, log_softmax of the columns, q): the student's log-probabilities and the
        teacher's probabilities along both directions."""
        lsm_r, p = S - row_lse_s[r0:r1, None], torch.exp(U - row_lse_u[r0:r1, None])
        lsm_c, q = S - col_lse_s[None, :], torch.exp(U - col_lse_u[None, :])
        return lsm_r, p, lsm_c, q

    for r0, r1 in bounds:  # B
        raw_s, S, _, U = logits(r0, r1)
        lsm_r, p, lsm_c, q = parts(r0, r1, S, U)
        row_terms[r0:r1] = -torch.linalg.vecdot(p, lsm_r, dim=1)
        col_terms += -torch.linalg.vecdot(q, lsm_c, dim=0).double()
        if student:
            # G = a (softmax_row(S) - p) + b (softmax_col(S) - q): d distill / d S.
            G = lsm_r.exp_().sub_(p).mul_(a).add_(lsm_c.exp_().sub_(q).mul_(b))
            del lsm_r, lsm_c, p, q
            _add_gradient(G, raw_s, s32, img[r0:r1], txt, grads, 0, r0, r1)
    if teacher:
        col_terms32 = col_terms.float()
        for r0, r1 in bounds:  # C: d distill / d U = -a p (lsm_r - sum p lsm_r) - b q (lsm_c - sum q lsm_c)
            _, S, raw_u, U = logits(r0, r1)
            lsm_r, p, lsm_c, q = parts(r0, r1, S, U)
            dU = lsm_r.add_(row_terms[r0:r1, None]).mul_(p).mul_(-a)
            dU = dU.sub_(lsm_c.add_(col_terms32[None, :]).mul_(q).mul_(b))
            _add_gradient(dU, raw_u, t32, t_img[r0:r1], t_txt, grads, 3, r0, r1)
    loss = (a * row_terms.double().sum() + b * col_terms.sum()).float()
    return loss, grads


def _one_direction(q, k, s, tq, tk, t, need):
    """sum over q's rows of CE(softmax(t tq tk^T)_i, log_softmax(s q k^T)_i) (float32) and the gradients `need` asks
    for: one pass over the chunks (a row's terms are complete within its chunk)."""
    f32 = dict(dtype=torch.float32, device=q.device)
    bounds = _bounds(q.shape[0], k.shape[0])
    logits = _Logits(q, k, s, tq, tk, t, need[2], need[5], False)
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    grads = _grad_buffers(need, q, k, tq, tk)
    for r0, r1 in bounds:
        raw_s, S, raw_u, U = logits(r0, r1)
        p, lsm = torch.softmax(U, 1), torch.log_softmax(S, 1)
        terms = -torch.linalg.vecdot(p, lsm, dim=1)
        total += terms.double().sum()
        if any(need[3:]):  # d/dU = -p (lsm - sum_k p_k lsm_k)
            dU = (lsm + terms[:, None]).mul_(p).neg_()
            _add_gradient(dU, raw_u, t.float(), tq[r0:r1], tk, grads, 3, r0, r1)
        if any(need[:3]):  # d/dS = softmax(S) - p
            dS = lsm.exp_().sub_(p)
            _add_gradient(dS, raw_s, s.float(), q[r0:r1], k, grads, 0, r0, r1)
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
        return (None, None, *_scaled_grads(ctx, grad))


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
