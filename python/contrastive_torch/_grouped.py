# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Group ids on CUDA tensors: the grouped steps (contrastive_torch::grouped_softmax_step and grouped_sigmoid_step) as
a composition of PyTorch operations over row chunks, for the device step, which takes one positive per row.

The loss, its gradients and its diagnosis are the host engine's (docs/multi_positive.md): the softmax objectives'
cross-entropy against the uniform distribution over each row's positives, averaged over the rows that have one
(CLIP: over the images' rows and the texts' rows, each direction weighted 1/2), SigLIP's label +1 on every positive
pair; a softmax batch without a positive pair gives 0 and zero gradients. With P(i) the positive keys of row i,
|K(g)| and |Q(g)| the keys and queries of a group, a_i = [P(i) nonempty] / R (1 / 2R for CLIP) and b_j likewise over
the C columns that have a positive, the gradient w.r.t. the logits S = s Q K^T is
    G_ij = a_i softmax_row(S)_ij + b_j softmax_col(S)_ij - [i ~ j] (a_i / |K(g)| + b_j / |Q(g)|),
and dQ = s G K, dK = s G^T Q, d loss / d log s = sum_ij G_ij S_ij.

Memory: the logits of one chunk of rows at a time (CHUNK_ELEMENTS of them, four to seven float32 buffers of that
size), so O(chunk x n_k + (n_q + n_k) d); InfoNCE and SigLIP take one product per chunk for their statistics and
reuse it for the gradient, CLIP two (its column statistics span every row). No value is read on the host: the group
sizes are counted on the device by sorting the ids, and a value the host engine refuses (a non-finite or non-positive
logit_scale, a non-finite logit_bias or feature) gives a NaN or infinite loss and the first non-finite site 'logits',
as on the device's sync-free step. With CUDA tensors for the features, ids, logit_scale and logit_bias, a CUDA graph
captures the step; a Python number or CPU tensor is copied to the device first (that copy waits), and float16's
backward reads the incoming gradient on the host (as every float16 step does).

Precision, the host engine's forms: each row's (column's) positives kept apart from its negatives, measured from m,
their largest logit: log-sum-exp = m + log |P| + pos_log, pos_log = log1p((deficit + rest) / |P|), with rest the
negatives' sum of exp(S - m), deficit the positives' sum of expm1(S - m) and the positives' distance below m summed
directly (the columns' merged over the chunks, each sum kept from its own maximum until the last), so a trained batch's
loss keeps its small excess over log |P|; on a positive, G's softmax-minus-target formed as (a_i / |P|) expm1((S - m) -
pos_log), a small difference without cancellation whatever |P|; d loss / d log s from S - m (each direction's G sums to
zero along it). Measured on CPU tensors (64 images, 2-3 captions each 1e-3 from their image, s = 30 and 100): dQ, dK and
d loss / d log s as close to float64 as the float64 gradients of the same float32 logits. The logits in float32 from the
features (16-bit products are exact in float32; torch.mm's float32 output on CUDA, float32 copies elsewhere), the loss
and d loss / d log s summed in float64. Before the gradient products dS is rounded to bfloat16 for bfloat16 features, as
the device's tensor-core products and the host's chunked path do; float16 features keep it in float32 (dS ~ 1 / (R n_k)
would fall below float16's range in a large batch). float32 products follow torch.backends.cuda.matmul.allow_tf32 as
torch.matmul does. dQ and dK are rounded once to the features' dtype, at the loss scale given."""

import torch

# Logits per chunk of rows: 64 MiB per float32 chunk-sized buffer. The step's peak, measured on CPU tensors (growth of
# the resident set, one chunk of 4096 x 4096): 6.5 such buffers for CLIP, 5.5 for InfoNCE, 4.3 for SigLIP (the
# logits, the parts of G as they are formed, the positives' mask), about 420 MiB for CLIP.
CHUNK_ELEMENTS = 1 << 24

# torch.mm(a, b, out_dtype=torch.float32) for 16-bit CUDA operands, per dtype: present (its CUDA kernel) in recent
# PyTorch; False after its first refusal (an older PyTorch, TunableOp, a reduced-precision setting), after which that
# dtype's operands are copied to float32.
_mm_out_dtype = dict.fromkeys((torch.bfloat16, torch.float16), hasattr(torch.ops.aten.mm, "dtype"))
# What is not a refusal of the call itself but the device's state: raised again, the flag left as it is.
_DEVICE_ERRORS = tuple(e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None))
                       if e is not None)

OBJECTIVES = ("symmetric", "info_nce", "sigmoid")


def rows_per_chunk(n_q, n_k):
    """The rows of one chunk: as many as CHUNK_ELEMENTS logits hold, at least one."""
    return max(1, min(n_q, CHUNK_ELEMENTS // max(n_k, 1)))


def _product(a, b):
    """a @ b in float32: 16-bit operands without rounding their product to 16 bits."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda and _mm_out_dtype.get(a.dtype) and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except _DEVICE_ERRORS:
            raise
        except (RuntimeError, TypeError):  # refused before anything ran
            _mm_out_dtype[a.dtype] = False
    return torch.mm(a.float(), b.float())


def _sizes(ids, other):
    """Per entry of `ids`: how many entries of `other` equal it (float64), counted on the device (sorted search)."""
    ordered = torch.sort(other).values
    return (torch.searchsorted(ordered, ids, right=True) - torch.searchsorted(ordered, ids)).to(torch.float64)


def _check(q, k, query_groups, key_groups, objective):
    """What the composition needs of its arguments (a direct operator call bypasses the functions' checks); the
    names are the library's (the functions rename them to the caller's)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"contrastive: obj: unknown objective {objective!r} (one of {', '.join(OBJECTIVES)})")
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"contrastive: {name}: expected a non-empty 2-D tensor, got shape {tuple(x.shape)} "
                             "[empty_input]")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"contrastive: {name}: dtype {x.dtype} is not float32, bfloat16 or float16")
    if q.shape[1] != k.shape[1] or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"contrastive: k: {tuple(k.shape)} {k.dtype} on {k.device} does not match q's "
                         f"{tuple(q.shape)} {q.dtype} on {q.device} [shape_mismatch]")
    for name, ids, n in (("query_groups", query_groups, q.shape[0]), ("key_groups", key_groups, k.shape[0])):
        if ids.dim() != 1 or ids.shape[0] != n or ids.dtype != torch.int64:
            raise ValueError(f"contrastive: {name}: expected {n} int64 ids (one per row), got {ids.dtype} of shape "
                             f"{tuple(ids.shape)} [shape_mismatch]")


