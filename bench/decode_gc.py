"""What the cyclic GC costs a subscriber that decodes every batch (``Update.batch``).

    python bench/decode_gc.py [--rounds 30]

kvbridge no longer pauses the GC around ``decode_batch`` (a library must not switch process-wide
state off, even briefly: another thread's allocations would run without collection meanwhile). This
measures what that costs: ``decode_batch`` on bench/bridge.py's vLLM-step payloads as the library
runs it (GC on) against the same call with the GC paused (the ceiling, for reference only), in
the same run, interleaved, the first quartile of ``--rounds``. ``keep`` is how many decoded batches
the consumer holds on to (1: drops each at once; 64: keeps a window, so the decoded lists survive
into older GC generations and make collections scan them).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bridge import bridge_payloads, vllm_steps  # noqa: E402

from kvbridge.wire.events import decode_batch  # noqa: E402


def paused(payload: bytes) -> object:
    gc.disable()
    try:
        return decode_batch(payload, "msgpack")
    finally:
        gc.enable()


def library(payload: bytes) -> object:
    return decode_batch(payload, "msgpack")


def one_pass(fn, payloads: list[bytes], keep: int) -> float:
    live: list = []
    t = time.perf_counter()
    for p in payloads:
        live.append(fn(p))
        if len(live) > keep:
            live.pop(0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    payloads = [p for p, _ in bridge_payloads(vllm_steps(400), 512 * 1024, 1024)]
    mb = sum(map(len, payloads)) / 1e6
    print(f"{len(payloads)} payloads, {mb:.1f} MB per pass")
    print("| keep | GC on (library) | GC paused (ceiling) | on / paused |")
    print("|---:|---:|---:|---:|")
    for keep in (1, 64):
        times: dict[str, list[float]] = {"library": [], "paused": []}
        for r in range(args.rounds):
            order = [("library", library), ("paused", paused)]
            for name, fn in order if r % 2 else order[::-1]:
                times[name].append(one_pass(fn, payloads, keep))
        q = {k: sorted(v)[len(v) // 4] for k, v in times.items()}
        print(f"| {keep} | {mb / q['library']:.0f} MB/s | {mb / q['paused']:.0f} MB/s | {q['paused'] / q['library']:.2f}x |")


if __name__ == "__main__":
    main()
