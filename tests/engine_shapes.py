"""Test-local copies of the engines' own msgspec Structs, to produce payloads exactly as the engines
write them (without importing an engine). Field order and struct options are part of the bytes.

- ``Vllm*``: vLLM 0.33.0, ``vllm/distributed/kv_events.py`` (``BlockStored`` ends with
  ``session_id``, ``lookahead_token_ids``).
- ``SchedulerStats`` / ``PrefixCacheStats``: what vLLM 0.33 hands a stat logger's ``record()``
  (``vllm/v1/metrics/stats.py``), as plain dataclasses (also used by bench/vllm_record.py).
- ``Sgl*``: SGLang 0.5.23, ``python/sglang/srt/disaggregation/kv_events.py``: the batch is
  ``[ts, events, attn_dp_rank]`` without ``omit_defaults`` (a None rank is written), events are
  tagged maps with ``omit_defaults`` whose ``medium`` defaults to None (so it is left out when None),
  then ``cache_salt``, ``session_id``, ``lora_name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class SglBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SglEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglBlockStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class SglBlockRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SglAllBlocksCleared(SglEvent, tag="AllBlocksCleared"):
    pass


@dataclass
class PrefixCacheStats:
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict = field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
