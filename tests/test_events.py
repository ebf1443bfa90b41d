import msgspec
import pytest

from kvbridge import events
from kvbridge.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch


def test_vllm_batches_roundtrip_byte_identical(load_vectors):
    vectors = load_vectors("vllm_event_batches.json")["vectors"]
    assert vectors
    for vec in vectors:
        payload = bytes.fromhex(vec["payload_hex"])
        batch = events.decode_batch(payload)
        assert events.encode_batch(batch) == payload, vec["name"]
        assert len(batch.events) == len(vec["decoded"][1])


def test_zmq_frame_payloads_roundtrip(load_vectors):
    for frame in load_vectors("vllm_zmq_frames.json")["frames"]:
        payload = bytes.fromhex(frame["payload_hex"])
        assert events.encode_batch(events.decode_batch(payload)) == payload


def test_json_mode_roundtrip(load_vectors):
    for vec in load_vectors("vllm_event_batches.json")["vectors"]:
        batch = events.decode_batch(bytes.fromhex(vec["payload_hex"]))
        assert events.decode_batch(events.encode_batch(batch, "json"), "json") == batch


def test_positional_and_sglang_events_decode():
    payload = msgspec.msgpack.encode(
        [
            2.5,
            [
                ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", "lora-x"],
                ["BlockStored", [3], 2, [5, 6], 2, None, "CPU_PINNED", {"prefill_len": 2}],
                ["BlockRemoved", [5]],
                ["AllBlocksCleared"],
            ],
            1,
        ]
    )
    batch = events.decode_batch(payload)
    assert batch.data_parallel_rank == 1
    first, second, removed, cleared = batch.events
    assert first == BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", "lora-x")
    assert second.metadata == {"prefill_len": 2} and second.lora_name is None
    assert removed == BlockRemoved([5], None)
    assert isinstance(cleared, AllBlocksCleared)


def test_unknown_fields_ignored_and_bytes_hashes():
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32, 7], "medium": "GPU", "future": [1]}]]
    )
    (ev,) = events.decode_batch(payload).events
    assert ev.block_hashes == [b"\x01" * 32, 7]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93",
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]]),
        msgspec.msgpack.encode(["ts", []]),
        "not bytes",
    ],
)
def test_garbage_raises_decode_error(payload):
    with pytest.raises(DecodeError) as info:
        events.decode_batch(payload)
    assert isinstance(info.value, ValueError)
    assert "KVEventBatch" in str(info.value)


def test_bad_format_and_batch_type():
    with pytest.raises(ValueError, match="format"):
        events.encode_batch(KVEventBatch(1.0, []), "yaml")
    with pytest.raises(TypeError, match="KVEventBatch"):
        events.encode_batch([1.0, []])
