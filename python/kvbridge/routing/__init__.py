"""Routing: using the workers' cached blocks to choose where a request goes.

The index of every worker's blocks is native (``kvbridge.Index``, in ``kvbridge._native``);
``router`` scores workers by prefix overlap and load the way Dynamo's KV router does, and
``service`` serves overlap queries from an index over NATS (``kvbridge index``) with its client;
``proxy`` (with ``upstreams``) is the OpenAI-compatible gateway ``kvbridge proxy``, imported only
when used.
The public names are re-exported by ``kvbridge``.
"""
