//! Provisional residency on plain Rust data: per worker, the block keys a router has just sent
//! it and until when (the rules: python/kvbridge/routing/provisional.py's module doc).
//!
//! Two views of the same entries: per worker `key -> expiry` (what expiry, confirmation and
//! reset take away), and per key the set of workers holding it, so that one walk over a
//! prompt's keys scores every worker at once (a worker's leading run ends at the first key
//! whose set lacks it). A hot system prompt sent to every worker costs that walk one lookup
//! per block, not one per block and worker.

use std::collections::VecDeque;

use crate::pool::core::Map;

/// A set of worker ids: the first 64 in a word, the rest in more words (allocated only for
/// fleets past 64 workers).
#[derive(Default, Clone)]
pub struct Holders {
    low: u64,
    high: Vec<u64>,
}

impl Holders {
    fn insert(&mut self, w: u32) {
        if w < 64 {
            self.low |= 1 << w;
        } else {
            let i = (w / 64 - 1) as usize;
            if self.high.len() <= i {
                self.high.resize(i + 1, 0);
            }
            self.high[i] |= 1 << (w % 64);
        }
    }

    fn remove(&mut self, w: u32) {
        if w < 64 {
            self.low &= !(1 << w);
        } else if let Some(word) = self.high.get_mut((w / 64 - 1) as usize) {
            *word &= !(1 << (w % 64));
        }
    }

    fn is_empty(&self) -> bool {
        self.low == 0 && self.high.iter().all(|&w| w == 0)
    }

    /// Word `i` of the set (0: ids 0..64).
    fn word(&self, i: usize) -> u64 {
        if i == 0 {
            self.low
        } else {
            self.high.get(i - 1).copied().unwrap_or(0)
        }
    }

    fn words(&self) -> usize {
        1 + self.high.len()
    }
}

/// Counters, in entries except `confirmed` and `reset` (calls that took something away).
#[derive(Default, Clone, Copy)]
pub struct Stats {
    pub added: u64,
    pub confirmed: u64,
    pub expired: u64,
    pub dropped: u64,
    pub reset: u64,
}

