"""Every name Lakestream gives to something on a store or in the mount, in one place. No I/O.

    <stream>/_lakestream/log/<version:020d>.json               one record per version
    <stream>/_lakestream/snapshots/<version:020d>.json         the state at that version
    <stream>/_lakestream/last_snapshot                         hint {"version": v}
    <stream>/_lakestream/tail                                  hint {"version": v, "head": h}
    <stream>/_lakestream/consumed                              mark {"step": s, "ts": t} (job `main`)
    <stream>/_lakestream/jobs/<job>/consumed                   mark {"step": s, "ts": t} (another job)
    <stream>/_lakestream/intents/<producer>/<epoch>-<seq>.json  a declared commit (combining)
    <stream>/_lakestream/intents/<producer>/r-<token>.json      a declared register (combining)
    <stream>/segments/<producer>/<epoch>-<seq>-<t><rand>.tgb   one immutable object per TGB
    .<name>.<hex>.tmp beside an object                         a put in progress (file://)

    MOUNT/_status.json, MOUNT/rank-<r>/latest, MOUNT/rank-<r>/<step:012d>/<key>.<field>,
    MOUNT/rank-<r>/<step:012d>/_meta.json

docs/format.md describes each format; this module only names things and parses names back.
"""

from __future__ import annotations

import re
import uuid

__all__ = [
    "CONSUMED_KEY",
    "COST_FIELD",
    "END_NAME",
    "HINT_KEY",
    "INTENTS_PREFIX",
    "JOBS_PREFIX",
    "KEY_FIELD",
    "LATEST_NAME",
    "LOG_PREFIX",
    "META_NAME",
    "RESERVED_FIELDS",
    "RESERVED_KEYS",
    "SEGMENTS_PREFIX",
    "SNAPSHOT_PREFIX",
    "SOURCE_FIELD",
    "STATUS_NAME",
    "TAIL_KEY",
    "TMP_SUFFIX",
    "consumed_key",
    "intent_key",
    "log_key",
    "parse_intent_key",
    "parse_segment_key",
    "rank_dir",
    "register_intent_key",
    "segment_key",
    "segment_prefix",
    "snapshot_key",
    "step_dir",
    "version_of",
]

LOG_PREFIX = "_lakestream/log/"
SNAPSHOT_PREFIX = "_lakestream/snapshots/"
HINT_KEY = "_lakestream/last_snapshot"
TAIL_KEY = "_lakestream/tail"  # where the log ends, as its last writer saw it (a hint)
CONSUMED_KEY = "_lakestream/consumed"  # the step the trainer consumed last (back-pressure's base)
JOBS_PREFIX = "_lakestream/jobs/"


def consumed_key(job: str) -> str:
    """Where training job `job` publishes its consumption mark (`main`'s: CONSUMED_KEY, as ever)."""
    return CONSUMED_KEY if job == "main" else f"{JOBS_PREFIX}{job}/consumed"


INTENTS_PREFIX = "_lakestream/intents/"  # what producers declared for combining committers to commit
SEGMENTS_PREFIX = "segments/"
TMP_SUFFIX = ".tmp"

KEY_FIELD = "__key__"  # the sample member that names the sample
COST_FIELD = "__cost__"  # a sample member that is its cost for rank balancing (not stored)
SOURCE_FIELD = "__source__"  # the field naming a sample's source under a mixture
STATUS_NAME = "_status.json"  # the mount's status file, at its root
META_NAME = "_meta.json"  # the mount's index of one rank slice, in its step directory
LATEST_NAME = "latest"  # the mount's symlink to a rank's newest step
END_NAME = "END"  # the mount's file in a rank directory once the stream ended (closed, its last step committed)
RESERVED_FIELDS = frozenset({KEY_FIELD, COST_FIELD, SOURCE_FIELD})  # what a source's own data may not name a field
RESERVED_KEYS = frozenset({STATUS_NAME.removesuffix(".json"), META_NAME.removesuffix(".json")})


def log_key(version: int) -> str:
    return f"{LOG_PREFIX}{version:020d}.json"


def snapshot_key(version: int) -> str:
    return f"{SNAPSHOT_PREFIX}{version:020d}.json"


def version_of(key: str) -> int | None:
    """The version of a log or snapshot key, or None if it is not one."""
    stem = key.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem) if stem.isdigit() and len(stem) == 20 else None


def intent_key(producer: str, epoch: int, seq: int) -> str:
    """Where a producer declares its commit of TGBs `seq`.. (epoch `epoch`) for a combiner."""
    return f"{INTENTS_PREFIX}{producer}/{epoch}-{seq}.json"


def register_intent_key(producer: str, token: str) -> str:
    """Where a producer declares its new incarnation (`token`) for a combiner."""
    return f"{INTENTS_PREFIX}{producer}/r-{token}.json"


_INTENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})/(?:r-([0-9a-f]{1,64})|([0-9]{1,18})-([0-9]{1,18}))\.json")


def parse_intent_key(key: str) -> tuple[str, int, int] | tuple[str, str] | None:
    """(producer, epoch, seq) of a commit intent's key, (producer, token) of a register intent's,
    or None for anything else."""
    m = _INTENT.fullmatch(key.removeprefix(INTENTS_PREFIX)) if key.startswith(INTENTS_PREFIX) else None
    if m is None:
        return None
    producer, token, epoch, seq = m.groups()
    return (producer, token) if token is not None else (producer, int(epoch), int(seq))


def segment_prefix(producer: str, epoch: int, seq: int) -> str:
    """`segments/<producer>/<epoch>-<seq>-`: how every key of that TGB starts. Producer ids have no
    `/` and the numbers are decimal, so no two (producer, epoch, seq) share a key."""
    return f"{SEGMENTS_PREFIX}{producer}/{epoch}-{seq}-"


def segment_key(producer: str, epoch: int, seq: int, now: float) -> str:
    """`segments/<producer>/<epoch>-<seq>-<t><rand>.tgb`: `t` is the upload time in ms (12 hex
    digits), so that GC can tell an old orphan from an upload whose commit is still on its way."""
    return f"{segment_prefix(producer, epoch, seq)}{int(now * 1000):012x}{uuid.uuid4().hex[:20]}.tgb"


def parse_segment_key(key: str) -> tuple[str, int, int, float] | None:
    """(producer, epoch, seq, upload time) of a segment key, or None if it is not one."""
    try:
        _, producer, name = key.split("/")
        epoch, seq, rest = name.removesuffix(".tgb").split("-")
        return producer, int(epoch), int(seq), int(rest[:12], 16) / 1000
    except ValueError:
        return None


def rank_dir(rank: int) -> str:
    return f"rank-{rank}"


def step_dir(step: int) -> str:
    return f"{step:012d}"
