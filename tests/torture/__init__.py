"""Torture test: everything at once, against a real S3 server (SeaweedFS), then check the result.

    .venv/bin/python tests/torture.py --minutes 10 [--seed N] [--replay] [--fork] [--keep] [--json FILE]
    .venv/bin/python -m pytest tests/test_torture.py        # the short versions (a minute or so each)

What runs, concurrently, for the chaos phase:

* 4 producers, `lakestream produce --from-dir` over 4 directories of small files with known bytes
  (throttled with `--rate`), SIGKILLed at random moments and restarted with the same producer id;
* trainer ranks (world size 2) reading every step in order, twice over: through the Python reader
  (`open_reader`, one subprocess per rank) and through a FUSE mount (`lakestream mount`
  subprocess, one plain-`open()` reader subprocess per rank). Every step a reader consumes is
  journaled (step, manifest version, producer, keys, a hash of every field). Reader processes and
  the mount daemon are SIGKILLed at random moments and restarted where their journal ends;
* rank 0's role (this process): a checkpoint every 6 steps, once every reader has consumed the step;
* `lakestream gc --orphan-grace G --force-grace` every few seconds (sometimes SIGKILLed half-way);
  G is 30 s, below the 300 s floor on purpose, to stress the producers' re-check of held uploads
  (5 s lost committed data in a long run; see docs/guarantees.md, "Torture test");
* one `lakestream rewind --to-checkpoint` half-way: every producer is fenced (exits non-zero
  with "fenced") and is restarted, resuming from its cursor as of the checkpoint; the Python
  readers notice the rewind themselves (StepUnavailable) and the mount readers are restarted,
  both from the checkpoint's step + 1;
* or, with `--replay` (`Config.replay`), that rewind is a replay instead: `lakestream rewind
  --to-checkpoint C --skip-steps A-B[,C-D]`, skipping 1 or 2 ranges of the steps after C (at most a
  quarter of them each) as the follower sees the head. No producer is fenced (a "fenced" exit is a
  failure) or moved back: running producers go on. The readers notice it as a rewind, as above. A
  failed command is run again unless the follower shows its record landed (applied at most once);
  the skipped TGBs' records are read at once, before GC may delete their segments;
* with `--fork` (`Config.fork`), half-way (at the first checkpoint after the rewind): `lakestream
  fork URL URL-fork --at-step S`, S the newest checkpoint's step + 1, into a second prefix of the
  same bucket (run again until it succeeds; once more at the end, when it must change nothing).
  Then the 4 producers run on the fork too (same ids, same source directories, throttled,
  SIGKILLed and restarted like the others, one of them within 3 s of the fork, never fenced)
  until their sources are exhausted in the drain; the first incarnation of each that registers
  must resume at the source's cursor as of S. Nothing reads the fork during the run, and only the
  source is GCed: the fork's final read proves that no GC of the source deleted a segment the fork
  shares;
* injected store faults everywhere: in subprocesses through `LAKESTREAM_FAULTS`
  (`lakestream.testing.inject_faults`: 503-like failures and ambiguous puts) plus a timeout hook
  added by the harness's child wrapper (`torture.py cli ...`, which runs the `lakestream` command
  and logs every injected fault); in this process through a FaultyStore wrapping the S3 store
  (follower, checkpoints, final reads).

Then a drain phase (no more chaos; producers restarted without a rate limit until their sources
are exhausted, readers catch up), a final GC, and the checks:

* the history (step -> version, producer, segment) observed by an in-process follower of the log is
  gap-free and agrees with the final state and with `lakestream verify`;
* every source record is in exactly one step of the final history, with its exact bytes, and each
  producer's records are in source order with the right cursor at every step. The final history is
  the reader-consumed steps below `first_step` (reclaimed by GC) plus the retained steps, read
  again at the end. After a replay, a record may instead be in exactly one TGB it skipped (never
  both), and the skipped TGBs count in their place in the history for the source order;
* after a replay, the follower saw the steps after the checkpoint become the old ones but the
  skipped, in order (the same TGBs at new step numbers), the skipped ones kept as skipped, and no
  producer's epoch or cursor move;
* every reader (both ranks, Python reader and mount) consumed every step of the final history, with
  the same (version, producer, samples, bytes) for a given (step, version, rank); each reclaimed
  step was consumed by every reader before the first checkpoint covering it was recorded;
* no reader failed on a retained step; StepUnavailable only where a rewind discarded a step;
* after the final GC, the bytes under `segments/` are within 10% of the retained steps' segment
  bytes (sum of Step.nbytes, with the skipped TGBs GC still keeps); after a log clean-up
  (in-process gc with lease 0, everything stopped) the whole stream prefix is too;
* with a fork (after a final GC of the fork too): its steps below S are exactly the source's TGBs
  (segment keys, producers, epochs, seqs, slices, cursors; version 0, read from the source's
  store) as the source had them when it forked, the source's still are, and its skipped TGBs are
  the source's below S; every source record is in exactly one step of the fork's final history
  (the source's reclaimed steps as its readers consumed them, then the fork's steps read again at
  the end, shared ones through the source's store, reading the bytes the source's readers read)
  or one skipped TGB it keeps, with its bytes, in source order with the right cursor at every
  step; `lakestream verify` of the fork passes; `lakestream fork` run again changes nothing;
  `lakestream delete SRC --yes` is refused naming
  the fork; then `lakestream unfork` and a `gc` of the source work: the source reclaims up to its
  watermark and `status` of it lists no forks.

Where each part lives:

* `driver.py`: the chaos driver, the schedule of kills, the rewind, the trainer's checkpoints and
  the GC cadence; the drain and the final GC; `run(cfg, url, env, workdir)` and `main(argv)`;
* `roles.py`: the process roles as the harness runs them (producers, Python and mount readers,
  the mount daemon, GC): how each is spawned, killed, restarted and journaled;
* `children.py`: what runs inside the child processes, `torture.py cli ARGS...`,
  `torture.py pyreader ...` and `torture.py mntreader ...`;
* `context.py`: the configuration, and `Run`, the harness's view of the run (the follower's
  history of the stream, what the readers journaled, counters and failures);
* `checker.py`: one function per guarantee, named after it (`check_exactly_once`,
  `check_gap_free_order`, `check_atomic_visibility`, `check_rewind_resumes_at_checkpoint`,
  `check_replay_keeps_the_rest_in_order`, `check_storage_reclaimed`,
  `check_fork_shares_the_source_steps`, `check_fork_exactly_once`,
  `check_unfork_releases_the_source`, ...), and the figures of the report.
"""

from __future__ import annotations

from .checker import Report
from .children import CHILD_MODES, child_main
from .context import Config
from .driver import main, run

__all__ = ["CHILD_MODES", "Config", "Report", "child_main", "main", "run"]
