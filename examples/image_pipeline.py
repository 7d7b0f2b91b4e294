"""An image pipeline: JPEG WebDataset shards -> decode, crop, flip in worker processes -> stream -> training.

    python examples/image_pipeline.py [--images N] [--steps S] [--dir DIR] [--url STREAM_URL]
                                      [--global-batch B] [--workers K]

    python examples/image_pipeline.py --images 64 --steps 5      # from the repository root

Options:
  --images N        synthetic images to generate (default 200)
  --steps S         training steps (default 10; at most the number of global batches produced)
  --dir DIR         where the shards (DIR/shards) and the default stream (DIR/stream) go (default: a new
                    temporary directory, removed at the end); shards already in DIR are used as they are
  --url STREAM_URL  the stream: file://PATH (or a plain path) or s3://BUCKET/PREFIX (default file://DIR/stream)
  --global-batch B  images per step of a stream this example creates (default 8)
  --workers K       processes running the map function (default 2)

Three parts, one after the other:

1. Data: N images of 400 to 600 pixels a side (random sizes), each a shape on a plain background
   whose kind is its class (circle, square, triangle, stripes), written as WebDataset tar shards of
   SHARD_SIZE samples, `<key>.jpg` and `<key>.cls`.
2. Producing: `lakestream.produce` reads the shards (`wds:` source) and maps every sample with
   `image_transform.train_transform` in K worker processes (order preserved): decode, a random
   resized crop to 224 x 224 and a horizontal flip, both seeded from the sample key, and the image
   stored as a uint8 (3, 224, 224) array with its label. The command line does the same:

       lakestream produce STREAM_URL --producer-id images-0 --source 'wds:DIR/shards/*.tar' \\
           --map examples.image_transform:train_transform --workers 2

3. Training: a small convolutional network reads the stream through `lakestream.torch.StreamDataset`
   (a DataLoader over it, one item per step), normalises the images and trains with SGD, printing
   the step, the samples seen and the loss.

The stream has world size 1 (this one process). Run again with the same --dir, the producer resumes
after its last committed sample (here: at the end, so it puts nothing) and training reads the same
steps.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
from PIL import Image, ImageDraw

import lakestream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the map function's module, also in workers
from image_transform import MEAN, SIZE, STD, train_transform

CLASSES = ("circle", "square", "triangle", "stripes")
SHARD_SIZE = 32
PRODUCER_ID = "images-0"


# -- 1. the data: synthetic JPEGs in WebDataset shards ------------------------------------------------


def make_image(rng: np.random.Generator) -> tuple[bytes, int]:
    """A JPEG of random size showing a shape of a random class, and the class."""
    label = int(rng.integers(len(CLASSES)))
    w, h = (int(v) for v in rng.integers(400, 601, size=2))
    background, colour = (tuple(int(c) for c in rng.integers(0, 256, size=3)) for _ in range(2))
    img = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(img)
    side = int(rng.integers(min(w, h) // 3, min(w, h) * 3 // 4))
    x, y = int(rng.integers(0, w - side)), int(rng.integers(0, h - side))
    kind = CLASSES[label]
    if kind == "circle":
        draw.ellipse((x, y, x + side, y + side), fill=colour)
    elif kind == "square":
        draw.rectangle((x, y, x + side, y + side), fill=colour)
    elif kind == "triangle":
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=colour)
    else:
        for top in range(y, y + side, 24):
            draw.rectangle((x, top, x + side, top + 11), fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), label


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shards(shards: Path, images: int, seed: int = 0) -> int:
    """Write `images` samples as WebDataset shards into `shards`; the number of shards."""
    shards.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    count = math.ceil(images / SHARD_SIZE)
    for s in range(count):
        tmp = shards / f".images-{s:04d}.tar.tmp"
        with tarfile.open(tmp, "w") as tar:
            for i in range(s * SHARD_SIZE, min(images, (s + 1) * SHARD_SIZE)):
                jpg, label = make_image(rng)
                add_member(tar, f"img{i:06d}.jpg", jpg)
                add_member(tar, f"img{i:06d}.cls", str(label).encode())
        tmp.rename(shards / f"images-{s:04d}.tar")
    return count


# -- 2. producing: the map function in worker processes ---------------------------------------------


async def produce(url: str, shards: Path, global_batch: int, workers: int) -> lakestream.ProduceReport:
    """Create the stream unless it exists, then produce every shard through `train_transform`."""
    try:
        state = await lakestream.load_state(url)
    except lakestream.StreamNotFound:
        await lakestream.create(url, world_size=1, global_batch=global_batch)
    else:
        assert state.config is not None
        if state.config.world_size != 1:
            raise ValueError(f"{url}: the stream has world size {state.config.world_size}; this example trains as 1")
    # The function itself (imported above) or "examples.image_transform:train_transform" from the
    # repository root: with workers, each worker process imports its module.
    return await lakestream.produce(url, PRODUCER_ID, f"wds:{shards}/*.tar", map=train_transform, workers=workers)


# -- 3. training through StreamDataset ----------------------------------------------------------------


def train(url: str, steps: int, seed: int = 0) -> int:
    """Train a small CNN on steps 0..steps-1 of the stream; the samples seen."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader

    from lakestream.torch import StreamDataset

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=8, stride=8),  # 224 -> 28
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, stride=2),  # 28 -> 13
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, len(CLASSES)),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    dataset = StreamDataset(url, rank=0, world_size=1, stop=steps)
    seen = 0
    for item in DataLoader(dataset, batch_size=None):
        samples = item["samples"]
        x = (torch.stack([s["image"] for s in samples]).float() / 255 - mean) / std
        y = torch.tensor([s["label"] for s in samples])
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += len(samples)
        accuracy = (logits.argmax(1) == y).float().mean().item()
        print(
            f"step {item['step']:4d}  samples {len(samples):3d}  seen {seen:5d}  "
            f"loss {loss.item():.4f}  batch accuracy {accuracy:.2f}",
            flush=True,
        )
    return seen


