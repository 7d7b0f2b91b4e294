"""Prometheus metrics of producers, readers, the mount, GC and the manifest (extra `metrics`).

    import lakestream.metrics
    lakestream.metrics.serve(9300)          # http://127.0.0.1:9300/metrics, from a daemon thread

Every metric is defined here, once, in the default registry of `prometheus_client` (with its
process metrics). The engine records through small recorders (`producer`, `reader`, `mount`,
`gc_done`) called once per TGB, commit, step, fetch or request, never per sample; a recorder is a
no-op when `prometheus_client` is not installed or recording is switched off (`set_enabled`),
so the core runs without the extra at the cost of one empty method call. What is a level rather
than an event (the manifest head and watermark, DAC's pace, prefetch depth, lookups waiting, the
slice cache's size) is read from the live objects when a scrape asks for it, so nothing is paid
for it in between.

Labels: `stream` (the stream URL), `producer` (a producer id), `rank`, plus `kind` (an error's
type name) and `op` (a FUSE operation): each takes as many values as the process has streams,
producers, ranks, error types or operations, never one per step, key or sample. docs/observability.md
lists every metric with what it means and what to alert on.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError:  # the core works without the extra: every recorder is a no-op
    prom = None  # type: ignore[assignment]

from . import _hooks
from ._hooks import NOOP_MOUNT, NOOP_PRODUCER, NOOP_READER, MountRecorder, ProducerRecorder, ReaderRecorder

if TYPE_CHECKING:
    from ._gc import GcReport
    from ._manifest import AppendResult, Manifest
    from ._producer import Producer, _Tgb
    from ._reader import Reader
    from ._transform import MapStats

__all__ = [
    "AVAILABLE",
    "NOOP_MOUNT",
    "NOOP_PRODUCER",
    "NOOP_READER",
    "MountRecorder",
    "ProducerRecorder",
    "ReaderRecorder",
    "enabled",
    "gc_done",
    "mount",
    "producer",
    "reader",
    "serve",
    "set_enabled",
    "track_map",
]

AVAILABLE = prom is not None
_enabled = AVAILABLE

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def enabled() -> bool:
    """Whether new recorders record (prometheus_client is installed and recording is on)."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Switch recording on or off for recorders created from now on (benchmarks compare the two).
    On needs prometheus_client."""
    global _enabled
    _enabled = bool(on) and AVAILABLE


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve every metric at `http://ADDR:PORT/metrics` from a daemon thread; the port bound (0:
    any free one). Raises ImportError without the `metrics` extra, OSError if the port is taken."""
    if prom is None:
        raise ImportError("metrics need the 'metrics' extra: pip install 'lakestream[metrics]' (prometheus-client)")
    if type(port) is not int or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an integer in 0..65535, got {port!r}")
    prom.disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series: half as many
    try:
        server, _ = prom.start_http_server(port, addr=addr)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from None
    return int(server.server_port)


# -- the metrics ----------------------------------------------------------------------------------

