"""The wire format: what travels on NATS and what vLLM defines byte for byte.

``events`` is the payload schema (msgspec Structs wire-identical to vLLM 0.33's KV events, the
load report, encoding and decoding, foreign shapes), ``subjects`` the subject and header names both
sides build and parse through, and ``hashing`` the chained block-hash algorithms (computed by the
native core), and ``residency`` the rule every view of a worker's blocks applies, in plain Python
(the spec the native views are tested against). Nothing here touches the network. The public
names of ``events`` and ``hashing`` are re-exported by ``kvbridge``; see docs/wire-format.md and
docs/hashing.md.
"""