def run(a: argparse.Namespace, workdir: Path) -> None:
    shards = workdir / "shards"
    url = a.url or f"file://{workdir / 'stream'}"
    if shards.is_dir():
        print(f"using the shards in {shards}", flush=True)
    else:
        t0 = time.perf_counter()
        n = write_shards(shards, a.images)
        print(
            f"generated {a.images} images ({len(CLASSES)} classes, 400-600 px) in {n} shards "
            f"in {time.perf_counter() - t0:.1f} s: {shards}",
            flush=True,
        )
    report = anyio.run(produce, url, shards, a.global_batch, a.workers)
    assert report.map is not None
    print(
        f"produced {report.stats.samples} samples of {SIZE}x{SIZE} from {report.map.records} records "
        f"({report.stats.tgbs_committed} TGBs) with {a.workers} worker processes in {report.seconds:.1f} s "
        f"(resumed at {'the start' if report.resumed_at is None else 'a committed cursor'}): {url}",
        flush=True,
    )
    state = anyio.run(lakestream.load_state, url)
    steps = min(a.steps, state.head + 1)
    seen = train(url, steps)
    print(f"trained {steps} steps on {seen} samples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", default=None, help="default: a new temporary directory, removed at the end")
    ap.add_argument("--url", default=None, help="default: file://DIR/stream")
    ap.add_argument("--global-batch", type=int, default=8, help="only for a stream this example creates")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    if a.images < 1 or a.steps < 0 or a.global_batch < 1 or a.workers < 0:
        ap.error("--images and --global-batch must be positive, --steps and --workers not negative")
    if a.dir is not None:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
        run(a, Path(a.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="lakestream-images-") as d:
            run(a, Path(d))


if __name__ == "__main__":
    main()
