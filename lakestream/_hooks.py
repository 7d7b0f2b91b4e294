"""What the engine reports as it works: the recorder interface, on the lowest floor.

The producer, the reader, the mount and GC call these hooks once per TGB, commit, step, fetch or
request, never per sample. The base recorders record nothing; `lakestream.metrics` installs
Prometheus ones (`install`) when it is imported with `prometheus_client` available. The engine
imports only this module, so measuring never makes the engine depend on what measures it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The engine's objects are `Any` here: this floor names none of the modules above it, not even for
# type checking (`lakestream.metrics` types them where it records).

__all__ = [
    "NOOP_MOUNT",
    "NOOP_PRODUCER",
    "NOOP_READER",
    "Hooks",
    "MountRecorder",
    "ProducerRecorder",
    "ReaderRecorder",
    "gc_done",
    "install",
    "install_on_first_use",
    "mount",
    "producer",
    "reader",
    "track_map",
]


class ProducerRecorder:
    """What a producer records; this base records nothing."""

    __slots__ = ()

    def uploaded(self, nbytes: int) -> None:
        pass

    def upload_failed(self, error: BaseException) -> None:
        pass

    def committed(self, tgb: Any, seconds: float) -> None:
        pass

    def appended(self, result: Any) -> None:
        pass

    def held(self, seconds: float) -> None:
        pass


class ReaderRecorder:
    """What a reader records; this base records nothing."""

    __slots__ = ()

    def stalled(self, seconds: float) -> None:
        pass

    def fetched(self, nbytes: int) -> None:
        pass

    def checksum_failed(self) -> None:
        pass


class MountRecorder:
    """What the mount records; this base records nothing."""

    __slots__ = ()

    def hit(self, rank: int) -> None:
        pass

    def miss(self, rank: int) -> None:
        pass

    def fetch(self, seconds: float) -> None:
        pass

    def waited(self, seconds: float) -> None:
        pass

    def eio(self, op: str) -> None:
        pass


NOOP_PRODUCER, NOOP_READER, NOOP_MOUNT = ProducerRecorder(), ReaderRecorder(), MountRecorder()


class Hooks:
    """Where recorders come from; this base hands out the ones that record nothing."""

    def producer(self, p: Any) -> ProducerRecorder:
        return NOOP_PRODUCER

    def reader(self, r: Any) -> ReaderRecorder:
        return NOOP_READER

    def mount(self, fs: Any) -> MountRecorder:
        return NOOP_MOUNT

    def track_map(self, stream: str, producer_id: str, stats: Any) -> None:
        pass

    def gc_done(self, report: Any) -> None:
        pass


class _OnFirstUse(Hooks):
    """Hooks that run `load` when the engine first asks for one, which installs the real ones (or
    does not: then these record nothing), and hand over to them."""

    def __init__(self, load: Callable[[], object]) -> None:
        self._load = load

    def _installed(self) -> Hooks:
        if _hooks is self:
            self._load()
            if _hooks is self:
                install(Hooks())
        return _hooks

    def producer(self, p: Any) -> ProducerRecorder:
        return self._installed().producer(p)

    def reader(self, r: Any) -> ReaderRecorder:
        return self._installed().reader(r)

    def mount(self, fs: Any) -> MountRecorder:
        return self._installed().mount(fs)

    def track_map(self, stream: str, producer_id: str, stats: Any) -> None:
        self._installed().track_map(stream, producer_id, stats)

    def gc_done(self, report: Any) -> None:
        self._installed().gc_done(report)


_hooks: Hooks = Hooks()


def install(hooks: Hooks) -> None:
    """Make `hooks` hand out the recorders of every producer, reader and mount created from now on."""
    global _hooks
    _hooks = hooks


def install_on_first_use(load: Callable[[], object]) -> None:
    """Run `load` (which installs hooks) only when the engine first asks for a recorder: a process
    that records nothing (most command-line commands) never pays for what measures."""
    if type(_hooks) is Hooks:  # nothing installed yet
        install(_OnFirstUse(load))


def producer(p: Any) -> ProducerRecorder:
    """The recorder of a producer."""
    return _hooks.producer(p)


def reader(r: Any) -> ReaderRecorder:
    """The recorder of a reader of one rank (or of the mount's reader)."""
    return _hooks.reader(r)


def mount(fs: Any) -> MountRecorder:
    """The recorder of a mount (`lakestream_mount.LakeFS`)."""
    return _hooks.mount(fs)


def track_map(stream: str, producer_id: str, stats: Any) -> None:
    """Expose a transform's figures as the producer's (None: no transform)."""
    _hooks.track_map(stream, producer_id, stats)


def gc_done(report: Any) -> None:
    """Count a GC run."""
    _hooks.gc_done(report)
