"""JetStream mode: the event subjects stored in a stream, so consumers can catch up without workers.

Core NATS keeps nothing: a consumer that starts late, or a worker that has gone, leaves only the
replay/snapshot protocol of docs/delivery.md, which needs the worker alive. With
``jetstream=True`` (``KVBRIDGE_JETSTREAM=1``) the same messages -- same subjects, same headers, same
payload bytes -- are also stored in a JetStream stream, and a subscriber can rebuild every worker's
view from the stream alone.

The mode in three rooms: ``admin`` the stream itself (created or updated in place, replicas, what a
failing JetStream API call means), ``acks`` the publisher's acked sender (the ack window and its
re-sends over the publisher's outbox) and ``reader`` the subscriber's ordered reader of the stream.
Each module's doc says its rules; the names below are re-exported for code that imports them
from here.
"""

from kvbridge.bus.jetstream.acks import JetStreamAcks
from kvbridge.bus.jetstream.admin import JetStreamError, ensure_stream, stream_subjects
from kvbridge.bus.jetstream.reader import StreamReader, subscribe_stream

__all__ = ["JetStreamAcks", "JetStreamError", "StreamReader", "ensure_stream", "stream_subjects", "subscribe_stream"]