# How far below a row's (column's) largest logit its reference point may sit: the positives' largest logit, unless a
# negative lies more than this above it (exp(S - m) stays below e^64 whatever the batch).
_GUARD = 64.0


def _point(top, top_pos):
    """The point the statistics are measured from: the positives' largest logit (where the precision after training
    lies), at least the largest logit less _GUARD."""
    return torch.maximum(top_pos, top - _GUARD)


def _reference(S, pos, dim):
    """Along `dim`: (m, largest logit, largest positive logit), m = _point's."""
    top = S.amax(dim)
    top_pos = S.masked_fill(~pos, -float("inf")).amax(dim)
    return _point(top, top_pos), top, top_pos


def _stats(S, pos, m, dim):
    """Along `dim`, measured from m: (rest, deficit, gap), the negatives' sum of exp(S - m), the positives' sum of
    expm1(S - m) and their sum of m - S. Finite for finite logits: S - m <= _GUARD."""
    centred = S - m.unsqueeze(dim)
    deficit = torch.expm1(centred).mul_(pos).sum(dim)
    gap = centred.mul(pos).sum(dim).neg_()
    rest = centred.exp_().mul_(~pos).sum(dim)
    return rest, deficit, gap


def _column_part(S, pos):
    """One chunk's column statistics: (largest logit, the negatives' sum of exp(S - it), the positives' largest logit,
    their sum of expm1(S - it) and of it - S, their count), each sum measured from its own maximum, so that merging
    chunks (_merge_columns) only ever scales a sum down by exp of a non-positive distance."""
    _, top, top_pos = _reference(S, pos, 0)
    rest = (S - top).exp_().mul_(~pos).sum(0)
    # The positives' distances below their maximum; 0 elsewhere (a negative may lie any distance above it).
    centred = (S - torch.where(top_pos == -float("inf"), top, top_pos)).masked_fill_(~pos, 0.0)
    deficit = torch.expm1(centred).sum(0)
    gap = centred.sum(0).neg_()
    return top, rest, top_pos, deficit, gap, pos.sum(0).float()


def _moved(deficit, gap, count, delta):
    """The positives' deficit and gap moved to a maximum `delta` (<= 0) below the new one; none (count 0): zeros."""
    some = count > 0
    return (torch.where(some, deficit * torch.exp(delta) + count * torch.expm1(delta), 0.0),
            torch.where(some, gap - count * delta, 0.0))


def _merge_columns(a, b):
    """Two chunks' (or the running and a chunk's) column statistics as those of their union."""
    top = torch.maximum(a[0], b[0])
    rest = a[1] * torch.exp(a[0] - top) + b[1] * torch.exp(b[0] - top)
    top_pos = torch.maximum(a[2], b[2])
    deficit_a, gap_a = _moved(a[3], a[4], a[5], a[2] - top_pos)
    deficit_b, gap_b = _moved(b[3], b[4], b[5], b[2] - top_pos)
    return top, rest, top_pos, deficit_a + deficit_b, gap_a + gap_b, a[5] + b[5]