if prom is not None:
    S, SP, SR = ["stream"], ["stream", "producer"], ["stream", "rank"]
    C, G, H = prom.Counter, prom.Gauge, prom.Histogram

    P_SAMPLES = C("lakestream_producer_samples", "Samples in TGBs committed by this producer", SP)
    P_BYTES = C("lakestream_producer_bytes", "Segment bytes of TGBs committed by this producer", SP)
    P_TGBS = C("lakestream_producer_tgbs", "TGBs (steps) committed by this producer", SP)
    P_COMMIT = H(
        "lakestream_producer_commit_latency_seconds",
        "Seconds from sealing a TGB to seeing it committed (visible to readers)", SP, buckets=LATENCY_BUCKETS,
    )  # fmt: skip
    P_APPENDS = C("lakestream_producer_log_appends", "Manifest log records written (registers and commits)", SP)
    P_LOST = C("lakestream_producer_lost_races", "Conditional puts of a log version that another writer won", SP)
    P_HELD = C(
        "lakestream_producer_backpressure_wait_seconds",
        "Seconds spent waiting for room under max_steps_ahead (back-pressure)", SP,
    )  # fmt: skip
    P_UPLOAD = C("lakestream_producer_upload_bytes", "Segment bytes uploaded (committed or not yet)", SP)
    P_UPLOAD_ERR = C(
        "lakestream_producer_upload_errors", "Failed segment uploads (each retried), by error type", [*SP, "kind"]
    )
    R_STALL = H(
        "lakestream_reader_stall_seconds",
        "Seconds the consumer waited for its next batch (from asking to getting it)", SR, buckets=STALL_BUCKETS,
    )  # fmt: skip
    R_BYTES = C("lakestream_reader_bytes_fetched", "Bytes of rank slices fetched from the store", SR)
    R_CRC = C("lakestream_reader_checksum_failures", "Slices whose bytes failed the checksum of their commit", SR)
    M_HITS = C("lakestream_mount_cache_hits", "Slice requests served from the mount's cache (or a fetch under way)", SR)
    M_MISSES = C("lakestream_mount_cache_misses", "Slice requests that fetched from the store", SR)
    M_FETCH = H(
        "lakestream_mount_fetch_seconds", "Seconds to fetch, check and index one rank slice", S, buckets=FETCH_BUCKETS
    )
    M_WAIT = H(
        "lakestream_mount_lookup_wait_seconds", "Seconds a lookup of an uncommitted step waited for its commit", S,
        buckets=STALL_BUCKETS,
    )  # fmt: skip
    M_EIO = C("lakestream_mount_eio", "FUSE requests answered with EIO, by operation", [*S, "op"])
    GC_RUNS = C("lakestream_gc_runs", "GC runs that completed (not dry runs)", S)
    GC_BYTES = C("lakestream_gc_reclaimed_bytes", "Bytes GC deleted (segments and temporary files)", S)
    GC_SEGMENTS = C("lakestream_gc_segments_deleted", "Segments GC deleted", S)
    GC_LAST = G("lakestream_gc_last_run_timestamp_seconds", "Unix time of the last completed GC run", S)


# -- recorders: the no-op ones are the base classes, in _hooks ----------------------------------------


class _Producer(ProducerRecorder):
    __slots__ = ("_appends", "_bytes", "_commit", "_err", "_held", "_labels", "_lost", "_samples", "_tgbs", "_up")

    def __init__(self, stream: str, producer_id: str) -> None:
        self._labels = (stream, producer_id)
        self._samples, self._bytes = P_SAMPLES.labels(*self._labels), P_BYTES.labels(*self._labels)
        self._tgbs, self._commit = P_TGBS.labels(*self._labels), P_COMMIT.labels(*self._labels)
        self._appends, self._lost = P_APPENDS.labels(*self._labels), P_LOST.labels(*self._labels)
        self._held, self._up = P_HELD.labels(*self._labels), P_UPLOAD.labels(*self._labels)
        self._err: dict[str, Any] = {}

    def uploaded(self, nbytes: int) -> None:
        self._up.inc(nbytes)

    def upload_failed(self, error: BaseException) -> None:
        kind = type(error).__name__
        child = self._err.get(kind)
        if child is None:
            child = self._err[kind] = P_UPLOAD_ERR.labels(*self._labels, kind)
        child.inc()

    def committed(self, tgb: _Tgb, seconds: float) -> None:
        samples = nbytes = 0
        for _, length, _, n in tgb.ref.ranks if tgb.ref is not None else ():
            samples += n
            nbytes += length
        self._samples.inc(samples)
        self._bytes.inc(nbytes)
        self._tgbs.inc()
        self._commit.observe(seconds)

    def appended(self, result: AppendResult) -> None:
        if result.conflicts:
            self._lost.inc(result.conflicts)
        if result.version is not None:
            self._appends.inc()

    def held(self, seconds: float) -> None:
        self._held.inc(seconds)


