"""Every error Lakestream raises on purpose.

    LakestreamError
    ├── StoreError                       the object store failed
    │   ├── ObjectNotFound               (also FileNotFoundError)
    │   ├── StoreUnavailable             endpoint unreachable, timeouts (also ConnectionError)
    │   ├── AccessDenied                 bad credentials, no permission (also PermissionError)
    │   ├── StoreFull                    no space left on the device (also OSError)
    │   └── BucketNotFound               (also FileNotFoundError)
    ├── StreamNotFound                   no stream at this URL (also FileNotFoundError)
    ├── ConfigMismatch                   init over a stream with another config (also ValueError)
    ├── ProducerFenced                   a newer incarnation of this producer registered
    ├── StreamClosed                     the stream is closed: nothing more is committed
    ├── SegmentLost                      an uploaded segment vanished before its commit
    ├── CorruptData                      a checksum or format check failed
    ├── InvalidSample                    a sample, key, field or cursor is unusable (also ValueError)
    └── StepUnavailable                  a step was reclaimed or discarded (also LookupError)

Caller misuse (wrong types, impossible arguments) raises plain ValueError/TypeError.
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "BucketNotFound",
    "ConfigMismatch",
    "CorruptData",
    "InvalidSample",
    "LakestreamError",
    "MixChanged",
    "ObjectNotFound",
    "ProducerFenced",
    "SegmentLost",
    "StepUnavailable",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "StreamClosed",
    "StreamNotFound",
]


class LakestreamError(Exception):
    """Base of every error Lakestream raises on purpose."""


class StoreError(LakestreamError):
    """The object store failed."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """An object does not exist."""


class StoreUnavailable(StoreError, ConnectionError):
    """The object store could not be reached, or kept failing after retries.

    `retried` is True when the store already retried the call as long as it was configured to,
    so callers should not retry again.
    """

    def __init__(self, *args: object, retried: bool = False) -> None:
        super().__init__(*args)
        self.retried = retried


class AccessDenied(StoreError, PermissionError):
    """The object store refused the credentials or the operation."""


class StoreFull(StoreError, OSError):
    """The store has no space left (a full disk or quota); free space, e.g. with `lakestream gc`."""


class BucketNotFound(StoreError, FileNotFoundError):
    """The bucket named in the URL does not exist."""


class StreamNotFound(LakestreamError, FileNotFoundError):
    """No stream has been created at this URL."""


class ConfigMismatch(LakestreamError, ValueError):
    """A stream exists with a different configuration, or a client disagrees with it."""


class ProducerFenced(LakestreamError):
    """A newer incarnation of this producer registered; this one may not commit."""


class StreamClosed(LakestreamError):
    """The stream is closed (`lakestream close`): no step past the close is committed, so a
    producer stops; what it produced that did not fit is not committed. `lakestream reopen` undoes
    the close, and the producer run again resumes from its committed cursor."""


class StreamInUse(LakestreamError):
    """`delete` refused: producers of the stream are live (they wrote a record lately)."""


class MixChanged(LakestreamError):
    """A mixture record put other weights in force at the step a producer's sealed TGBs would take:
    they are never committed; the producer starts again from its committed cursors and reseals."""


class SegmentLost(LakestreamError):
    """A producer's uploaded segment was deleted (by GC, as an old orphan) before its commit.

    Not raised by this version: producers upload again what waits (`_decisions.MAX_UPLOAD_AGE`);
    kept so that code catching it still runs.
    """


class CorruptData(LakestreamError):
    """Stored bytes failed a checksum or format check."""


class InvalidSample(LakestreamError, ValueError):
    """A sample, sample key, field name or cursor cannot be stored."""


class StepUnavailable(LakestreamError, LookupError):
    """A step is not readable: it was reclaimed, or discarded by a rewind."""


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The leaf of `group` to report: the first Lakestream error, else the first OSError, else the first leaf."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        e = pending.pop(0)
        if isinstance(e, BaseExceptionGroup):
            pending[:0] = e.exceptions
        else:
            leaves.append(e)
    for kind in (LakestreamError, OSError, Exception):
        if found := next((e for e in leaves if isinstance(e, kind)), None):
            return found
    return leaves[0] if leaves else group
