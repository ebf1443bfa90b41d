"""Tools around the library: the ``kvbridge`` command line (``cli``), the end-to-end ``demo`` (and
``demo_http`` over ``standin``, a stand-in OpenAI-compatible engine), a
local nats-server or cluster on loopback for tests, benchmarks and the demo (``server``; stable path
``kvbridge.tools.server``), and least-privilege nats-server users for a deployment (``authconfig``).
None of it is imported by ``import kvbridge``.
"""