class _Reader(ReaderRecorder):
    __slots__ = ("_bytes", "_crc", "_stall")

    def __init__(self, stream: str, rank: str) -> None:
        self._stall = R_STALL.labels(stream, rank)  # its _count: the steps delivered
        self._bytes, self._crc = R_BYTES.labels(stream, rank), R_CRC.labels(stream, rank)

    def stalled(self, seconds: float) -> None:
        self._stall.observe(seconds)

    def fetched(self, nbytes: int) -> None:
        self._bytes.inc(nbytes)

    def checksum_failed(self) -> None:
        self._crc.inc()


class _Mount(MountRecorder):
    __slots__ = ("_eio", "_fetch", "_hits", "_misses", "_stream", "_wait")

    def __init__(self, stream: str) -> None:
        self._stream = stream
        self._hits: dict[int, Any] = {}
        self._misses: dict[int, Any] = {}
        self._eio: dict[str, Any] = {}
        self._fetch, self._wait = M_FETCH.labels(stream), M_WAIT.labels(stream)

    def hit(self, rank: int) -> None:
        c = self._hits.get(rank)
        if c is None:
            c = self._hits[rank] = M_HITS.labels(self._stream, str(rank))
        c.inc()

    def miss(self, rank: int) -> None:
        c = self._misses.get(rank)
        if c is None:
            c = self._misses[rank] = M_MISSES.labels(self._stream, str(rank))
        c.inc()

    def fetch(self, seconds: float) -> None:
        self._fetch.observe(seconds)

    def waited(self, seconds: float) -> None:
        self._wait.observe(seconds)

    def eio(self, op: str) -> None:
        c = self._eio.get(op)
        if c is None:
            c = self._eio[op] = M_EIO.labels(self._stream, op)
        c.inc()


# -- what is read at scrape time --------------------------------------------------------------------

_lock = threading.RLock()  # reentrant: a weakref callback may run while it is held
_producers: weakref.WeakSet[Any] = weakref.WeakSet()
_readers: weakref.WeakSet[Any] = weakref.WeakSet()
_mounts: weakref.WeakSet[Any] = weakref.WeakSet()
_manifests: weakref.WeakSet[Any] = weakref.WeakSet()
_maps: dict[int, tuple[weakref.ref[Any], tuple[str, str]]] = {}  # by id: MapStats is not hashable


def _live(objects: weakref.WeakSet[Any]) -> list[Any]:
    with _lock:
        return list(objects)


def _watch(objects: weakref.WeakSet[Any], obj: Any) -> None:
    with _lock:
        objects.add(obj)


def producer(p: Producer) -> ProducerRecorder:
    """The recorder of a producer (and its manifest and pace read at scrape time)."""
    if not _enabled:
        return NOOP_PRODUCER
    _watch(_producers, p)
    _watch(_manifests, p.manifest)
    return _Producer(p.store.url, p.id)


def reader(r: Reader) -> ReaderRecorder:
    """The recorder of a reader of one rank (the mount's reader, of any rank: rank="any")."""
    if not _enabled:
        return NOOP_READER
    _watch(_readers, r)
    _watch(_manifests, r.manifest)
    return _Reader(r.store.url, "any" if r.rank is None else str(r.rank))


def mount(fs: Any) -> MountRecorder:
    """The recorder of a mount (`lakestream_mount.LakeFS`)."""
    if not _enabled:
        return NOOP_MOUNT
    _watch(_mounts, fs)
    return _Mount(fs.reader.url)


def track_map(stream: str, producer_id: str, stats: MapStats | None) -> None:
    """Expose a transform's figures (read at scrape time) as the producer's (None: no transform)."""
    if _enabled and stats is not None:
        key = id(stats)

        def gone(_: object) -> None:
            with _lock:
                _maps.pop(key, None)

        with _lock:
            _maps[key] = (weakref.ref(stats, gone), (stream, producer_id))


def gc_done(report: GcReport) -> None:
    """Count a GC run (dry runs are not counted)."""
    if not _enabled or report.dry_run:
        return
    GC_RUNS.labels(report.url).inc()
    GC_BYTES.labels(report.url).inc(report.bytes_freed)
    GC_SEGMENTS.labels(report.url).inc(report.segments_deleted)
    GC_LAST.labels(report.url).set(time.time())


