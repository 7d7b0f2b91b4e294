"""Distributed training fed by a stream, with checkpoints, a crash, and an exact resume.

    torchrun --nproc-per-node 2 examples/train_torch.py train STREAM_URL --ckpt-dir DIR --steps 20
    torchrun --nproc-per-node 2 examples/train_torch.py train STREAM_URL --ckpt-dir DIR --steps 20 --kill-at 13
    torchrun --nproc-per-node 2 examples/train_torch.py train STREAM_URL --ckpt-dir DIR --steps 20 --resume
    python examples/train_torch.py produce STREAM_URL --samples N     # the producer on its own

`train` runs one process per rank (CPU, gloo, DistributedDataParallel) training a small MLP on
the `x` (features) and `y` (target) npy fields of the stream, one global batch per step, each rank
reading its slice with `lakestream.torch.StreamDataset`. Rank 0 creates the stream (idempotent)
and starts the producer (`produce`, below) as a subprocess, which writes `--steps` global batches
while training runs; `--no-produce` leaves producing to someone else. The producer's samples are
a deterministic function of their index, and it resumes after its last committed sample, so the
stream holds the same batches however often it is restarted.

Every `--checkpoint-every` steps rank 0 saves a trainer checkpoint (model, optimizer, RNG, the
dataset's state_dict, step) atomically (temporary file, fsync, rename, fsync of the directory)
and then records it in the stream with the checkpoint hook, which keeps the steps it needs
readable. `--resume` restores the newest trainer checkpoint, including where the dataset
continues. `--kill-at S` makes every rank exit abruptly (`os._exit`) when step S arrives, before
training on it: a crash. Rank 0 appends `step loss` lines to `--losses` (default
DIR/losses.txt), the loss (averaged over the ranks) as `float.hex`, so runs compare bit for bit.
`--keys FILE`: every rank appends a `step rank key...` line for each step it trains on.

The world size is torchrun's: nothing here assumes a number of ranks. A stream that exists keeps
its shape, so a job checkpointed at W ranks resumes at W2 once the stream is reshaped from the
checkpoint's next step (`lakestream reshape URL --world-size W2 --from-step N`): the dataset's
state_dict (`{"next_step": N}`) is the same for any world size, and a step not read as W2 ranks
stops the readers with ConfigMismatch rather than feed them part of it.

Determinism: fixed seeds, `torch.use_deterministic_algorithms(True)`, one thread per process, no
shuffling or dropout, so a run resumed from a checkpoint computes exactly the losses of a run that
never stopped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = 8
HIDDEN = 16
PRODUCER_ID = "features"
KILL_EXIT = 17


# -- the producer: a deterministic synthetic source -----------------------------------------------


def sample(i: int) -> dict[str, Any]:
    """Sample i: features and a noisy nonlinear target, a pure function of i."""
    rng = np.random.default_rng(i)
    x = rng.standard_normal(FEATURES).astype(np.float32)
    w = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    y = np.array([np.tanh(x @ w) + 0.05 * rng.standard_normal()], dtype=np.float32)
    return {"__key__": f"s{i:09d}", "x": x, "y": y}


async def produce(url: str, samples: int, producer_id: str) -> None:
    import lakestream

    async with lakestream.open_producer(url, producer_id, policy="eager") as producer:
        start = producer.cursor or 0  # resume after the last committed sample
        for i in range(start, samples):
            await producer.put(sample(i), cursor=i + 1)
    print(f"producer {producer_id}: resumed at {start}, put {producer.stats.samples} samples", flush=True)


def start_producer(url: str, samples: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start `produce` in a subprocess (output appended to `log_path`); if it fails, this process
    exits at once (and torchrun stops the other ranks) rather than wait for steps forever."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "produce", url, "--samples", str(samples)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def watch() -> None:
        if proc.wait() != 0:
            tail = log_path.read_text(errors="replace")[-2000:]
            print(f"the producer failed (exit {proc.returncode}); {log_path}:\n{tail}", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=watch, daemon=True, name="producer-watch").start()
    return proc


# -- training ---------------------------------------------------------------------------------------


def save_atomic(obj: Any, path: Path) -> None:
    """Write `obj` to `path` so that `path` is always either absent or complete, and durable."""
    import torch

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def ensure_stream(url: str, world: int, global_batch: int) -> None:
    """Create the stream for `world` ranks unless it exists. One that exists keeps its world size
    (a reshape may have changed it since it was created: the readers check each step's), but its
    global batch must be `global_batch`, which the producer's sample count assumes."""
    import lakestream

    try:
        state = await lakestream.load_state(url)
    except lakestream.StreamNotFound:
        await lakestream.create(url, world_size=world, global_batch=global_batch)
        return
    batch = state.batch_at(state.head + 1)
    if batch != global_batch:
        raise lakestream.ConfigMismatch(f"{url}: the stream's global batch is {batch}, not {global_batch}")


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("ckpt-*.pt"))  # zero-padded step: the last is the newest
    return found[-1] if found else None


