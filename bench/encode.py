"""Batch encoding: kvbridge's native encoder against msgspec on the same KVEventBatch.

Run: .venv/bin/python bench/encode.py [--quick]

Both encoders run interleaved, best of several rounds (the machine is shared, so the minimum
is the least disturbed measurement). Byte identity is checked on every shape in the same run;
a mismatch exits non-zero. Decode throughput (kvbridge.decode_batch, msgspec underneath) is
printed for information.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import msgspec

from kvbridge import _native
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch

BLOCK_SIZE = 16
VOCAB = 151_936  # Qwen2's vocabulary: token ids straddle the uint16/uint32 boundary like real ones


def _stored(rng: random.Random, blocks: int, *, bytes_hashes: bool = False, **extra) -> BlockStored:
    new_hash = (lambda: rng.randbytes(32)) if bytes_hashes else (lambda: rng.getrandbits(64))
    return BlockStored(
        block_hashes=[new_hash() for _ in range(blocks)],
        parent_block_hash=new_hash(),
        token_ids=[rng.randrange(VOCAB) for _ in range(blocks * BLOCK_SIZE)],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **extra,
    )


def _mixed_step(rng: random.Random, events: int) -> list:
    """What a busy vLLM step emits: prefills of a few blocks, evictions, some LoRA/mm extras."""
    out: list = []
    while len(out) < events:
        roll = rng.random()
        if roll < 0.55:
            blocks = rng.randint(1, 8)
            extra = {}
            if rng.random() < 0.2:
                extra = dict(extra_keys=[("adapter-a",)] * blocks, group_idx=0, kv_cache_spec_kind="full_attention")
            out.append(_stored(rng, blocks, **extra))
        elif roll < 0.999:
            out.append(BlockRemoved([rng.getrandbits(64) for _ in range(rng.randint(1, 4))], "GPU"))
        else:
            out.append(AllBlocksCleared())
    return out


def shapes(rng: random.Random) -> dict[str, KVEventBatch]:
    ts = 1764672000.25
    return {
        "1 block/event x 1000": KVEventBatch(ts, [_stored(rng, 1) for _ in range(1000)], 0),
        "32 blocks/event x 100": KVEventBatch(ts, [_stored(rng, 32) for _ in range(100)], 0),
        "bytes hashes, 1 block x 1000": KVEventBatch(
            ts, [_stored(rng, 1, bytes_hashes=True) for _ in range(1000)], 0
        ),
        "vLLM-like mixed step x 1000": KVEventBatch(ts, _mixed_step(rng, 1000), 0),
        "BlockRemoved x 1000": KVEventBatch(ts, [BlockRemoved([rng.getrandbits(64)], "GPU") for _ in range(1000)], 0),
        # One quiet step: per-call overhead dominates.
        "mixed step x 10": KVEventBatch(ts, _mixed_step(rng, 10), 0),
    }


def best_seconds(fn, arg, *, rounds: int, inner: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn(arg)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = parser.parse_args()
    rounds, budget = (3, 0.02) if args.quick else (15, 0.1)

    reference = msgspec.msgpack.Encoder().encode
    native = _native.encode_batch_msgpack
    print(f"python {sys.version.split()[0]}, msgspec {msgspec.__version__}; best of {rounds} rounds\n")
    print("| shape | bytes | msgspec encode | native encode | native / msgspec | identical | decode |")
    print("|---|---:|---:|---:|---:|:---:|---:|")
    failed = False
    for name, batch in shapes(random.Random(20251202)).items():
        payload = reference(batch)
        identical = native(batch) == payload
        failed |= not identical
        inner = max(1, int(budget / max(best_seconds(reference, batch, rounds=1, inner=1), 1e-6)))
        times = {"msgspec": float("inf"), "native": float("inf")}
        for _ in range(rounds):  # interleaved, so both see the same background load
            times["msgspec"] = min(times["msgspec"], best_seconds(reference, batch, rounds=1, inner=inner))
            times["native"] = min(times["native"], best_seconds(native, batch, rounds=1, inner=inner))
        decode = best_seconds(decode_batch, payload, rounds=rounds, inner=inner)
        n = len(batch.events)
        rate = {k: n / v / 1e6 for k, v in times.items()}
        print(
            f"| {name} | {len(payload):,} | {rate['msgspec']:.2f} M ev/s | {rate['native']:.2f} M ev/s"
            f" | {times['msgspec'] / times['native']:.2f}x | {'yes' if identical else 'NO'}"
            f" | {n / decode / 1e6:.2f} M ev/s |"
        )
    if failed:
        print("\nbyte identity FAILED", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
