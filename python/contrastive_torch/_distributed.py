# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The loss of a global batch over a torch.distributed process group: every rank calls with its own rows and gets
the global loss (the mean over all N rows of the batch; for SigLIP (1/N) times the sum over all N x N pairs).

Two exchanges, one convention:
- 'engine' (CPU tensors, gloo): the library's distributed engine (csrc/torch_comm.hpp) gathers the text features,
  runs this rank's rows against them and reduce-scatters their gradients; nothing N x N is formed.
- 'gather' (CUDA and CPU tensors, any backend): torch.distributed's autograd all-gather (the exchange open_clip's
  gather_with_grad uses) of the texts (and, for CLIP, the images), then the one-process operator on this rank's rows
  against the gathered ones (both directions for CLIP, as open_clip's local_loss scheme); the gather's backward sums
  every rank's gradient of its rows. The only device code is the one-process step.

Gradients: each rank's features get grad_ranks x d(global loss)/d(its rows) (grad_ranks defaults to the group's size,
which DDP's averaging turns into the exact gradient; open_clip's gather_with_grad=True or local_loss=True gives the
same); logit_scale and logit_bias get d(global loss)/d(them) on every rank. Before any exchange, every rank's
checks are agreed on (one all-gather), so an error found on one rank is raised on every rank, naming it, instead of
leaving the others in a collective."""

import struct

import torch

from . import _checks, _host, _ops, _steps
from ._checks import DTYPE_NAMES, scale_value, bias_value
from ._extension import extension
from ._ops import autocast_features

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_EXCHANGES = ("engine", "gather")
# The Python exception kinds the agreement carries from the failing rank to every rank.
_KINDS = {1: TypeError, 2: ValueError, 3: NotImplementedError, 4: RuntimeError, 5: MemoryError, 6: OverflowError}
# The most values one rank says in the agreement (binding.cpp's agree_values).
_AGREED_VALUES = 12


def _kind_of(error):
    for code in (3, 1, 2, 5, 6):  # NotImplementedError before RuntimeError (it is one)
        if isinstance(error, _KINDS[code]):
            return code
    return 4


def _with_rank(rank, text):
    """'argument: what' -> 'argument: rank r: what', as the library's agreed errors read."""
    head, sep, rest = text.partition(": ")
    if sep and " " not in head.strip():
        return f"{head}: rank {rank}: {rest}"
    return f"rank {rank}: {text}"


def _agreement_device(group):
    """None where the group carries CPU tensors (gloo): the library's agreement runs; else the device whose tensors
    carry the same exchange through torch.distributed (NCCL: the current CUDA device)."""
    import torch.distributed as dist

    return None if "gloo" in str(dist.get_backend(group)) else torch.device("cuda", torch.cuda.current_device())


