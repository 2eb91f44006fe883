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

Memory: the logits of one chunk of rows at a time (CHUNK_ELEMENTS of them, a few float32 buffers of that size), so
O(chunk x n_k + (n_q + n_k) d); InfoNCE and SigLIP take one product per chunk for their statistics and reuse it for the
gradient, CLIP two (its column statistics span every row). No value is read on the host (no synchronisation; the
group sizes are counted on the device by sorting the ids): a value the host engine refuses (a non-finite or
non-positive logit_scale, a non-finite logit_bias or feature) gives a NaN loss and the first non-finite site
'logits', as on the device's sync-free step.

Precision: the logits in float32 from the features (16-bit products are exact in float32; torch.mm's float32 output on
CUDA, float32 copies elsewhere), their statistics in float32, the loss and d loss / d log s summed in float64. Before
the gradient products dS is rounded to bfloat16 for bfloat16 features, as the device's tensor-core products and the
host's chunked path do; float16 features keep it in float32 (dS ~ 1 / (R n_k) would fall below float16's range in a
large batch). float32 products follow torch.backends.cuda.matmul.allow_tf32 as torch.matmul does. dQ and dK are
rounded once to the features' dtype, at the loss scale given."""

import torch

# Logits per chunk of rows: 64 MiB per float32 chunk-sized buffer (the step holds four or five of them at once).
CHUNK_ELEMENTS = 1 << 24

# torch.mm(a, b, out_dtype=torch.float32) for 16-bit CUDA operands: present (its CUDA kernel) in recent PyTorch; set to
# False at the first refusal, after which the operands are copied to float32.
_mm_out_dtype = hasattr(torch.ops.aten.mm, "dtype")

OBJECTIVES = ("symmetric", "info_nce", "sigmoid")


