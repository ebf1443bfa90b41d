//! A record's events written as msgpack straight from the record, byte for byte what
//! `encode_batch` writes for the events `events::build` makes of it (tests/test_pool.py
//! compares the two).
//!
//! The encoder's cost on a pool's batch is reading its token ids: one Python int per token,
//! built for the events and then walked, cold by the time the publisher's loop gets to them.
//! Here they are read from the record's flat `u32`s and no event object is made.
//!
//! Only the shapes of a single-group pool's events without a LoRA are written here (what
//! msgspec writes for them is spelled out below); a LoRA's event or a hybrid pool's group fields
//! make `put_events` answer false, and the caller builds the events and encodes those.

use crate::encode::msgpack::{put_array_header, put_str, put_uint, put_uints};

use super::core::{Event, Record};

/// msgspec sizes a map-encoded struct's header for all its fields plus the tag, then patches
/// the count: BlockStored (15 fields + tag) starts `de 00 nn`, BlockRemoved (5 + tag) and
/// AllBlocksCleared (0 + tag) with a fixmap. Written here: the tag and the fields without a
/// default, which are always written (`extra_keys` and the group fields are None, omitted).
const STORED_HEAD: [u8; 3] = [0xde, 0x00, 0x08];
const REMOVED_HEAD: u8 = 0x83;
const CLEARED_HEAD: u8 = 0x81;
const NIL: u8 = 0xc0;

fn key(out: &mut Vec<u8>, name: &str) {
    // Every key and tag here is a fixstr (under 32 bytes): it cannot fail.
    let _ = put_str(out, name.as_bytes());
}

fn uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) -> bool {
    if put_array_header(out, values.len()).is_err() {
        return false;
    }
    put_uints(out, values);
    true
}

fn medium_value(out: &mut Vec<u8>, medium: Option<&[u8]>) -> bool {
    match medium {
        Some(m) => put_str(out, m).is_ok(),
        None => {
            out.push(NIL);
            true
        }
    }
}

/// Append the record's events (each a msgpack map, no enclosing array). False, with `out` in
/// an unspecified state, when an event is of a shape left to the caller (a LoRA's).
pub fn put_events(
    out: &mut Vec<u8>,
    rec: &Record,
    block_size: usize,
    medium: Option<&[u8]>,
) -> bool {
    for ev in &rec.events {
        match ev {
            Event::Stored {
                parent,
                hashes,
                tokens,
                lora,
                ..
            } => {
                if *lora != 0 {
                    return false;
                }
                out.extend_from_slice(&STORED_HEAD);
                key(out, "type");
                key(out, "BlockStored");
                key(out, "block_hashes");
                if !uints(out, rec.hashes[hashes.clone()].iter().copied()) {
                    return false;
                }
                key(out, "parent_block_hash");
                match parent {
                    Some(p) => put_uint(out, *p),
                    None => out.push(NIL),
                }
                key(out, "token_ids");
                if !uints(out, rec.tokens[tokens.clone()].iter().map(|&t| t as u64)) {
                    return false;
                }
                key(out, "block_size");
                put_uint(out, block_size as u64);
                key(out, "lora_id");
                out.push(NIL);
                key(out, "medium");
                if !medium_value(out, medium) {
                    return false;
                }
                key(out, "lora_name");
                out.push(NIL);
            }
            Event::Removed { hashes, .. } => {
                out.push(REMOVED_HEAD);
                key(out, "type");
                key(out, "BlockRemoved");
                key(out, "block_hashes");
                if !uints(out, rec.hashes[hashes.clone()].iter().copied()) {
                    return false;
                }
                key(out, "medium");
                if !medium_value(out, medium) {
                    return false;
                }
            }
            Event::Cleared => {
                out.push(CLEARED_HEAD);
                key(out, "type");
                key(out, "AllBlocksCleared");
            }
        }
    }
    true
}

/// Block events in the record: the hashes its stored and removed events carry.
pub fn n_blocks(rec: &Record) -> usize {
    rec.events
        .iter()
        .map(|ev| match ev {
            Event::Stored { hashes, .. } | Event::Removed { hashes, .. } => hashes.len(),
            Event::Cleared => 0,
        })
        .sum()
}
