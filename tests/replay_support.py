"""Helpers for the replay's tests: requests made by hand, a fleet run to its end."""

from __future__ import annotations

from typing import Sequence

from kvbridge.replay.engine import EngineConfig, Seq
from kvbridge.replay.fleet import FleetConfig, simulate
from kvbridge.replay.policies import make_policy
from kvbridge.replay.trace import Request


def request(index: int, tokens: Sequence[int], output: int, at_ms: float = 0.0) -> Request:
    return Request(index, at_ms, len(tokens), output, list(tokens), runs=False)


def run(requests: Sequence[Request], *, workers: int = 1, policy: str = "rr", **engine: int) -> tuple[list[Seq], object]:
    """The requests through ``workers`` engines of ``engine``'s config, to the end."""
    seqs, fleet, _ = simulate(requests, make_policy(policy), FleetConfig(workers=workers, engine=EngineConfig(**engine)))
    return seqs, fleet
