# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""open_clip's loss modules (ClipLoss, SigLipLoss, CoCaLoss, DistillClipLoss) with open_clip's constructors and
calls, and InfoNCELoss: thin modules over contrastive_torch.functional (DistillClipLoss's distillation term:
_distill.py). Each keeps the diagnosis of its last call in `last_step`."""

import torch

from . import _checks, _distill, _distributed, _ops, _steps, functional
from ._host import NONFINITE_SITES


class StepReport(dict):
    """A loss call's diagnosis: 'loss', 'max_logit', 'first_nonfinite_code' (tensors on the features' device, read
    without synchronising), 'first_nonfinite', the site's name (NONFINITE_SITES), read from the code when asked
    (one synchronisation on CUDA), and on CPU tensors 'algorithm', the one the call ran."""

    def __missing__(self, key):
        if key == "first_nonfinite" and "first_nonfinite_code" in self:
            return NONFINITE_SITES[int(self["first_nonfinite_code"])]
        raise KeyError(key)


def _open_clip_dtype(loss, features):
    """open_clip's loss dtype: float32 under autocast (cross-entropy runs in float32 there), else the features' dtype
    (pure bfloat16 / float16 training)."""
    if features.dtype == torch.float32 or torch.is_autocast_enabled(features.device.type):
        return loss
    return loss.to(features.dtype)


def _open_clip_sigmoid_dtype(loss, features):
    """open_clip's SigLipLoss dtype: its labels take the features' dtype and its logits the autocast dtype inside
    autocast (log-sigmoid runs at the logits' dtype there), so its loss is their promotion: the features' dtype outside
    autocast and for 16-bit features of the region's dtype inside, float32 for float32 features."""
    region = _ops.autocast_dtype(features.device.type)
    dtype = features.dtype if region is None else torch.promote_types(features.dtype, region)
    return loss if loss.dtype == dtype else loss.to(dtype)


class _Loss(torch.nn.Module):
    def __init__(self, algorithm, threads, fused_tiles):
        super().__init__()
        self.algorithm = _checks.algorithm(algorithm, allow_none=True)
        self.threads = _checks.threads(threads)
        self.fused_tiles = _checks.boolean("fused_tiles", fused_tiles)
        self.last_step = StepReport()

    def _report(self):
        """A fresh report for this call (None while torch.compile traces: the module is not mutated there). It becomes
        `last_step` when the call returns (_kept): a refused call leaves the last step's report in place."""
        if _steps.compiling():
            return None
        return StepReport()

    def _kept(self, report, loss):
        """`loss`, with `report` (this call's, filled) now `last_step`."""
        if report is not None:
            self.last_step = report
        return loss

    def _distribution(self, rank, world_size, group, exchange):
        self.rank, self.world_size = _checks.rank_and_world(rank, world_size)
        self.group = _checks.group(group)
        if exchange is not None and exchange not in ("engine", "gather"):
            raise ValueError(f"exchange: '{exchange}' is not one of 'engine', 'gather'")
        self.exchange = exchange
        self.distributed = self.world_size > 1 or group is not None
        if self.distributed:
            _build_for(group)


def _build_for(group):
    """Builds (or loads) the extension a distributed loss will run, here, before its first collective: ranks that
    compile it on first use wait for one build together at construction instead of inside a step, where the others
    would wait in a collective. The group's backend decides: NCCL (CUDA tensors) the CUDA extension, else the host's."""
    import torch.distributed as dist

    from ._extension import cuda_extension, extension

    backend = ""
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        cuda_extension()
    if "nccl" not in backend or "gloo" in backend:
        extension()


class ClipLoss(_Loss):
    """open_clip's ClipLoss: same constructor (released 3.3 and its development branch, where use_horovod is gone),
    same call.

        loss_fn = ClipLoss(local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                           use_horovod=False, *, algorithm=None, threads=0, fused_tiles=False, group=None,
                           exchange=None)
        loss = loss_fn(image_features, text_features, logit_scale)      # logit_scale = model.logit_scale.exp()

    functional.clip_loss with open_clip's arguments: `local_loss` and `gather_with_grad` choose open_clip's
    multi-process scheme (with world_size=1 both change nothing); `cache_labels` has nothing to cache (the diagonal is
    implied); use_horovod=True raises NotImplementedError. With world_size > 1 (or `group`) every rank gets the
    global loss (also for local_loss=True, whose open_clip value is the rank's share: their mean over ranks is this);
    each rank's features get world_size x d(global loss)/d(its rows) with gather_with_grad=True or local_loss=True
    (DDP's averaging then gives the exact gradient), 1 x with neither; logit_scale gets d(global loss)/d(logit_scale)
    on every rank. The loss is float32, or the features' dtype for 16-bit features outside autocast (open_clip's)."""

    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                 use_horovod=False, *, algorithm=None, threads=0, fused_tiles=False, group=None, exchange=None):
        super().__init__(algorithm, threads, fused_tiles)
        self.local_loss = _checks.flag("local_loss", local_loss)
        self.gather_with_grad = _checks.flag("gather_with_grad", gather_with_grad)
        self.cache_labels = _checks.flag("cache_labels", cache_labels)
        self.use_horovod = _checks.flag("use_horovod", use_horovod)
        if self.use_horovod:
            raise NotImplementedError("use_horovod: Horovod is not supported by contrastive_torch (use_horovod=True)")
        self._distribution(rank, world_size, group, exchange)

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False, *,
                image_groups=None, text_groups=None):
        """open_clip's forward. open_clip adds `logit_bias` to every logit; one value (open_clip's CLIP models pass
        None) shifts every row and column alike, which no softmax sees: it changes neither the loss nor the other
        gradients, and its own gradient is 0, which it gets here; a NaN or infinite bias makes the loss NaN, as it
        does open_clip's. A per-logit bias is refused. `image_groups`,
        `text_groups`: group ids, several positives per row (functional.clip_loss)."""
        report = self._report()
        if self.distributed:  # the bias is checked there, inside the ranks' agreement
            grad_ranks = None if (self.gather_with_grad or self.local_loss) else 1
            loss = _distributed.global_loss("symmetric", image_features, text_features, logit_scale, logit_bias,
                                            self.algorithm, self.threads, self.fused_tiles, self.group,
                                            grad_ranks, self.exchange, report, expected=(self.rank, self.world_size),
                                            groups=(image_groups, text_groups))
        else:
            if logit_bias is not None:
                _checks.features("image_features", image_features)
                bias = _checks.scalar("logit_bias", logit_bias, image_features.device, "None, a number or a "
                                      "one-element tensor")
            loss = functional.clip_loss(image_features, text_features, logit_scale, algorithm=self.algorithm,
                                        threads=self.threads, fused_tiles=self.fused_tiles, report=report,
                                        image_groups=image_groups, text_groups=text_groups)
        if logit_bias is not None:  # its gradient, 0; a NaN or infinite bias gives a NaN loss, as open_clip's does
            if self.distributed:  # checked inside the ranks' agreement; here only made a tensor
                bias = _checks.scalar("logit_bias", logit_bias, loss.device, "None, a number or a one-element tensor")
            loss = loss + (bias.reshape(()) * 0).to(device=loss.device, dtype=loss.dtype)
        loss = self._kept(report, _open_clip_dtype(loss, image_features))
        return {"contrastive_loss": loss} if output_dict else loss

    def get_ground_truth(self, device, num_logits):
        """open_clip's: each of `num_logits` rows' positive column, int64 on `device`: the diagonal, offset by rank x
        num_logits with local_loss over ranks (world_size > 1 or `group`: the rank's rows against every rank's
        columns)."""
        labels = torch.arange(num_logits, device=device, dtype=torch.long)
        if self.distributed and self.local_loss:
            rank = self.rank if self.group is None else self.group.rank()
            labels = labels + num_logits * rank
        return labels

    def get_logits(self, image_features, text_features, logit_scale, logit_bias=None):
        """open_clip's: (logits_per_image, logits_per_text) = s I T^T and s T I^T (+ logit_bias), formed with PyTorch
        operations, N x N, for inspection or a loss of one's own; the loss itself never forms them. Over ranks
        (world_size > 1 or `group`) as open_clip's: the towers gathered in rank order (with gradients under
        gather_with_grad, else without, this rank's rows kept differentiable unless local_loss); with local_loss this
        rank's rows against every rank's, else every row against every column. The logits keep their dtype when a
        bias is added (open_clip adds it in place). One difference: over ranks without local_loss open_clip's
        logits_per_text is a view of logits_per_image, so its in-place bias reaches both twice (S + 2b); here each
        gets it once."""
        if not self.distributed:
            per_image = logit_scale * image_features @ text_features.T
            per_text = logit_scale * text_features @ image_features.T
        else:
            all_images = _distributed.gather_features(image_features, self.group, self.gather_with_grad,
                                                      not self.local_loss)
            all_texts = _distributed.gather_features(text_features, self.group, self.gather_with_grad,
                                                     not self.local_loss)
            if self.local_loss:
                per_image = logit_scale * image_features @ all_texts.T
                per_text = logit_scale * text_features @ all_images.T
            else:
                per_image = logit_scale * all_images @ all_texts.T
                per_text = per_image.T
        if logit_bias is not None:
            per_image, per_text = _biased(per_image, logit_bias), _biased(per_text, logit_bias)
        return per_image, per_text


