# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""CachedStep: a two-tower training step whose contrastive batch does not depend on the encoders' activation memory
(gradient caching, Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup").

    step = CachedStep(model, ClipLoss(), chunk_size=256)               # an open_clip model (or DDP-wrapped one)
    loss = step(images, texts, model.logit_scale.exp())               # forward and backward of the whole batch
    optimizer.step()

One call runs a training step's forward and backward for a batch of any size with the activations of one chunk:
1. pass 1, no graph: the encoders embed the batch chunk by chunk; each chunk's random state (CPU and the devices', as
   torch.utils.checkpoint saves it) is kept, so dropout and stochastic depth draw the same masks in pass 2;
2. the loss once on all embeddings (leaves): its value, their gradients, and through the user's graph the gradients
   of the loss's other arguments (`model.logit_scale.exp()`, `logit_bias`); O(N D) memory with this library's losses;
3. pass 2: per chunk, the chunk's random state restored, the encoders run again with a graph and the chunk's cached
   embedding gradients are back-propagated into the parameters. Under DDP every chunk but the last runs inside
   `no_sync()`, so the parameters are all-reduced once per step.
The gradients equal the one-pass step's (same masks; BatchNorm's statistics are per chunk: the known difference).
The towers may differ in length (five captions per image, with group ids for the loss): both are cut into the same
number of chunks, the longer one into chunks of `chunk_size` rows.
"""

import contextlib
import inspect
import itertools

import torch

from . import _checks


def _is_ddp(module):
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def _open_clip_model(model):
    """The open_clip model inside `model` (itself, or a DDP wrapper's module), or None."""
    inner = model.module if _is_ddp(model) else model
    return inner if hasattr(inner, "encode_image") and hasattr(inner, "encode_text") else None


class _RandomState:
    """The CPU generator's state and, when the chunk is on CUDA, the current device's (torch.utils.checkpoint's way)."""

    def __init__(self, device):
        self.cpu = torch.get_rng_state()
        self.cuda = None
        self.device = None
        if device.type == "cuda" and torch.cuda.is_initialized():
            self.device = device.index if device.index is not None else torch.cuda.current_device()
            self.cuda = torch.cuda.get_rng_state(self.device)

    @contextlib.contextmanager
    def restored(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _chunks(n, count, size):
    """`count` (start, end) row ranges of a tower of n rows: chunks of `size` rows where that takes `count` of them
    (the longer tower), else n split as evenly as `count` ranges allow (some may be empty; the last is not). No range
    holds a single row of a tower that has more (BatchNorm refuses one row in training): a last chunk of one row
    takes one from the chunk before it, and a tower of fewer than 2 rows per range goes in ranges of 2 (the last
    one's 3 when n is odd), the first ones empty."""
    if -(-n // size) == count:
        sizes = [min(size, n - j * size) for j in range(count)]
        if count > 1 and sizes[-1] == 1 and sizes[-2] > 2:
            sizes[-2:] = [sizes[-2] - 1, 2]
    elif 2 <= n < 2 * count:
        pairs = n // 2
        sizes = [0] * (count - pairs) + [2] * pairs
        sizes[-1] += n % 2
    else:
        sizes = [(j + 1) * n // count - j * n // count for j in range(count)]
    ends = list(itertools.accumulate(sizes))
    return [(e - z, e) for e, z in zip(ends, sizes)]


# The loss keywords that carry group ids: with them the towers may differ in length.
_IDS = {"image_groups", "text_groups", "query_groups", "key_groups"}


def _device_of(*inputs):
    """The device whose random state a chunk saves: a CUDA tensor's among the inputs, else the CPU."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return x.device
    return torch.device("cpu")


def _features(name, out):
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{name}: expected to return one 2-D tensor (batch x dim), returned {what}")
    return out


class CachedStep:
    """A two-tower step with cached embedding gradients: `step(images, texts, *loss_args, scaler=None, **loss_kwargs)`.

    CachedStep(model, loss, chunk_size=256)
    CachedStep(image_encoder, text_encoder, loss, chunk_size=256, *, no_sync=None)

    `model`: an open_clip model, or one wrapped in DistributedDataParallel (its encoders then run through the wrapper's
    forward, `model(images, texts)` per chunk, with normalized features, and its `no_sync` is used). `image_encoder`,
    `text_encoder`: callables from a chunk of inputs to its features (the features the loss should see: for
    open_clip, `lambda x: model.encode_image(x, normalize=True)`). `loss`: a loss of this library (ClipLoss,
    SigLipLoss, InfoNCELoss, DistillClipLoss; one process or world_size > 1) or any callable
    `loss(image_features, text_features, *loss_args, **loss_kwargs)` returning a scalar, a dict or a tuple of scalars
    (summed). DistillClipLoss takes (logit_scale, dist_image_features, dist_text_features, dist_logit_scale) as
    `loss_args`: the teacher's features of the whole batch, computed without gradients. CoCaLoss is refused: its
    captioning term needs the text decoder's logits, which no chunk has for the whole batch. `chunk_size`: rows per chunk of the longer tower. `no_sync`: a
    context manager factory (a DDP module's `no_sync`) under which every chunk's backward but the last runs; None
    with plain encoders.

    The call: `images` and `texts` (tensors, or anything with a length whose slices the encoders take); their
    lengths may differ when group ids come with the loss's keywords (five captions per image): both towers are cut
    into the same number of chunks, the longer one into chunks of `chunk_size` rows, the shorter one evenly (a chunk
    without rows of one tower runs the other alone: `model(images, None)`). `loss_args`: what the loss takes after the
    two feature tensors (`model.logit_scale.exp()`, and `model.logit_bias` for SigLIP); `loss_kwargs`: its keywords
    (the whole batch's `image_groups` and `text_groups`, say). `scaler`: a GradScaler; the cached gradients are those
    of the scaled loss, so float16 gradients keep their digits; unscaling and `scaler.step` stay the caller's.
    Encoders run under whatever autocast the caller has entered. Returns the loss, detached. Parameters' gradients
    accumulate into `.grad` as a backward does (zero them before, as usual)."""

    def __init__(self, *args, chunk_size=256, no_sync=None):
        if len(args) == 2 or (len(args) == 3 and not callable(args[2])):
            model, loss = args[0], args[1]
            if len(args) == 3:
                chunk_size = args[2]
            inner = _open_clip_model(model)
            if inner is None:
                raise TypeError(f"model: expected an open_clip model (with encode_image and encode_text) or one "
                                f"wrapped in DistributedDataParallel, got {type(model).__name__}; pass "
                                "image_encoder, text_encoder, loss instead")
            if _is_ddp(model):
                # No closure over self: a reference cycle would keep a DDP model (and its process group) alive
                # until a garbage collection, past destroy_process_group.
                ddp_joint = self._ddp_joint
                self._joint = lambda x, y: ddp_joint(model, x, y)
                no_sync = self._ddp_no_sync(model)
                self._ddp_extras = True
            else:
                self._joint = lambda x, y: (None if x is None else inner.encode_image(x, normalize=True),
                                            None if y is None else inner.encode_text(y, normalize=True))
                self._ddp_extras = False
            self.image_encoder = self.text_encoder = None
        elif len(args) in (3, 4):
            self.image_encoder, self.text_encoder, loss = args[:3]
            if len(args) == 4:
                chunk_size = args[3]
            for name, f in (("image_encoder", self.image_encoder), ("text_encoder", self.text_encoder)):
                if not callable(f):
                    raise TypeError(f"{name}: expected a callable (a module or function), got {type(f).__name__}")
            if _is_ddp(self.image_encoder) and no_sync is None:
                no_sync = self._ddp_no_sync(self.image_encoder)
            image_encoder, text_encoder = self.image_encoder, self.text_encoder
            self._joint = lambda x, y: (None if x is None else image_encoder(x),
                                        None if y is None else text_encoder(y))
            self._ddp_extras = False
        else:
            raise TypeError("CachedStep(model, loss, chunk_size=256) or CachedStep(image_encoder, text_encoder, loss, "
                            f"chunk_size=256): got {len(args)} positional arguments")
        if not callable(loss):
            raise TypeError(f"loss: expected a callable loss, got {type(loss).__name__}")
        from .losses import CoCaLoss

        if isinstance(loss, CoCaLoss):
            raise TypeError("loss: CoCaLoss's captioning term needs the text decoder's logits, which depend on both "
                            "towers of the whole batch and are not cached here; call the model and the loss directly")
        self.loss = loss
        if isinstance(chunk_size, bool) or _checks.index("chunk_size", chunk_size) <= 0:
            raise ValueError(f"chunk_size: must be an int > 0, got {chunk_size!r}")
        self.chunk_size = int(chunk_size)
        if no_sync is not None and not callable(no_sync):
            raise TypeError(f"no_sync: expected a context manager factory (a DDP module's no_sync), got "
                            f"{type(no_sync).__name__}")
        self.no_sync = no_sync

    @staticmethod
    def _ddp_no_sync(model):
        no_sync = getattr(model, "no_sync", None)
        if not callable(no_sync):
            raise TypeError(f"model: wrapped in {type(model).__name__}, whose no_sync is unavailable: every chunk's "
                            "backward would all-reduce the parameters")
        return no_sync

    @staticmethod
    def _ddp_joint(model, x, y):
        out = model(x, y)
        if isinstance(out, dict):
            return out["image_features"], out["text_features"], [v for k, v in out.items() if k.startswith("logit_")]
        return out[0], out[1], list(out[2:])

    def _embed(self, x, y):
        """The chunk's (image features, text features, extras); x or y None: that tower has no rows in this chunk."""
        out = self._joint(x, y)
        extras = out[2] if len(out) == 3 else []
        return (None if x is None else _features("image_encoder", out[0]),
                None if y is None else _features("text_encoder", out[1]), extras)

    @staticmethod
    def _rows(inputs, bounds):
        """The chunk's slice of a tower's inputs, or None where the chunk holds none of its rows."""
        a, b = bounds
        return inputs[a:b] if b > a else None

    def _check_ids(self, n_images, n_texts, loss_args, loss_kwargs):
        """The group ids a loss of this library is given, checked before pass 1 (as its call would check them, less
        the devices, which the features' are not known yet): a refused call then runs no encoder, whose forward in
        training mode changes state (BatchNorm's running statistics, the random generators)."""
        from .losses import ClipLoss, InfoNCELoss, SigLipLoss

        if isinstance(self.loss, InfoNCELoss):
            names = ("query_groups", "key_groups")
            labels = loss_args[1] if len(loss_args) > 1 else loss_kwargs.get("labels")
        elif isinstance(self.loss, (ClipLoss, SigLipLoss)):
            names, labels = ("image_groups", "text_groups"), None
        else:
            return
        try:  # the keywords' names and the arguments' count, as the call will bind them
            inspect.signature(self.loss.forward).bind(None, None, *loss_args, **loss_kwargs)
        except TypeError as e:
            raise TypeError(f"loss: {type(self.loss).__name__} takes (image_features, text_features, *loss_args, "
                            f"**loss_kwargs): {e}") from None
        _checks.groups(loss_kwargs.get(names[0]), loss_kwargs.get(names[1]), n_images, n_texts, None, labels, names)

    def __call__(self, images, texts, *loss_args, scaler=None, **loss_kwargs):
        n_images, n_texts = len(images), len(texts)
        for name, n in (("images", n_images), ("texts", n_texts)):
            if n == 0:
                raise ValueError(f"{name}: an empty batch")
        if n_images != n_texts and all(loss_kwargs.get(name) is None for name in _IDS):
            raise ValueError(f"texts: {n_texts} rows where images has {n_images}; without group ids (image_groups, "
                             "text_groups) a contrastive batch pairs them row by row")
        self._check_ids(n_images, n_texts, loss_args, loss_kwargs)
        # Both towers in the same number of chunks (equal lengths: chunk_size rows each, the last one shorter); the
        # last chunk holds rows of both, so a DDP model's synchronised backward reaches every parameter.
        count = -(-max(n_images, n_texts) // self.chunk_size)
        bounds = list(zip(_chunks(n_images, count, self.chunk_size), _chunks(n_texts, count, self.chunk_size)))
        # Pass 1: embeddings without a graph, and each chunk's random state.
        states, image_parts, text_parts = [], [], []
        with torch.no_grad():
            for ib, tb in bounds:
                x, y = self._rows(images, ib), self._rows(texts, tb)
                states.append(_RandomState(_device_of(x, y)))
                f, g, _ = self._embed(x, y)
                got = (0 if f is None else f.shape[0], 0 if g is None else g.shape[0])
                if got != (ib[1] - ib[0], tb[1] - tb[0]):
                    raise ValueError(f"image_encoder/text_encoder: returned {got[0]} and {got[1]} rows for a chunk of "
                                     f"{ib[1] - ib[0]} images and {tb[1] - tb[0]} texts")
                image_parts += [f] if f is not None else []
                text_parts += [g] if g is not None else []
        # The loss on all embeddings as leaves: their gradients, and the loss arguments' through the user's graph.
        image_features = torch.cat(image_parts).requires_grad_()
        text_features = torch.cat(text_parts).requires_grad_()
        del image_parts, text_parts
        loss = self.loss(image_features, text_features, *loss_args, **loss_kwargs)
        if isinstance(loss, dict):  # open_clip's output_dict
            loss = sum(loss.values())
        elif isinstance(loss, (tuple, list)):  # a loss of several terms (DistillClipLoss: contrastive, distill)
            loss = sum(loss)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        # A loss that does not depend on one side leaves it without a gradient: zeros, so pass 2 still runs that tower.
        d_image = image_features.grad if image_features.grad is not None else torch.zeros_like(image_features)
        d_text = text_features.grad if text_features.grad is not None else torch.zeros_like(text_features)
        del image_features, text_features
        # Pass 2: each chunk again with a graph, its cached gradients back-propagated.
        for i, ((ib, tb), state) in enumerate(zip(bounds, states)):
            last = i == len(bounds) - 1
            sync = contextlib.nullcontext() if (last or self.no_sync is None) else self.no_sync()
            with sync, state.restored():
                f, g, extras = self._embed(self._rows(images, ib), self._rows(texts, tb))
                outputs, grads = [], []
                for out, d, (a, b) in ((f, d_image, ib), (g, d_text, tb)):
                    if out is not None and out.requires_grad:  # a frozen tower (LiT's locked image tower) has none
                        outputs.append(out)
                        grads.append(d[a:b])
                if last and self._ddp_extras:
                    # The DDP model's forward also returns logit_scale.exp() (and logit_bias): a zero gradient through
                    # them lets DDP's reducer see those parameters used in this backward and all-reduce their
                    # gradients, which the loss's backward above accumulated.
                    for e in extras:
                        if isinstance(e, torch.Tensor) and e.requires_grad:
                            outputs.append(e)
                            grads.append(torch.zeros_like(e))
                if outputs:
                    torch.autograd.backward(outputs, grads)
        return loss.detach()
