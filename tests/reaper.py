"""The test run's reaper: `python reaper.py RUN PID TEMP`, its stdin a pipe from the test run (conftest.py).

When the pipe closes (the run ended, was interrupted or was killed: the kernel closes it in every case)
it ends every process the run started and left behind, wherever it sits in the process tree (a SeaweedFS
server, a Ray cluster, a FUSE mount, a nats-server, a CLI in a new session, an xdist worker of a killed
run): each has LAKESTREAM_TEST_RUN=RUN in its environment. SIGTERM first (a mount unmounts, `ray start
--block` stops its cluster), SIGKILL after a grace; then it lazily unmounts the FUSE mounts left under
TEMP. PID (the run itself) is spared. Prints one line for what it had to end; nothing if nothing.
Standard library only: it starts in a blink and outlives anything the tests import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

RUN_VAR = "LAKESTREAM_TEST_RUN"
GRACE = 10.0


def marked(run: str, spare: set[int]) -> dict[int, str]:
    """{pid: command line} of the live processes with RUN_VAR=run in their environment."""
    needle = f"{RUN_VAR}={run}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in spare:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
    return found


def signal_all(pids: dict[int, str], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def fuse_mounts_under(root: str) -> list[str]:
    """Mount points of FUSE file systems at or below `root` (from /proc/self/mountinfo)."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest.startswith("fuse"):
            continue
        point = parts[4].encode().decode("unicode_escape")  # \040 for a space, ...
        if point == root or point.startswith(root.rstrip("/") + "/"):
            out.append(point)
    return out


def reap(run: str, spare: set[int], temp: str) -> list[str]:
    """End what the run left; a description of each process or mount ended."""
    left = marked(run, spare)
    deadline = time.monotonic() + 2.0  # xdist workers of a run that ended may be exiting still
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked(run, spare)
    ended = [f"{pid} {cmd[:120]}" for pid, cmd in left.items()]
    if left:
        signal_all(left, signal.SIGTERM)
        deadline = time.monotonic() + GRACE
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = marked(run, spare)
        for _ in range(3):  # a dying parent may still have started one more child
            if not left:
                break
            signal_all(left, signal.SIGKILL)
            time.sleep(0.5)
            left = marked(run, spare)
    for point in fuse_mounts_under(temp) if temp else []:
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, timeout=30)
        ended.append(f"mount {point}")
    return ended


def main() -> None:
    run, pid, temp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the run: this ends after it
    while sys.stdin.buffer.read(4096):
        pass
    ended = reap(run, {os.getpid(), pid}, temp)
    if ended:
        print(f"reaper: ended {len(ended)} left over by the test run: " + "; ".join(ended), file=sys.stderr)


if __name__ == "__main__":
    main()
