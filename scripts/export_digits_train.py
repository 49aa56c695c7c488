#!/usr/bin/env python3
"""Writes the training split of scripts/train_vit_digits.py (scikit-learn's
digits, 80 % stratified, seed 0) as 8x8 uint8 images for
examples/train_vit_digits.rs, which trains the same model in Rust:

    .venv-ref/bin/python scripts/export_digits_train.py

Writes weights/vit-digits/train-8x8.safetensors: `images` (N, 8, 8) uint8,
values 0..16 as scikit-learn stores them; `labels` (N,) uint8; `indices`
(N,) int64, each image's index in load_digits(). The held-out split is the
committed weights/vit-digits/heldout/ PNGs.
"""

import os
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SEED = 0  # as scripts/train_vit_digits.py

digits = load_digits()
idx = np.arange(len(digits.target))
train_idx, _ = train_test_split(idx, test_size=0.2, random_state=SEED, stratify=digits.target)
images = digits.images[train_idx].astype(np.uint8)
assert (images == digits.images[train_idx]).all()
# Written beside the committed file first and renamed over it, so a failed
# write leaves the committed file as it was.
out = os.path.join(ROOT, "weights", "vit-digits", "train-8x8.safetensors")
fd, tmp = tempfile.mkstemp(prefix=".train-8x8-", suffix=".safetensors", dir=os.path.dirname(out))
os.close(fd)
try:
    save_file(
        {
            "images": torch.from_numpy(np.ascontiguousarray(images)),
            "labels": torch.from_numpy(digits.target[train_idx].astype(np.uint8)),
            "indices": torch.from_numpy(train_idx.astype(np.int64)),
        },
        tmp,
    )
except BaseException:
    os.remove(tmp)
    raise
os.replace(tmp, out)
print(f"{len(train_idx)} training images")
