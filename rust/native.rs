//! The index core for Rust callers that are not Python: bench/native measures it against
//! Dynamo's indexers (the crate is also built as an rlib for that). It reaches the core through
//! its public methods only, so changes to the core's rules need no change here.
//!
//! Not thread-safe by itself (the Python face wraps the core in a lock): one owner applies and
//! queries, or the caller brings its own lock.

use crate::hash::algo::{Algo, Chain};
use crate::index::core::{Core, Mode};
use crate::index::parse::{detect, parse};

pub struct NativeIndex {
    core: Core,
    /// JSON payloads transcoded to msgpack (kept for its allocation, as the Python face does
    /// not: a native caller applies many payloads in a row).
    scratch: Vec<u8>,
}

impl NativeIndex {
    /// `engine_keys`: keyed by the engines' block hashes (`key="engine"`); otherwise by the
    /// index's own chained xxh3 of the tokens (`key="tokens"`).
    pub fn new(block_size: usize, engine_keys: bool) -> NativeIndex {
        let mode = if engine_keys {
            Mode::Engine
        } else {
            Mode::Tokens
        };
        NativeIndex {
            core: Core::new(block_size, mode),
            scratch: Vec::new(),
        }
    }

    /// Applies one KV event payload (msgpack or JSON, as on the wire) from `worker`; the
    /// number of events in it, 0 for a payload that is not a batch (nothing applied).
    pub fn apply(&mut self, worker: &str, payload: &[u8]) -> usize {
        let spare = self.core.take_spare();
        match parse(payload, detect(payload), &mut self.scratch, spare) {
            Some(batch) => self.core.apply(worker, batch),
            None => {
                self.core.malformed();
                0
            }
        }
    }

    /// (worker id, leading blocks held) for each worker with a hit, in worker id order, as
    /// `Index.find_matches` answers with its defaults (any medium, no remote copies);
    /// `worker_name` turns the id into the name the worker's payloads came under.
    pub fn find_matches(&self, keys: &[u64], out: &mut Vec<(u32, u32)>) {
        self.core.find_matches(keys, None, false, out);
    }

    /// `find_matches` from token ids (full blocks only), hashed the way `key="tokens"` keys its
    /// blocks; `keys` is scratch space for the hashes.
    pub fn find_matches_tokens(
        &self,
        tokens: &[u32],
        keys: &mut Vec<u64>,
        out: &mut Vec<(u32, u32)>,
    ) {
        self.hash_tokens(tokens, keys);
        self.core.find_matches(keys, None, false, out);
    }

    /// The `key="tokens"` index keys of `tokens`' full blocks (no LoRA, no extra keys).
    pub fn hash_tokens(&self, tokens: &[u32], keys: &mut Vec<u64>) {
        let bs = self.core.block_size;
        keys.clear();
        let mut chain = Chain::new(Algo::Xxh3, bs, 0, None, None, None);
        chain.run_words(&tokens[..tokens.len() / bs * bs], None, |k| keys.push(k));
    }

    pub fn worker_name(&self, id: u32) -> &str {
        self.core.name(id)
    }

    pub fn remove_worker(&mut self, worker: &str) {
        self.core.remove_worker(worker);
    }

    /// Distinct blocks held by anyone.
    pub fn len(&self) -> usize {
        self.core.len()
    }

    pub fn is_empty(&self) -> bool {
        self.core.len() == 0
    }

    /// The core's own estimate of its bytes (what `Index.memory_bytes` reports).
    pub fn memory_bytes(&self) -> usize {
        self.core.memory_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_in_answers_out_in_both_key_modes() {
        let payload =
            br#"[0, [{"type": "BlockStored", "block_hashes": [10, 11], "parent_block_hash": null,
            "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null, "medium": "GPU"}]]"#;
        let mut engine = NativeIndex::new(2, true);
        let mut tokens = NativeIndex::new(2, false);
        for idx in [&mut engine, &mut tokens] {
            assert_eq!(idx.apply("a", payload), 1);
            assert_eq!(idx.apply("b", b"not a batch"), 0);
            assert_eq!(idx.len(), 2);
        }
        let mut out = Vec::new();
        engine.find_matches(&[10, 11, 12], &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((engine.worker_name(out[0].0), out[0].1), ("a", 2));
        let mut keys = Vec::new();
        tokens.find_matches_tokens(&[1, 2, 3, 9, 9], &mut keys, &mut out);
        assert_eq!(keys.len(), 2);
        assert_eq!(out.iter().map(|&(_, n)| n).collect::<Vec<_>>(), vec![1]);
        tokens.remove_worker("a");
        tokens.find_matches(&keys, &mut out);
        assert!(out.is_empty() && tokens.is_empty() && tokens.memory_bytes() > 0);
    }
}
