//! The event stream and queries every indexer gets: vLLM-shaped steps from many workers
//! (a step: the KV events of a few requests, evictions first, then the prefill's blocks in one
//! BlockStored with its parent, then decode blocks one at a time), requests sharing system
//! prompts and continuing earlier conversations, evictions leaf-first in LRU order (as vLLM's
//! free queue gives blocks back), and a rare AllBlocksCleared.
//!
//! Leaf-first eviction keeps every worker's blocks prefix-closed, where Dynamo's trees (which
//! drop a removed block's subtree) and kvbridge (which removes that block only) mean the same
//! thing, so brute force over each worker's set is the reference for both.

use std::collections::{BTreeSet, HashMap, HashSet};

use dynamo_kv_router::protocols::BlockHashOptions;
use dynamo_kv_router::{compute_block_hash_for_seq, LocalBlockHash};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::Scores;

pub struct Config {
    pub workers: u32,
    /// Blocks a worker's cache holds.
    pub capacity: usize,
    /// The stream ends once this many blocks were stored or removed.
    pub block_events: usize,
    pub queries: usize,
    pub query_blocks: usize,
    pub block_size: usize,
    pub system_prompts: usize,
    pub seed: u64,
}

impl Config {
    pub fn full() -> Config {
        Config {
            workers: 64,
            capacity: 4096,
            block_events: 1_500_000,
            queries: 2000,
            query_blocks: 128,
            block_size: 16,
            system_prompts: 200,
            seed: 19,
        }
    }

    pub fn quick() -> Config {
        Config {
            workers: 16,
            capacity: 1024,
            block_events: 100_000,
            queries: 300,
            ..Config::full()
        }
    }
}

pub const ROOT: u32 = u32::MAX;

/// A block of content at one place in a prompt tree.
pub struct Node {
    pub parent: u32,
    pub depth: u32,
    /// Dynamo's LocalBlockHash of the block's tokens.
    pub local: u64,
    /// The engine's block hash: chained over the prefix (Dynamo's SequenceHash).
    pub seq: u64,
}

pub enum Ev {
    Stored {
        parent: Option<u32>,
        blocks: Vec<u32>,
    },
    Removed(Vec<u32>),
    Cleared,
}

/// One worker's KV events of one engine step: one payload.
pub struct Step {
    pub worker: u32,
    pub events: Vec<Ev>,
}

pub struct Query {
    pub local: Vec<u64>,
    pub seq: Vec<u64>,
    pub tokens: Vec<u32>,
    /// Brute force: per worker holding the first block, how many leading blocks it holds.
    pub expect: Scores,
}

impl Query {
    pub fn local_hashes(&self) -> Vec<LocalBlockHash> {
        self.local.iter().map(|&h| LocalBlockHash(h)).collect()
    }
}

pub struct Workload {
    pub block_size: usize,
    pub workers: u32,
    pub nodes: Vec<Node>,
    /// Node i's tokens: tokens[i * block_size..][..block_size].
    pub tokens: Vec<u32>,
    pub steps: Vec<Step>,
    pub queries: Vec<Query>,
    pub stored: usize,
    pub removed: usize,
    pub clears: usize,
    pub entries_held: usize,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    /// Skewed towards 0: a few system prompts are most of the traffic.
    fn skewed(&mut self, n: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((u * u * u) * n as f64) as usize
    }
}

#[derive(Default)]
struct Cache {
    /// Held block -> (children held, last use).
    held: HashMap<u32, (u32, u64)>,
    /// Held blocks without held children, oldest use first: what LRU eviction may take.
    leaves: BTreeSet<(u64, u32)>,
}

impl Cache {
    fn touch(&mut self, n: u32, now: u64) {
        let e = self.held.get_mut(&n).expect("held");
        if e.0 == 0 {
            self.leaves.remove(&(e.1, n));
            self.leaves.insert((now, n));
        }
        e.1 = now;
    }

    fn add(&mut self, nodes: &[Node], n: u32, now: u64) {
        let p = nodes[n as usize].parent;
        if p != ROOT {
            let e = self.held.get_mut(&p).expect("parent held");
            if e.0 == 0 {
                self.leaves.remove(&(e.1, p));
            }
            e.0 += 1;
        }
        self.held.insert(n, (0, now));
        self.leaves.insert((now, n));
    }

    /// The least recently used leaf, unless it is in use by this step's requests.
    fn evict(&mut self, nodes: &[Node], now: u64) -> Option<u32> {
        let &(stamp, n) = self.leaves.first()?;
        if stamp == now {
            return None;
        }
        self.leaves.pop_first();
        self.held.remove(&n);
        let p = nodes[n as usize].parent;
        if p != ROOT {
            let e = self.held.get_mut(&p).expect("parent held");
            e.0 -= 1;
            if e.0 == 0 {
                self.leaves.insert((e.1, p));
            }
        }
        Some(n)
    }
}

impl Workload {
    pub fn block_events(&self) -> usize {
        self.stored + self.removed
    }

