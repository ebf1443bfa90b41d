//! Provisional residency on plain Rust data: per block key, the workers a router has just sent
//! it to and until when (the rules: python/kvbridge/routing/provisional.py's module doc).
//!
//! A router adds only what the chosen worker does not already hold by its own events (the keys
//! past its index hit), so a worker holding a long system prompt is not sent it again at every
//! decision, and reads a worker's run from where its hit ends.
//!
//! The entries are one open-addressing table of (key, worker, decision), hashed by key (a key's
//! workers sit together), 16 bytes each, at most half full: a decision's reads and writes cost a cache line per key,
//! and at the cap (100,000 entries: megabytes) that is the cost. An entry belongs to the newest
//! decision that added it; a decision that expires or is dropped past the cap ends its entries
//! at once, by leaving the live range of decisions, without touching them (their slots are
//! reused by later inserts, and the table is rebuilt when dead slots pile up). Each decision
//! counts the entries it still owns, so the counts stay exact.

use std::collections::VecDeque;

use crate::prefetch::prefetch;

/// Block keys are uniform already: one multiply spreads them over the table.
fn slot_of(key: u64, mask: usize) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & mask
}

/// A slot's worker when the slot is free (it ends probe runs).
const EMPTY: u32 = u32::MAX;
/// A slot's worker when its entry was taken away (confirmed, reset): never live, reusable.
const TAKEN: u32 = u32::MAX - 1;
/// Decision numbers are kept modulo 2**32 in the slots; the table is rebuilt (dead slots
/// dropped) at least this often, so a dead slot's number never comes round to a live one.
const RENUMBER: u64 = 1 << 31;

#[derive(Clone, Copy)]
struct Slot {
    key: u64,
    /// The decision that owns it (its number modulo 2**32, see `Provisional::front`).
    gen: u32,
    worker: u32,
}

const FREE: Slot = Slot {
    key: 0,
    gen: 0,
    worker: EMPTY,
};

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

struct Decision {
    expiry: f64,
    /// Entries this decision owns (added or renewed by it, not since renewed or taken away).
    owned: usize,
}

pub struct Provisional {
    pub ttl_s: f64,
    pub max_entries: usize,
    table: Vec<Slot>,
    /// Slots not EMPTY (live or dead).
    used: usize,
    /// Live decisions, oldest first: one TTL for all, so expiry order (a peer's shorter one only
    /// ends sooner, and goes with the next prune past it).
    decisions: VecDeque<Decision>,
    /// The number of `decisions[0]`: decision i is `front + i`; an entry is live iff its
    /// decision is.
    front: u64,
    /// `front` when the table was last rebuilt.
    rebuilt: u64,
    entries: usize,
    pub stats: Stats,
}

