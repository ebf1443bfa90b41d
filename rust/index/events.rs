//! The events of a payload as the index applies them: what `parse` produces and `core` reads,
//! with their hashes and token ids in a batch's flat vectors, which the index keeps from one
//! payload to the next (`Spare`).

use std::ops::Range;

use crate::hash::value::Value;

pub struct Stored<'a> {
    pub hashes: Range<usize>,
    pub parent: Option<u64>,
    /// The token ids in `Batch::tokens`; parsed with `Spare::count_tokens` (key="engine", which
    /// reads only how many there are) they are checked but not kept: only its length is theirs.
    pub tokens: Range<usize>,
    pub block_size: i64,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub extra_keys: Option<Vec<Option<Value>>>,
    /// A token id outside 0..2**32-1: the blocks cannot be hashed.
    pub bad_tokens: bool,
    /// An extra key of a type no engine writes (float, map): the blocks cannot be keyed.
    pub bad_extra_keys: bool,
    pub group: u8,
    /// `kv_cache_spec_kind`: `NO_KIND`, 1 + its index in `KINDS`, or `UNKNOWN_KIND`. A byte,
    /// not the name, so an event stays small enough to move without a memcpy call.
    pub kind: u8,
    /// `kv_cache_spec_sliding_window`; 0 when absent, nil or not an int (no window is 0).
    pub window: i64,
    pub remote: bool,
}

/// vLLM's `KVCacheSpecKind` values (v1/kv_cache_interface.py).
pub const KINDS: [&[u8]; 10] = [
    b"full_attention",
    b"mla_attention",
    b"sliding_window",
    b"sliding_window_mla",
    b"mamba",
    b"chunked_local_attention",
    b"sink_full_attention",
    b"encoder_only_attention",
    b"cross_attention",
    b"unknown",
];
pub const NO_KIND: u8 = 0;
pub const UNKNOWN_KIND: u8 = u8::MAX;

/// `group_idx` that is not an int in 0..=63 (a bool, a float, a negative): the event is skipped.
pub const BAD_GROUP: u8 = u8::MAX;
/// Groups a worker may have: its group bits fit a u64.
pub const MAX_GROUPS: u8 = 64;

pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed {
        hashes: Range<usize>,
        medium: Option<&'a str>,
        group: u8,
        remote: bool,
    },
    Cleared,
}

/// A payload's events; their hashes and token ids live in two flat vectors.
#[derive(Default)]
pub struct Batch<'a> {
    pub events: Vec<Event<'a>>,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
}

/// A batch's vectors, emptied, kept by the index from one payload to the next: a payload's
/// worth of malloc and free saved each time.
#[derive(Default)]
pub struct Spare {
    /// The parser's (`parse`) to fill.
    pub(super) events: Vec<Event<'static>>,
    pub(super) hashes: Vec<u64>,
    pub(super) tokens: Vec<u32>,
    /// Token ids are checked and counted, not kept (see `Stored::tokens`).
    pub count_tokens: bool,
}

/// Larger vectors are freed, so one huge payload does not pin its memory.
const KEEP_MAX_ITEMS: usize = 1 << 18;

impl Spare {
    pub fn keep(&mut self, mut batch: Batch<'_>) {
        if batch
            .hashes
            .capacity()
            .max(batch.tokens.capacity())
            .max(batch.events.capacity())
            > KEEP_MAX_ITEMS
        {
            return;
        }
        batch.events.clear();
        batch.hashes.clear();
        batch.tokens.clear();
        // SAFETY: the vector is empty, so it holds no borrow of the payload; the types differ
        // only in that lifetime (same layout).
        self.events =
            unsafe { std::mem::transmute::<Vec<Event<'_>>, Vec<Event<'static>>>(batch.events) };
        self.hashes = batch.hashes;
        self.tokens = batch.tokens;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// each move (measured: ~5% more instructions per block event).
    #[test]
    fn an_event_stays_small() {
        assert!(
            std::mem::size_of::<Event>() <= 128,
            "{}",
            std::mem::size_of::<Event>()
        );
    }
}
