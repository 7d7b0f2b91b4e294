"""A trainer that tests/test_torch.py kills and resumes: it reads a stream through
`StatefulDataLoader(StreamDataset(URL, rank=0, world_size=1, stop=STEPS), num_workers=WORKERS)`.

    python tests/stateful_trainer.py URL CHECKPOINT --steps STEPS [--workers W] [--step-time S]

After every step it replaces CHECKPOINT (`torch.save` to a temporary file, then a rename) with
`{"loader": loader.state_dict(), "consumed": [[step, key, ...], ...]}`: the steps trained on so
far, saved together with the loader's state as a trainer saves its model with it, so that a
SIGKILL at any moment leaves one consistent checkpoint. If CHECKPOINT exists it resumes from it
(`loader.load_state_dict`). `--step-time`: seconds each step "trains".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lakestream.torch import StreamDataset


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step-time", type=float, default=0.0)
    a = ap.parse_args()

    loader = StatefulDataLoader(
        StreamDataset(a.url, rank=0, world_size=1, stop=a.steps), batch_size=None, num_workers=a.workers
    )
    consumed: list[list[int | str]] = []
    if a.checkpoint.exists():
        saved = torch.load(a.checkpoint, weights_only=True)
        loader.load_state_dict(saved["loader"])
        consumed = saved["consumed"]
        print(f"resumed after {len(consumed)} steps", flush=True)
    tmp = a.checkpoint.with_name(f".{a.checkpoint.name}.tmp")
    for item in loader:
        time.sleep(a.step_time)
        consumed.append([item["step"], *(s["__key__"] for s in item["samples"])])
        torch.save({"loader": loader.state_dict(), "consumed": consumed}, tmp)
        os.replace(tmp, a.checkpoint)
    print(f"done: {len(consumed)} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
