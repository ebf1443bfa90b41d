"""A worker process for fault tests: a publisher over a pool holding ``--blocks`` blocks, then
idle until killed. Prints its epoch once it is publishing."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvbridge import KvEventPublisher
from kvbridge.engine.pool import KVCacheManager


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--blocks", type=int, default=0)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--jetstream", action="store_true")
    args = p.parse_args()
    manager = KVCacheManager(num_blocks=max(64, args.blocks * 2), block_size=4)
    async with KvEventPublisher(servers=args.servers, subject_prefix=args.prefix, model="m", worker_id=args.worker,
                                heartbeat_s=args.heartbeat, jetstream=args.jetstream) as pub:  # fmt: skip
        pub.attach(manager)
        with pub.lock:
            if args.blocks:
                manager.allocate("r", list(range(args.blocks * 4)))
        pub.step()
        print(pub.epoch, flush=True)
        await asyncio.Event().wait()  # idle until killed


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