def _pace(policy: Any) -> tuple[float, float, float]:
    """(pace seconds, multiplier, slot latency) of a commit policy: DAC's T = m · N · L."""
    interval = getattr(policy, "interval", None)
    if callable(interval):
        return float(interval(getattr(policy, "_active", 1))), float(policy.multiplier), float(policy.latency)
    if isinstance(interval, (int, float)):
        return float(interval), 1.0, 0.0
    return 0.0, 1.0, 0.0


def _gauge(name: str, doc: str, labels: list[str], rows: dict[tuple[str, ...], float]) -> Any:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for key, value in rows.items():
        g.add_metric(list(key), value)
    return g


def _counter(name: str, doc: str, labels: list[str], rows: dict[tuple[str, ...], float]) -> Any:
    c = CounterMetricFamily(name, doc, labels=labels)
    for key, value in rows.items():
        c.add_metric(list(key), value)
    return c


def _manifest_rows(manifests: list[Manifest]) -> dict[str, dict[tuple[str, ...], float]]:
    """Per stream, the newest view any live manifest of it holds."""
    best: dict[str, Any] = {}
    for m in manifests:
        s = m.state
        if s.config is not None and (m.url not in best or s.version > best[m.url].version):
            best[m.url] = s
    out: dict[str, dict[tuple[str, ...], float]] = {k: {} for k in ("head", "first", "mark", "ahead", "version")}
    for url, s in best.items():
        head, mark = s.head, s.watermark
        base = mark if s.checkpoints else s.first_step - 1
        out["head"][(url,)] = head
        out["first"][(url,)] = s.first_step
        out["mark"][(url,)] = mark
        out["ahead"][(url,)] = head - base
        out["version"][(url,)] = s.version
    return out


