"""The bus: everything that talks to NATS and the loss-free delivery contract over it.

``connection`` connects (fail fast, then reconnect as configured) through ``natsclient`` (nats-py
with native header parsing). On the publishing side ``framer`` cuts events into messages and
``outbox`` owns the numbered send log; ``publisher`` is built on them in rooms: ``handoff`` (the
engine threads' side), ``coalescer`` (hand-offs to numbered messages), ``sender`` (core NATS;
``jetstream.acks`` in JetStream mode) and ``answers`` (replay and snapshot replies). On the
receiving side ``sequencer`` holds one worker's ``(epoch, seq)`` rules, ``update`` what is
delivered (``Update``, ``WorkerView``), ``loads`` the load reports and ``worker`` the record of one
worker, all with no I/O; ``subscriber`` applies them to what arrives (``jetstream.reader`` when it
comes from the stream), built in rooms too: ``delivery`` (each update applied and handed on),
``resync`` (replay and snapshot requests) and ``liveness`` (expiry, which incarnation speaks).
The public names are re-exported by ``kvbridge``; see docs/delivery.md.
"""
