//! The block pool on plain Rust data: free queue, ref counts, the hash -> cached block map and
//! the event record. A line-by-line port of `BlockPool` in python/kvbridge/engine/_reference_pool.py (the
//! executable spec; the state machine in tests/test_pool.py runs both side by side), so the
//! comments there explain the rules; the ones here explain the representation.
//!
//! A hybrid pool (KV-cache groups) keeps one map pair per group, a per-block group and, since
//! copies are announced one by one there, a per-block `Entry` for snapshots (`meta`). The
//! single-group pool uses map pair 0 and leaves `meta` empty.

use std::collections::hash_map::{Entry as MapEntry, HashMap, RandomState};
use std::hash::{BuildHasher, Hasher};
use std::ops::Range;

/// Block hashes are already uniform, so the map only mixes them with a per-process key: a full
/// SipHash per lookup would cost more than the rest of caching a block, and the key keeps
/// crafted prompts from piling hashes into one bucket chain.
#[derive(Clone)]
pub struct Mix(u64);

impl Default for Mix {
    fn default() -> Self {
        Mix(RandomState::new().hash_one(0x6b76_6272_6964_6765u64) | 1)
    }
}

impl BuildHasher for Mix {
    type Hasher = MixHasher;
    fn build_hasher(&self) -> MixHasher {
        MixHasher(self.0)
    }
}

pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    #[inline(always)]
    fn write_u64(&mut self, h: u64) {
        let x = (h ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
}

pub type Map<V> = HashMap<u64, V, Mix>;

/// What the map keeps per cached hash. `seq` is the insertion order (a dict's order in the
/// spec, which a replacement keeps); `run`/`idx` say which `cache` call stored it and where,
/// so a snapshot can merge what one call stored back into one event, as the spec does.
#[derive(Clone, Copy)]
struct Entry {
    block: u32,
    idx: u32,
    seq: u64,
    run: u64,
    parent: Option<u64>,
    lora: u32,
}

/// Events as offsets into two flat vectors; Python objects are made only when drained.
#[derive(Default)]
pub struct Record {
    pub events: Vec<Event>,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
}

pub enum Event {
    /// `lora` indexes the caller's LoRA table (0: no LoRA). `group` is read only by a hybrid
    /// pool's events.
    Stored {
        parent: Option<u64>,
        hashes: Range<usize>,
        tokens: Range<usize>,
        lora: u32,
        group: u8,
    },
    Removed {
        hashes: Range<usize>,
        group: u8,
    },
    Cleared,
}

impl Record {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    fn stored(
        &mut self,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u32],
        lora: u32,
        group: u8,
    ) {
        let h = self.hashes.len();
        let t = self.tokens.len();
        self.hashes.extend_from_slice(hashes);
        self.tokens.extend_from_slice(tokens);
        self.events.push(Event::Stored {
            parent,
            hashes: h..self.hashes.len(),
            tokens: t..self.tokens.len(),
            lora,
            group,
        });
    }
}

pub struct Core {
    pub num_blocks: usize,
    pub block_size: usize,
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u64>>,
    /// The free queue through block ids; `HEAD` and `TAIL` are sentinels past the blocks.
    prev: Vec<u32>,
    next: Vec<u32>,
    num_free: usize,
    /// Each block's tokens, written when it is cached: a snapshot reads them from here (a
    /// copy that takes over a hash holds the same tokens).
    tokens: Vec<u32>,
    /// Per group: hash -> its first holder.
    cached: Vec<Map<Entry>>,
    /// Per group: further blocks holding an already cached hash, oldest first. Rare.
    copies: Vec<Map<Vec<u32>>>,
    /// Hybrid only: the window of each group (None: a main group). Empty: single group.
    windows: Vec<Option<usize>>,
    /// Hybrid only, per block: the group whose map holds its hash, and its own `Entry`.
    group: Vec<u8>,
    meta: Vec<Entry>,
    seq: u64,
    run: u64,
    pub record: Option<Record>,
    scratch: Vec<u32>,
}

