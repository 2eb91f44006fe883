# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""open_clip's own training program (open_clip_train.main, from the open-clip-torch package) on the CPU, with its loss
and then with ours swapped in through open_clip's factory (python/README.md): a tiny model, synthetic data whose
samples differ, a few steps of AdamW. Every loss call of both runs is recorded; the two runs must log the same loss
at every step, which holds only if ours gives open_clip's loss and, through the optimizer, its gradients."""

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import contrastive_torch as ct
from conftest import require

# A model small enough for a few CPU steps in about a second (the model config open_clip reads by name).
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
# CoCa (its name says so: open_clip's create_loss builds CoCaLoss for a model whose name contains "coca").
TINY_COCA = {  # the decoder's width is the embedding's, as in open_clip's CoCa configs
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32,
                   "attentional_pool": True, "attn_pooler_heads": 2, "output_tokens": True},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2, "embed_cls": True,
                 "output_tokens": True},
    "multimodal_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1,
                       "attn_pooler_heads": 2},
    "custom_text": True,
}
MODELS = {"tiny-contrastive": TINY, "tiny-coca": TINY_COCA}

# Runs open_clip_train.main with the loss named by argv[1] ("open_clip" or "ours"), appending one JSON line per loss
# call to argv[2]; argv[3] is the folder of the model config, the rest open_clip_train's own arguments.
LAUNCHER = r'''
import json, sys
import numpy as np
import open_clip, open_clip.factory
from PIL import Image

impl, record, configs, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
open_clip.add_model_config(configs)

import open_clip_train.data as data

WORDS = "cat dog red blue car tree sky sea house bird green small".split()


def sample(self, index):
    # open_clip's synthetic dataset repeats one image and one caption: every row would be the same pair.
    rs = np.random.RandomState(index)
    image = Image.fromarray(rs.randint(0, 256, (*self.image_size, 3), dtype=np.uint8))
    return self.transform(image), self.preprocess_txt(" ".join(rs.choice(WORDS, 5)))


data.SyntheticDataset.__getitem__ = sample

if impl == "ours":
    import contrastive_torch
    open_clip.factory.ClipLoss = contrastive_torch.ClipLoss
    open_clip.factory.SigLipLoss = contrastive_torch.SigLipLoss
    open_clip.factory.CoCaLoss = contrastive_torch.CoCaLoss
    open_clip.factory.DistillClipLoss = contrastive_torch.DistillClipLoss


def recorded(cls):
    class Recorded(cls):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            total = sum(out.values()) if isinstance(out, dict) else out
            # The scalars the model hands the loss: after a step they carry the loss's gradients through AdamW.
            scalars = dict(zip(("logit_scale", "logit_bias"), args[2:]), **kwargs)
            scalars = {name: float(scalars[name]) if scalars.get(name) is not None else None
                       for name in ("logit_scale", "logit_bias")}
            with open(record, "a") as f:
                f.write(json.dumps({"loss": float(total), "type": type(out).__name__, **scalars,
                                    "keys": sorted(out) if isinstance(out, dict) else None,
                                    "class": cls.__module__ + "." + cls.__name__}) + "\n")
            return out
    return Recorded


open_clip.factory.ClipLoss = recorded(open_clip.factory.ClipLoss)
open_clip.factory.SigLipLoss = recorded(open_clip.factory.SigLipLoss)
open_clip.factory.CoCaLoss = recorded(open_clip.factory.CoCaLoss)
open_clip.factory.DistillClipLoss = recorded(open_clip.factory.DistillClipLoss)

from open_clip_train.main import main
main(argv)
'''


def _training_program():
    """(whether open_clip_train.main imports, why not): it needs open-clip-torch[training]'s webdataset and pandas
    beyond open-clip-torch itself (scripts/setup.sh installs them)."""
    if importlib.util.find_spec("open_clip_train") is None:
        return False, "open-clip-torch without its open_clip_train package"
    try:
        importlib.import_module("open_clip_train.main")
    except ImportError as e:
        return False, f"open_clip_train.main does not import ({e}): pip install 'open-clip-torch[training]'"
    return True, ""


