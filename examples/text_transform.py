"""The map function of examples/text_pipeline.py: byte-level tokenising and packing into fixed-length sequences.

    await lakestream.produce(url, "text-0", "parquet:DIR/docs", key_column="id", map=pack)

The tokenizer is byte-level and needs no vocabulary file: a document is BOS, then each byte of its
UTF-8 text as the token `byte + 3`, then EOS (VOCAB = 259 tokens; PAD = 0). It is exact and
invertible (`detokenise`), and deterministic, as `--map` functions must be: a producer resumed
after a crash applies the function again to the record its cursor points into and skips the
sequences it had already committed.

`pack` turns one document into sequences of SEQ_LEN tokens: the document's tokens cut into
consecutive chunks of SEQ_LEN, the last chunk padded with PAD. A map function sees one record at a
time, so it cannot pack several documents into one sequence; packing across documents needs a
stage that holds state between records (in a custom pipeline, see examples/producer_pipeline.py).
A document of fewer than MIN_TOKENS tokens (blank or a fragment) is dropped: its sequence would be
mostly padding. Each sequence is `{"__key__": "<doc key>-<chunk:04d>", "tokens": int32 (SEQ_LEN,),
"n_tokens": int, "__cost__": int}`, `n_tokens` being its tokens before the padding; `__cost__` (the
same number) is the sample's cost for the producer, which balances every rank's share of a step by
it (so each holds about as many real tokens) and does not store it. `lakestream produce --map
examples.text_transform:pack` runs the same map, costs included, from the repository root.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SEQ_LEN = 512
PAD, BOS, EOS = 0, 1, 2
OFFSET = 3  # token of byte b: b + OFFSET
VOCAB = 256 + OFFSET
MIN_TOKENS = 16


def tokenise(text: str) -> np.ndarray:
    """BOS, the UTF-8 bytes of `text` as tokens, EOS."""
    body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + OFFSET
    return np.concatenate([np.array([BOS], np.int32), body, np.array([EOS], np.int32)])


def detokenise(tokens: np.ndarray) -> str:
    """The text of a document's tokens (BOS, EOS and PAD left out)."""
    body = np.asarray(tokens)
    body = body[body >= OFFSET] - OFFSET
    return body.astype(np.uint8).tobytes().decode("utf-8")


def pack(sample: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A Parquet row (`text`) as SEQ_LEN-token sequences, or None for a document under MIN_TOKENS."""
    key = sample["__key__"]
    text = sample.get("text")
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"sample {key!r}: text is a {type(text).__name__}, not text")
    tokens = tokenise(text)
    if len(tokens) < MIN_TOKENS:
        return None
    out = []
    for i, start in enumerate(range(0, len(tokens), SEQ_LEN)):
        chunk = tokens[start : start + SEQ_LEN]
        seq = np.full(SEQ_LEN, PAD, dtype=np.int32)
        seq[: len(chunk)] = chunk
        out.append({"__key__": f"{key}-{i:04d}", "tokens": seq, "n_tokens": len(chunk), "__cost__": len(chunk)})
    return out
