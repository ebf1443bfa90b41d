"""The relay's view alone: ``_native.ResidencyView.apply`` over bench/relay.py's frames (vLLM 0.33
steps, ~614 block events, 44 KiB each), the view held at its steady size (~46k blocks).

    python bench/relay_view.py [--laps 5] [--frames 300]

Printed: CPU (process time) per block event of ``apply`` (read and applied) and of ``read_batch``
(read alone). Under callgrind, ``--laps 1`` with
``--toggle-collect='_native::view::ResidencyView::__pymethod_apply__'`` counts the instructions of
one pass of ``apply`` (the warm-up goes through ``apply_read``, which the toggle leaves out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from relay import make_frames  # noqa: E402

from kvbridge._native import ResidencyView, read_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--laps", type=int, default=5)
    ap.add_argument("--frames", type=int, default=300)
    args = ap.parse_args()
    frames = make_frames(args.frames, 600, 50_000)
    n_ev = sum(k for _, k in frames)
    view = ResidencyView()
    for payload, _ in frames:  # to the steady size, through a path the callgrind toggle skips
        view.apply_read(read_batch(payload))
    t = time.process_time()
    for _ in range(args.laps):
        for payload, _ in frames:
            view.apply(payload)
    applied = (time.process_time() - t) / (args.laps * n_ev)
    t = time.process_time()
    for _ in range(args.laps):
        for payload, _ in frames:
            read_batch(payload)
    read = (time.process_time() - t) / (args.laps * n_ev)
    print(f"apply: {applied * 1e9:.1f} ns per block event (read {read * 1e9:.1f}), view of {len(view)} blocks")


if __name__ == "__main__":
    main()
