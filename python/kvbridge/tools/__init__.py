"""Tools around the library: the ``kvbridge`` command line (``cli``), the end-to-end ``demo``, a
local nats-server or cluster on loopback for tests, benchmarks and the demo (``server``; stable path
``kvbridge.server``), and least-privilege nats-server users for a deployment (``authconfig``).
None of it is imported by ``import kvbridge``.
"""
