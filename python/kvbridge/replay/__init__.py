"""``kvbridge replay``: routing policies compared by time on a trace, in a simulated fleet.

Rooms: :mod:`~kvbridge.replay.trace` (Mooncake and token-id traces), :mod:`~kvbridge.replay.engine`
(the vLLM engine model, Dynamo's timing), :mod:`~kvbridge.replay.fleet` (the event loop and the
signals a router gets), :mod:`~kvbridge.replay.policies` (rr, random, kv, kv-reports, dynamo) and
:mod:`~kvbridge.replay.report`. docs/routing.md says how it was validated against Dynamo's own
replay.
"""