    fn new_node(&mut self, rng: &mut Rng, parent: u32) -> u32 {
        let bs = self.block_size;
        let start = self.tokens.len();
        for _ in 0..bs {
            self.tokens.push(rng.below(150_000) as u32);
        }
        let local = compute_block_hash_for_seq(
            &self.tokens[start..],
            bs as u32,
            BlockHashOptions::default(),
        )[0]
        .0;
        let (seq, depth) = if parent == ROOT {
            (local, 0)
        } else {
            let p = &self.nodes[parent as usize];
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&p.seq.to_le_bytes());
            b[8..].copy_from_slice(&local.to_le_bytes());
            (xxh3_64_with_seed(&b, 1337), p.depth + 1)
        };
        self.nodes.push(Node {
            parent,
            depth,
            local,
            seq,
        });
        (self.nodes.len() - 1) as u32
    }

    fn extend(&mut self, rng: &mut Rng, mut end: u32, n: usize) -> u32 {
        for _ in 0..n {
            end = self.new_node(rng, end);
        }
        end
    }

    /// Root..=end.
    pub fn path(&self, end: u32) -> Vec<u32> {
        let mut p = Vec::new();
        let mut n = end;
        while n != ROOT {
            p.push(n);
            n = self.nodes[n as usize].parent;
        }
        p.reverse();
        p
    }

    pub fn generate(cfg: &Config) -> Workload {
        let mut rng = Rng(cfg.seed);
        let mut w = Workload {
            block_size: cfg.block_size,
            workers: cfg.workers,
            nodes: Vec::new(),
            tokens: Vec::new(),
            steps: Vec::new(),
            queries: Vec::new(),
            stored: 0,
            removed: 0,
            clears: 0,
            entries_held: 0,
        };
        // System prompts, some sharing a preamble with another.
        let mut prompts: Vec<u32> = Vec::new();
        for _ in 0..cfg.system_prompts {
            let base = if !prompts.is_empty() && rng.chance(0.3) {
                prompts[rng.below(prompts.len())]
            } else {
                ROOT
            };
            let len = 4 + rng.below(40);
            let end = w.extend(&mut rng, base, len);
            prompts.push(end);
        }
        let mut recent: Vec<u32> = Vec::new();
        let mut caches: Vec<Cache> = (0..cfg.workers).map(|_| Cache::default()).collect();
        let mut now = 0u64;
        while w.stored + w.removed < cfg.block_events {
            now += 1;
            let worker = rng.below(cfg.workers as usize) as u32;
            let cache = &mut caches[worker as usize];
            let mut events = Vec::new();
            if rng.chance(0.0005) {
                events.push(Ev::Cleared);
                *cache = Cache::default();
                w.clears += 1;
            }
            let mut removed = Vec::new();
            let mut stores = Vec::new();
            for _ in 0..1 + rng.below(3) {
                // A conversation's next turn, or a new one on a system prompt.
                let base = match recent.len() {
                    n if n > 0 && rng.chance(0.5) => recent[n - 1 - rng.skewed(n.min(4096))],
                    _ => prompts[rng.skewed(prompts.len())],
                };
                let base = if w.nodes[base as usize].depth > 200 {
                    prompts[rng.below(prompts.len())]
                } else {
                    base
                };
                let new = 2 + rng.below(40);
                let end = w.extend(&mut rng, base, new);
                recent.push(end);
                let path = w.path(end);
                let cache = &mut caches[worker as usize];
                let k = path
                    .iter()
                    .take_while(|n| cache.held.contains_key(n))
                    .count();
                for &n in &path[..k] {
                    cache.touch(n, now);
                }
                let need = path.len() - k;
                while cache.held.len() + need > cfg.capacity {
                    match cache.evict(&w.nodes, now) {
                        Some(n) => removed.push(n),
                        None => break,
                    }
                }
                for &n in &path[k..] {
                    cache.add(&w.nodes, n, now);
                }
                // The prompt's blocks at once, then decode blocks one by one.
                let decode = rng.below(4).min(need);
                let prefill = need - decode;
                let mut parent = (k > 0).then(|| path[k - 1]);
                if prefill > 0 {
                    stores.push(Ev::Stored {
                        parent,
                        blocks: path[k..k + prefill].to_vec(),
                    });
                    parent = Some(path[k + prefill - 1]);
                }
                for &n in &path[k + prefill..] {
                    stores.push(Ev::Stored {
                        parent,
                        blocks: vec![n],
                    });
                    parent = Some(n);
                }
                w.stored += need;
            }
            w.removed += removed.len();
            if !removed.is_empty() {
                events.push(Ev::Removed(removed));
            }
            events.extend(stores);
            w.steps.push(Step { worker, events });
        }
        let held: Vec<HashSet<u32>> = caches
            .iter()
            .map(|c| c.held.keys().copied().collect())
            .collect();
        w.entries_held = held.iter().map(HashSet::len).sum();
        for _ in 0..cfg.queries {
            let end = match rng.below(20) {
                0 => ROOT,
                1..=3 => prompts[rng.skewed(prompts.len())],
                _ => recent[recent.len() - 1 - rng.skewed(recent.len().min(8192))],
            };
            let mut path = w.path(end);
            path.truncate(cfg.query_blocks);
            let last = path.last().copied().unwrap_or(ROOT);
            let fresh = cfg.query_blocks - path.len();
            let end = w.extend(&mut rng, last, fresh);
            let path = w.path(end);
            let mut expect: Scores = held
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    (
                        i as u32,
                        path.iter().take_while(|n| h.contains(n)).count() as u32,
                    )
                })
                .filter(|&(_, n)| n > 0)
                .collect();
            expect.sort_unstable();
            let bs = w.block_size;
            w.queries.push(Query {
                local: path.iter().map(|&n| w.nodes[n as usize].local).collect(),
                seq: path.iter().map(|&n| w.nodes[n as usize].seq).collect(),
                tokens: path
                    .iter()
                    .flat_map(|&n| w.tokens[n as usize * bs..][..bs].iter().copied())
                    .collect(),
                expect,
            });
        }
        w
    }

    pub fn node_tokens(&self, n: u32) -> &[u32] {
        &self.tokens[n as usize * self.block_size..][..self.block_size]
    }
}
