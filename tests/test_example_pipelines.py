"""The image pipeline example, run as a program: every record arrives once, transformed as documented."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import numpy as np

import lakestream

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(*args: str) -> str:
    """Run an example from the repository root, as its docstring says; its standard output."""
    out = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=EXAMPLES.parent,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def load(name: str) -> ModuleType:
    """An example module (the map functions), imported from its file."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def read_all(url: str, rank: int) -> dict[int, list[dict]]:
    """Every committed step's samples for `rank`."""
    steps: dict[int, list[dict]] = {}
    async with lakestream.open_reader(url, rank) as reader:
        async for batch in reader.steps(0, reader.state.head + 1):
            steps[batch.step] = batch.samples
    return steps


async def test_image_pipeline_streams_every_image_once_cropped_with_its_label(tmp_path: Path) -> None:
    out = run(str(EXAMPLES / "image_pipeline.py"), "--images", "40", "--steps", "4", "--dir", str(tmp_path))
    shards: dict[str, dict[str, bytes]] = defaultdict(dict)  # what the example generated: key -> field -> bytes
    for path in sorted((tmp_path / "shards").glob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar:
                key, _, field = member.name.partition(".")
                f = tar.extractfile(member)
                assert f is not None
                shards[key][field] = f.read()
    assert len(shards) == 40 and all(set(fields) == {"jpg", "cls"} for fields in shards.values())

    stream = await read_all(f"file://{tmp_path}/stream", 0)
    samples = [s for step in sorted(stream) for s in stream[step]]
    keys = [s["__key__"] for s in samples]
    assert len(keys) == len(set(keys)) and set(keys) == set(shards)  # every image, exactly once
    for s in samples:
        assert s["image"].shape == (3, 224, 224) and s["image"].dtype == np.uint8, s["__key__"]
        assert s["label"] == int(shards[s["__key__"]]["cls"]), s["__key__"]
        assert s["image"].std() > 0  # a picture, not a blank
    # The crop and flip are seeded by the key: the function gives the same array again, which is
    # what a resumed producer relies on. Different images get different crops.
    transform = load("image_transform")
    by_key = {s["__key__"]: s for s in samples}
    for key in sorted(shards)[::6]:
        again = transform.train_transform({"__key__": key, **shards[key]})
        assert np.array_equal(again["image"], by_key[key]["image"]), key
    boxes = {transform.crop_box(500, 500, transform.rng_for(key)) for key in shards}
    assert len(boxes) == len(shards)

    lines = out.splitlines()
    assert "produced 40 samples of 224x224 from 40 records" in out
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["0", "1", "2", "3"]
    assert lines[-1] == "trained 4 steps on 32 samples"
