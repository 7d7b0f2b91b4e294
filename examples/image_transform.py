"""The map function of examples/image_pipeline.py: decode, random-resized crop, flip, uint8 CHW.

    lakestream produce STREAM_URL --producer-id images-0 --source 'wds:DIR/shards/*.tar' \\
        --map examples.image_transform:train_transform --workers 2          # from the repository root

`train_transform` takes a WebDataset sample (`jpg`: the encoded image, `cls`: the class as text)
and returns `{"image": uint8 array (3, 224, 224), "label": int}`. The crop follows the usual
random-resized-crop recipe (an area of 8 % to 100 % of the image, an aspect ratio from 3/4 to 4/3,
resized to 224 x 224), then a horizontal flip half the time; it uses Pillow and numpy only.

The randomness is seeded from the sample's key, so the same sample always gives the same array:
`--map` functions must be deterministic, because a producer resumed after a crash applies the
function again to the record its cursor points into. (With `--epochs` > 1 the keys of later epochs
carry `-e<N>`, so each epoch gets its own crop of every image.)

The image stays uint8 in the stream (a quarter of float32's bytes); the trainer converts it to
float and normalises it with MEAN and STD.
"""

from __future__ import annotations

import hashlib
import io
import math
from typing import Any

import numpy as np
from PIL import Image

SIZE = 224
SCALE = (0.08, 1.0)  # the crop's share of the image's area
RATIO = (3 / 4, 4 / 3)  # the crop's width / height
MEAN = (0.485, 0.456, 0.406)  # per channel, of pixel values scaled to [0, 1]
STD = (0.229, 0.224, 0.225)
MAX_PIXELS = 64 << 20  # a source image larger than this is refused, not decoded


def rng_for(key: str) -> np.random.Generator:
    """A random generator determined by the sample key alone."""
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a random crop of a `width` x `height` image: up to ten tries at
    a random area and aspect ratio; if none fits, the largest centred crop within RATIO."""
    area = width * height
    log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    ratio = width / height
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def decode(data: bytes, key: str) -> Image.Image:
    """The RGB image encoded in `data`; ValueError naming `key` if it is not a readable image."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise ValueError(f"sample {key!r}: {img.width} x {img.height} pixels, over {MAX_PIXELS}")
            return img.convert("RGB")
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"sample {key!r}: not a readable image: {e}") from None


def train_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """A WebDataset sample (`jpg`, `cls`) as `{"image": uint8 (3, SIZE, SIZE), "label": int}`."""
    key = sample["__key__"]
    if not isinstance(sample.get("jpg"), bytes) or not isinstance(sample.get("cls"), bytes):
        raise ValueError(f"sample {key!r}: expected jpg and cls fields, got {sorted(sample)}")
    try:
        label = int(sample["cls"].decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"sample {key!r}: cls {sample['cls'][:20]!r} is not an integer") from None
    img = decode(sample["jpg"], key)
    rng = rng_for(key)
    img = img.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=crop_box(img.width, img.height, rng))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    chw = np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
    return {"__key__": key, "image": chw, "label": label}
