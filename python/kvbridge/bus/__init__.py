"""The bus: everything that talks to NATS and the loss-free delivery contract over it.

``connection`` connects (fail fast, then reconnect as configured) through ``natsclient`` (nats-py
with native header parsing); on the publishing side ``outbox`` owns the numbered send log that
``publisher`` (core NATS) and ``jetstream`` (the stream, acked sends, the ordered reader) drive; on
the receiving side ``sequencer`` holds one worker's ``(epoch, seq)`` rules with no I/O and
``subscriber`` applies them to what arrives, with replay, snapshots, views and load reports. The
public names are re-exported by ``kvbridge``; see docs/delivery.md.
"""