class CoCaLoss(ClipLoss):
    """open_clip's CoCaLoss: same constructor, same call; the contrastive term is this package's ClipLoss, the
    captioning term PyTorch's cross-entropy over the text decoder's logits, as open_clip computes it.

        loss_fn = CoCaLoss(caption_loss_weight, clip_loss_weight, pad_id=0, local_loss=False, gather_with_grad=False,
                           cache_labels=False, rank=0, world_size=1, use_horovod=False, *, algorithm=None, threads=0,
                           fused_tiles=False, group=None, exchange=None)
        clip, caption = loss_fn(image_features, text_features, logits, labels, logit_scale)

    Returns (clip_loss_weight x ClipLoss, caption_loss_weight x CE(logits, labels)), or {"contrastive_loss": ...,
    "caption_loss": ...} when output_dict. `logits` are the decoder's (batch, tokens, vocabulary) scores and `labels`
    the (batch, tokens) next tokens; tokens equal to `pad_id` are left out of the mean. A falsy clip_loss_weight skips
    the contrastive term (then a 0 tensor on the logits' device, as open_clip's), on every rank alike: give every rank
    the same weights. The captioning term is open_clip's own computation (its memory is the logits'); the library
    serves the contrastive one."""

    def __init__(self, caption_loss_weight, clip_loss_weight, pad_id=0, local_loss=False, gather_with_grad=False,
                 cache_labels=False, rank=0, world_size=1, use_horovod=False, *, algorithm=None, threads=0,
                 fused_tiles=False, group=None, exchange=None):
        super().__init__(local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod,
                         algorithm=algorithm, threads=threads, fused_tiles=fused_tiles, group=group,
                         exchange=exchange)
        self.caption_loss_weight = _checks.weight("caption_loss_weight", caption_loss_weight)
        self.clip_loss_weight = _checks.weight("clip_loss_weight", clip_loss_weight)
        self.pad_id = _checks.index("pad_id", pad_id)
        self.caption_loss = torch.nn.CrossEntropyLoss(ignore_index=self.pad_id)

    def forward(self, image_features, text_features, logits, labels, logit_scale, output_dict=False, *,
                image_groups=None, text_groups=None):
        """open_clip's CoCaLoss forward; `image_groups`, `text_groups` as ClipLoss's (group ids for the contrastive
        term). The captioning term runs first, so a refusal of `logits` or `labels` (their shapes, the labels' dtype,
        on CPU tensors a token outside the vocabulary) comes before the contrastive term changes anything; over a
        process group a refusal on one rank is raised on every rank. On CUDA tensors a token outside the vocabulary
        is PyTorch's device-side assertion, as in open_clip."""
        error = None
        try:
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                raise ValueError(f"logits: expected the decoder's (batch, tokens, vocabulary) scores, got "
                                 f"{_describe(logits)}")
            if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(logits.shape[:2]):
                raise ValueError(f"labels: expected one token per (batch, token) of logits "
                                 f"{tuple(logits.shape[:2])}, got {_describe(labels)}")
            if labels.dtype != torch.int64:
                raise TypeError(f"labels: dtype {labels.dtype}; the next tokens are int64 (torch.long)")
            try:
                caption = self.caption_loss(logits.permute(0, 2, 1), labels) * self.caption_loss_weight
            except IndexError as e:  # a token outside the vocabulary (CPU tensors)
                raise ValueError(f"labels: {e} (logits have {logits.shape[2]} tokens in their vocabulary)") from None
        except Exception as e:
            if not self._agreeing():
                raise
            error = e
        if self._agreeing():
            import torch.distributed as dist

            _distributed.agree(self.group if self.group is not None else dist.group.WORLD, error, [])
        if self.clip_loss_weight:
            clip = self.clip_loss_weight * super().forward(image_features, text_features, logit_scale,
                                                           image_groups=image_groups, text_groups=text_groups)
        else:
            clip = torch.tensor(0, device=logits.device)
        if output_dict:
            return {"contrastive_loss": clip, "caption_loss": caption}
        return clip, caption

    def _agreeing(self):
        """Over an initialised process group: the ranks agree on the captioning term's refusals."""
        import torch.distributed as dist

        return self.distributed and dist.is_available() and dist.is_initialized()


