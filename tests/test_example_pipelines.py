"""The image and text pipeline examples, run as programs: every record arrives once, transformed as
documented, and the text example's ranks are balanced by tokens."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow.parquet as pq

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


async def test_text_pipeline_packs_every_token_and_balances_ranks_by_tokens(tmp_path: Path) -> None:
    """Balance: the producer gives each rank the same number of sequences (± 1) and places them most
    tokens first, each on the rank with the fewest tokens that has room. Within a step, the tokens of
    any rank Y exceed those of any other rank X by at most the longest sequence's (≤ SEQ_LEN). Take
    Y's sequences in the order Y got them. If each after the first came when X already held at least
    as many as Y, each matches a distinct sequence of X placed earlier, so no shorter: Y exceeds X by
    at most its first. Otherwise take the last one that came while X held fewer: X had room then, so
    Y was no heavier than X before it; every later one of Y matches a distinct sequence X got after
    that moment. Either way the excess is at most one sequence."""
    out = run(str(EXAMPLES / "text_pipeline.py"), "--docs", "150", "--dir", str(tmp_path))
    tt = load("text_transform")
    docs: dict[str, str | None] = {}
    for path in sorted((tmp_path / "docs").glob("*.parquet")):
        table = pq.read_table(path)
        docs.update(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    assert len(docs) == 150
    # The input tokenised independently of the example: BOS, each UTF-8 byte + 3, EOS; documents under
    # MIN_TOKENS tokens are dropped.
    tokenised = {
        doc: [tt.BOS, *(b + tt.OFFSET for b in text.encode()), tt.EOS] for doc, text in docs.items() if text is not None
    }
    expected = {doc: tokens for doc, tokens in tokenised.items() if len(tokens) >= tt.MIN_TOKENS}
    assert 0 < len(docs) - len(expected) < 40  # some are dropped: blank, null, fragments
    assert any(len(t) > 2 * tt.SEQ_LEN for t in expected.values())  # some give three sequences or more

    url = f"file://{tmp_path}/stream"
    state = await lakestream.load_state(url)
    assert state.config is not None and state.config.world_size == 2
    ranks = [await read_all(url, r) for r in range(2)]
    chunks: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    for steps in ranks:
        for samples in steps.values():
            for s in samples:
                t, n = s["tokens"], s["n_tokens"]
                assert t.shape == (tt.SEQ_LEN,) and t.dtype == np.int32
                assert 0 < n <= tt.SEQ_LEN and not t[n:].any() and t[:n].all()  # padding only after the tokens
                doc, _, i = s["__key__"].rpartition("-")
                assert int(i) not in chunks[doc]
                chunks[doc][int(i)] = t[:n]
    assert chunks.keys() == expected.keys()
    for doc, parts in chunks.items():
        assert sorted(parts) == list(range(len(parts)))
        assert all(len(parts[i]) == tt.SEQ_LEN for i in range(len(parts) - 1))  # only the last is short
        assert np.concatenate([parts[i] for i in range(len(parts))]).tolist() == expected[doc]
    total = sum(len(t) for t in expected.values())

    assert ranks[0].keys() == ranks[1].keys()
    totals = [0, 0]
    for step in ranks[0]:
        slices = [ranks[r][step] for r in range(2)]
        loads = [sum(int(s["n_tokens"]) for s in sl) for sl in slices]
        longest = max(int(s["n_tokens"]) for sl in slices for s in sl)
        assert abs(len(slices[0]) - len(slices[1])) <= 1, step
        assert abs(loads[0] - loads[1]) <= longest, (step, loads, longest)
        totals = [a + b for a, b in zip(totals, loads)]
    assert sum(totals) == total  # every token of the tokenised input, once

    printed = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("rank ")}
    assert printed["rank 0"].endswith(f", {totals[0]} tokens") and printed["rank 1"].endswith(f", {totals[1]} tokens")

    # Run again: the files and the stream are used as they are, the producer resumes at its end.
    again = run(str(EXAMPLES / "text_pipeline.py"), "--dir", str(tmp_path))
    assert "using the Parquet files" in again and "produced 0 sequences" in again
    assert [line for line in again.splitlines() if line.startswith("rank ")] == list(printed.values())
