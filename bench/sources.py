"""Sources benchmark: what reading through `open_source` and producing into a stream costs, next to
the same data read by its own library, with and without a CPU-heavy map.

    .venv/bin/python bench/sources.py            # full run, a few minutes
    .venv/bin/python bench/sources.py --quick    # under a minute: fewer samples, one repetition
    .venv/bin/python bench/sources.py --smoke    # seconds: every part, a few dozen samples

The data is made here, in a temp dir, once per kind from the same samples: JPEG images of 256x192,
384x288 and 512x384 pixels (photo-like noise, ~20-70 KB, 48 distinct images cycled under unique
keys) with a class label, as WebDataset tar shards (`<key>.jpg`, `<key>.cls`), Parquet files (one
row group of 256 rows at a time, columns key/jpg/cls, no dictionary encoding) and a Hugging Face
dataset saved with `save_to_disk` (same columns, `jpg` binary). Every read below is from the page
cache (the files were just written); a stream is a `file://` stream in the same temp dir (durable:
the file store fsyncs), world size 4, global batch 256, deleted after each run.

(a) no map, per kind:
    library      the library's own read, one dict per sample: tarfile in streaming mode, members
                 grouped by key (wds); pyarrow `ParquetFile.iter_batches` of 256 rows + `to_pylist` (parquet);
                 pyarrow memory-mapped arrow files, `to_batches` + `to_pylist` (hf, which is how
                 `datasets` reads them; `datasets.load_from_disk` row iteration is timed once apart);
    source       `open_source(spec).iterate()` to the end, no stream (listing, fingerprint, cursors,
                 validation): the source's own overhead;
    put loop     the source's samples put by a plain loop in the event loop (`open_producer`,
                 `put(sample, cursor=...)`, close): source + the stream's own cost (put, seal,
                 write and fsync the segments, commit);
    produce      `lakestream.produce(file://..., spec)`: the same through the pipeline (a thread
                 reads the source ahead; the event loop puts what is ready).
(b) the map `decode_map` (PIL: decode the JPEG, resize to 128x128 RGB; ~2-4 ms a sample here), on a
    smaller set, for workers 0 (in-process), 1 and 2:
    library+map  the library read with `decode_map` applied in this process (0) or in a pool of
                 spawned processes, submitted in order with 4 x workers in flight (what --workers does);
    produce+map  `lakestream.produce(..., map=decode_map, workers=W)`.
(c) fleet: `lakestream.ray.run_fleet` with 1 and 2 actors on the wds shards, without and with the map
    (on a local Ray started once, not timed; actor start-up is in the figure, and a fleet run on 4
    samples measures it).

Each repetition runs every configuration once, alternating the order of the runs it compares; the
tables give medians over repetitions of samples/s and MB/s (JPEG bytes read, 10^6 bytes/s), and the
time ratios and differences taken within each repetition (median); an untimed warm-up pass runs first.
Process pools (library+map, produce --workers) are started inside the timed region on both sides.
The target: the source stage adds < 10% to the library's own read time. The 1-minute load average
is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import io
import multiprocessing
import os
import shlex
import shutil
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt_bytes, format_table, load_average, machine_description, median, removing, temp_dir

import lakestream
from lakestream.sources import open_source

BENCH = Path(__file__).resolve().parent
WORLD_SIZE = 4
GLOBAL_BATCH = 256
ROW_GROUP = 256
IMAGE_SIZES = ((256, 192), (384, 288), (512, 384))
DISTINCT = 48  # distinct JPEGs, cycled under unique keys
THUMB = (128, 128)
TARGET = 0.10  # the source stage adds < 10% to the library's read time
KINDS = ("wds", "parquet", "hf")

Sample = dict[str, Any]


# -- the map --------------------------------------------------------------------------------------


def decode_map(sample: Sample) -> Sample:
    """Decode the sample's JPEG, resize it to THUMB RGB: the raw pixels and the class (deterministic)."""
    from PIL import Image

    with Image.open(io.BytesIO(sample["jpg"])) as im:
        thumb = im.convert("RGB").resize(THUMB, Image.Resampling.BILINEAR)
    return {"img": thumb.tobytes(), "cls": int(sample["cls"])}