impl Provisional {
    pub fn new(ttl_s: f64, max_entries: usize) -> Provisional {
        Provisional {
            ttl_s,
            max_entries,
            table: Vec::new(),
            used: 0,
            decisions: VecDeque::new(),
            front: 0,
            rebuilt: 0,
            entries: 0,
            stats: Stats::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.ttl_s > 0.0
    }

    /// (key, worker) entries held.
    pub fn len(&self) -> usize {
        self.entries
    }

    fn live(&self, s: &Slot) -> bool {
        s.worker < TAKEN && (s.gen.wrapping_sub(self.front as u32) as usize) < self.decisions.len()
    }

    /// The index in `decisions` of a live slot's owner.
    fn owner(&self, s: &Slot) -> usize {
        s.gen.wrapping_sub(self.front as u32) as usize
    }

    /// The slot of (key, w) if it is in the table (live or not).
    fn find(&self, key: u64, w: u32) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        let mask = self.table.len() - 1;
        let mut i = slot_of(key, mask);
        loop {
            let s = &self.table[i];
            if s.worker == EMPTY {
                return None;
            }
            if s.key == key && s.worker == w {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Worker `w` is about to hold `keys[start..]` of a prompt's chain `keys` until `expiry`
    /// (> now; the caller checks): `start` is where its own hit ends.
    pub fn add(&mut self, w: u32, keys: &[u64], start: usize, expiry: f64, now: f64) {
        let Some(added) = keys.get(start..).filter(|k| !k.is_empty()) else {
            return;
        };
        self.prune(now);
        self.reserve(added.len());
        // The keys' slots are far apart in a table of megabytes: ask for all their lines first,
        // so the waits overlap instead of coming one per key.
        let mask = self.table.len() - 1;
        for &k in added {
            prefetch(self.table.as_ptr().wrapping_add(slot_of(k, mask)));
        }
        let gen = (self.front + self.decisions.len() as u64) as u32;
        self.decisions.push_back(Decision { expiry, owned: 0 });
        let (mut new, mut owned) = (0, 0);
        for &k in added {
            let mask = self.table.len() - 1;
            let mut i = slot_of(k, mask);
            let mut reuse = None;
            let found = loop {
                let s = &self.table[i];
                if s.worker == EMPTY {
                    break None;
                }
                if s.key == k && s.worker == w {
                    break Some(i);
                }
                if reuse.is_none() && !self.live(s) {
                    reuse = Some(i);
                }
                i = (i + 1) & mask;
            };
            match found {
                Some(j) => {
                    let old = self.table[j];
                    let live = self.live(&old);
                    if live && old.gen == gen {
                        continue; // a key twice in one chain
                    }
                    if live {
                        // Renewed: the newer decision owns it now.
                        let o = self.owner(&old);
                        self.decisions[o].owned -= 1;
                    } else {
                        new += 1;
                    }
                    self.table[j].gen = gen;
                    owned += 1;
                }
                None => {
                    let j = match reuse {
                        Some(j) => j,
                        None => {
                            self.used += 1;
                            i
                        }
                    };
                    self.table[j] = Slot {
                        key: k,
                        gen,
                        worker: w,
                    };
                    new += 1;
                    owned += 1;
                }
            }
        }
        let last = self.decisions.len() - 1;
        self.decisions[last].owned = owned;
        self.entries += new;
        self.stats.added += new as u64;
        while self.entries > self.max_entries && !self.decisions.is_empty() {
            self.stats.dropped += self.pop() as u64;
        }
    }

    /// Room for `n` more entries: the table is rebuilt (live entries only) or grown when
    /// occupied slots would pass three quarters of it.
    fn reserve(&mut self, n: usize) {
        if (self.used + n) * 2 <= self.table.len() && self.front - self.rebuilt < RENUMBER {
            return;
        }
        self.rebuilt = self.front;
        let want = ((self.entries + n) * 4).max(1024).next_power_of_two();
        let size = want.max(self.table.len());
        let old = std::mem::replace(&mut self.table, vec![FREE; size]);
        self.used = 0;
        let mask = self.table.len() - 1;
        for s in old {
            if self.live(&s) {
                let mut i = slot_of(s.key, mask);
                while self.table[i].worker != EMPTY {
                    i = (i + 1) & mask;
                }
                self.table[i] = s;
                self.used += 1;
            }
        }
    }

    /// Ends the oldest decision; the entries it owned.
    fn pop(&mut self) -> usize {
        let d = self.decisions.pop_front().expect("a decision");
        self.front += 1;
        self.entries -= d.owned;
        d.owned
    }

    /// Drops what has expired by `now`.
    pub fn prune(&mut self, now: f64) {
        while self.decisions.front().is_some_and(|d| d.expiry <= now) {
            self.stats.expired += self.pop() as u64;
        }
    }

    /// The workers holding `first` provisionally (a prompt's first block: the workers sent a
    /// chain from it).
    pub fn starting(&self, first: u64) -> Vec<u32> {
        let mut out = Vec::new();
        if self.table.is_empty() {
            return out;
        }
        let mask = self.table.len() - 1;
        let mut i = slot_of(first, mask);
        while self.table[i].worker != EMPTY {
            let s = &self.table[i];
            if s.key == first && self.live(s) {
                out.push(s.worker);
            }
            i = (i + 1) & mask;
        }
        out
    }

    /// Whether worker `w` holds `key` provisionally.
    pub fn holds(&self, w: u32, key: u64) -> bool {
        self.find(key, w).is_some_and(|i| self.live(&self.table[i]))
    }

    /// How many of `keys[from..]`, consecutively, worker `w` holds provisionally.
    pub fn run(&self, w: u32, keys: &[u64], from: usize) -> usize {
        keys.get(from..)
            .map_or(0, |k| k.iter().take_while(|&&k| self.holds(w, k)).count())
    }

    /// Per worker holding `keys[0]`: (worker id, how many leading keys), in id order.
    pub fn leading(&mut self, keys: &[u64], now: f64, out: &mut Vec<(u32, u32)>) {
        out.clear();
        if self.entries == 0 || keys.is_empty() {
            return;
        }
        self.prune(now);
        for w in self.starting(keys[0]) {
            out.push((w, self.run(w, keys, 0) as u32));
        }
        out.sort_unstable();
    }

    /// Takes the live entry in slot `i` away; whether there was one.
    fn take(&mut self, i: usize) -> bool {
        let s = self.table[i];
        if !self.live(&s) {
            return false;
        }
        let o = self.owner(&s);
        self.decisions[o].owned -= 1;
        self.table[i].worker = TAKEN;
        self.entries -= 1;
        true
    }

    /// Worker `w`'s own events now show it holding `keys`: its entries for them end.
    pub fn confirm(&mut self, w: u32, keys: &[u64]) {
        let mut removed = 0;
        for &k in keys {
            if let Some(i) = self.find(k, w) {
                removed += self.take(i) as usize;
            }
        }
        if removed > 0 {
            self.stats.confirmed += 1;
        }
    }

    /// Worker `w`'s cache was reset, cleared or it is gone: nothing it was sent stays.
    pub fn reset(&mut self, w: u32) {
        let mut removed = 0;
        for i in 0..self.table.len() {
            if self.table[i].worker == w {
                removed += self.take(i) as usize;
            }
        }
        if removed > 0 {
            self.stats.reset += 1;
        }
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
        p.add(0, &[1, 2, 3], 0, 2.0, 0.0);
        p.add(70, &[1, 2], 0, 2.0, 0.0);
        p.add(5, &[9], 0, 2.0, 0.0);
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
        p.add(1, &[1, 2], 0, 2.0, 0.0);
        p.add(1, &[1, 3], 0, 3.0, 1.0);
        assert_eq!(leading(&mut p, &[1, 3], 2.5), vec![(1, 2)]);
        assert_eq!(leading(&mut p, &[1, 2], 2.5), vec![(1, 1)]);
        p.reset(1);
        assert_eq!(p.len(), 0);
        assert_eq!(leading(&mut p, &[1], 2.5), vec![]);
    }

    #[test]
    fn a_chain_added_past_a_hit_is_read_from_where_the_hit_ends() {
        let mut p = Provisional::new(2.0, 1000);
        p.add(3, &[1, 2, 3, 4], 2, 2.0, 0.0);
        assert_eq!(p.len(), 2);
        assert_eq!(leading(&mut p, &[1, 2, 3, 4], 0.5), vec![]);
        assert_eq!(p.run(3, &[1, 2, 3, 4], 2), 2);
        assert_eq!(p.run(3, &[1, 2, 3, 5], 2), 1);
        assert!(p.holds(3, 4) && !p.holds(3, 1));
    }

    /// Random operations against the plain model: per (key, worker) the expiry and the decision
    /// that last added it; a decision's end takes the entries it still owns.
    #[test]
    fn the_table_keeps_what_a_plain_model_keeps() {
        use std::collections::HashMap;
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..20 {
            let cap = 20 + round * 40;
            let mut p = Provisional::new(2.0, cap);
            let mut model: HashMap<(u64, u32), u64> = HashMap::new(); // -> decision number
            let mut live: VecDeque<(u64, f64)> = VecDeque::new(); // (number, expiry)
            let mut number = 0u64;
            let mut now = 0.0;
            let drop_ended = |model: &mut HashMap<(u64, u32), u64>, live: &VecDeque<(u64, f64)>| {
                model.retain(|_, d| live.iter().any(|l| l.0 == *d));
            };
            for _ in 0..400 {
                let w = next(5) as u32 * 40; // ids past 64 too
                let chain: Vec<u64> = (0..1 + next(12)).map(|i| next(3) * 100 + i).collect();
                match next(6) {
                    0..=2 => {
                        let start = next(chain.len() as u64) as usize;
                        p.add(w, &chain, start, now + 2.0, now);
                        while live.front().is_some_and(|l| l.1 <= now) {
                            live.pop_front();
                        }
                        drop_ended(&mut model, &live);
                        live.push_back((number, now + 2.0));
                        for &k in &chain[start..] {
                            model.insert((k, w), number);
                        }
                        number += 1;
                        while model.len() > cap && !live.is_empty() {
                            live.pop_front();
                            drop_ended(&mut model, &live);
                        }
                    }
                    3 => {
                        p.confirm(w, &chain);
                        for k in &chain {
                            model.remove(&(*k, w));
                        }
                    }
                    4 => {
                        p.reset(w);
                        model.retain(|e, _| e.1 != w);
                    }
                    _ => now += next(100) as f64 / 100.0,
                }
                p.prune(now);
                while live.front().is_some_and(|l| l.1 <= now) {
                    live.pop_front();
                }
                drop_ended(&mut model, &live);
                assert_eq!(p.len(), model.len());
                for k in 0..3 * 100 + 13 {
                    for w in (0..5).map(|w| w * 40) {
                        assert_eq!(
                            p.holds(w, k),
                            model.contains_key(&(k, w)),
                            "key {k} worker {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_oldest_decisions_go_past_the_cap() {
        let mut p = Provisional::new(2.0, 3);
        p.add(0, &[1, 2], 0, 2.0, 0.0);
        p.add(1, &[3, 4], 0, 2.0, 0.0);
        assert_eq!(p.len(), 2);
        assert_eq!(p.stats.dropped, 2);
        assert_eq!(leading(&mut p, &[1], 0.0), vec![]);
    }
}