class DistillClipLoss(ClipLoss):
    """open_clip's DistillClipLoss: same constructor (ClipLoss's), same call, the distillation term in row chunks.

        loss_fn = DistillClipLoss(local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                                  use_horovod=False, *, algorithm=None, threads=0, fused_tiles=False, group=None,
                                  exchange=None)
        contrastive, distill = loss_fn(image_features, text_features, logit_scale,
                                       dist_image_features, dist_text_features, dist_logit_scale)

    Returns (ClipLoss, the distillation term), or {"contrastive_loss": ..., "distill_loss": ...} when output_dict.
    The distillation term is open_clip's: the mean of each image's and each text's cross-entropy between the
    teacher's distribution (softmax of dist_logit_scale x its logits) and the student's log-softmax, the two
    directions averaged. open_clip forms both models' N x N logits for it; here they exist one chunk of rows at a time
    (memory O(chunk x N)); the forward forms the gradients too (with one chunk open_clip's products, else 1.5x
    them for this term), and the sums run in float32 and float64 from logits in float32 (open_clip's are in the
    features' dtype). The teacher may have another embedding size; it gets gradients too where its features (or
    scale) ask for them. With world_size > 1 (or `group`) both terms are the global batch's on every rank, with ClipLoss's gradient convention (world_size x
    d(global loss)/d(this rank's rows) with gather_with_grad=True or local_loss=True, else 1 x)."""

    def forward(self, image_features, text_features, logit_scale, dist_image_features, dist_text_features,
                dist_logit_scale, output_dict=False):
        """open_clip's DistillClipLoss forward. Every argument is checked before either term runs (over a process
        group: inside an agreement of every rank)."""
        grad_ranks = None if (self.gather_with_grad or self.local_loss) else 1
        if self.distributed:
            distill = _distill.global_loss(image_features, text_features, logit_scale, dist_image_features,
                                           dist_text_features, dist_logit_scale, self.group, grad_ranks)
        else:
            args = _distill.check(image_features, text_features, logit_scale, dist_image_features,
                                  dist_text_features, dist_logit_scale)
        contrastive = super().forward(image_features, text_features, logit_scale)
        if not self.distributed:
            distill = _distill.loss(*args)
        distill = _distill.open_clip_dtype(distill, image_features, dist_image_features)
        if output_dict:
            return {"contrastive_loss": contrastive, "distill_loss": distill}
        return contrastive, distill