def train(a: argparse.Namespace) -> int:
    import anyio
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from lakestream.torch import StreamDataset, checkpoint_hook

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir = Path(a.ckpt_dir)
    losses_path = Path(a.losses) if a.losses else ckpt_dir / "losses.txt"

    producer = None
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        anyio.run(ensure_stream, a.url, world, a.global_batch)
        if a.produce:
            producer = start_producer(a.url, a.steps * a.global_batch, ckpt_dir / "producer.log")
    dist.barrier()  # the stream exists

    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    dataset = StreamDataset(a.url, stop=a.steps, prefetch=4)
    restored = latest_checkpoint(ckpt_dir) if a.resume else None
    ckpt = torch.load(restored, map_location="cpu", weights_only=True) if restored else None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        dataset.load_state_dict(ckpt["dataset"])
        torch.set_rng_state(ckpt["rng"])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=0.9)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if rank == 0:
        where = f"resumed from {restored.name}" if restored else "from scratch"
        print(f"rank 0 of {world}: training {where}, next step {dataset.state_dict()['next_step']}", flush=True)

    hook = checkpoint_hook(a.url)
    loss_fn = nn.MSELoss()
    with (
        open(losses_path, "a") if rank == 0 else open(os.devnull, "w") as losses,
        open(a.keys or os.devnull, "a") as keys,
    ):
        for item in DataLoader(dataset, batch_size=None):
            step = item["step"]
            if step == a.kill_at:
                hook.wait()  # the crash comes after the checkpoints asked for are recorded
                dist.barrier()  # every rank got here (rank 0 wrote the previous loss): crash
                os._exit(KILL_EXIT)
            keys.write(" ".join([str(step), str(rank), *(s["__key__"] for s in item["samples"])]) + "\n")
            keys.flush()  # one write of one line to a file opened for appending: ranks' lines do not mix
            x = torch.stack([s["x"] for s in item["samples"]])
            y = torch.stack([s["y"] for s in item["samples"]])
            loss = loss_fn(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            value = (mean / world).item()
            losses.write(f"{step} {value.hex()}\n")
            losses.flush()
            if rank == 0:
                print(f"step {step:4d}  loss {value:.6f}", flush=True)
            if (step + 1) % a.checkpoint_every == 0:
                if rank == 0:
                    state = {
                        "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "dataset": dataset.state_dict(), "rng": torch.get_rng_state(),
                    }  # fmt: skip
                    save_atomic(state, ckpt_dir / f"ckpt-{step:09d}.pt")
                hook(step)  # rank 0 records it in the stream, in the background; a no-op elsewhere
    hook.wait()  # every checkpoint recorded (raises a failure to record one)
    dist.barrier()
    # Tear down in this order. Destroying a gloo process group joins its worker thread while
    # holding the GIL; if that thread is still freeing a finished collective whose tensor's Python
    # object is gone (`mean`, once this frame is cleared), it waits for the GIL: a deadlock. So the
    # group goes here, while every tensor a collective used is still referenced, and not as a side
    # effect of DDP's reducer being freed when this function returns.
    del ddp
    dist.destroy_process_group()
    if producer is not None:
        producer.wait()  # it has committed every step trained on: it is finishing
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (run under torchrun)")
    t.add_argument("url")
    t.add_argument("--ckpt-dir", required=True)
    t.add_argument("--steps", type=int, default=20, help="train on steps 0..STEPS-1")
    t.add_argument("--global-batch", type=int, default=16)
    t.add_argument("--checkpoint-every", type=int, default=5)
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--resume", action="store_true", help="restore the newest trainer checkpoint in --ckpt-dir")
    t.add_argument("--kill-at", type=int, default=None, metavar="STEP", help="crash (os._exit) when STEP arrives")
    t.add_argument(
        "--losses", default=None, help="rank 0 appends 'step loss.hex()' lines (default CKPT_DIR/losses.txt)"
    )
    t.add_argument(
        "--keys",
        default=None,
        metavar="FILE",
        help="every rank appends 'step rank key...' lines of the steps it trains on",
    )
    t.add_argument("--no-produce", dest="produce", action="store_false", help="do not start the producer")
    p = sub.add_parser("produce", help="produce the synthetic samples 0..N-1 (resumable)")
    p.add_argument("url")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--producer-id", default=PRODUCER_ID)
    a = ap.parse_args()
    if a.command == "produce":
        import anyio

        anyio.run(produce, a.url, a.samples, a.producer_id)
        return 0
    return train(a)


if __name__ == "__main__":
    sys.exit(main())