def rows_per_chunk(n_q, n_k):
    """The rows of one chunk: as many as CHUNK_ELEMENTS logits hold, at least one."""
    return max(1, min(n_q, CHUNK_ELEMENTS // max(n_k, 1)))


def _product(a, b):
    """a @ b in float32: 16-bit operands without rounding their product to 16 bits."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.mm(a, b)
    global _mm_out_dtype
    if a.is_cuda and _mm_out_dtype and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a PyTorch or a card without it: refused before anything ran
            _mm_out_dtype = False
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


def step(q, k, logit_scale, logit_bias, query_groups, key_groups, objective, grads, loss_scale=1.0):
    """One grouped step: (loss float32, dq, dk (the features' dtype, at `loss_scale`; 0 x d when not `grads`),
    d loss / d log s (float64), d loss / d b (float64; sigmoid, else None), the largest logit (float32; sigmoid: of
    S + b), the first non-finite site (int32, a NONFINITE_SITES index)), every one a tensor on the features' device.
    `objective`: 'symmetric', 'info_nce' or 'sigmoid'."""
    _check(q, k, query_groups, key_groups, objective)
    device, dtype = q.device, q.dtype
    n_q, n_k = q.shape[0], k.shape[0]
    sym, sig = objective == "symmetric", objective == "sigmoid"
    nan = float("nan")
    s = logit_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    s = torch.where((s > 0) & torch.isfinite(s), s, nan)
    b = None
    if sig:
        b = logit_bias.detach().reshape(()).to(device=device, dtype=torch.float32)
        b = torch.where(torch.isfinite(b), b, nan)
    qg, kg = query_groups.to(device), key_groups.to(device)
    f64 = dict(dtype=torch.float64, device=device)

    if not sig:
        keys_of_row = _sizes(qg, kg)  # |K(g(i))|
        has_row = keys_of_row > 0
        rows = has_row.sum().to(torch.float64).clamp(min=1)
        a = torch.where(has_row, (0.5 if sym else 1.0) / rows, 0.0)
        pos_row = torch.where(has_row, a / keys_of_row.clamp(min=1), 0.0).float()
        a = a.float()
        if sym:
            queries_of_col = _sizes(kg, qg)  # |Q(g(j))|
            has_col = queries_of_col > 0
            bc = torch.where(has_col, 0.5 / has_col.sum().to(torch.float64).clamp(min=1), 0.0)
            pos_col = torch.where(has_col, bc / queries_of_col.clamp(min=1), 0.0).float()
            bc = bc.float()
            col_lse = torch.full((n_k,), -float("inf"), dtype=torch.float32, device=device)
            col_pos = torch.zeros(n_k, dtype=torch.float32, device=device)
        lse = torch.empty(n_q, dtype=torch.float32, device=device)

    loss = torch.zeros((), **f64)
    dlogs = torch.zeros((), **f64)
    dbias = torch.zeros((), **f64) if sig else None
    max_logit = torch.full((), -float("inf"), dtype=torch.float32, device=device)
    bad_logits = torch.zeros((), dtype=torch.bool, device=device)
    if grads:
        dq = torch.empty_like(q)
        dk_sum = torch.zeros(k.shape, dtype=torch.float32, device=device)
        # float16's dS stays float32 (its products take float32 operands); bfloat16's is rounded to bfloat16.
        k_op, q_op = (k.float(), q.float()) if dtype == torch.float16 else (k, q)
        factor = s * float(loss_scale)
    kt = k.t()
    chunk = rows_per_chunk(n_q, n_k)

    def logits(r0, r1):
        S = _product(q[r0:r1], kt).mul_(s)
        return S, qg[r0:r1, None] == kg[None, :]

    def gradient_products(r0, r1, G, S):
        nonlocal dlogs
        dlogs = dlogs + (G * S).sum(dtype=torch.float64)
        Gm = G.to(torch.bfloat16) if dtype == torch.bfloat16 else G
        dq[r0:r1] = _product(Gm, k_op).mul_(factor).to(dtype)
        dk_sum.add_(_product(Gm.t(), q_op[r0:r1]))

    for r0 in range(0, n_q, chunk):
        r1 = min(n_q, r0 + chunk)
        S, pos = logits(r0, r1)
        if sig:
            z = S + b
            bad_logits = bad_logits | ~torch.isfinite(z).all()
            max_logit = torch.maximum(max_logit, z.amax())
            sign = torch.where(pos, 1.0, -1.0)
            loss = loss - torch.nn.functional.logsigmoid(sign * z).sum(dtype=torch.float64) / n_q
            if grads:
                G = torch.sigmoid(-sign * z).mul_(sign).mul_(-1.0 / n_q)
                dbias = dbias + G.sum(dtype=torch.float64)
                gradient_products(r0, r1, G, S)
            continue
        bad_logits = bad_logits | ~torch.isfinite(S).all()
        max_logit = torch.maximum(max_logit, S.amax())
        row_lse = torch.logsumexp(S, 1)
        lse[r0:r1] = row_lse
        on_pos = torch.where(pos, S, 0.0)
        loss = loss + (a[r0:r1] * row_lse).sum(dtype=torch.float64) - \
            (pos_row[r0:r1] * on_pos.sum(1)).sum(dtype=torch.float64)
        if sym:
            col_lse = torch.logaddexp(col_lse, torch.logsumexp(S, 0))
            col_pos.add_(on_pos.sum(0))
        elif grads:  # InfoNCE: the row statistics are the chunk's own, so its gradient follows at once
            G = torch.exp(S - row_lse[:, None]).mul_(a[r0:r1, None]).sub_(torch.where(pos, pos_row[r0:r1, None], 0.0))
            gradient_products(r0, r1, G, S)
    if sym:
        loss = loss + (bc * col_lse).sum(dtype=torch.float64) - (pos_col * col_pos).sum(dtype=torch.float64)
        for r0 in range(0, n_q, chunk) if grads else ():
            r1 = min(n_q, r0 + chunk)
            S, pos = logits(r0, r1)
            G = torch.exp(S - lse[r0:r1, None]).mul_(a[r0:r1, None])
            G.add_(torch.exp(S - col_lse[None, :]).mul_(bc[None, :]))
            G.sub_(torch.where(pos, pos_row[r0:r1, None] + pos_col[None, :], 0.0))
            gradient_products(r0, r1, G, S)

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
