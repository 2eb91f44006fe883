# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The host extension's errors: the library's status codes map to Python exception types through one table
(csrc/binding.cpp `raise`), the message names the argument and ends with the code."""

import pytest
import torch

import contrastive_torch as ct
import contrastive_torch.functional as CF


def test_memory_that_cannot_be_had_is_a_memory_error():
    # The materialized algorithm holds the n x n logits: 2^20 x 2^20 floats are 4 TiB, which no machine here has.
    n, d = 1 << 20, 4
    q = torch.nn.functional.normalize(torch.randn(n, d), dim=1)
    loss = ct.ClipLoss(algorithm="materialized", threads=1)
    with pytest.raises(MemoryError, match=r"memory: the host engine needs \d+ bytes .*\[resource_exhausted\]"):
        loss(q, q.clone(), torch.tensor(10.0))


def test_bad_input_is_a_value_error_naming_the_argument():
    q = torch.nn.functional.normalize(torch.randn(8, 4), dim=1)
    k = q.clone()
    k[5, 2] = float("inf")
    with pytest.raises(ValueError, match=r"text_features: text_features\[5\]\[2\] is not finite.*\[non_finite_input\]"):
        ct.ClipLoss()(q, k, torch.tensor(10.0))


def test_every_algorithm_the_library_lists_is_accepted():
    ext = ct.extension()
    for name in ("fused", "materialized", "chunked"):
        ext.Loss("float32", name, 1)
    with pytest.raises(ValueError, match="'fused', 'materialized', 'chunked'"):
        ext.Loss("float32", "tiled", 1)


def test_the_library_refusals_name_the_callers_arguments():
    # The operators' messages call the features q and k; each function names them as its caller does.
    q = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
    bad = q.clone()
    bad[2, 3] = float("nan")
    cases = [(lambda: CF.clip_loss(bad, q, 10.0), r"image_features: image_features\[2\]\[3\] is not finite"),
             (lambda: CF.clip_loss(q, bad, 10.0), r"text_features: text_features\[2\]\[3\] is not finite"),
             (lambda: CF.siglip_loss(q, bad, 10.0, -1.0), r"text_features: text_features\[2\]\[3\]"),
             (lambda: CF.info_nce_loss(bad, q, 10.0), r"query: query\[2\]\[3\] is not finite"),
             (lambda: CF.info_nce_loss(q, bad, 10.0), r"keys: keys\[2\]\[3\] is not finite"),
             (lambda: ct.InfoNCELoss()(q, bad, 10.0), r"keys: keys\[2\]\[3\]"),
             (lambda: CF.clip_loss(q[:0], q[:0], 10.0), r"image_features: no queries"),
             (lambda: CF.clip_loss(q, q[:5], 10.0), r"text_features: the symmetric loss needs "
              r"image_features.shape\[0\] == text_features.shape\[0\] \(got image_features.shape\[0\] = 6, "
              r"text_features.shape\[0\] = 5\)"),
             (lambda: CF.info_nce_loss(q, q[:5], 10.0), r"labels: .* needs query.shape\[0\] <= keys.shape\[0\]")]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


def _double_backward_cases(dtype):
    torch.manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(6, 8), dim=1).to(dtype).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(6, 8), dim=1).to(dtype).requires_grad_()
    s = torch.tensor(10.0, requires_grad=True)
    b = torch.tensor(-2.0, requires_grad=True)
    ids = torch.tensor([0, 0, 1, 2, 3, 3])
    return (q, k, s, b), {
        "softmax_step": lambda x, y: CF.clip_loss(x, y, s),
        "sigmoid_step": lambda x, y: CF.siglip_loss(x, y, s, b),
        "grouped_softmax_step": lambda x, y: CF.info_nce_loss(x, y, s, query_groups=ids, key_groups=ids),
        "grouped_sigmoid_step": lambda x, y: CF.siglip_loss(x, y, s, b, image_groups=ids, text_groups=ids),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_second_derivative_raises_naming_the_operator(dtype):
    # The formulas multiply saved gradients: a gradient penalty or d2L/ds2 through them would be silently wrong (the
    # penalty dropped, the second derivative of s missing its terms), so create_graph=True gives gradients whose own
    # backward refuses. First derivatives under create_graph=True are the plain ones.
    inputs, calls = _double_backward_cases(dtype)
    q, k, s, b = inputs
    for name, call in calls.items():
        refused = pytest.raises(RuntimeError, match=f"{name}: the loss is differentiable once")
        wanted = inputs if "sigmoid" in name else inputs[:3]
        plain = torch.autograd.grad(call(q, k), wanted)
        graphed = torch.autograd.grad(call(q, k), wanted, create_graph=True)
        for x, y in zip(graphed, plain):
            assert x.requires_grad and torch.equal(x.detach(), y)
        with refused:
            torch.autograd.grad(graphed[2], s)  # d2L / ds2
        loss = call(q, k)
        (gq,) = torch.autograd.grad(loss, q, create_graph=True)
        with refused:
            (loss + gq.float().square().sum()).backward()  # a gradient penalty
        # Towards the features or upstream of them by torch.autograd.grad, which follows only the paths to what it is
        # asked for: the Hessian in the features, and a gradient penalty on a tower's weights (both came back zero or
        # without the loss's part, the refusal on no path).
        (gq,) = torch.autograd.grad(call(q, k), q, create_graph=True)
        with refused:
            torch.autograd.grad(gq.float().sum(), q)
        with refused:
            torch.autograd.functional.hessian(lambda x: call(x, k), q.detach().clone())
        tower = torch.nn.Linear(8, 8).to(dtype)
        features = torch.nn.functional.normalize(tower(torch.randn(6, 8).to(dtype)), dim=1)
        weights = list(tower.parameters())
        grads = torch.autograd.grad(call(features, k), weights, create_graph=True)
        with refused:
            torch.autograd.grad(sum(g.float().square().sum() for g in grads), weights)


def test_refusals_of_the_adversarial_sweep_name_the_argument():
    q = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    # threads beyond the pool's limit, however large (no silent truncation to 32 bits).
    for n in (5000, 2**32 + 1, 2**40):
        with pytest.raises(ValueError, match=rf"threads: {n} threads requested; at most 4096"):
            CF.clip_loss(q, q.clone(), 10.0, threads=n)
    # An empty embedding names the features.
    with pytest.raises(ValueError, match="image_features: embedding dimension is 0"):
        CF.clip_loss(torch.randn(3, 0), torch.randn(3, 0), 10.0)
    with pytest.raises(ValueError, match="query: embedding dimension is 0"):
        CF.info_nce_loss(torch.randn(3, 0), torch.randn(3, 0), 10.0)
    # SigLIP takes no labels: fewer texts than images names the texts.
    with pytest.raises(ValueError, match="text_features: 3 texts for 5 images; without group ids"):
        CF.siglip_loss(torch.randn(5, 8), torch.randn(3, 8), 10.0)
    # Finite values float32 cannot hold are named as passed, not as the inf or 0 they would become.
    for name, call in (("logit_scale", lambda v: CF.clip_loss(q, q.clone(), v)),
                       ("logit_bias", lambda v: CF.siglip_loss(q, q.clone(), 10.0, v))):
        for v in (1e300, -1e39, torch.tensor(1e300, dtype=torch.float64)):
            with pytest.raises(ValueError, match=rf"{name}: .* lies outside float32's range"):
                call(v)
    with pytest.raises(ValueError, match=r"logit_scale: 1e-300 lies outside float32's range"):
        CF.clip_loss(q, q.clone(), 1e-300)
    # Sparse (or other non-dense) tensors are refused naming the argument, not by a RuntimeError from inside.
    ids = torch.arange(4)
    for call, name in ((lambda: CF.clip_loss(q.to_sparse(), q, 10.0), "image_features"),
                       (lambda: CF.info_nce_loss(q, q, 10.0, labels=ids.to_sparse()), "labels"),
                       (lambda: CF.clip_loss(q, q, 10.0, image_groups=ids.to_sparse(), text_groups=ids),
                        "image_groups"),
                       (lambda: CF.siglip_loss(q, q, 10.0, -1.0, image_groups=ids, text_groups=ids.to_sparse()),
                        "text_groups")):
        with pytest.raises(TypeError, match=rf"{name}: layout torch.sparse_coo; a dense tensor is expected"):
            call()
    # A bias that rounds to 0 is a bias of 0.
    assert torch.equal(CF.siglip_loss(q, q.clone(), 10.0, 1e-60), CF.siglip_loss(q, q.clone(), 10.0, 0.0))


def test_forward_mode_ad_is_refused_naming_the_argument():
    # Reverse mode only: a dual tensor's tangent would be dropped without a word (a jvp of None, or of the other
    # terms only), so it is refused naming the argument; plain tensors inside a dual level run as ever.
    import torch.autograd.forward_ad as fwAD

    q = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
    k = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
    want = CF.clip_loss(q, k, 3.0)
    with fwAD.dual_level():
        s = fwAD.make_dual(torch.tensor(3.0), torch.tensor(1.0))
        dual_q = fwAD.make_dual(q, torch.ones_like(q))
        for call, name in ((lambda: CF.clip_loss(q, k, s), "logit_scale"),
                           (lambda: CF.clip_loss(dual_q, k, 3.0), "image_features"),
                           (lambda: CF.info_nce_loss(q, fwAD.make_dual(k, torch.ones_like(k)), 3.0), "keys"),
                           (lambda: ct.SigLipLoss()(q, k, 3.0, fwAD.make_dual(torch.tensor(-1.0), torch.tensor(1.0))),
                            "logit_bias")):
            with pytest.raises(NotImplementedError, match=f"{name}: has a forward-mode tangent"):
                call()
        assert torch.equal(CF.clip_loss(q, k, 3.0), want)
    # functorch's forward mode (jacfwd gave zeros) is refused too; vmap of the forward still runs.
    for transform in (lambda f: torch.func.jacfwd(f)(q),
                      lambda f: torch.func.jvp(f, (q,), (torch.ones_like(q),))):
        with pytest.raises(NotImplementedError, match=r"inside torch.func.jvp / jacfwd \(forward mode\)"):
            transform(lambda a: CF.clip_loss(a, k, 3.0))
    # A scale with no value (the meta device) is refused naming it (PyTorch's "Cannot copy out of meta tensor").
    with pytest.raises(ValueError, match="logit_scale: on the meta device, which holds no value"):
        CF.clip_loss(q, k, torch.tensor(3.0, device="meta"))
    # torch.func's reverse mode: PyTorch refuses these autograd.Functions there (setup_context); ours says what to use.
    for transform in (lambda f: torch.func.grad(f)(q), lambda f: torch.func.jacrev(f)(q),
                      lambda f: torch.func.vjp(f, q)):
        with pytest.raises(NotImplementedError, match=r"inside torch.func.grad / vjp / jacrev; .*torch.autograd"):
            transform(lambda a: CF.clip_loss(a, k, 3.0))
    with pytest.raises(NotImplementedError, match=r"inside torch.func.grad / vjp / jacrev"):
        torch.func.grad(lambda s: CF.clip_loss(q, k, s))(torch.tensor(3.0))  # the scale tracked
    # A loss of tensors the transform does not track is a constant of the transformed function, as PyTorch runs it.
    x = torch.tensor([1.0, 2.0])
    grad_x = torch.func.grad(lambda a: (a * a).sum() + CF.clip_loss(q, k, 3.0))(x)
    assert torch.equal(grad_x, 2 * x)
    value, aux = torch.func.grad(lambda a: ((a * a).sum(), CF.clip_loss(q, k, 3.0)), has_aux=True)(x)
    assert torch.equal(value, 2 * x) and torch.equal(aux, want)
    batched = torch.func.vmap(lambda a: CF.clip_loss(a, k, 3.0))(torch.stack([q, q]))
    assert torch.equal(batched, torch.stack([want, want]))


def test_a_report_that_is_not_a_dict_is_refused_before_the_step():
    q = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
    for call in (lambda r: CF.clip_loss(q, q.clone(), 3.0, report=r),
                 lambda r: CF.info_nce_loss(q, q.clone(), 3.0, report=r),
                 lambda r: CF.siglip_loss(q, q.clone(), 3.0, -1.0, report=r)):
        with pytest.raises(TypeError, match="report: expected a dict to fill"):
            call([])
        filled = {}
        call(filled)
        assert "loss" in filled
