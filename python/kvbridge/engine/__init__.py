"""The engine side: where block events come from.

``pool`` is a prefix-caching block pool with vLLM v1's semantics that records its events (native;
``_reference_pool`` is its plain-Python executable spec, the oracle of the tests). A stock engine
is attached instead through ``relay`` (its ZMQ events to NATS), ``discover`` (a kept-running set of
relays, ranks from vLLM's ``/kv_event_sources``) and ``vllm`` (the stat-logger plugin and
``logger_factory``; ``kvbridge.vllm`` re-exports its public names). Nothing here is imported by ``import
kvbridge`` except ``pool``: zmq and vLLM load only when a relay is used.
"""
