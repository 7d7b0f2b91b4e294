"""The end-to-end benchmark's workload, shared by every process of bench/e2e.py.

The dataset (JPEG images as WebDataset tar shards), the standard training transform (decode,
random-resized crop to 224, horizontal flip, uint8 CHW), the co-located loader's dataset that
streams the shards from S3, the rank-slice framing the broker pipeline publishes, and the CPU
accounting every process reports with. It imports numpy, PIL and (for the co-located loader)
torch and botocore, nothing of lakestream, so the Mosaic Streaming virtual environment can
import it too.
"""

from __future__ import annotations

import io
import math
import os
import random
import resource
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

CROP = 224
SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults
RATIO = (3 / 4, 4 / 3)
CLASSES = 1000
DISTINCT_IMAGES = 96  # distinct JPEGs per image size; samples cycle through them (own keys)


# -- the dataset --------------------------------------------------------------------------------


def make_jpeg(rng: np.random.Generator, width: int, height: int, quality: int = 90) -> bytes:
    """A photo-like JPEG: smooth colour structure (an upscaled random field) plus grain, which
    compresses like a photograph (~85 KB at 500x400), not like noise or a flat image."""
    from PIL import Image

    small = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=np.int16)
    grain = rng.integers(-20, 21, (height, width, 3), dtype=np.int16)
    img = Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def write_shards(out: Path, n: int, size: int, per_shard: int, seed: int = 0) -> list[Path]:
    """`n` samples (`<key>.jpg`, `<key>.cls`) as tar shards `train-NNNNN.tar` under `out`.

    Images are `size` px wide (height 0.75 to 1.0 of that, varied), DISTINCT_IMAGES of them,
    cycled; keys are `s<size>-<i>`, unique."""
    rng = np.random.default_rng(seed + size)
    pool = [make_jpeg(rng, size, int(size * (0.75 + 0.25 * (i % 5) / 4))) for i in range(min(n, DISTINCT_IMAGES))]
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for s in range(math.ceil(n / per_shard)):
        path = out / f"train-{s:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
                key = f"s{size}-{i:07d}"
                for field, data in (("jpg", pool[i % len(pool)]), ("cls", str(i % CLASSES).encode())):
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


# -- the transform ------------------------------------------------------------------------------


def crop_box(rng: random.Random, width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (left, top, right, bottom)."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)
            j = rng.randint(0, width - w)
            return j, i, j + w, i + h
    ratio = width / height  # fallback: the whole image, centre-cropped to the ratio bounds
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    j, i = (width - w) // 2, (height - h) // 2
    return j, i, j + w, i + h


TRANSFORM_CPU = [0.0, 0]  # thread CPU seconds spent in train_transform, calls: in this process


def train_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """Decode the JPEG, random-resized-crop to 224 (bilinear), flip with p=0.5, uint8 CHW.

    Seeded by the key, so the same record always gives the same output (a resumed producer
    re-applies it). Returns `{"__key__", "img": uint8 array (3, 224, 224), "cls": int}`; adds
    its thread CPU time to TRANSFORM_CPU."""
    from PIL import Image

    t0 = time.thread_time()
    key = sample["__key__"]
    rng = random.Random(key)
    img = Image.open(io.BytesIO(sample["jpg"]))
    img = img.convert("RGB")
    box = crop_box(rng, *img.size)
    img = img.resize((CROP, CROP), Image.BILINEAR, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    chw = np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1))
    out = {"__key__": key, "img": chw, "cls": int(sample["cls"])}
    TRANSFORM_CPU[0] += time.thread_time() - t0
    TRANSFORM_CPU[1] += 1
    return out


def image_digest(img: Any) -> int:
    """xxh3-64 of one sample's image bytes (uint8 CHW): what a trainer held, or what the transform
    made of its record. Keys say that every sample arrived once; this says it arrived whole."""
    import xxhash

    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(img))


def expected_digests(paths: list[Path]) -> dict[str, int]:
    """Each key's `image_digest` of `train_transform` applied to its record in the shards (the
    transform is seeded by the key, so every pipeline's trainer must hold exactly these bytes)."""
    records: dict[str, dict[str, Any]] = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                f = tar.extractfile(member)
                if f is not None:
                    key, _, field = member.name.rpartition(".")
                    records.setdefault(key, {"__key__": key})[field] = f.read()
    saved = list(TRANSFORM_CPU)  # the producers' accounting, not this
    digests = {key: image_digest(train_transform(r)["img"]) for key, r in records.items()}
    TRANSFORM_CPU[:] = saved
    return digests


# -- CPU accounting -----------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """utime + stime of a live process (0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (every thread's children)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    dead = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + dead.ru_utime + dead.ru_stime
    todo = children(os.getpid())
    while todo:
        pid = todo.pop()
        total += proc_cpu(pid)
        todo += children(pid)
    return total


# -- the co-located loader: shards streamed from S3 -----------------------------------------------


def s3_client() -> Any:
    """A botocore S3 client from the AWS_* environment (path-style addressing)."""
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}),
    )


def tar_samples(fileobj: Any) -> Iterator[dict[str, Any]]:
    """WebDataset samples (`__key__` and fields as bytes) of a tar stream read front to back."""
    sample: dict[str, Any] | None = None
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, field = os.path.basename(member.name).partition(".")
            if sample is not None and sample["__key__"] != key:
                yield sample
                sample = None
            if sample is None:
                sample = {"__key__": key}
            data = tar.extractfile(member)
            assert data is not None
            sample[field] = data.read()
    if sample is not None:
        yield sample


def shard_share(shards: list[str], rank: int, world: int) -> list[str]:
    """The shards rank `rank` of `world` reads: every world-th, starting at rank."""
    return shards[rank::world]


def _torch_dataset() -> type:
    import torch
    import torch.utils.data

    class S3ShardDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        """This rank's shards from S3, split among the DataLoader's workers; each sample through
        `train_transform`, as `{"__key__", "img": uint8 tensor, "cls"}`."""

        def __init__(self, bucket: str, keys: list[str]) -> None:
            self.bucket, self.keys = bucket, keys

        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = torch.utils.data.get_worker_info()
            wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
            client = s3_client()
            for key in self.keys[wid::workers]:
                body = client.get_object(Bucket=self.bucket, Key=key)["Body"]
                for sample in tar_samples(body):
                    out = train_transform(sample)
                    out["img"] = torch.from_numpy(out["img"])
                    yield out

    return S3ShardDataset


def s3_shard_dataset(bucket: str, keys: list[str]) -> Any:
    return _torch_dataset()(bucket, keys)


# -- the broker's rank slices ---------------------------------------------------------------------


def encode_slice(samples: list[dict[str, Any]]) -> bytes:
    """One rank's samples as one message: a JSON header line (keys, classes, shape) and the
    images' bytes back to back."""
    import json

    head = json.dumps({"keys": [s["__key__"] for s in samples], "cls": [s["cls"] for s in samples]}).encode()
    return b"".join([len(head).to_bytes(4, "little"), head, *(s["img"].tobytes() for s in samples)])


def decode_slice(data: bytes) -> tuple[list[str], list[int], np.ndarray]:
    """(keys, classes, uint8 array (n, 3, 224, 224)) of a message made by `encode_slice`."""
    import json

    n = int.from_bytes(data[:4], "little")
    head = json.loads(data[4 : 4 + n])
    imgs = np.frombuffer(data, dtype=np.uint8, offset=4 + n).reshape(len(head["keys"]), 3, CROP, CROP)
    return head["keys"], head["cls"], imgs