def _finish_columns(cols):
    """(m, pos_log, gap) of every column from its merged statistics, measured from _point's m."""
    top, rest, top_pos, deficit, gap, count = cols
    m = _point(top, top_pos)
    deficit, gap = _moved(deficit, gap, count, top_pos - m)
    rest = rest * torch.exp(top - m)  # top - m <= _GUARD
    return m, _pos_log(rest, deficit, count), gap


def _pos_log(rest, deficit, count):
    """log(sum_j exp(S_j - m) / |P|) = log1p((deficit + rest) / |P|): with m at the positives' largest logit it keeps
    a trained row's small excess over log |P| (rows without a positive: |P| taken as 1, their weight is 0)."""
    return torch.log1p((deficit + rest) / count.clamp(min=1))


def _softmax_part(S, m, pos_log, pos, weight, pos_weight, log_count):
    """One direction's share of G along the rows of S (a direction's rows: S itself, or its transpose for the
    columns): weight P off the positives and, on them, pos_weight (|P| P - 1) = pos_weight expm1((S - m) - pos_log),
    a small difference after training formed without cancellation; log P = (S - m) - pos_log - log |P|. Returns it
    and its share of d loss / d log s, sum G (S - m): the share sums to zero along each row, so measuring S from m
    loses nothing."""
    centred = S - m[:, None]
    shifted = centred - pos_log[:, None]  # <= log |P|: expm1 and exp stay finite on every entry
    on_pos = torch.expm1(shifted).mul_(pos_weight[:, None]).mul_(pos)
    part = shifted.sub_(log_count[:, None]).exp_().mul_(weight[:, None]).mul_(~pos).add_(on_pos)
    return part, centred.mul_(part).sum(1).double().sum()


def step(q, k, logit_scale, logit_bias, query_groups, key_groups, objective, grads, loss_scale=1.0):
    """One grouped step: (loss float32, dq, dk (the features' dtype, at `loss_scale`; 0 x d when not `grads`),
    d loss / d log s (float64), d loss / d b (float64; sigmoid, else None), the largest logit (float32; sigmoid: of
    S + b), the first non-finite site (int32, a NONFINITE_SITES index)), every one a tensor on the features' device.
    `objective`: 'symmetric', 'info_nce' or 'sigmoid'. Runs outside autocast (a float16 backward's rerun may be
    called inside a region, whose casts would round the float32 products)."""
    _check(q, k, query_groups, key_groups, objective)
    with torch.autocast(q.device.type, enabled=False):
        return _step(q, k, logit_scale, logit_bias, query_groups, key_groups, objective, grads, loss_scale)