def _exchange_verdicts(group, kind, message, values):
    """(first failing rank or -1, its kind, its message, every rank's values): the library's agreement, or the same
    exchange in device tensors (_agreement_device)."""
    device = _agreement_device(group)
    if device is None:
        return extension().agree(group, kind, message, [float(v) for v in values])
    import torch.distributed as dist

    mine = torch.zeros(2 + _AGREED_VALUES, dtype=torch.float64, device=device)
    mine[0], mine[1] = kind, len(values)
    if values:
        mine[2:2 + len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(rows, mine, group=group)
    rows = [r.tolist() for r in rows]
    got = [r[2:2 + int(r[1])] for r in rows]
    for r, row in enumerate(rows):
        if row[0] != 0:
            text = torch.zeros(1024, dtype=torch.uint8, device=device)
            if r == group.rank():
                raw = message.encode()[:1023]
                text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
            dist.broadcast(text, src=dist.get_global_rank(group, r), group=group)
            raw = bytes(text.cpu().tolist())
            return r, int(row[0]), raw.split(b"\0", 1)[0].decode(errors="replace"), got
    return -1, 0, "", got


def agree(group, error, values):
    """Every rank's verdict on its own checks (`error`: None or the exception it would raise) and its `values` (at
    most _AGREED_VALUES numbers), all-gathered over `group`: if any rank failed, every rank raises the first failing
    rank's error, naming it. Returns every rank's values."""
    kind = 0 if error is None else _kind_of(error)
    bad, bad_kind, text, got = _exchange_verdicts(group, kind, "" if error is None else str(error), values)
    if bad >= 0:
        raised = _KINDS.get(bad_kind, RuntimeError)(_with_rank(bad, text))
        if error is not None and bad == group.rank():
            raise raised from error
        raise raised
    return got


def _first_other(got, i):
    """The first rank whose value i differs from rank 0's (bitwise: NaN differs from everything), or None."""
    bits = [struct.pack("<d", v[i]) for v in got]
    return next((r for r in range(1, len(got)) if bits[r] != bits[0]), None)


def _check_same(got, first_name):
    """The ranks' dtype, algorithm, exchange, logit_scale, logit_bias, embedding size and which inputs want gradients
    must agree."""
    names = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}
    r = _first_other(got, 0)
    if r is not None:
        raise TypeError(f"{first_name}: rank {r}: dtype {names.get(int(got[r][0]))} where rank 0 has "
                        f"{names.get(int(got[0][0]))}; every rank must pass the same dtype")
    r = _first_other(got, 1)
    if r is not None:
        raise ValueError(f"algorithm: rank {r}: '{_checks.ALGORITHMS[int(got[r][1])]}' where rank 0 has "
                         f"'{_checks.ALGORITHMS[int(got[0][1])]}'; every rank must use the same algorithm")
    r = _first_other(got, 2)
    if r is not None:
        raise ValueError(f"exchange: rank {r}: '{_EXCHANGES[int(got[r][2])]}' where rank 0 has "
                         f"'{_EXCHANGES[int(got[0][2])]}'; every rank must use the same exchange")
    for i, name in ((3, "logit_scale"), (4, "logit_bias")):
        r = _first_other(got, i)
        if r is not None:
            raise ValueError(f"{name}: rank {r}: {got[r][i]!r} where rank 0 has {got[0][i]!r}; every rank must pass "
                             f"the same {name} (a parameter that DDP keeps equal on every rank)")
    r = _first_other(got, 7)
    if r is not None:
        raise ValueError(f"{first_name}: rank {r}: embedding size {int(got[r][7])} where rank 0 has "
                         f"{int(got[0][7])}; every rank must pass the same")
    grouped = [int(v[6]) >> 4 & 1 for v in got]  # bit 4 of the wants code: the call has group ids
    r = next((r for r in range(1, len(got)) if grouped[r] != grouped[0]), None)
    if r is not None:
        given = ("without", "with")
        raise ValueError(f"image_groups: rank {r} calls {given[grouped[r]]} group ids where rank 0 calls "
                         f"{given[grouped[0]]}; every rank passes its rows' ids, or none does")
    r = _first_other(got, 6)
    if r is not None:
        raise ValueError(f"{first_name}: rank {r} wants gradients for (image_features, text_features, logit_scale, "
                         f"logit_bias) = "
                         f"{_wants(got[r][6])} where rank 0 wants {_wants(got[0][6])}; the backward is a collective of "
                         "every rank")


def _wants(code):
    code = int(code)
    return tuple(bool(code >> i & 1) for i in range(4))


