"""Routing: using the workers' cached blocks to choose where a request goes.

The index of every worker's blocks is native (``kvbridge.Index``, in ``kvbridge._native``);
``router`` picks the worker with the lowest predicted time to first token (``work``: the engine
model it predicts with; ``provisional`` and ``sync``: its own and its peers' decisions), and
``service`` serves overlap queries from an index over NATS (``kvbridge index``) with its client;
``proxy`` (with ``upstreams`` and ``record``) is the OpenAI-compatible gateway ``kvbridge proxy``,
imported only when used. ``kvbridge`` re-exports ``Router``, ``EngineModel``, ``IndexService``,
``IndexClient`` and their errors; the rest is imported from here.
"""