def _step(q, k, logit_scale, logit_bias, query_groups, key_groups, objective, grads, loss_scale):
    device, dtype = q.device, q.dtype
    n_q, n_k = q.shape[0], k.shape[0]
    sym, sig = objective == "symmetric", objective == "sigmoid"
    nan, inf = float("nan"), float("inf")
    f32 = dict(dtype=torch.float32, device=device)
    s = logit_scale.detach().reshape(()).to(**f32)
    s = torch.where((s > 0) & torch.isfinite(s), s, nan)
    b = None
    if sig:
        b = logit_bias.detach().reshape(()).to(**f32)
        b = torch.where(torch.isfinite(b), b, nan)
    qg, kg = query_groups.to(device), key_groups.to(device)

    if not sig:
        # Per row: a_i = [P(i) nonempty] / R (1 / 2R symmetric), a_i / |K(g(i))| on its positives; per column
        # likewise b_j = [Q(g(j)) nonempty] / 2C and b_j / |Q(g(j))|.
        keys_of_row = _sizes(qg, kg)
        has_row = keys_of_row > 0
        a = torch.where(has_row, (0.5 if sym else 1.0) / has_row.sum().to(torch.float64).clamp(min=1), 0.0)
        a_pos = (a / keys_of_row.clamp(min=1)).float()
        a, log_keys, keys_of_row = a.float(), keys_of_row.clamp(min=1).log().float(), keys_of_row.float()
        row_m = torch.empty(n_q, **f32)
        row_pos_log = torch.empty(n_q, **f32)
        if sym:
            queries_of_col = _sizes(kg, qg)
            has_col = queries_of_col > 0
            bc = torch.where(has_col, 0.5 / has_col.sum().to(torch.float64).clamp(min=1), 0.0)
            bc_pos = (bc / queries_of_col.clamp(min=1)).float()
            bc, log_queries = bc.float(), queries_of_col.clamp(min=1).log().float()
            # The columns' running statistics over the chunks (_column_part's), merged chunk by chunk.
            cols = None

    loss = torch.zeros((), dtype=torch.float64, device=device)
    dlogs = torch.zeros((), dtype=torch.float64, device=device)
    dbias = torch.zeros((), dtype=torch.float64, device=device) if sig else None
    max_logit = torch.full((), -inf, **f32)
    bad_logits = torch.zeros((), dtype=torch.bool, device=device)
    if grads:
        dq = torch.empty_like(q)
        dk_sum = torch.zeros(k.shape, **f32)
        # float16's dS stays float32 (its products take float32 operands); bfloat16's is rounded to bfloat16.
        k_op, q_op = (k.float(), q.float()) if dtype == torch.float16 else (k, q)
        factor = s * float(loss_scale)
    kt = k.t()
    chunk = rows_per_chunk(n_q, n_k)

    def logits(r0, r1):
        return _product(q[r0:r1], kt).mul_(s), qg[r0:r1, None] == kg[None, :]

    def gradient_products(r0, r1, G):
        G = G.to(torch.bfloat16) if dtype == torch.bfloat16 else G
        dq[r0:r1] = _product(G, k_op).mul_(factor).to(dtype)
        dk_sum.add_(_product(G.t(), q_op[r0:r1]))

    def seen(x):
        nonlocal bad_logits, max_logit
        low, high = torch.aminmax(x)  # NaN in either
        bad_logits = bad_logits | ~(torch.isfinite(low) & torch.isfinite(high))
        max_logit = torch.maximum(max_logit, high)

    for r0 in range(0, n_q, chunk):
        r1 = min(n_q, r0 + chunk)
        S, pos = logits(r0, r1)
        if sig:
            # u = -l z, l = +1 on the positives and -1 elsewhere: the term is softplus(u) = -log sigmoid(l z) and
            # d term / d z = -l sigmoid(u).
            minus_l = pos.to(torch.float32).mul_(-2.0).add_(1.0)
            u = S + b
            seen(u)
            u.mul_(minus_l)
            loss = loss + torch.nn.functional.softplus(u).sum(1).double().sum() / n_q
            if grads:
                G = u.sigmoid_().mul_(minus_l).mul_(1.0 / n_q)
                dbias = dbias + G.sum(1).double().sum()
                dlogs = dlogs + S.mul_(G).sum(1).double().sum()
                gradient_products(r0, r1, G)
            continue
        seen(S)
        m = _reference(S, pos, 1)[0]
        rest, deficit, gap = _stats(S, pos, m, 1)
        pos_log = _pos_log(rest, deficit, keys_of_row[r0:r1])
        row_m[r0:r1], row_pos_log[r0:r1] = m, pos_log
        # Row i's term: lse_i - mean over P(i) of S_ij = log |P(i)| + pos_log_i + (sum over P(i) of m_i - S_ij) / |P(i)|.
        loss = loss + (a[r0:r1] * (log_keys[r0:r1] + pos_log) + a_pos[r0:r1] * gap).double().sum()
        if sym:
            part = _column_part(S, pos)
            cols = part if cols is None else _merge_columns(cols, part)
        elif grads:  # InfoNCE: the row statistics are the chunk's own, so its gradient follows at once
            G, share = _softmax_part(S, m, pos_log, pos, a[r0:r1], a_pos[r0:r1], log_keys[r0:r1])
            dlogs = dlogs + share
            gradient_products(r0, r1, G)
    if sym:
        col_m, col_pos_log, col_gap = _finish_columns(cols)
        loss = loss + (bc * (log_queries + col_pos_log) + bc_pos * col_gap).double().sum()
        for r0 in range(0, n_q, chunk) if grads else ():
            r1 = min(n_q, r0 + chunk)
            S, pos = logits(r0, r1)
            G, share = _softmax_part(S, row_m[r0:r1], row_pos_log[r0:r1], pos, a[r0:r1], a_pos[r0:r1],
                                     log_keys[r0:r1])
            C, col_share = _softmax_part(S.t(), col_m, col_pos_log, pos.t(), bc, bc_pos, log_queries)
            dlogs = dlogs + share + col_share
            gradient_products(r0, r1, G.add_(C.t()))

    loss = loss.float()
    checks = [(bad_logits, 1), (~torch.isfinite(loss), 2)]
    if grads:
        dk = dk_sum.mul_(factor).to(dtype)
        checks += [(~torch.isfinite(dq).all(), 3), (~torch.isfinite(dk).all(), 4), (~torch.isfinite(dlogs), 5)]
        if sig:
            checks.append((~torch.isfinite(dbias), 7))
    else:
        dq, dk = q.new_empty((0, q.shape[1])), k.new_empty((0, k.shape[1]))
    site = torch.zeros((), dtype=torch.int32, device=device)
    for flag, code in reversed(checks):
        site = torch.where(flag, code, site)
    return loss, dq, dk, dlogs, dbias, max_logit, site