def _eager_only(f):
    """torch.compile runs `f` eagerly (a graph break; fullgraph=True refuses it with this reason)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return f
    reason = ("contrastive_torch: over a process group the loss is a torch.distributed collective, run eagerly (a "
              "graph break); fullgraph=True needs one process")
    try:
        return disable(f, reason=reason)
    except TypeError:  # PyTorch before reason=
        return disable(f)


@_eager_only
def global_loss(objective, q, k, logit_scale, logit_bias, algorithm, threads, fused_tiles, group, grad_ranks,
                exchange, report, expected=None, groups=(None, None)):
    """The loss of the global batch (objective 'symmetric' or 'sigmoid'); every rank of `group` calls it. Every
    argument is checked here, inside the agreement (a refusal on one rank is raised on every rank). `expected`:
    (rank, world_size) the caller was constructed with (open_clip's arguments), checked against the group. For
    'symmetric', a `logit_bias` is only checked (one value: open_clip's ClipLoss adds it to every logit, which no
    softmax sees). `groups`: this rank's rows' (image, text) group ids, or (None, None); the engine gathers every
    rank's ids (exchange 'engine', CPU tensors)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise NotImplementedError("group: this PyTorch has no torch.distributed")
    if not dist.is_initialized():
        raise RuntimeError("world_size > 1: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, on every rank)")
    group = group if group is not None else dist.group.WORLD
    rank, size = group.rank(), group.size()
    names = ("image_features", "text_features")
    error, values = None, []
    try:
        algorithm = _checks.algorithm(algorithm, allow_none=True)
        _checks.threads(threads)
        _checks.boolean("fused_tiles", fused_tiles)
        _checks.report(report)
        _checks.feature_pair(q, k, names)
        # Under torch.autocast, float32 features run at its dtype, as in one process (the operators' autocast rule):
        # cast here, before the exchange, so the ranks agree on and move the dtype the steps run at.
        q, k = autocast_features(q, k)
        q, k = q.contiguous(), k.contiguous()  # the engine and the gather take rows in place
        for name, x in zip(names, (q, k)):  # group ids let the towers differ in length, not vanish on a rank
            if x.shape[0] == 0:
                raise ValueError(f"{name}: no rows on this rank; every rank of the group needs at least one")
        if exchange is None:
            exchange = "gather" if q.device.type == "cuda" else "engine"
        if exchange not in _EXCHANGES:
            raise ValueError(f"exchange: '{exchange}' is not one of 'engine', 'gather'")
        if exchange == "engine" and q.device.type == "cuda":
            raise NotImplementedError("image_features: CUDA tensors: the library's distributed engine runs on the CPU "
                                      "(gloo); use exchange='gather' (the default for CUDA tensors)")
        if exchange == "engine" and not getattr(extension(), "HAS_DISTRIBUTED", False):
            raise NotImplementedError("exchange: 'engine': the extension was built without torch.distributed")
        if objective == "sigmoid":
            algorithm = _checks.sigmoid_algorithm(algorithm, q.device)
        else:
            algorithm = _checks.resolve_algorithm(algorithm, q.device, distributed=True)
        if expected is not None and expected[1] > 1 and expected[1] != size:
            raise ValueError(f"world_size: {expected[1]}, but the process group has {size} ranks")
        if expected is not None and expected[1] > 1 and expected[0] != rank:
            raise ValueError(f"rank: {expected[0]}, but this process is rank {rank} of the process group")
        groups = _checks.groups(groups[0], groups[1], q.shape[0], k.shape[0], q.device,
                                names=("image_groups", "text_groups"))
        if q.shape[0] != k.shape[0] and groups[0] is None:
            raise ValueError(f"features: each rank passes as many texts as images ({q.shape[0]} and {k.shape[0]})")
        if exchange == "gather":
            # The engine agrees on its own value checks; the one-process step runs after the gather, where a refusal
            # on one rank would leave the others in the next collective: checked here (one read; a sync on CUDA).
            for name, x in zip(names, (q, k)):
                if not bool(torch.isfinite(x).all()):
                    raise ValueError(f"{name}: holds a non-finite value")
        s = _checks.scalar("logit_scale", logit_scale, q.device)
        b = None
        if objective == "sigmoid" or logit_bias is not None:
            b = _checks.scalar("logit_bias", 0.0 if logit_bias is None else logit_bias, q.device,
                               "None, a number or a one-element tensor")
            if objective != "sigmoid":
                b = None  # checked only
        grad_on = torch.is_grad_enabled()
        wants = [grad_on and x is not None and x.requires_grad for x in (q, k, s, b)]
        c = size if grad_ranks is None else _checks.index("grad_ranks", grad_ranks)
        if c < 1:
            raise ValueError(f"grad_ranks: must be >= 1, got {c}")
        values = [_DTYPE_CODES[q.dtype], _checks.ALGORITHMS.index(algorithm), _EXCHANGES.index(exchange),
                  scale_value(s), bias_value(b), q.shape[0],
                  sum(int(w) << i for i, w in enumerate(wants)) | int(groups[0] is not None) << 4, q.shape[1],
                  k.shape[0]]
    except Exception as e:  # raised below on every rank, after the agreement
        error = e
    got = agree(group, error, values)
    _check_same(got, names[0])
    counts = ([int(v[5]) for v in got], [int(v[8]) for v in got])  # every rank's (images, texts)
    if exchange == "engine":
        key = (DTYPE_NAMES[q.dtype], algorithm, threads, rank, size)
        return _EngineFunction.apply(q, k, s, b, objective, key, group, c, report, *groups)
    return _gathered(objective, q, k, s, b, algorithm, threads, fused_tiles, group, c, counts, report, groups)


class _EngineFunction(torch.autograd.Function):
    """The library's distributed engine: forward and backward are collectives of every rank. The backward runs the
    engine at loss scale grad_ranks x the incoming gradient (which every rank must share)."""

    @staticmethod
    def forward(ctx, q, k, logit_scale, logit_bias, objective, key, group, c, report, query_groups=None,
                key_groups=None):
        handle = _host.pool.take(key, group)
        scale = scale_value(logit_scale)
        ctx.sigmoid = objective == "sigmoid"
        try:
            if ctx.sigmoid:
                value, _tau = handle.forward_sigmoid(q, k, scale, bias_value(logit_bias), None, group,
                                                     query_groups=query_groups, key_groups=key_groups)
            else:
                value, _tau = handle.forward(q, k, scale, None, True, group, query_groups=query_groups,
                                             key_groups=key_groups)
        except Exception as e:
            _host.pool.give(key, handle)
            if isinstance(e, (ValueError, OverflowError)):  # the engine's agreed refusal: named as the caller names it
                raise _steps.renamed(e, _steps.TOWER_NAMES) from None
            raise
        ctx.key, ctx.handle, ctx.group, ctx.scale, ctx.c, ctx.report = key, handle, group, scale, c, report
        ctx.params = (logit_scale, logit_bias)
        ctx.anchors = (q, k)  # not_twice's: a second derivative towards the features or upstream reaches the refusal
        loss = torch.tensor(value, dtype=torch.float32)
        _report(report, loss, handle)
        if not any(ctx.needs_input_grad[:4]):
            _host.pool.give(key, handle)
            ctx.handle = ctx.group = None
        return loss

    @staticmethod
    def backward(ctx, grad):
        handle, g, c = ctx.handle, float(grad), ctx.c
        ctx.handle = None
        try:
            error = None if handle is not None else RuntimeError(
                "contrastive_torch: backward called twice, or after a forward without grad")
            got = agree(ctx.group, error, [g])
            r = _first_other(got, 0)
            if r is not None:
                raise ValueError(f"loss: rank {r}: the incoming gradient is {got[r][0]!r} where rank 0's is "
                                 f"{got[0][0]!r}; the global loss's backward takes one loss scale, the same on every "
                                 "rank (GradScaler's scale, or 1)")
            # The incoming gradient (times c) is the engine's loss scale when it can be: 16-bit gradients are rounded
            # after scaling. Otherwise (0, negative, non-finite) it is applied afterwards.
            direct = g > 0.0 and g * c < 3.0e38
            ls = g * c if direct else float(c)
            dbias = None
            if ctx.sigmoid:
                dq, dk, dlogs, dbias = handle.backward_sigmoid(ls, ctx.group)
            else:
                dq, dk, dlogs = handle.backward(ls, ctx.group)
            _report(ctx.report, None, handle)
        finally:
            ctx.group = None  # not kept with the graph
            if handle is not None:
                _host.pool.give(ctx.key, handle)
        if not direct:
            dq, dk, dlogs = dq * g, dk * g, dlogs * g
            dbias = dbias * g if dbias is not None else None
        scale_param, bias_param = ctx.params
        d_scale = d_bias = None
        # The engine's d(loss)/d(log s) and d(loss)/d b are of the global loss on every rank (scaled by c here).
        if ctx.needs_input_grad[2] and scale_param is not None:
            d_scale = (dlogs / (c * ctx.scale)).to(scale_param.dtype).reshape(scale_param.shape)
        if dbias is not None and ctx.needs_input_grad[3] and bias_param is not None:
            d_bias = (dbias / c).to(device=bias_param.device, dtype=bias_param.dtype).reshape(bias_param.shape)
        # Under create_graph=True: gradients whose second derivative raises (they hang off no graph).
        grads = _ops.not_twice("distributed engine (exchange='engine')", (dq, dk, d_scale, d_bias),
                               ctx.params + ctx.anchors)
        return grads + (None,) * 7


def _report(report, loss, handle):
    if report is None:
        return
    site, max_logit = handle.diagnosis()
    if loss is not None:
        report["loss"] = loss.detach()
    report.update({"max_logit": torch.tensor(max_logit, dtype=torch.float32), "first_nonfinite": site,
                   "first_nonfinite_code": torch.tensor(_host.NONFINITE_SITES.index(site), dtype=torch.int32)})


# --- the 'gather' exchange ---------------------------------------------------------------------------------------


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward: `weight` (this rank's) times the incoming gradient, summed over the group's ranks.
    Turns every rank's gradient of its share of the loss into the gradient of the global loss."""

    @staticmethod
    def forward(ctx, x, group, weight):
        ctx.group, ctx.weight = group, weight
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        total = (grad * ctx.weight).contiguous()
        dist.all_reduce(total, group=ctx.group)
        return total, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward: the incoming gradient times `weight`, computed in float (float16 gradients keep
    their range: the one-process step ran at the caller's loss scale)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.weight == 1.0:
            return grad, None
        return (grad.float() * ctx.weight).to(grad.dtype), None


def _all_gather_with_grad(x, group):
    """The ranks' (equal-sized) tensors concatenated along rows; its backward sums every rank's gradient of each
    rank's rows. torch's functional collective where it has one (all_gather_single_autograd; before PyTorch 2.15
    all_gather_tensor_autograd, which open_clip's development branch uses), else torch.distributed.nn.all_gather
    (open_clip 3.3's gather_with_grad)."""
    from torch.distributed import _functional_collectives as fcol

    gather = getattr(fcol, "all_gather_single_autograd", None) or getattr(fcol, "all_gather_tensor_autograd", None)
    if gather is not None:
        out = gather(x.contiguous(), gather_dim=0, group=group)
        return fcol.wait_tensor(out) if hasattr(fcol, "wait_tensor") else out
    import torch.distributed.nn as dist_nn

    return torch.cat(dist_nn.all_gather(x, group=group), dim=0)


def gather_features(x, group, with_grad, keep_own):
    """Every rank's (equal-sized) rows in rank order, as open_clip's gather_features gives them: with gradients
    (with_grad), else gathered without them, this rank's own rows put back differentiable where `keep_own`."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    if with_grad:
        return _all_gather_with_grad(x, group)
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    if keep_own:
        parts[group.rank()] = x
    return torch.cat(parts, dim=0)


def _rank_order(rank, size):
    """The ranks in the order the gathered rows take: this rank first, then the ranks after it, then those before."""
    return list(range(rank, size)) + list(range(rank))


def _gather_rows(x, group, counts, rank):
    """Every rank's rows, this rank's first (_rank_order): the positives of this rank's rows are the diagonal.
    Unequal row counts are padded for the exchange and cut after it."""
    most = max(counts)
    padded = x if x.shape[0] == most else torch.nn.functional.pad(x, (0, 0, 0, most - x.shape[0]))
    full = _all_gather_with_grad(padded, group)
    return torch.cat([full[r * most:r * most + counts[r]] for r in _rank_order(rank, len(counts))], dim=0)


def _gather_ids(groups, group, counts, rank):
    """Every rank's (image ids, text ids), each in _gather_rows' order: one all-gather of bytes (no gradient)."""
    import torch.distributed as dist

    most = [max(c) for c in counts]
    mine = torch.zeros(most[0] + most[1], dtype=torch.int64, device=groups[0].device)
    mine[:counts[0][rank]] = groups[0]
    mine[most[0]:most[0] + counts[1][rank]] = groups[1]
    every = [torch.empty_like(mine) for _ in counts[0]]
    dist.all_gather(every, mine, group=group)
    order = _rank_order(rank, len(counts[0]))
    return (torch.cat([every[r][:counts[0][r]] for r in order]),
            torch.cat([every[r][most[0]:most[0] + counts[1][r]] for r in order]))


def _direction_weights(objective, ids, counts, rank):
    """(w_images, w_texts): the share of the global loss each of this rank's one-process terms carries.
    Without ids: n_r / 2N for each of CLIP's directions, n_r / N for SigLIP (the mean over the N images). With ids
    (`ids`: the gathered (image, text) ids, this rank's first), CLIP's mean runs over the rows that have a positive
    (R images, C texts of the global batch) and this rank's terms are means over its own such rows (R_r, C_r):
    R_r / 2R and C_r / 2C, 0 where the batch has no such row (loss 0, zero gradients). SigLIP's mean stays over the
    images. On CUDA the four counts are read with one synchronisation."""
    if objective != "symmetric":
        return counts[0][rank] / sum(counts[0]), 0.0
    if ids[0] is None:
        w = counts[0][rank] / sum(counts[0]) / 2.0
        return w, w
    has = (torch.isin(ids[0], ids[1]), torch.isin(ids[1], ids[0]))  # rows with at least one positive
    r_all, r_mine, c_all, c_mine = torch.stack([has[0].sum(), has[0][:counts[0][rank]].sum(), has[1].sum(),
                                                has[1][:counts[1][rank]].sum()]).tolist()
    return (r_mine / r_all / 2.0 if r_all else 0.0), (c_mine / c_all / 2.0 if c_all else 0.0)


def _gathered(objective, q, k, s, b, algorithm, threads, fused_tiles, group, c, counts, report, groups):
    import torch.distributed as dist

    rank = group.rank()
    # This rank's rows carry the share P_r = w_1 l_1 + w_2 l_2 of the global loss G = sum_r P_r (l_1, l_2 the
    # one-process terms of its images and its texts; _direction_weights). The one-process steps see the caller's
    # incoming gradient g itself (a GradScaler's scale: float16 reruns only where it would in one process); the
    # weights go on in the backward, per direction: c w on the features (the gathered ones too, so the gather's
    # backward sums c dG/d(rows) over ranks), w on the scalars before their gradient is summed over ranks (dG/ds on
    # every rank).
    ids = _gather_ids(groups, group, counts, rank) if groups[0] is not None else (None, None)
    w = _direction_weights(objective, ids, counts, rank)
    grad_on = torch.is_grad_enabled()

    def scalar(x, weight):
        return _SumGradOverRanks.apply(x, group, weight) if grad_on and x.requires_grad else x

    def features(x, weight):
        return _ScaleGrad.apply(x, c * weight) if grad_on and x.requires_grad else x

    reports = [{}, {}]
    # With ids the two directions' weights differ, each its own scalar (the ranks agreed on whether ids are given, so
    # every rank runs the same collectives in the backward).
    s_image = scalar(s, w[0])
    s_text = s_image if groups[0] is None else scalar(s, w[1])
    keys = features(_gather_rows(k, group, counts[1], rank), w[0])
    if objective == "symmetric":
        images = features(_gather_rows(q, group, counts[0], rank), w[1])
        step = _steps.softmax
        towers = _steps.TOWER_NAMES
        parts = (step(features(q, w[0]), keys, s_image, None, False, algorithm, threads, fused_tiles, reports[0],
                      (groups[0], ids[1]), towers),
                 step(features(k, w[1]), images, s_text, None, False, algorithm, threads, fused_tiles, reports[1],
                      (groups[1], ids[0]), (towers[1], towers[0], towers[3], towers[2])))
    else:
        parts = (_steps.sigmoid(features(q, w[0]), keys, s_image, scalar(b, w[0]), algorithm, threads, reports[0],
                                (groups[0], ids[1])),)
    local = sum(parts[1:], parts[0])
    if groups[0] is None:  # one weight
        mine = local.detach() * w[0]
    else:
        mine = sum((p.detach() * wp for p, wp in zip(parts[1:], w[1:])), parts[0].detach() * w[0])
    shared = torch.stack([mine, torch.zeros_like(mine)])
    if reports[0]:
        shared[1] = torch.stack([r["max_logit"].float().to(shared.device) for r in reports if r]).max()
    dist.all_reduce(shared[:1], group=group)
    if reports[0]:
        dist.all_reduce(shared[1:], op=dist.ReduceOp.MAX, group=group)
    total = shared[0].clone()
    loss = total + (local - local.detach())
    if report is not None and reports[0]:
        sites = [r["first_nonfinite_code"] for r in reports if r]
        report.update({"loss": total, "max_logit": shared[1].clone(),
                       "first_nonfinite_code": sites[0] if len(sites) == 1 else torch.where(sites[0] != 0, sites[0],
                                                                                            sites[1])})
        if q.device.type == "cpu":
            report["first_nonfinite"] = _host.NONFINITE_SITES[int(report["first_nonfinite_code"])]
    return loss