class _LiveCollector:
    """Levels read from the live producers, readers, mounts and manifests at scrape time."""

    def describe(self) -> list[Any]:
        return []  # unchecked: the families depend on what is alive

    def collect(self) -> Iterator[Any]:
        for _ in range(3):  # a dict resized by the event loop mid-read: read again
            try:
                return iter(self._collect())
            except RuntimeError:
                continue
        return iter(())

    def _collect(self) -> list[Any]:
        pace: dict[tuple[str, ...], float] = {}
        mult: dict[tuple[str, ...], float] = {}
        slot: dict[tuple[str, ...], float] = {}
        inflight: dict[tuple[str, ...], float] = {}
        pending: dict[tuple[str, ...], float] = {}
        for p in _live(_producers):
            if p.epoch and p._tg is not None:  # registered and not closed
                key = (p.store.url, p.id)
                pace[key], mult[key], slot[key] = _pace(p._policy)
                inflight[key], pending[key] = p._inflight, len(p._pending)
        depth: dict[tuple[str, ...], float] = {}
        ahead_bytes: dict[tuple[str, ...], float] = {}
        for r in _live(_readers):
            if r._tg is not None and r.rank is not None:
                key = (r.store.url, str(r.rank))
                depth[key] = depth.get(key, 0) + len(r._fetches)
                ahead_bytes[key] = ahead_bytes.get(key, 0) + r._inflight_bytes
        waiting: dict[tuple[str, ...], float] = {}
        cache: dict[tuple[str, ...], float] = {}
        slices: dict[tuple[str, ...], float] = {}
        requests: dict[tuple[str, ...], float] = {}
        for fs in _live(_mounts):
            url = (fs.reader.url,)
            waiting[url] = waiting.get(url, 0) + fs._waiters
            cache[url] = cache.get(url, 0) + fs.cache.nbytes
            slices[url] = slices.get(url, 0) + len(fs.cache._slices)
            for op, n in list(fs.requests.items()):
                requests[(*url, op)] = requests.get((*url, op), 0) + n
        records: dict[tuple[str, ...], float] = {}
        outputs: dict[tuple[str, ...], float] = {}
        dropped: dict[tuple[str, ...], float] = {}
        skipped: dict[tuple[str, ...], float] = {}
        seconds: dict[tuple[str, ...], float] = {}
        with _lock:
            maps = [(st, key) for ref, key in _maps.values() if (st := ref()) is not None]
        for st, key in maps:
            records[key] = records.get(key, 0) + st.records
            outputs[key] = outputs.get(key, 0) + st.outputs
            dropped[key] = dropped.get(key, 0) + st.dropped
            skipped[key] = skipped.get(key, 0) + len(st.skipped)
            seconds[key] = seconds.get(key, 0) + st.seconds
        m = _manifest_rows(_live(_manifests))
        sp, sr, s = ["stream", "producer"], ["stream", "rank"], ["stream"]
        return [
            _gauge("lakestream_producer_pace_seconds", "Commit pace: DAC's interval T = m * N * L (before jitter "
                   "and the latency ceiling), an interval policy's interval, 0 for eager ones", sp, pace),
            _gauge("lakestream_producer_pace_multiplier", "DAC's multiplier m, moved by the lost races the "
                   "manifest reports", sp, mult),
            _gauge("lakestream_producer_slot_latency_seconds", "DAC's estimate L of one commit slot (the read "
                   "that finds the tail plus the put)", sp, slot),
            _gauge("lakestream_producer_inflight_bytes", "Sample bytes sealed and not committed yet", sp, inflight),
            _gauge("lakestream_producer_pending_tgbs", "TGBs sealed and not committed yet", sp, pending),
            _gauge("lakestream_reader_prefetch_depth", "Steps fetched or being fetched ahead of the consumer",
                   sr, depth),
            _gauge("lakestream_reader_prefetch_bytes", "Bytes of the steps being fetched ahead", sr, ahead_bytes),
            _gauge("lakestream_mount_lookups_waiting", "Lookups waiting for a step to be committed", s, waiting),
            _gauge("lakestream_mount_cache_bytes", "Bytes of rank slices in the mount's cache", s, cache),
            _gauge("lakestream_mount_cache_slices", "Rank slices in the mount's cache", s, slices),
            _counter("lakestream_mount_requests", "FUSE requests the mount served, by operation", ["stream", "op"],
                     requests),
            _counter("lakestream_transform_records", "Source records given to the map function", sp, records),
            _counter("lakestream_transform_outputs", "Samples the map function returned", sp, outputs),
            _counter("lakestream_transform_dropped", "Records the map function mapped to nothing", sp, dropped),
            _counter("lakestream_transform_skipped", "Records skipped because the map function raised "
                     "(--on-error skip)", sp, skipped),
            _counter("lakestream_transform_seconds", "Seconds spent in the map function (summed over worker "
                     "processes)", sp, seconds),
            _gauge("lakestream_manifest_head_step", "The newest committed step (-1: none)", s, m["head"]),
            _gauge("lakestream_manifest_first_step", "The oldest retained (not reclaimed) step", s, m["first"]),
            _gauge("lakestream_manifest_watermark_step", "The oldest retained checkpoint's step (-1: none)", s,
                   m["mark"]),
            _gauge("lakestream_manifest_steps_ahead", "Steps committed past the watermark (head - watermark; with "
                   "no checkpoint, past the first retained step): what max_steps_ahead bounds", s, m["ahead"]),
            _gauge("lakestream_manifest_version", "The newest manifest log version seen", s, m["version"]),
        ]  # fmt: skip


if prom is not None:
    prom.REGISTRY.register(_LiveCollector())


class _PrometheusHooks(_hooks.Hooks):
    """The engine's hooks, recorded here."""

    def producer(self, p: Producer) -> ProducerRecorder:
        return producer(p)

    def reader(self, r: Reader) -> ReaderRecorder:
        return reader(r)

    def mount(self, fs: Any) -> MountRecorder:
        return mount(fs)

    def track_map(self, stream: str, producer_id: str, stats: MapStats | None) -> None:
        track_map(stream, producer_id, stats)

    def gc_done(self, report: GcReport) -> None:
        gc_done(report)


if prom is not None:
    _hooks.install(_PrometheusHooks())