# -- the data -------------------------------------------------------------------------------------


def make_jpegs(seed: int = 0) -> list[bytes]:
    """DISTINCT photo-like JPEGs (an upscaled random colour field plus grain), the sizes in turn."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(DISTINCT):
        w, h = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        field_ = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(field_).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
        pixels = np.clip(base + rng.integers(-12, 13, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


@dataclass
class Dataset:
    """One set of samples written as every kind: the specs to open them and what they hold."""

    root: Path
    samples: int
    shards: int
    nbytes: int  # JPEG bytes
    specs: dict[str, str] = field(default_factory=dict)

    def spec(self, kind: str) -> str:
        return self.specs[kind]


def make_dataset(root: Path, n: int, shards: int, jpegs: list[bytes], kinds: list[str]) -> Dataset:
    """`n` samples (key `%08d`, JPEG `jpegs[i % len]`, class i % 1000) in `shards` files of each kind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = Dataset(root, n, shards, sum(len(jpegs[i % len(jpegs)]) for i in range(n)))
    (root / "wds").mkdir(parents=True)
    (root / "parquet").mkdir()
    columns: dict[str, list[Any]] = {"key": [], "jpg": [], "cls": []}
    per = -(-n // shards)
    for s in range(shards):
        rows = range(s * per, min(n, (s + 1) * per))
        keys = [f"{i:08d}" for i in rows]
        jpgs = [jpegs[i % len(jpegs)] for i in rows]
        classes = [i % 1000 for i in rows]
        with tarfile.open(root / "wds" / f"shard-{s:04d}.tar", "w") as tar:
            for key, jpg, cls in zip(keys, jpgs, classes, strict=True):
                for name, data in ((f"{key}.jpg", jpg), (f"{key}.cls", str(cls).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    info.mtime = 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
        table = pa.table({"key": keys, "jpg": pa.array(jpgs, pa.binary()), "cls": pa.array(classes, pa.int64())})
        pq.write_table(
            table, root / "parquet" / f"part-{s:04d}.parquet", row_group_size=ROW_GROUP, use_dictionary=False
        )
        for column, values in (("key", keys), ("jpg", jpgs), ("cls", classes)):
            columns[column].extend(values)
    ds.specs["wds"] = f"wds:{root}/wds/shard-{{0000..{shards - 1:04d}}}.tar"
    ds.specs["parquet"] = f"parquet:{root}/parquet"
    if "hf" in kinds:
        import datasets

        datasets.disable_progress_bars()
        features = datasets.Features(
            {"key": datasets.Value("string"), "jpg": datasets.Value("binary"), "cls": datasets.Value("int64")}
        )
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(root / "hf"), num_shards=shards)
        ds.specs["hf"] = f"hf:{root}/hf"
    return ds


# -- the library reads (no lakestream) ------------------------------------------------------------


def read_tar(ds: Dataset) -> Iterator[Sample]:
    """WebDataset samples with tarfile: members streamed in order, consecutive names with one key grouped."""
    for path in sorted((ds.root / "wds").glob("*.tar")):
        sample: Sample | None = None
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.partition(".")
                if sample is not None and sample["__key__"] != key:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": key}
                data = tar.extractfile(member)
                assert data is not None
                sample[ext] = data.read()
        if sample is not None:
            yield sample


def read_parquet(ds: Dataset) -> Iterator[Sample]:
    """Rows as dicts with pyarrow: `iter_batches` of 256 rows of each file, `to_pylist`."""
    import pyarrow.parquet as pq

    for path in sorted((ds.root / "parquet").glob("*.parquet")):
        with pq.ParquetFile(path) as pf:
            for batch in pf.iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    row["__key__"] = row.pop("key")
                    yield row


def hf_files(ds: Dataset) -> list[Path]:
    import json

    state = json.loads((ds.root / "hf" / "state.json").read_text())
    return [ds.root / "hf" / f["filename"] for f in state["_data_files"]]


def read_hf(ds: Dataset) -> Iterator[Sample]:
    """Rows as dicts with pyarrow, as `datasets` reads them: each arrow file memory-mapped, `to_pylist`."""
    import pyarrow as pa

    for path in hf_files(ds):
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        for batch in table.to_batches(max_chunksize=256):
            for row in batch.to_pylist():
                row["__key__"] = row.pop("key")
                yield row


def read_hf_datasets(ds: Dataset) -> Iterator[Sample]:
    """Rows as `datasets` gives them: `load_from_disk`, then iterating the Dataset."""
    import datasets

    for row in datasets.load_from_disk(str(ds.root / "hf")):
        row["__key__"] = row.pop("key")
        yield row


LIBRARY: dict[str, Callable[[Dataset], Iterator[Sample]]] = {"wds": read_tar, "parquet": read_parquet, "hf": read_hf}


def mapped(records: Iterator[Sample], fn: Callable[[Sample], Sample], workers: int) -> Iterator[Sample]:
    """`fn` of each record in order: here (workers 0), else in a pool of spawned processes with
    4 x workers in flight, submitted and collected in order as the transform stage does."""
    if workers <= 0:
        for r in records:
            yield fn(r)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        pending: collections.deque[concurrent.futures.Future[Sample]] = collections.deque()
        for r in records:
            pending.append(pool.submit(fn, r))
            while len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def pool_startup(workers: int) -> float:
    """Seconds from creating a pool of `workers` spawned processes (as `mapped` and --workers do) until
    each has run a task (each task sleeps 0.2 s, not counted), and the pool has shut down."""
    ctx = multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for f in [pool.submit(time.sleep, 0.2) for _ in range(workers)]:
            f.result()
    return time.perf_counter() - t0 - 0.2


# -- one run each ---------------------------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    samples: int
    nbytes: int  # JPEG bytes read
    cpu: float = 0.0  # CPU seconds of this process (all its threads; not of worker processes)
    rep: int = 0

    @property
    def per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def mb_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds


def library_run(ds: Dataset, kind: str, workers: int | None) -> Run:
    """The library read (and `decode_map` with `workers` unless None), to the last sample."""
    read = LIBRARY[kind]
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    it = read(ds) if workers is None else mapped(read(ds), decode_map, workers)
    for _ in it:
        n += 1
    return Run(time.perf_counter() - t0, n, ds.nbytes, time.process_time() - c0)


def source_run(ds: Dataset, kind: str) -> Run:
    """`open_source(spec).iterate()` to the end, no stream."""
    t0, c0 = time.perf_counter(), time.process_time()
    src = open_source(ds.spec(kind), key_column=None if kind == "wds" else "key")
    n = 0
    for _ in src.iterate():
        n += 1
    return Run(time.perf_counter() - t0, n, ds.nbytes, time.process_time() - c0)


class Streams:
    """New `file://` streams under one directory, each deleted after its run."""

    def __init__(self, root: Path) -> None:
        self.root, self.n = root, 0

    async def new(self) -> str:
        self.n += 1
        url = f"file://{self.root}/stream-{self.n}"
        await lakestream.create(url, world_size=WORLD_SIZE, global_batch=GLOBAL_BATCH)
        return url

    def discard(self, url: str) -> None:
        shutil.rmtree(url[len("file://") :], ignore_errors=True)


async def put_run(streams: Streams, ds: Dataset, kind: str) -> Run:
    """The source's samples put into a new stream by a loop in the event loop (`open_producer`, `put`
    with the cursor, close): the source and the stream, without the pipeline `produce` wraps round them."""
    url = await streams.new()
    t0, c0 = time.perf_counter(), time.process_time()
    async with lakestream.open_producer(url, "p0") as p:
        for sample, cursor in open_source(ds.spec(kind), key_column=None if kind == "wds" else "key").iterate():
            await p.put(sample, cursor=cursor)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    streams.discard(url)
    return Run(seconds, p.stats.samples, ds.nbytes, cpu)


async def produce_run(streams: Streams, ds: Dataset, kind: str, workers: int | None) -> Run:
    """`lakestream.produce` of the whole source into a new stream (with `decode_map` unless workers is None)."""
    url = await streams.new()
    key_column = None if kind == "wds" else "key"
    t0, c0 = time.perf_counter(), time.process_time()
    if workers is None:
        report = await lakestream.produce(url, "p0", ds.spec(kind), key_column=key_column)
    else:
        report = await lakestream.produce(
            url, "p0", ds.spec(kind), key_column=key_column, map=decode_map, workers=workers
        )
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    streams.discard(url)
    return Run(seconds, report.stats.samples, ds.nbytes, cpu)


async def fleet_run(streams: Streams, ds: Dataset, actors: int, with_map: bool) -> Run:
    """`run_fleet` of `actors` producers on the wds shards (map `sources:decode_map` by name)."""
    from lakestream.ray import run_fleet

    url = await streams.new()
    t0 = time.perf_counter()
    report = await anyio.to_thread.run_sync(
        lambda: run_fleet(url, ds.spec("wds"), actors, name="bench", map="sources:decode_map" if with_map else None)
    )
    seconds = time.perf_counter() - t0
    streams.discard(url)
    if not report.ok:
        raise RuntimeError(f"fleet of {actors}: {report.reason()}")
    return Run(seconds, report.samples, ds.nbytes)


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[tuple[Any, ...], list[Run]] = field(default_factory=lambda: collections.defaultdict(list))
    startup: dict[int, float] = field(default_factory=dict)  # workers: seconds to start a pool of them
    rep: int = 0  # the repetition running

    def seconds(self, key: tuple[Any, ...]) -> float:
        return median([r.seconds for r in self.runs.get(key, [])])

    def add(self, key: tuple[Any, ...], run: Run, expected: int) -> Run:
        """Record `run`, which must have read (or committed) every one of the `expected` samples."""
        if run.samples != expected:
            raise RuntimeError(f"{key}: {run.samples} samples, expected {expected}")
        run.rep = self.rep
        self.runs[key].append(run)
        return run

    def rate(self, key: tuple[Any, ...]) -> float:
        return median([r.per_s for r in self.runs.get(key, [])])

    def mb_s(self, key: tuple[Any, ...]) -> float:
        return median([r.mb_s for r in self.runs.get(key, [])])

    def _by_rep(self, key: tuple[Any, ...], cpu: bool) -> dict[int, float]:
        """The median seconds (wall, or CPU) of `key`'s runs in each repetition."""
        reps: dict[int, list[float]] = collections.defaultdict(list)
        for r in self.runs.get(key, []):
            reps[r.rep].append(r.cpu if cpu else r.seconds)
        return {rep: median(v) for rep, v in reps.items()}

    def us_per_sample(self, key: tuple[Any, ...], base: tuple[Any, ...] | None, *, cpu: bool = False) -> float:
        """Median over repetitions of the time of `key` less that of `base` (None: 0), in µs per sample."""
        n = self.runs[key][0].samples
        mine = self._by_rep(key, cpu)
        theirs = self._by_rep(base, cpu) if base is not None else dict.fromkeys(mine, 0.0)
        return median([(mine[r] - theirs[r]) / n * 1e6 for r in mine if r in theirs])

    def ratio(self, key: tuple[Any, ...], base: tuple[Any, ...], *, cpu: bool = False) -> float:
        """Median over repetitions of (time of `key`) / (time of `base`) within the same repetition."""
        mine, theirs = self._by_rep(key, cpu), self._by_rep(base, cpu)
        return median([mine[r] / theirs[r] for r in mine if r in theirs])


def progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


async def one_repetition(
    rep: int,
    a: argparse.Namespace,
    kinds: list[str],
    data: Dataset,
    small: Dataset,
    tiny: Dataset,
    streams: Streams,
    res: Results,
) -> None:
    """Every configuration once; the runs compared with each other in alternating order."""
    res.rep = rep
    flip = rep % 2 == 1
    for kind in kinds:
        runs: list[tuple[tuple[Any, ...], Callable[[], Any]]] = []
        for j in range(a.pairs):  # the cheap runs compared most closely: a few times, alternating
            reads: list[tuple[tuple[Any, ...], Callable[[], Any]]] = [
                (("library", kind, None), lambda: library_run(data, kind, None)),
                (("source", kind, None), lambda: source_run(data, kind)),
            ]
            runs += reversed(reads) if j % 2 else reads
        runs += [
            (("put", kind, None), lambda: put_run(streams, data, kind)),
            (("produce", kind, None), lambda: produce_run(streams, data, kind, None)),
        ]
        for key, fn in reversed(runs) if flip else runs:
            r = fn()
            r = await r if not isinstance(r, Run) else r
            res.add(key, r, data.samples)
            progress(f"rep {rep + 1} {kind:7} {key[0]:8} no map: {r.per_s:8.0f} samples/s {r.mb_s:6.0f} MB/s")
        for w in a.workers:
            pair: list[tuple[tuple[Any, ...], Callable[[], Any]]] = [
                (("library", kind, w), lambda: library_run(small, kind, w)),
                (("produce", kind, w), lambda: produce_run(streams, small, kind, w)),
            ]
            for key, fn in reversed(pair) if flip != (w % 2 == 1) else pair:
                r = fn()
                r = await r if not isinstance(r, Run) else r
                res.add(key, r, small.samples)
                progress(f"rep {rep + 1} {kind:7} {key[0]:8} map, {w} workers: {r.per_s:6.0f} samples/s")
    if "hf" in kinds and rep == 0:
        t0 = time.perf_counter()
        n = sum(1 for _ in read_hf_datasets(data))
        res.add(("hf-datasets", None, None), Run(time.perf_counter() - t0, n, data.nbytes), data.samples)
    if rep == 0:
        for w in a.workers:
            if w > 0:
                res.startup[w] = pool_startup(w)
                progress(f"pool of {w} started in {res.startup[w]:.2f} s")
    for actors in a.fleet:
        for what in ("tiny", "none", "map"):
            ds = {"tiny": tiny, "none": data, "map": small}[what]
            r = res.add(("fleet", actors, what), await fleet_run(streams, ds, actors, what == "map"), ds.samples)
            progress(f"rep {rep + 1} fleet of {actors}, {what}: {r.seconds:.1f} s, {r.per_s:6.0f} samples/s")


def hf_status() -> str:
    """'' when `open_source("hf:...")` is there, else why not."""
    try:
        open_source("hf:/nonexistent")
    except FileNotFoundError:
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def fleet_status() -> str:
    """'' when `lakestream.ray.run_fleet` can run here, else why not."""
    try:
        import ray  # noqa: F401

        from lakestream.ray import run_fleet  # noqa: F401
    except ImportError as e:
        return f"ImportError: {e}"
    return ""


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


def report(a: argparse.Namespace, kinds: list[str], data: Dataset, small: Dataset, res: Results) -> list[str]:
    """Print the tables and the verdicts; the verdict lines."""
    print()
    print(f"(a) no map: {data.samples} samples, {fmt_bytes(data.nbytes)} of JPEG, {data.shards} files per kind")
    print()
    rows = []
    for kind in kinds:
        lib, src, put, prod = (
            ("library", kind, None),
            ("source", kind, None),
            ("put", kind, None),
            ("produce", kind, None),
        )
        rows.append([kind, *(f"{res.rate(k):.0f} / {res.mb_s(k):.0f}" for k in (lib, src, put, prod))])
    print(
        format_table(
            [
                "kind",
                "library samples/s / MB/s",
                "source (no stream)",
                "source + put loop",
                "produce (source + stream)",
            ],
            rows,
        )
    )
    print()
    print("time ratios within a repetition, and where the time goes in µs per sample (differences within a")
    print("repetition), each as wall / CPU of this process (CPU: less disturbed by other work on the machine);")
    print("medians over repetitions")
    print()
    rows = []
    for kind in kinds:
        lib, src, put, prod = (
            ("library", kind, None),
            ("source", kind, None),
            ("put", kind, None),
            ("produce", kind, None),
        )

        def both(f: Callable[..., float], fmt: str, *args: Any) -> str:
            return f"{f(*args, cpu=False):{fmt}} / {f(*args, cpu=True):{fmt}}"

        rows.append(
            [
                kind,
                both(res.ratio, ".2f", src, lib),
                both(res.ratio, ".2f", put, lib),
                both(res.ratio, ".2f", prod, lib),
                both(res.us_per_sample, ".0f", lib, None),
                both(res.us_per_sample, "+.0f", src, lib),
                both(res.us_per_sample, "+.0f", put, src),
                both(res.us_per_sample, "+.0f", prod, put),
            ]
        )
    print(
        format_table(
            [
                "kind",
                "source / library",
                "put loop / library",
                "produce / library",
                "library µs",
                "+ source's own",
                "+ stream (put, commit)",
                "+ produce's pipeline",
            ],
            rows,
        )
    )
    hfd = res.runs.get(("hf-datasets", None, None))
    if hfd:
        print(
            f"\nhf, for reference: datasets.load_from_disk + iterating the Dataset row by row: "
            f"{hfd[0].per_s:.0f} samples/s, {hfd[0].mb_s:.0f} MB/s (one run)"
        )
    print()
    print(f"(b) map decode_map: {small.samples} samples, {fmt_bytes(small.nbytes)} of JPEG, {small.shards} files")
    print()
    rows = []
    for kind in kinds:
        for w in a.workers:
            lib, prod = ("library", kind, w), ("produce", kind, w)
            rows.append(
                [
                    kind,
                    str(w),
                    f"{res.rate(lib):.0f}",
                    f"{res.rate(prod):.0f}",
                    f"{res.ratio(prod, lib):.2f} ({pct(res.ratio(prod, lib))})",
                    f"{res.startup[w]:.2f}" if w in res.startup else "-",
                ]
            )
    print(
        format_table(
            [
                "kind",
                "workers",
                "library+map samples/s",
                "produce+map samples/s",
                "produce / library time",
                "pool start-up s (in both)",
            ],
            rows,
        )
    )
    if a.fleet:
        print()
        print("(c) fleet: lakestream.ray.run_fleet on the wds shards (actor start-up included), beside produce in")
        print("this process; start-up: a fleet run on 4 samples; the last column subtracts it (an estimate)")
        print()
        rows = []
        for what in ("none", "map"):
            ds = small if what == "map" else data
            base = res.rate(("produce", "wds", 0 if what == "map" else None))
            for actors in a.fleet:
                r, up = res.rate(("fleet", actors, what)), res.seconds(("fleet", actors, "tiny"))
                secs = res.seconds(("fleet", actors, what))
                rows.append(
                    [
                        "decode_map" if what == "map" else "none",
                        str(ds.samples),
                        str(actors),
                        f"{secs:.1f}",
                        f"{r:.0f}",
                        f"{base:.0f}",
                        f"{r / base:.2f}",
                        f"{up:.1f}",
                        f"{ds.samples / (secs - up):.0f}" if secs > up else "-",
                    ]
                )
        print(
            format_table(
                [
                    "map",
                    "samples",
                    "actors",
                    "fleet s",
                    "fleet samples/s",
                    "produce samples/s (1 process, 0 workers)",
                    "fleet / produce",
                    "start-up s",
                    "fleet samples/s less start-up",
                ],
                rows,
            )
        )
    print()
    verdicts = []
    for kind in kinds:
        lib = ("library", kind, None)
        src, put, prod = (res.ratio((what, kind, None), lib) for what in ("source", "put", "produce"))
        src_cpu, prod_cpu = (res.ratio((what, kind, None), lib, cpu=True) for what in ("source", "produce"))
        verdicts.append(
            f"target {kind}: the source adds {pct(src)} to the library's read time, {pct(src_cpu)} in CPU time "
            f"(< +{TARGET:.0%}: {'met' if src - 1 < TARGET else 'NOT MET'} / {'met' if src_cpu - 1 < TARGET else 'NOT MET'}); "
            f"with the stream, the put loop adds {pct(put)} and produce {pct(prod)}, {pct(prod_cpu)} in CPU time "
            f"({'met' if prod - 1 < TARGET else 'NOT MET'})"
        )
    for kind in kinds:
        worst = max(res.ratio(("produce", kind, w), ("library", kind, w)) for w in a.workers)
        verdicts.append(
            f"target {kind} with the map: produce adds at most {pct(worst)} over workers {a.workers} "
            f"({'met' if worst - 1 < TARGET else 'NOT MET'})"
        )
    for line in verdicts:
        print(line)
    return verdicts


def plot(a: argparse.Namespace, kinds: list[str], res: Results, path: Path) -> None:
    """Two panels: samples/s without a map (library, source, produce) and with it (by workers, and the fleet)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=110, gridspec_kw={"width_ratios": [1, 1.6]})
    colours = {
        "library": "tab:grey",
        "source": "tab:blue",
        "put": "tab:purple",
        "produce": "tab:orange",
        "fleet": "tab:green",
    }
    width = 0.2
    label = {
        "library": "library read",
        "source": "open_source, no stream",
        "put": "open_source + put loop",
        "produce": "produce (source + stream)",
    }
    for i, what in enumerate(("library", "source", "put", "produce")):
        xs = [k + (i - 1.5) * width for k in range(len(kinds))]
        left.bar(xs, [res.rate((what, kind, None)) for kind in kinds], width, color=colours[what], label=label[what])
    left.set_xticks(range(len(kinds)), kinds)
    left.set_yscale("log")
    left.set_ylabel("samples/s (median, log scale)")
    left.set_title("no map", fontsize=10)
    left.legend(fontsize=7)
    groups = [(kind, w) for kind in kinds for w in a.workers]
    for i, what in enumerate(("library", "produce")):
        xs = [g + (i - 0.5) * 0.38 for g in range(len(groups))]
        text = {"library": "library read + map", "produce": "produce --map"}[what]
        right.bar(xs, [res.rate((what, k, w)) for k, w in groups], 0.38, color=colours[what], label=text)
    ticks = [f"{k}\n{w} w." for k, w in groups]
    if a.fleet:
        for j, actors in enumerate(a.fleet):
            x = len(groups) + j
            right.bar(
                x,
                res.rate(("fleet", actors, "map")),
                0.5,
                color=colours["fleet"],
                label="fleet (Ray)" if j == 0 else None,
            )
            ticks.append(f"fleet\n{actors} act.")
    right.set_xticks(range(len(ticks)), ticks, fontsize=7)
    right.set_ylabel("samples/s (median)")
    right.set_title("map: JPEG decode + resize (by workers; fleet: actors, 0 workers each)", fontsize=10)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


async def main_async(a: argparse.Namespace, kinds: list[str], work: Path) -> int:
    with_fleet = bool(a.fleet)
    t0 = time.perf_counter()
    jpegs = make_jpegs()
    data = make_dataset(work / "data", a.samples, a.shards, jpegs, kinds)
    small = make_dataset(work / "small", a.map_samples, a.map_shards, jpegs, kinds)
    tiny = make_dataset(work / "tiny", 4, 2, jpegs, ["wds"])  # the fleet's start-up
    progress(f"data made in {time.perf_counter() - t0:.1f} s")
    if with_fleet:
        import logging

        import ray

        # The actors import the map as `sources:decode_map`: this directory on their PYTHONPATH.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        t0 = time.perf_counter()
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        progress(f"local Ray started in {time.perf_counter() - t0:.1f} s")
    streams = Streams(work / "streams")
    t0 = time.perf_counter()
    for kind in kinds:  # warm-up, not timed: imports, lazy set-up, the page cache
        library_run(data, kind, None)
        source_run(data, kind)
        await put_run(streams, small, kind)
    progress(f"warm-up in {time.perf_counter() - t0:.1f} s")
    res = Results()
    try:
        for rep in range(a.reps):
            await one_repetition(rep, a, kinds, data, small, tiny, streams, res)
    finally:
        if with_fleet:
            import ray

            ray.shutdown()
    report(a, kinds, data, small, res)
    if a.plot:
        path = Path(a.plot)
        plot(a, kinds, res, path)
        print(f"plot: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples, one repetition (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="every part in seconds, a few dozen samples")
    ap.add_argument("--samples", type=int, help="samples without a map (default 10000, quick 2000)")
    ap.add_argument("--map-samples", type=int, help="samples with the map (default 1500, quick 300)")
    ap.add_argument("--reps", type=int, help="repetitions (default 3, quick 1)")
    ap.add_argument("--pairs", type=int, help="library/source read pairs per repetition (default 3, quick 2)")
    ap.add_argument("--workers", nargs="+", type=int, help="map workers (default 0 1 2)")
    ap.add_argument("--fleet", nargs="*", type=int, help="fleet sizes (default 1 2, quick and smoke 2; none: no fleet)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--plot", help="where to write the plot (full run: docs/sources_throughput.png; else a temp dir)")
    a = ap.parse_args(argv)
    if a.smoke:
        defaults = {"samples": 64, "map_samples": 16, "reps": 1, "pairs": 1, "workers": [0, 1], "fleet": [2]}
    elif a.quick:
        defaults = {"samples": 2000, "map_samples": 300, "reps": 1, "pairs": 2, "workers": [0, 1, 2], "fleet": [2]}
    else:
        defaults = {"samples": 10000, "map_samples": 1500, "reps": 3, "pairs": 3, "workers": [0, 1, 2], "fleet": [1, 2]}
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.shards = max(2, min(24, a.samples // 500))
    a.map_shards = max(2, min(8, a.map_samples // 100))
    kinds = list(a.kinds)
    notes = []
    if "hf" in kinds and (why := hf_status()):
        kinds.remove("hf")
        notes.append(f"hf: left out, open_source('hf:...') is not available ({why})")
    if a.fleet and (why := fleet_status()):
        a.fleet = []
        notes.append(f"fleet: left out, lakestream.ray.run_fleet is not available ({why})")
    cmd = shlex.join([".venv/bin/python", "bench/sources.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"$ {cmd}")
    print(f"machine: {machine_description()}")
    print(
        f"kinds {', '.join(kinds)}; {a.samples} samples without a map, {a.map_samples} with it; {a.reps} repetition(s); "
        f"map workers {a.workers}; fleet sizes {a.fleet or 'none'}; stream: file://, world size {WORLD_SIZE}, "
        f"global batch {GLOBAL_BATCH}; MB/s = 10^6 bytes of JPEG read per second",
        flush=True,
    )
    for note in notes:
        print(note)
    print(f"load average at start: {load_average()}", flush=True)
    t0 = time.perf_counter()
    with removing(temp_dir("lakestream-sources-")) as work:
        if a.plot is None:
            full = not (a.smoke or a.quick)
            a.plot = str(REPO / "docs" / "sources_throughput.png") if full else str(work / "sources_throughput.png")
        rc = anyio.run(main_async, a, kinds, work)
    print(f"load average at end: {load_average()}; total time {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
