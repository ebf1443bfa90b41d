"""Provisional residency: what a router has just sent a worker, before the worker says it holds it.

A ``BlockStored`` reaches the index only after the chosen worker has run the prefill. Until then
the router is blind to its own decision, and a burst of requests sharing a new prefix scatters
(or herds onto one worker by a stale load). So when a router chooses a worker for a request, it
records that worker as about to hold the request's full blocks past its own hit (what its events
already show is not recorded again), for ``ttl_s`` seconds or until the worker's own events confirm
them (the index then holds those blocks) or its state is reset. A worker's score is its index hit
extended by the blocks it was sent past it (without a hit: those sent from the prompt's first
block). The same idea as llm-d's speculative index entries (2 s TTL) and Dynamo's predicted active
blocks.

Keys are the router's own chained hashes of the prompt's blocks (``hash_blocks(..., algo="xxh3")``
with the LoRA name and extra keys: what a token-keyed ``Index`` uses), so router replicas that
share decisions agree on them whatever hash the engines use.

The entries live in the router's native core (``kvbridge._native.ProvisionalResidency``,
rust/route/provisional.rs: one table of (block, worker, decision)); bounded by ``max_entries``,
the oldest decisions go first (``stats["dropped"]``).
"""

from __future__ import annotations

from kvbridge._native import ProvisionalResidency

__all__ = ["ProvisionalResidency"]