impl Stats {
    pub fn pairs(&self) -> [(&'static str, u64); 5] {
        [
            ("added", self.added),
            ("confirmed", self.confirmed),
            ("expired", self.expired),
            ("dropped", self.dropped),
            ("reset", self.reset),
        ]
    }
}

pub struct Provisional {
    pub ttl_s: f64,
    pub max_entries: usize,
    /// By worker id: key -> expiry (a key in several decisions keeps the latest).
    held: Vec<Map<f64>>,
    holders: Map<Holders>,
    /// (expiry, worker, keys) per decision in the order made: one TTL for all, so expiry order
    /// (a peer's shorter one only ends sooner, and is pruned with the next).
    decisions: VecDeque<(f64, u32, Box<[u64]>)>,
    entries: usize,
    pub stats: Stats,
    alive: Vec<u64>,
}

impl Provisional {
    pub fn new(ttl_s: f64, max_entries: usize) -> Provisional {
        Provisional {
            ttl_s,
            max_entries,
            held: Vec::new(),
            holders: Map::default(),
            decisions: VecDeque::new(),
            entries: 0,
            stats: Stats::default(),
            alive: Vec::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.ttl_s > 0.0
    }

    /// (key, worker) entries held.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Worker `w` is about to hold `keys` (a prompt's chain, first block first) until `expiry`
    /// (> now; the caller checks).
    pub fn add(&mut self, w: u32, keys: &[u64], expiry: f64, now: f64) {
        if keys.is_empty() {
            return;
        }
        self.prune(now);
        let i = w as usize;
        if self.held.len() <= i {
            self.held.resize_with(i + 1, Map::default);
        }
        let held = &mut self.held[i];
        let mut new = 0;
        for &k in keys {
            if held.insert(k, expiry).is_none() {
                new += 1;
                self.holders.entry(k).or_default().insert(w);
            }
        }
        self.entries += new;
        self.stats.added += new as u64;
        self.decisions.push_back((expiry, w, keys.into()));
        while self.entries > self.max_entries {
            let Some((expiry, w, keys)) = self.decisions.pop_front() else {
                break;
            };
            self.stats.dropped += self.forget(expiry, w, &keys) as u64;
        }
    }

    /// Per worker expected to hold `keys[0]`: (worker id, how many leading keys), in id order.
    pub fn leading(&mut self, keys: &[u64], now: f64, out: &mut Vec<(u32, u32)>) {
        out.clear();
        if self.entries == 0 || keys.is_empty() {
            return;
        }
        self.prune(now);
        let Some(first) = self.holders.get(&keys[0]) else {
            return;
        };
        let mut alive = std::mem::take(&mut self.alive);
        alive.clear();
        alive.extend((0..first.words()).map(|i| first.word(i)));
        let mut n = 1;
        while n < keys.len() && alive.iter().any(|&w| w != 0) {
            let next = self.holders.get(&keys[n]);
            for (i, word) in alive.iter_mut().enumerate() {
                let kept = next.map_or(0, |h| h.word(i)) & *word;
                push_ids(*word & !kept, i, n, out);
                *word = kept;
            }
            n += 1;
        }
        for (i, &word) in alive.iter().enumerate() {
            push_ids(word, i, n, out);
        }
        self.alive = alive;
        out.sort_unstable();
    }

    /// Worker `w`'s own events now show it holding `keys`: its entries for them end.
    pub fn confirm(&mut self, w: u32, keys: &[u64]) {
        let Some(held) = self.held.get_mut(w as usize) else {
            return;
        };
        let mut removed = 0;
        for k in keys {
            if held.remove(k).is_some() {
                removed += 1;
                unhold(&mut self.holders, *k, w);
            }
        }
        if removed > 0 {
            self.entries -= removed;
            self.stats.confirmed += 1;
        }
    }

    /// Worker `w`'s cache was reset, cleared or it is gone: nothing it was sent stays.
    pub fn reset(&mut self, w: u32) {
        let Some(held) = self.held.get_mut(w as usize) else {
            return;
        };
        if held.is_empty() {
            return;
        }
        let n = held.len();
        for (k, _) in held.drain() {
            unhold(&mut self.holders, k, w);
        }
        self.entries -= n;
        self.stats.reset += 1;
    }

    fn prune(&mut self, now: f64) {
        while self.decisions.front().is_some_and(|d| d.0 <= now) {
            let (expiry, w, keys) = self.decisions.pop_front().expect("a front");
            self.stats.expired += self.forget(expiry, w, &keys) as u64;
        }
    }

    /// Drops a decision's entries that no later decision renewed; how many.
    fn forget(&mut self, expiry: f64, w: u32, keys: &[u64]) -> usize {
        let Some(held) = self.held.get_mut(w as usize) else {
            return 0;
        };
        let mut removed = 0;
        for k in keys {
            if held.get(k) == Some(&expiry) {
                held.remove(k);
                removed += 1;
                unhold(&mut self.holders, *k, w);
            }
        }
        self.entries -= removed;
        removed
    }
}

fn unhold(holders: &mut Map<Holders>, k: u64, w: u32) {
    if let Some(h) = holders.get_mut(&k) {
        h.remove(w);
        if h.is_empty() {
            holders.remove(&k);
        }
    }
}

/// (id, n) for each id in word `i` of a set.
fn push_ids(mut word: u64, i: usize, n: usize, out: &mut Vec<(u32, u32)>) {
    while word != 0 {
        let bit = word.trailing_zeros();
        out.push(((i * 64) as u32 + bit, n as u32));
        word &= word - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leading(p: &mut Provisional, keys: &[u64], now: f64) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        p.leading(keys, now, &mut out);
        out
    }

    #[test]
    fn each_worker_scores_its_leading_run() {
        let mut p = Provisional::new(2.0, 1000);
        p.add(0, &[1, 2, 3], 2.0, 0.0);
        p.add(70, &[1, 2], 2.0, 0.0);
        p.add(5, &[9], 2.0, 0.0);
        assert_eq!(leading(&mut p, &[1, 2, 3, 4], 0.5), vec![(0, 3), (70, 2)]);
        assert_eq!(p.len(), 6);
        p.confirm(0, &[1, 2, 3]);
        assert_eq!(leading(&mut p, &[1, 2, 3], 0.5), vec![(70, 2)]);
        // expiry
        assert_eq!(leading(&mut p, &[1, 2], 2.0), vec![]);
        assert_eq!(p.len(), 0);
        assert_eq!(p.stats.expired, 3);
    }

    #[test]
    fn a_renewed_key_outlives_the_decision_that_first_added_it() {
        let mut p = Provisional::new(2.0, 1000);
        p.add(1, &[1, 2], 2.0, 0.0);
        p.add(1, &[1, 3], 3.0, 1.0);
        assert_eq!(leading(&mut p, &[1, 3], 2.5), vec![(1, 2)]);
        assert_eq!(leading(&mut p, &[1, 2], 2.5), vec![(1, 1)]);
        p.reset(1);
        assert_eq!(p.len(), 0);
        assert_eq!(leading(&mut p, &[1], 2.5), vec![]);
    }

    #[test]
    fn the_oldest_decisions_go_past_the_cap() {
        let mut p = Provisional::new(2.0, 3);
        p.add(0, &[1, 2], 2.0, 0.0);
        p.add(1, &[3, 4], 2.0, 0.0);
        assert_eq!(p.len(), 2);
        assert_eq!(p.stats.dropped, 2);
        assert_eq!(leading(&mut p, &[1], 0.0), vec![]);
    }
}