impl Core {
    /// `windows`: one entry per KV-cache group of a hybrid pool (None for a main group, the
    /// window in tokens for a window group); empty for the single-group pool.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        events: bool,
        windows: Vec<Option<usize>>,
    ) -> Core {
        let n = num_blocks;
        let hybrid = !windows.is_empty();
        let num_maps = windows.len().max(1);
        let blank = Entry {
            block: 0,
            idx: 0,
            seq: 0,
            run: 0,
            parent: None,
            lora: 0,
        };
        let (head, tail) = (n as u32, n as u32 + 1);
        // Block i sits between i-1 and i+1; block 0 follows HEAD and the last precedes TAIL.
        let mut prev: Vec<u32> = (0..n as u32 + 2).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<u32> = (1..n as u32 + 3).collect();
        prev[0] = head;
        next[n - 1] = tail;
        prev[tail as usize] = n as u32 - 1;
        next[head as usize] = 0;
        Core {
            num_blocks,
            block_size,
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev,
            next,
            num_free: n,
            tokens: vec![0; n * block_size],
            cached: vec![Map::default(); num_maps],
            copies: vec![Map::default(); num_maps],
            group: if hybrid { vec![0; n] } else { Vec::new() },
            meta: if hybrid { vec![blank; n] } else { Vec::new() },
            windows,
            seq: 0,
            run: 0,
            record: events.then(Record::default),
            scratch: Vec::new(),
        }
    }

    fn head(&self) -> u32 {
        self.num_blocks as u32
    }

    fn tail(&self) -> u32 {
        self.num_blocks as u32 + 1
    }

    // --- queries --------------------------------------------------------------------------

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    #[inline]
    fn hybrid(&self) -> bool {
        !self.windows.is_empty()
    }

    /// Distinct cached (group, hash) keys.
    pub fn num_cached(&self) -> usize {
        self.cached.iter().map(|m| m.len()).sum()
    }

    pub fn ref_cnt(&self, b: u32) -> u32 {
        self.ref_cnt[b as usize]
    }

    pub fn block_hash(&self, b: u32) -> Option<u64> {
        self.hash[b as usize]
    }

    pub fn free_block_ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.next[self.head() as usize];
        while b != self.tail() {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }

    /// Cached hashes in insertion order: parents before children (hybrid: one per key).
    pub fn cached_hashes(&self) -> Vec<u64> {
        let mut items: Vec<(u64, u64)> = self
            .cached
            .iter()
            .flat_map(|m| m.iter().map(|(&h, e)| (e.seq, h)))
            .collect();
        items.sort_unstable();
        items.into_iter().map(|(_, h)| h).collect()
    }

    /// The blocks holding the longest cached prefix of `hashes`.
    pub fn find_cached_prefix(&self, hashes: &[u64], out: &mut Vec<u32>) {
        for h in hashes {
            match self.cached[0].get(h) {
                Some(e) => out.push(e.block),
                None => break,
            }
        }
    }

    /// How many leading `hashes` (at most `max_blocks`) group `g` holds.
    pub fn held_prefix(&self, g: usize, hashes: &[u64], max_blocks: usize) -> usize {
        let held = |h: &&u64| self.cached[g].contains_key(*h);
        hashes.iter().take(max_blocks).take_while(held).count()
    }

    /// The first block holding `h` in group `g`.
    pub fn lookup(&self, g: usize, h: u64) -> Option<u32> {
        self.cached[g].get(&h).map(|e| e.block)
    }

    // --- the hybrid hit rule (the spec's `BlockPool.longest_hit` and helpers) ---------------

    /// Blocks a window group needs before a hit: max(1, cdiv(W - 1, block_size)); 0 for main.
    pub fn window_blocks(&self, g: usize) -> usize {
        self.windows[g].map_or(0, |w| (w - 1).div_ceil(self.block_size).max(1))
    }

    /// Leading blocks outside group `g`'s window once `num_tokens` are computed.
    pub fn skipped_blocks(&self, g: usize, num_tokens: usize) -> usize {
        self.windows
            .get(g)
            .copied()
            .flatten()
            .map_or(0, |w| (num_tokens + 1).saturating_sub(w) / self.block_size)
    }

    /// HybridKVCacheCoordinator.find_longest_cache_hit, in blocks (see the spec's docstring).
    pub fn longest_hit(&self, hashes: &[u64], max_blocks: usize) -> usize {
        let groups = 0..self.windows.len();
        let mains: Vec<usize> = groups
            .clone()
            .filter(|&g| self.windows[g].is_none())
            .collect();
        let mut n = hashes
            .iter()
            .take(max_blocks)
            .take_while(|h| mains.iter().all(|&g| self.cached[g].contains_key(h)))
            .count();
        let wins: Vec<(usize, usize)> = groups
            .filter(|&g| self.windows[g].is_some())
            .map(|g| (g, self.window_blocks(g)))
            .collect();
        let mut changed = true;
        while changed {
            changed = false;
            for &(g, k) in &wins {
                let m = self.window_hit(g, k, &hashes[..n]);
                if m < n {
                    n = m;
                    changed = true;
                }
            }
        }
        n
    }

    fn window_hit(&self, g: usize, k: usize, hashes: &[u64]) -> usize {
        let mut run = 0;
        for (i, h) in hashes.iter().enumerate().rev() {
            if self.cached[g].contains_key(h) {
                run += 1;
                if run >= k {
                    return i + k;
                }
            } else {
                run = 0;
            }
        }
        run
    }

    /// Whether `hit` plus `num_new` fresh blocks can be had, counting free hits as taken.
    pub fn can_take(&self, hit: &[u32], num_new: usize) -> bool {
        if num_new + hit.len() <= self.num_free {
            return true;
        }
        num_new
            + hit
                .iter()
                .filter(|&&b| self.ref_cnt[b as usize] == 0)
                .count()
            <= self.num_free
    }

    // --- block lifecycle --------------------------------------------------------------------

    pub fn touch(&mut self, blocks: &[u32]) {
        let mut taken = 0;
        for &b in blocks {
            let b = b as usize;
            if self.ref_cnt[b] == 0 {
                let (p, n) = (self.prev[b], self.next[b]);
                self.next[p as usize] = n;
                self.prev[n as usize] = p;
                taken += 1;
            }
            self.ref_cnt[b] += 1;
        }
        self.num_free -= taken;
    }

    /// Takes `count` blocks from the head of the free queue into `out`, evicting their hashes;
    /// the caller checked that they are free.
    pub fn new_blocks(&mut self, count: usize, out: &mut Vec<u32>) {
        if count == 0 {
            return;
        }
        let removed_from = self.record.as_ref().map_or(0, |r| r.hashes.len());
        let mut b = self.next[self.head() as usize];
        for _ in 0..count {
            out.push(b);
            let i = b as usize;
            self.ref_cnt[i] = 1;
            if let Some(h) = self.hash[i].take() {
                if self.hybrid() {
                    // Every holder is removed on its own, as vLLM announces it.
                    let g = self.group[i];
                    self.drop_cached(g as usize, b, h);
                    if let Some(r) = self.record.as_mut() {
                        r.hashes.push(h);
                        let at = r.hashes.len();
                        r.events.push(Event::Removed {
                            hashes: at - 1..at,
                            group: g,
                        });
                    }
                } else {
                    let last = if self.copies[0].is_empty() {
                        self.cached[0].remove(&h);
                        true
                    } else {
                        self.drop_cached(0, b, h)
                    };
                    if let (true, Some(r)) = (last, self.record.as_mut()) {
                        r.hashes.push(h);
                    }
                }
            }
            b = self.next[i];
        }
        let head = self.head();
        self.next[head as usize] = b;
        self.prev[b as usize] = head;
        self.num_free -= count;
        let hybrid = self.hybrid();
        if let (Some(r), false) = (self.record.as_mut(), hybrid) {
            if r.hashes.len() > removed_from {
                r.events.push(Event::Removed {
                    hashes: removed_from..r.hashes.len(),
                    group: 0,
                });
            }
        }
    }

    /// Forgets that `block` holds `h` in group `g`; true when that was the hash's last copy.
    fn drop_cached(&mut self, g: usize, block: u32, h: u64) -> bool {
        let MapEntry::Occupied(mut copies) = self.copies[g].entry(h) else {
            self.cached[g].remove(&h);
            return true;
        };
        let entry = self.cached[g].get_mut(&h).expect("a copied hash is cached");
        if entry.block == block {
            // The oldest other copy takes over, keeping the hash's place and run.
            entry.block = copies.get_mut().remove(0);
        } else {
            let list = copies.get_mut();
            let at = list
                .iter()
                .position(|&c| c == block)
                .expect("block holds a copy");
            list.remove(at);
        }
        if copies.get().is_empty() {
            copies.remove();
        }
        false
    }

    /// Marks in-use blocks without a hash as cached, one chain continuing `parent`; records a
    /// `Stored` event per stretch of hashes not already held by other blocks (hybrid: one
    /// event for all of them, in group `g`; with `mask`, only the blocks it keeps, the event
    /// still carrying every token).
    #[allow(clippy::too_many_arguments)]
    pub fn cache(
        &mut self,
        blocks: &[u32],
        hashes: &[u64],
        tokens: &[u32],
        parent: Option<u64>,
        lora: u32,
        g: usize,
        mask: Option<&[bool]>,
    ) {
        if self.hybrid() {
            return self.cache_group(blocks, hashes, tokens, parent, lora, g, mask);
        }
        let bs = self.block_size;
        self.run += 1;
        let run = self.run;
        // Stretches of new hashes as [start, end) pairs; one stretch unless duplicates occur.
        let mut stretches = std::mem::take(&mut self.scratch);
        stretches.clear();
        let mut start = 0;
        for (i, (&b, &h)) in blocks.iter().zip(hashes).enumerate() {
            let bi = b as usize;
            self.hash[bi] = Some(h);
            self.tokens[bi * bs..(bi + 1) * bs].copy_from_slice(&tokens[i * bs..(i + 1) * bs]);
            match self.cached[0].entry(h) {
                MapEntry::Occupied(_) => {
                    self.copies[0].entry(h).or_default().push(b);
                    if i > start {
                        stretches.extend([start as u32, i as u32]);
                    }
                    start = i + 1;
                }
                MapEntry::Vacant(v) => {
                    self.seq += 1;
                    let parent = if i > 0 { Some(hashes[i - 1]) } else { parent };
                    v.insert(Entry {
                        block: b,
                        idx: i as u32,
                        seq: self.seq,
                        run,
                        parent,
                        lora,
                    });
                }
            }
        }
        if start < hashes.len() {
            stretches.extend([start as u32, hashes.len() as u32]);
        }
        if let Some(r) = self.record.as_mut() {
            for pair in stretches.chunks_exact(2) {
                let (s, e) = (pair[0] as usize, pair[1] as usize);
                let parent = if s > 0 { Some(hashes[s - 1]) } else { parent };
                r.stored(parent, &hashes[s..e], &tokens[s * bs..e * bs], lora, 0);
            }
        }
        self.scratch = stretches;
    }

    #[allow(clippy::too_many_arguments)]
    fn cache_group(
        &mut self,
        blocks: &[u32],
        hashes: &[u64],
        tokens: &[u32],
        parent: Option<u64>,
        lora: u32,
        g: usize,
        mask: Option<&[bool]>,
    ) {
        let bs = self.block_size;
        self.run += 1;
        let kept = |i: usize| mask.is_none_or(|m| m[i]);
        for (i, (&b, &h)) in blocks.iter().zip(hashes).enumerate() {
            if !kept(i) {
                continue;
            }
            let bi = b as usize;
            self.hash[bi] = Some(h);
            self.tokens[bi * bs..(bi + 1) * bs].copy_from_slice(&tokens[i * bs..(i + 1) * bs]);
            self.seq += 1;
            let entry = Entry {
                block: b,
                idx: i as u32,
                seq: self.seq,
                run: self.run,
                parent: if i > 0 { Some(hashes[i - 1]) } else { parent },
                lora,
            };
            self.group[bi] = g as u8;
            self.meta[bi] = entry;
            match self.cached[g].entry(h) {
                MapEntry::Occupied(_) => self.copies[g].entry(h).or_default().push(b),
                MapEntry::Vacant(v) => {
                    v.insert(entry);
                }
            }
        }
        if let Some(r) = self.record.as_mut() {
            match mask {
                None => r.stored(parent, hashes, tokens, lora, g as u8),
                Some(m) => {
                    // vLLM's sparse shape: the kept hashes, every token.
                    let kept: Vec<u64> = (hashes.iter().zip(m).filter(|(_, &k)| k))
                        .map(|(&h, _)| h)
                        .collect();
                    r.stored(parent, &kept, tokens, lora, g as u8);
                }
            }
        }
    }

    /// Drops one reference per block, walking `blocks` backwards (a request's tail first, so a
    /// chain's last blocks are evicted first). Blocks reaching zero go to the tail if cached,
    /// to the head if not.
    pub fn free_reversed(&mut self, blocks: &[u32]) {
        let tail = self.tail();
        let mut last = self.prev[tail as usize];
        let mut fresh = std::mem::take(&mut self.scratch);
        fresh.clear();
        let mut released = 0;
        for &b in blocks.iter().rev() {
            let i = b as usize;
            self.ref_cnt[i] -= 1;
            if self.ref_cnt[i] != 0 {
                continue;
            }
            released += 1;
            if self.hash[i].is_none() {
                fresh.push(b);
            } else {
                self.next[last as usize] = b;
                self.prev[i] = last;
                last = b;
            }
        }
        self.next[last as usize] = tail;
        self.prev[tail as usize] = last;
        if !fresh.is_empty() {
            let head = self.head();
            let mut first = self.next[head as usize];
            for &b in fresh.iter().rev() {
                self.next[b as usize] = first;
                self.prev[first as usize] = b;
                first = b;
            }
            self.next[head as usize] = first;
            self.prev[first as usize] = head;
        }
        self.num_free += released;
        self.scratch = fresh;
    }

    pub fn reset(&mut self) -> bool {
        if self.num_free != self.num_blocks {
            return false;
        }
        self.hash.fill(None);
        self.cached.iter_mut().for_each(Map::clear);
        self.copies.iter_mut().for_each(Map::clear);
        if let Some(r) = self.record.as_mut() {
            r.events.push(Event::Cleared);
        }
        true
    }

    // --- events ---------------------------------------------------------------------------

    pub fn take_record(&mut self) -> Record {
        match self.record.as_mut() {
            Some(r) if !r.is_empty() => std::mem::take(r),
            _ => Record::default(),
        }
    }

    /// Every cached hash as `Stored` events, parents before children, consecutive hashes of
    /// one `cache` call merged into one event as they were stored.
    /// Hybrid: every block holding a hash, group by group in caching order (the spec's rule).
    pub fn snapshot(&self) -> Record {
        let mut entries: Vec<(u8, u64, &Entry)> = if self.hybrid() {
            (0..self.num_blocks)
                .filter_map(|b| {
                    let h = self.hash[b]?;
                    Some((self.group[b], h, &self.meta[b]))
                })
                .collect()
        } else {
            self.cached[0].iter().map(|(&h, e)| (0, h, e)).collect()
        };
        entries.sort_unstable_by_key(|&(g, _, e)| (g, e.seq));
        let bs = self.block_size;
        let mut out = Record::default();
        let mut prev: Option<&Entry> = None;
        for (g, h, e) in entries {
            let b = e.block as usize;
            let block_tokens = &self.tokens[b * bs..(b + 1) * bs];
            let continues = prev.is_some_and(|p| p.run == e.run && p.idx + 1 == e.idx);
            if let (true, Some(Event::Stored { hashes, tokens, .. })) =
                (continues, out.events.last_mut())
            {
                hashes.end += 1;
                tokens.end += bs;
                out.hashes.push(h);
                out.tokens.extend_from_slice(block_tokens);
                prev = Some(e);
                continue;
            }
            out.stored(e.parent, &[h], block_tokens, e.lora, g);
            prev = Some(e);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(r: &Record) -> Vec<(Option<u64>, Vec<u64>, Vec<u32>)> {
        r.events
            .iter()
            .filter_map(|e| match e {
                Event::Stored {
                    parent,
                    hashes,
                    tokens,
                    ..
                } => Some((
                    *parent,
                    r.hashes[hashes.clone()].to_vec(),
                    r.tokens[tokens.clone()].to_vec(),
                )),
                _ => None,
            })
            .collect()
    }

    fn removed(r: &Record) -> Vec<Vec<u64>> {
        r.events
            .iter()
            .filter_map(|e| match e {
                Event::Removed { hashes, .. } => Some(r.hashes[hashes.clone()].to_vec()),
                _ => None,
            })
            .collect()
    }

    /// The free-queue order of the spec (python/kvbridge/engine/_reference_pool.py `BlockPool`, same steps):
    /// freeing walks a request backwards; cached blocks go to the tail (tail of the chain
    /// first, so it is evicted first), uncached ones to the head; taking evicts from the head.
    #[test]
    fn free_queue_order_follows_the_spec() {
        let mut core = Core::new(6, 2, true, Vec::new());
        let mut taken = Vec::new();
        core.new_blocks(4, &mut taken);
        assert_eq!(taken, [0, 1, 2, 3]);
        assert_eq!(core.free_block_ids(), [4, 5]);

        core.cache(&taken[..2], &[100, 101], &[1, 2, 3, 4], None, 0, 0, None);
        core.free_reversed(&taken);
        assert_eq!(core.free_block_ids(), [3, 2, 4, 5, 1, 0]);
        assert_eq!(core.num_free(), 6);

        let mut again = Vec::new();
        core.new_blocks(4, &mut again);
        assert_eq!(again, [3, 2, 4, 5]);
        assert_eq!(core.cached_hashes(), [100, 101]);
        let mut evicting = Vec::new();
        core.new_blocks(1, &mut evicting);
        assert_eq!(evicting, [1]);
        assert_eq!(core.free_block_ids(), [0]);
        assert_eq!(core.cached_hashes(), [100]);

        let record = core.take_record();
        assert_eq!(stored(&record), [(None, vec![100, 101], vec![1, 2, 3, 4])]);
        assert_eq!(removed(&record), [vec![101]]);
        assert!(core.take_record().is_empty());
    }

    /// A prefix hit on a free block takes it out of the queue wherever it is (`touch`), and
    /// a hash held by two blocks is removed only when its last copy goes.
    #[test]
    fn touch_unlinks_and_copies_keep_a_hash_cached() {
        let mut core = Core::new(4, 1, true, Vec::new());
        let mut a = Vec::new();
        core.new_blocks(2, &mut a);
        core.cache(&a, &[7, 8], &[70, 80], None, 0, 0, None);
        let mut b = Vec::new();
        core.new_blocks(1, &mut b);
        core.cache(&b, &[7], &[70], None, 0, 0, None); // a second copy of 7: no new event
        core.free_reversed(&a);
        assert_eq!(core.free_block_ids(), [3, 1, 0]);
        core.touch(&[1]);
        assert_eq!(core.free_block_ids(), [3, 0]);
        assert_eq!(core.ref_cnt(1), 1);

        let mut fresh = Vec::new();
        core.new_blocks(2, &mut fresh); // 3 (no hash), then 0, the first holder of 7
        assert_eq!(fresh, [3, 0]);
        assert_eq!(core.cached_hashes(), [7, 8]);
        let mut found = Vec::new();
        core.find_cached_prefix(&[7, 8], &mut found);
        assert_eq!(found, [2, 1]); // block 2, the other copy, took over hash 7
        let record = core.take_record();
        assert_eq!(stored(&record).len(), 1);
        assert!(removed(&record).is_empty());
        assert!(!core.reset()); // blocks in use: no reset
    }

    /// The spec's `test_longest_hit_is_the_coordinators_fixed_point` (tests/test_pool.py), on the
    /// core: group 2 cuts the hit from 5 to 3, after which group 1 cuts it to 2.
    #[test]
    fn longest_hit_is_the_coordinators_fixed_point() {
        let mut core = Core::new(16, 1, true, vec![None, Some(2), Some(3)]);
        let hashes = [11, 12, 13, 14, 15];
        for (g, held) in [(0, &[0, 1, 2, 3, 4][..]), (1, &[0, 1, 4]), (2, &[0, 1, 2])] {
            for &i in held {
                let mut b = Vec::new();
                core.new_blocks(1, &mut b);
                core.cache(&b, &[hashes[i]], &[i as u32], None, 0, g, None);
            }
        }
        assert_eq!([0, 1, 2].map(|g| core.window_blocks(g)), [0, 1, 2]);
        assert_eq!(core.longest_hit(&hashes, 5), 2);
        assert_eq!(core.longest_hit(&hashes, 1), 1);
        assert_eq!(core.lookup(1, 15), Some(7));
        assert_eq!(core.skipped_blocks(2, 5), 3);
        assert_eq!(core.skipped_blocks(0, 5), 0);
        let removed: usize = core
            .take_record()
            .events
            .iter()
            .filter(|e| matches!(e, Event::Removed { .. }))
            .count();
        assert_eq!(removed, 0);
    }
}