def _biased(logits, bias):
    """logits + bias in the logits' dtype, as open_clip's in-place addition gives it (a float32 bias of shape [1] would
    otherwise promote 16-bit logits)."""
    return (logits + bias).to(logits.dtype)


def _describe(x):
    """A value as an error message names it: a tensor's shape and dtype, else its type."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({x.dtype})"
    return f"{type(x).__name__}"


class SigLipLoss(_Loss):
    """open_clip's SigLipLoss: same constructor (released 3.3; the development branch's chunk_size), same call.

        loss_fn = SigLipLoss(cache_labels=False, rank=0, world_size=1, dist_impl=None, chunk_size=0, *,
                             algorithm=None, threads=0, group=None, exchange=None)
        loss = loss_fn(image_features, text_features, logit_scale, logit_bias)  # logit_scale = t = exp(t')

    functional.siglip_loss with open_clip's arguments. `dist_impl` ('bidir', 'shift', 'reduce', 'gather') picks
    open_clip's exchange; all four give the same loss and gradients, and so does this one whichever is named.
    `chunk_size` bounds open_clip's logits memory; this loss never forms them, so it only has to be an int >= 0.
    `cache_labels` has nothing to cache. With world_size > 1 (or `group`) every rank gets the global loss, (1/N) sum
    over all N x N pairs (the mean over ranks of open_clip's per-rank values); each rank's features get world_size x
    d(global loss)/d(its rows) (open_clip's: its exchanges carry gradients back), logit_scale and logit_bias
    d(global loss)/d(them) on every rank. The loss has open_clip's dtype: the features' dtype, also for 16-bit features
    inside autocast (float32 for float32 features); its value is computed in float32 either way."""

    _DIST_IMPLS = ("bidir", "shift", "reduce", "gather")

    def __init__(self, cache_labels=False, rank=0, world_size=1, dist_impl=None, chunk_size=0, *, algorithm=None,
                 threads=0, group=None, exchange=None):
        super().__init__(algorithm, threads, False)
        self.cache_labels = _checks.flag("cache_labels", cache_labels)
        if dist_impl is not None and dist_impl not in self._DIST_IMPLS:
            raise ValueError(f"dist_impl: '{dist_impl}' is not one of "
                             f"{', '.join(repr(d) for d in self._DIST_IMPLS)}")
        self.dist_impl = dist_impl or "bidir"
        self.chunk_size = _checks.index("chunk_size", chunk_size)
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size: must be >= 0, got {self.chunk_size}")
        self._distribution(rank, world_size, group, exchange)

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False, *,
                image_groups=None, text_groups=None):
        """open_clip's SigLipLoss forward: the sigmoid loss of these features at scale s = logit_scale (a number or a
        one-element tensor) and bias logit_bias; a dict {"contrastive_loss": loss} when output_dict. `image_groups`,
        `text_groups`: group ids, every pair with equal ids positive (functional.siglip_loss)."""
        report = self._report()
        if self.distributed:
            loss = _distributed.global_loss("sigmoid", image_features, text_features, logit_scale, logit_bias,
                                            self.algorithm, self.threads, False, self.group, None, self.exchange,
                                            report, expected=(self.rank, self.world_size),
                                            groups=(image_groups, text_groups))
        else:
            loss = functional.siglip_loss(image_features, text_features, logit_scale, logit_bias,
                                          algorithm=self.algorithm, threads=self.threads, report=report,
                                          image_groups=image_groups, text_groups=text_groups)
        loss = self._kept(report, _open_clip_sigmoid_dtype(loss, image_features))
        return {"contrastive_loss": loss} if output_dict else loss

    @staticmethod
    def get_ground_truth(device, dtype, num_logits, negative_only=False):
        """open_clip's: the num_logits x num_logits labels of `dtype` on `device`, +1 on the diagonal and -1 elsewhere
        (-1 everywhere with negative_only: the pairs of two ranks' rows)."""
        labels = torch.full((num_logits, num_logits), -1.0, device=device, dtype=dtype)
        if not negative_only:
            labels.fill_diagonal_(1.0)
        return labels

    @staticmethod
    def get_logits(image_features, text_features, logit_scale, logit_bias=None):
        """open_clip's: s I T^T (+ logit_bias), this rank's rows and columns, formed with PyTorch operations, for
        inspection or a loss of one's own; the loss itself never forms them."""
        logits = logit_scale * image_features @ text_features.T
        return logits if logit_bias is None else _biased(logits, logit_bias)


class InfoNCELoss(_Loss):
    """One-directional InfoNCE (functional.info_nce_loss): mean_i CE(s q_i . K^T, labels[i]); keys may outnumber
    queries (a MoCo queue); labels=None means the diagonal (needs n_q <= n_k)."""

    def __init__(self, *, algorithm=None, threads=0, fused_tiles=False):
        super().__init__(algorithm, threads, fused_tiles)

    def forward(self, query, keys, logit_scale, labels=None, *, query_groups=None, key_groups=None):
        """The InfoNCE loss of `query` against `keys` at scale s = logit_scale; labels[i] is row i's positive key, or
        group ids give several positives per row (functional.info_nce_loss)."""
        report = self._report()
        loss = functional.info_nce_loss(query, keys, logit_scale, labels, algorithm=self.algorithm,
                                        threads=self.threads, fused_tiles=self.fused_tiles, report=report,
                                        query_groups=query_groups, key_groups=key_groups)
        return self._kept(report, loss)
