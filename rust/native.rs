//! The index core for Rust callers that are not Python: bench/native measures it against
//! Dynamo's indexers (the crate is also built as an rlib for that). It reaches the core through
//! its public methods only, so changes to the core's rules need no change here.
//!
//! Not thread-safe by itself (the Python face wraps the core in a lock): one owner applies and
//! queries, or the caller brings its own lock.

use crate::hash::algo::{salted, xxh3_chain};
use crate::index::core::{Core, Mode};
use crate::index::keys::TokenKeys;
use crate::index::parse::detect;
use crate::index::pipeline;

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
        pipeline::apply_one(
            &mut self.core,
            worker,
            payload,
            detect(payload),
            &mut self.scratch,
        )
    }

    /// `apply` of each (worker, payload) in order, the payloads read on a second thread while
    /// this one applies those before (from 64 KiB of payloads in all; see
    /// rust/index/pipeline.rs): the same index, answers and stats. Each payload's number of
    /// events is pushed to `counts`.
    pub fn apply_many(&mut self, items: &[(&str, &[u8])], counts: &mut Vec<usize>) {
        pipeline::apply_many(&mut self.core, items, None, counts);
    }

    /// (worker id, leading blocks held) for each worker with a hit, in worker id order, as
    /// `Index.find_matches` answers with its defaults (any medium, no remote copies);
    /// `worker_name` turns the id into the name the worker's payloads came under.
    pub fn find_matches(&self, keys: &[u64], out: &mut Vec<(u32, u32)>) {
        self.core.find_matches(keys, None, false, out);
    }

    /// `find_matches` from token ids (full blocks only), hashed the way `key="tokens"` keys its
    /// blocks, as the query's walk reaches them (`index::keys`); `keys` is scratch space for
    /// the hashes.
    pub fn find_matches_tokens(
        &self,
        tokens: &[u32],
        keys: &mut Vec<u64>,
        out: &mut Vec<(u32, u32)>,
    ) {
        let mut keys = TokenKeys::new(tokens, self.core.block_size, salted(0, None, None), keys);
        self.core.find_matches_of(&mut keys, None, false, out);
    }

    /// The `key="tokens"` index keys of `tokens`' full blocks (no LoRA, no extra keys).
    pub fn hash_tokens(&self, tokens: &[u32], keys: &mut Vec<u64>) {
        let bs = self.core.block_size;
        keys.clear();
        xxh3_chain(tokens, bs, salted(0, None, None), keys);
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

    /// The index's counters (`Index.stats`' names and values).
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        self.core.stats.pairs()
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

    /// (worker, payload) in order; queries as (engine hashes, token ids) of a chain's prefix.
    type Stream = (Vec<(String, Vec<u8>)>, Vec<(Vec<u64>, Vec<u32>)>);

    /// A stream with what a router sees besides plain chains: removals, clears, a sliding
    /// window group (hybrid workers), malformed and JSON payloads, out-of-range token ids.
    fn stream(seed: u64) -> Stream {
        let mut x = seed;
        let mut rand = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let bs = 2u64;
        // Per worker: its chain's (content seed, blocks so far); content seeds are shared, so
        // workers hold common prefixes under the same engine hashes.
        let mut chains = [(0u64, 0u64); 6];
        let mut payloads = Vec::new();
        let mut queries = Vec::new();
        let hash = |seed: u64, b: u64| seed * 1000 + b + 1;
        let tok = |seed: u64, t: u64| ((seed * 31 + t * 7) % 50) as u32;
        for _ in 0..3000 {
            let w = rand(6) as usize;
            let mut events = Vec::new();
            for _ in 0..1 + rand(6) {
                let (seed, len) = chains[w];
                match rand(20) {
                    0..=10 => {
                        let (seed, len) = if len > 40 || rand(8) == 0 {
                            (rand(5), 0)
                        } else {
                            (seed, len)
                        };
                        let n = 1 + rand(4);
                        let hashes: Vec<u64> = (len..len + n).map(|b| hash(seed, b)).collect();
                        let mut tokens: Vec<i64> = (len * bs..(len + n) * bs)
                            .map(|t| tok(seed, t) as i64)
                            .collect();
                        if rand(50) == 0 {
                            tokens[0] = -1;
                        }
                        let parent = if len == 0 {
                            "null".to_string()
                        } else {
                            hash(seed, len - 1).to_string()
                        };
                        let group = if rand(10) == 0 {
                            r#", "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
                              "kv_cache_spec_sliding_window": 4"#
                        } else {
                            ""
                        };
                        events.push(format!(
                            r#"{{"type": "BlockStored", "block_hashes": {hashes:?},
                            "parent_block_hash": {parent}, "token_ids": {tokens:?},
                            "block_size": 2, "lora_id": null, "medium": "GPU"{group}}}"#
                        ));
                        chains[w] = (seed, len + n);
                    }
                    11..=16 if len > 0 => {
                        let b = len - 1 - rand(len.min(3));
                        let group = if rand(5) == 0 { 1 } else { 0 };
                        events.push(format!(
                            r#"{{"type": "BlockRemoved", "block_hashes": [{}], "medium": "GPU",
                            "group_idx": {group}}}"#,
                            hash(seed, b)
                        ));
                        chains[w].1 = b;
                    }
                    17 if rand(10) == 0 => {
                        events.push(r#"{"type": "AllBlocksCleared"}"#.to_string());
                        chains[w] = (seed, 0);
                    }
                    _ => {}
                }
            }
            let json = format!("[0, [{}]]", events.join(", "));
            let bytes = match rand(40) {
                0 => json.into_bytes(),
                1 => b"\xc1 not a batch".to_vec(),
                _ => {
                    let mut m = Vec::new();
                    crate::index::json::json_to_msgpack(json.as_bytes(), &mut m).expect("json");
                    if rand(40) == 0 {
                        m.truncate(m.len() / 2);
                    }
                    m
                }
            };
            payloads.push((format!("w{w}"), bytes));
            let (seed, len) = chains[rand(6) as usize];
            let n = len + rand(3);
            queries.push((
                (0..n).map(|b| hash(seed, b)).collect(),
                (0..n * bs).map(|t| tok(seed, t)).collect(),
            ));
        }
        (payloads, queries)
    }

    #[test]
    fn apply_many_builds_the_index_one_by_one_would() {
        for seed in [1, 2, 3] {
            let (payloads, queries) = stream(0x9e37_79b9_7f4a_7c15 ^ seed);
            let items: Vec<(&str, &[u8])> = payloads
                .iter()
                .map(|(w, p)| (w.as_str(), p.as_slice()))
                .collect();
            let bytes: usize = items.iter().map(|i| i.1.len()).sum();
            assert!(bytes >= pipeline::MIN_BYTES, "two threads: {bytes} B");
            for engine in [true, false] {
                let mut one = NativeIndex::new(2, engine);
                let want: Vec<usize> = items.iter().map(|&(w, p)| one.apply(w, p)).collect();
                let mut two = NativeIndex::new(2, engine);
                let mut got = Vec::new();
                two.apply_many(&items, &mut got);
                assert_eq!(got, want);
                assert_eq!(two.stats(), one.stats());
                let stats: std::collections::HashMap<_, _> = one.stats().into_iter().collect();
                for counted in [
                    "malformed_payloads",
                    "cleared",
                    "blocks_removed",
                    "bad_token_ids",
                ] {
                    assert!(stats[counted] > 0, "{counted}: the stream has some");
                }
                assert_eq!(
                    (two.len(), two.memory_bytes()),
                    (one.len(), one.memory_bytes())
                );
                let named = |idx: &NativeIndex, out: &[(u32, u32)]| -> Vec<(String, u32)> {
                    out.iter()
                        .map(|&(w, n)| (idx.worker_name(w).to_string(), n))
                        .collect()
                };
                let (mut a, mut b, mut keys) = (Vec::new(), Vec::new(), Vec::new());
                let mut hits = 0;
                for (hashes, tokens) in &queries {
                    if engine {
                        one.find_matches(hashes, &mut a);
                        two.find_matches(hashes, &mut b);
                    } else {
                        one.find_matches_tokens(tokens, &mut keys, &mut a);
                        two.find_matches_tokens(tokens, &mut keys, &mut b);
                    }
                    assert_eq!(named(&two, &b), named(&one, &a));
                    hits += usize::from(!a.is_empty());
                }
                assert!(hits > queries.len() / 4, "{hits} queries with a hit");
            }
        }
    }
}