def _train(tmp_path, impl, extra):
    configs = tmp_path / "configs"
    configs.mkdir(exist_ok=True)
    for name, config in MODELS.items():
        (configs / f"{name}.json").write_text(json.dumps(config))
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    if "{teacher}" in extra:  # a teacher of the tiny config, other weights than the student's, as a checkpoint file
        teacher = tmp_path / "teacher.pt"
        if not teacher.exists():
            import open_clip

            open_clip.add_model_config(str(configs))
            torch.manual_seed(1)
            torch.save(open_clip.create_model("tiny-contrastive").state_dict(), teacher)
        extra = [str(teacher) if a == "{teacher}" else a for a in extra]
    record = tmp_path / f"{impl}.jsonl"
    args = ["--model", "tiny-contrastive", *extra, "--dataset-type", "synthetic", "--train-num-samples", "64",
            "--batch-size", "8", "--epochs", "1", "--workers", "0", "--device", "cpu", "--seed", "0",
            "--warmup", "2", "--lr", "1e-3", "--precision", "fp32", "--logs", str(tmp_path / "logs"), "--name", impl]
    python_dir = os.path.dirname(os.path.dirname(os.path.abspath(ct.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (python_dir, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(launcher), impl, str(record), str(configs), *args],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return [json.loads(line) for line in record.read_text().splitlines()]


# CLIP with gradient accumulation (open_clip calls the loss on its cached features, one micro-batch live at a time),
# SigLIP (its learnable bias), CoCa (its captioning term) and distillation from a teacher checkpoint. float32: under open_clip's default `amp` the two losses differ by open_clip's own
# float16 rounding, which ours does not have (test_open_clip.py compares those against float64).
@pytest.mark.parametrize("extra", [["--accum-freq", "2"], ["--siglip"], ["--model", "tiny-coca"],
                                   ["--distill-model", "tiny-contrastive", "--distill-pretrained", "{teacher}"]],
                         ids=["clip_accum_freq_2", "siglip", "coca", "distill"])
def test_open_clip_train_logs_the_same_loss_with_ours(tmp_path, extra):
    require("open_clip_train", *_training_program())
    require("custom_ops", ct.HAS_CUSTOM_OPS, f"PyTorch {torch.__version__} < 2.4 has no torch.library.custom_op")
    theirs = _train(tmp_path, "open_clip", extra)
    ours = _train(tmp_path, "ours", extra)
    expected_class = "contrastive_torch.losses." + ("SigLipLoss" if "--siglip" in extra else
                                                     "CoCaLoss" if "tiny-coca" in extra else
                                                     "DistillClipLoss" if "--distill-model" in extra else "ClipLoss")
    assert {c["class"] for c in ours} == {expected_class}, ours[0]
    assert {c["class"] for c in theirs} == {"open_clip.loss." + expected_class.rsplit(".", 1)[1]}, theirs[0]
    # 64 samples in batches of 8: 8 loss calls (with --accum-freq 2, 4 optimizer steps of two calls each).
    assert len(ours) == len(theirs) == 8, (len(ours), len(theirs))
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert (a["type"], a["keys"]) == (b["type"], b["keys"]), (step, a, b)
        # float32 throughout; a few steps of AdamW on 1e-7 differences stay far below this.
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (step, a["loss"], b["loss"])
        # The logit scale (and SigLIP's bias) the model passed: equal steps, so equal gradients reached them.
        assert abs(a["logit_scale"] - b["logit_scale"]) <= 1e-5 * abs(b["logit_scale"]), (step, a, b)
        assert (a["logit_bias"] is None) == (b["logit_bias"] is None) == ("--siglip" not in extra), (step, a, b)
        if a["logit_bias"] is not None:
            assert abs(a["logit_bias"] - b["logit_bias"]) <= 1e-5 * (1 + abs(b["logit_bias"])), (step, a, b)
    # The run learned something, so equal losses are not those of frozen parameters; the scale (and bias) moved.
    assert ours[-1]["loss"] != ours[0]["loss"]
    assert ours[-1]["logit_scale"] != ours[0]["logit_scale"]
    if "--siglip" in extra:
        assert ours[-1]["logit_bias"] != ours[0]["logit_bias"]
