"""A payload's array counts never size an allocation unchecked: msgpack can claim 2**32 elements
in five bytes, and reserving for them aborted the whole process (Rust's allocation failure is not
an exception). Each native reader of payloads is fed such claims in a child process, which must
exit cleanly with the payload refused."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

HEAD = b"\x93\xcb" + struct.pack(">d", 1.0)
CLAIMS = {
    "events": HEAD + b"\xdd\xff\xff\xff\xff",
    "block hashes": HEAD + b"\x91\x82\xa4type\xabBlockStored\xacblock_hashes\xdd\xff\xff\xff\xff",
}
READERS = {
    "scan_batch_msgpack": "from kvbridge._native import scan_batch_msgpack as read",
    "ResidencyView.apply": "from kvbridge._native import ResidencyView; read = ResidencyView().apply",
    "read_batch": "from kvbridge._native import read_batch as read",
    "Index.apply": "from kvbridge._native import Index; read = lambda p: Index(4, 'engine').apply('w', p) or None",
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_a_count_the_payload_cannot_hold_is_refused_not_allocated(reader, claim):
    code = f"{READERS[reader]}\nassert read({CLAIMS[claim]!r}) is None\nprint('refused')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stderr[-2000:]
