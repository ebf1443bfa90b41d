//! The index's state and its rules, on plain Rust data (no Python, no lock).
//!
//! - `blocks`: block key -> the (worker, medium) pairs holding it (`Holders`, 8 bytes inline).
//!   The key is the index's own chained xxh3 hash (`Mode::Tokens`) or the engine's block hash
//!   (`Mode::Engine`).
//! - per worker, per medium a `Slot`; in tokens mode it maps each engine hash to the index hash
//!   it stands for, which is how removals and parents (both given as engine hashes) are found.
//!   Two engine hashes may stand for one index hash (engines hash things the index leaves out,
//!   e.g. the LoRA path): `dups` counts the extra ones, so the block stays held until the last
//!   engine hash for it is removed.
//!
//! Removing a block removes that block only: a hole in a chain keeps its children, and a
//! query's prefix simply stops at the hole.
//!
//! Engine mode keeps no per-worker list of blocks (the blocks' holder sets are the only record,
//! which keeps an entry to the map's bytes): clearing or removing a worker there is one pass
//! over all blocks. Both are rare (a cache reset, a restart, an expired worker).

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use hashbrown::HashMap;

use super::holders::{entry, Bits, Entry, Holders, Removed, Slab, MAX_MEDIA, MAX_WORKERS};
use super::parse::{eq_bytes, Batch, Event, Spare, Stored};
use super::table::Table;
use crate::hash::algo::{Algo, Chain, Digest};
use crate::hash::value::Value;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The keys are hashes already, but not always good ones (tests use 1, 2, 3): one folded
/// multiply spreads any u64 over both the bucket index and hashbrown's 7-bit tag.
#[derive(Clone, Copy, Default)]
pub struct Mix;

pub struct MixHasher(u64);

impl BuildHasher for Mix {
    type Hasher = MixHasher;
    #[inline]
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
    #[inline]
    fn finish(&self) -> u64 {
        let m = (self.0 ^ 0x2d35_8dcc_aa6c_78a5) as u128 * 0x9e37_79b9_7f4a_7c15u128;
        (m as u64) ^ ((m >> 64) as u64)
    }
}

type Map<V> = HashMap<u64, V, Mix>;

/// How far ahead `find_matches` prefetches blocks' slots, and their slab entries.
const AHEAD: usize = 16;
const HALF: usize = AHEAD / 2;

/// Worker names (from subjects: anyone who may publish chooses them), looked up once per
/// payload: xxh3 rather than std's SipHash, which took a tenth of a one-event payload's apply.
/// Seeded at random per index, so names that collide cannot be prepared in advance.
#[derive(Clone, Copy)]
pub struct NameHash(u64);

impl Default for NameHash {
    fn default() -> Self {
        NameHash(std::collections::hash_map::RandomState::new().hash_one(0u64))
    }
}

pub struct NameHasher(u64);

impl BuildHasher for NameHash {
    type Hasher = NameHasher;
    #[inline]
    fn build_hasher(&self) -> NameHasher {
        NameHasher(self.0)
    }
}

impl Hasher for NameHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxh3_64_with_seed(bytes, self.0);
    }
    #[inline]
    fn write_u8(&mut self, b: u8) {
        self.0 ^= b as u64; // str's end marker
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Tokens,
    Engine,
}

macro_rules! stats {
    ($($name:ident),* $(,)?) => {
        /// Counters since the index was made; `clear()` keeps them.
        #[derive(Default, Clone, Debug)]
        pub struct Stats { $(pub $name: u64,)* }
        impl Stats {
            pub fn pairs(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

stats!(
    payloads,
    events,
    blocks_stored,
    blocks_removed,
    cleared,
    unknown_parents,
    block_size_mismatches,
    events_without_tokens,
    malformed_payloads,
    unknown_removes,
    bad_extra_keys,
    bad_token_ids,
    too_many_media,
    too_many_workers,
);

#[derive(Default)]
struct Slot {
    medium: u8,
    /// Tokens mode: engine hash -> index hash.
    engine: Map<u64>,
    /// Index hashes that more than one engine hash stands for: the number of extra ones.
    dups: Map<u32>,
    /// Distinct blocks held.
    held: usize,
}

struct Worker {
    name: Arc<str>,
    slots: Vec<Slot>,
}

pub struct Core {
    pub block_size: usize,
    pub mode: Mode,
    blocks: Table<Holders>,
    slab: Slab,
    workers: Vec<Option<Worker>>,
    ids: HashMap<Arc<str>, u32, NameHash>,
    free_ids: Vec<u32>,
    media: Vec<Option<Box<str>>>,
    pub stats: Stats,
    /// One stored event's index hashes (kept for its allocation).
    digests: Vec<u64>,
    spare: Spare,
}

impl Core {
    pub fn new(block_size: usize, mode: Mode) -> Core {
        Core {
            block_size,
            mode,
            blocks: Table::default(),
            slab: Slab::default(),
            workers: Vec::new(),
            ids: HashMap::default(),
            free_ids: Vec::new(),
            media: Vec::new(),
            stats: Stats::default(),
            digests: Vec::new(),
            spare: Spare::default(),
        }
    }

    // --- reading ---------------------------------------------------------------------------

    /// Distinct blocks held by anyone.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn worker_names(&self) -> Vec<Arc<str>> {
        self.workers.iter().flatten().map(|w| w.name.clone()).collect()
    }

    pub fn name(&self, id: u32) -> &Arc<str> {
        &self.workers[id as usize].as_ref().expect("live worker").name
    }

    /// Per worker holding the first block: how many leading blocks of `keys` it holds (in
    /// `medium`, or in any medium when None), as (worker id, count) in worker id order.
    pub fn find_matches(&self, keys: &[u64], medium: Option<&str>, out: &mut Vec<(u32, u32)>) {
        out.clear();
        let filter = match medium {
            None => None,
            Some(m) => match self.find_medium(Some(m)) {
                Some(id) => Some(id),
                None => return,
            },
        };
        let n_words = self.workers.len().div_ceil(64);
        // The lookups are independent of each other: the slots of the blocks AHEAD on are
        // requested early, and the slab entries (popular blocks) of those HALF on, whose slots
        // have arrived by then, so the cache misses overlap instead of coming one after another.
        for k in keys.iter().take(AHEAD) {
            self.blocks.prefetch(*k);
        }
        for k in keys.iter().take(HALF) {
            if let Some(h) = self.blocks.get(k) {
                h.prefetch(&self.slab);
            }
        }
        let Some(first) = keys.first().and_then(|k| self.blocks.get(k)) else {
            return;
        };
        if n_words == 1 {
            // Up to 64 workers: one word per block; the walk stops at the first block nobody
            // is left holding. Counts go by worker id, so the answer comes out in id order
            // without a sort (a tenth of a query with tens of workers).
            let mut active = [0u64];
            first.workers_into(&self.slab, filter, &mut active);
            let holding = active[0];
            let mut active = holding;
            let mut counts = [0u32; 64];
            let mut i = 1;
            while i < keys.len() && active != 0 {
                self.prefetch_ahead(keys, i);
                let mut cur = [0u64];
                if let Some(h) = self.blocks.get(&keys[i]) {
                    h.workers_into(&self.slab, filter, &mut cur);
                }
                for b in Bits(active & !cur[0]) {
                    counts[b] = i as u32;
                }
                active &= cur[0];
                i += 1;
            }
            for b in Bits(active) {
                counts[b] = keys.len() as u32;
            }
            out.extend(Bits(holding).map(|b| (b as u32, counts[b])));
            return;
        } else {
            let mut active = vec![0u64; n_words];
            let mut cur = vec![0u64; n_words];
            first.workers_into(&self.slab, filter, &mut active);
            for (i, k) in keys.iter().enumerate().skip(1) {
                self.prefetch_ahead(keys, i);
                cur.fill(0);
                if let Some(h) = self.blocks.get(k) {
                    h.workers_into(&self.slab, filter, &mut cur);
                }
                let mut any = 0;
                for (w, (a, c)) in active.iter_mut().zip(&cur).enumerate() {
                    emit(out, w, *a & !c, i);
                    *a &= c;
                    any |= *a;
                }
                if any == 0 {
                    break;
                }
            }
            for (w, a) in active.iter().enumerate() {
                emit(out, w, *a, keys.len());
            }
        }
        out.sort_unstable();
    }

    #[inline]
    fn prefetch_ahead(&self, keys: &[u64], i: usize) {
        if let Some(k) = keys.get(i + AHEAD) {
            self.blocks.prefetch(*k);
        }
        if let Some(h) = keys.get(i + HALF).and_then(|k| self.blocks.get(k)) {
            h.prefetch(&self.slab);
        }
    }

    /// Bytes held by the index's tables, with an estimate of the allocator's bookkeeping.
    pub fn memory_bytes(&self) -> usize {
        let slots: usize = self
            .workers
            .iter()
            .flatten()
            .map(|w| {
                w.name.len()
                    + 16
                    + w.slots.capacity() * std::mem::size_of::<Slot>()
                    + w.slots
                        .iter()
                        .map(|s| s.engine.allocation_size() + s.dups.allocation_size())
                        .sum::<usize>()
            })
            .sum();
        std::mem::size_of::<Core>()
            + self.blocks.allocation_size()
            + self.slab.heap_bytes()
            + self.workers.capacity() * std::mem::size_of::<Option<Worker>>()
            + self.ids.capacity() * (std::mem::size_of::<(Arc<str>, u32)>() + 1)
            + self.free_ids.capacity() * 4
            + slots
    }

    // --- changing ----------------------------------------------------------------------------

    /// Applies a payload's events for `worker`; returns how many events it had.
    pub fn apply(&mut self, worker: &str, mut batch: Batch) -> usize {
        self.stats.payloads += 1;
        let Some(w) = self.worker_id(worker) else {
            self.stats.too_many_workers += 1;
            return 0;
        };
        let n = batch.events.len();
        self.stats.events += n as u64;
        let mut events = std::mem::take(&mut batch.events);
        let (hashes, tokens) = (&batch.hashes, &batch.tokens);
        if self.mode == Mode::Tokens {
            self.touch(w, &events, hashes);
        }
        for ev in events.drain(..) {
            match ev {
                Event::Stored(s) => self.stored(w, s, hashes, tokens),
                Event::Removed { hashes: r, medium } => self.removed(w, &hashes[r], medium),
                Event::Cleared => {
                    self.stats.cleared += 1;
                    self.clear_worker(w);
                }
            }
        }
        batch.events = events;
        self.spare.keep(batch);
        n
    }

    /// The vectors for the next payload's batch (see `parse`).
    pub fn take_spare(&mut self) -> Spare {
        std::mem::take(&mut self.spare)
    }

    /// Reads, without changing anything, the table entries a payload's events will change:
    /// independent lookups whose cache misses the CPU overlaps, where the updates that follow
    /// (each waiting on the last) would take them one at a time.
    fn touch(&self, w: u32, events: &[Event], hashes: &[u64]) {
        let Some(worker) = self.workers[w as usize].as_ref() else {
            return;
        };
        for ev in events {
            let (range, medium, parent) = match ev {
                Event::Stored(s) => (&s.hashes, s.medium, s.parent),
                Event::Removed { hashes, medium } => (hashes, *medium, None),
                Event::Cleared => continue,
            };
            let Some(m) = self.find_medium(medium) else {
                continue;
            };
            let Some(slot) = worker.slots.iter().find(|s| s.medium == m) else {
                continue;
            };
            // The parent's index hash is looked up first thing when the event is applied.
            if let Some(p) = parent {
                std::hint::black_box(slot.engine.get(&p));
            }
            for e in &hashes[range.clone()] {
                if let Some(k) = slot.engine.get(e) {
                    std::hint::black_box(self.blocks.get(k));
                }
            }
        }
    }

    pub fn malformed(&mut self) {
        self.stats.payloads += 1;
        self.stats.malformed_payloads += 1;
    }

    pub fn remove_worker(&mut self, worker: &str) {
        let Some(w) = self.ids.remove(worker) else {
            return;
        };
        self.clear_worker(w);
        self.workers[w as usize] = None;
        while self.workers.last().is_some_and(Option::is_none) {
            self.workers.pop();
        }
        self.free_ids.retain(|&id| (id as usize) < self.workers.len());
        if (w as usize) < self.workers.len() {
            self.free_ids.push(w);
        }
    }

    /// Forgets every block and worker; the counters stay.
    pub fn clear(&mut self) {
        let stats = std::mem::take(&mut self.stats);
        *self = Core::new(self.block_size, self.mode);
        self.stats = stats;
    }

    fn worker_id(&mut self, name: &str) -> Option<u32> {
        if let Some(&w) = self.ids.get(name) {
            return Some(w);
        }
        // The lowest free id: ids stay dense, and so do the bitsets over them.
        let w = match self.free_ids.iter().enumerate().min_by_key(|x| x.1) {
            Some((i, _)) => self.free_ids.swap_remove(i),
            None if self.workers.len() < MAX_WORKERS as usize => {
                self.workers.push(None);
                (self.workers.len() - 1) as u32
            }
            None => return None,
        };
        let name: Arc<str> = name.into();
        self.ids.insert(name.clone(), w);
        self.workers[w as usize] = Some(Worker {
            name,
            slots: Vec::new(),
        });
        Some(w)
    }

    fn find_medium(&self, medium: Option<&str>) -> Option<u8> {
        self.media
            .iter()
            .position(|m| match (m.as_deref(), medium) {
                (Some(a), Some(b)) => eq_bytes(a.as_bytes(), b.as_bytes()),
                (a, b) => a.is_none() && b.is_none(),
            })
            .map(|i| i as u8)
    }

    fn medium_id(&mut self, medium: Option<&str>) -> Option<u8> {
        if let Some(m) = self.find_medium(medium) {
            return Some(m);
        }
        if self.media.len() >= MAX_MEDIA {
            return None;
        }
        self.media.push(medium.map(Into::into));
        Some((self.media.len() - 1) as u8)
    }

    fn worker(&mut self, w: u32) -> &mut Worker {
        self.workers[w as usize].as_mut().expect("live worker")
    }

    fn slot_index(&mut self, w: u32, m: u8) -> usize {
        let slots = &mut self.worker(w).slots;
        match slots.iter().position(|s| s.medium == m) {
            Some(i) => i,
            None => {
                slots.push(Slot {
                    medium: m,
                    ..Slot::default()
                });
                slots.len() - 1
            }
        }
    }

    fn stored(&mut self, w: u32, s: Stored, hashes: &[u64], tokens: &[u32]) {
        let keys = &hashes[s.hashes.clone()];
        let tokens = &tokens[s.tokens.clone()];
        let n = keys.len();
        let bs = self.block_size;
        if n == 0 {
            return;
        }
        if s.block_size != bs as i64 || !(tokens.is_empty() || tokens.len() == n * bs) {
            self.stats.block_size_mismatches += 1;
            return;
        }
        if tokens.is_empty() {
            self.stats.events_without_tokens += 1;
            if self.mode == Mode::Tokens {
                return;
            }
        }
        if s.bad_tokens {
            self.stats.bad_token_ids += 1;
            if self.mode == Mode::Tokens {
                return;
            }
        }
        if self.mode == Mode::Tokens
            && (s.bad_extra_keys || s.extra_keys.as_ref().is_some_and(|e| e.len() != n))
        {
            self.stats.bad_extra_keys += 1;
            return;
        }
        let Some(m) = self.medium_id(s.medium) else {
            self.stats.too_many_media += 1;
            return;
        };
        match self.mode {
            Mode::Engine => {
                if let Some(p) = s.parent {
                    let held = self
                        .blocks
                        .get(&p)
                        .is_some_and(|h| h.held_by_worker(&self.slab, w));
                    if !held {
                        // Keyed by the engine's own hashes, the blocks need no parent: kept.
                        self.stats.unknown_parents += 1;
                    }
                }
                let si = self.slot_index(w, m);
                let e = entry(w, m);
                let (blocks, slab, slot) = self.parts(w, si);
                for &k in keys {
                    add_holder(blocks, slab, slot, e, k);
                }
            }
            Mode::Tokens => {
                let parent = match s.parent {
                    None => None,
                    Some(p) => match self.parent_key(w, m, p) {
                        Some(k) => Some(k),
                        None => {
                            // The chain cannot be continued without the parent's index hash.
                            self.stats.unknown_parents += 1;
                            return;
                        }
                    },
                };
                let extras = s.extra_keys.map(|e| strip_lora(e, s.lora_name));
                let mut chain = Chain::new(Algo::Xxh3, bs, 0, None, s.lora_name, None);
                chain.parent = parent.map(Digest::from_u64);
                let mut digests = std::mem::take(&mut self.digests);
                digests.clear();
                chain.run_words(tokens, extras.as_deref(), |k| digests.push(k));
                for k in &digests {
                    std::hint::black_box(self.blocks.get(k));
                }
                let si = self.slot_index(w, m);
                let e = entry(w, m);
                let (blocks, slab, slot) = self.parts(w, si);
                for (&engine, &k) in keys.iter().zip(&digests) {
                    match slot.engine.insert(engine, k) {
                        Some(old) if old == k => {}
                        Some(old) => {
                            drop_ref(blocks, slab, slot, e, old);
                            add_ref(blocks, slab, slot, e, k);
                        }
                        None => add_ref(blocks, slab, slot, e, k),
                    }
                }
                self.digests = digests;
            }
        }
        self.stats.blocks_stored += n as u64;
    }

    /// The index hash of engine hash `p` in worker `w`: its medium `m` first, then the others.
    fn parent_key(&self, w: u32, m: u8, p: u64) -> Option<u64> {
        let slots = &self.workers[w as usize].as_ref()?.slots;
        let same = slots.iter().find(|s| s.medium == m);
        same.into_iter()
            .chain(slots.iter().filter(|s| s.medium != m))
            .find_map(|s| s.engine.get(&p).copied())
    }

    fn removed(&mut self, w: u32, keys: &[u64], medium: Option<&str>) {
        let slot_i = self.find_medium(medium).and_then(|m| {
            let slots = &self.workers[w as usize].as_ref()?.slots;
            slots.iter().position(|s| s.medium == m)
        });
        let Some(si) = slot_i else {
            self.stats.unknown_removes += keys.len() as u64;
            return;
        };
        let mode = self.mode;
        let (blocks, slab, slot) = self.parts(w, si);
        let e = entry(w, slot.medium);
        let mut found = 0;
        for &engine in keys {
            found += match mode {
                Mode::Tokens => match slot.engine.remove(&engine) {
                    Some(k) => {
                        drop_ref(blocks, slab, slot, e, k);
                        1
                    }
                    None => 0,
                },
                Mode::Engine => drop_holder(blocks, slab, slot, e, engine) as u64,
            };
        }
        self.stats.blocks_removed += found;
        self.stats.unknown_removes += keys.len() as u64 - found;
    }

    /// The block map, the holder slab and worker `w`'s slot `si`, borrowed together.
    fn parts(&mut self, w: u32, si: usize) -> (&mut Table<Holders>, &mut Slab, &mut Slot) {
        let worker = self.workers[w as usize].as_mut().expect("live worker");
        (&mut self.blocks, &mut self.slab, &mut worker.slots[si])
    }

    /// Drops everything worker `w` holds, in every medium.
    fn clear_worker(&mut self, w: u32) {
        let Core {
            blocks,
            slab,
            workers,
            mode,
            ..
        } = self;
        let worker = workers[w as usize].as_mut().expect("live worker");
        if worker.slots.iter().all(|s| s.held == 0) {
            worker.slots.clear();
            return;
        }
        match mode {
            Mode::Tokens => {
                for slot in &worker.slots {
                    let e = entry(w, slot.medium);
                    for &k in slot.engine.values() {
                        remove_entry(blocks, slab, e, k);
                    }
                }
            }
            // Only the blocks know who holds them: one pass over all of them.
            Mode::Engine => blocks.retain(|_, h| {
                if h.remove_worker(slab, w) {
                    h.release(slab);
                    return false;
                }
                true
            }),
        }
        worker.slots.clear();
    }
}

fn emit(out: &mut Vec<(u32, u32)>, word: usize, bits: u64, count: usize) {
    for b in Bits(bits) {
        out.push(((word * 64 + b) as u32, count as u32));
    }
}

/// vLLM repeats the LoRA name as the first extra key of every block of a LoRA request; the
/// index salts by `lora_name` instead, so queries need not repeat it.
fn strip_lora(keys: Vec<Option<Value>>, lora_name: Option<&str>) -> Vec<Option<Value>> {
    keys.into_iter()
        .map(|k| {
            let Some(Value::Tuple(mut items, id)) = k else {
                return k;
            };
            if let (Some(name), Some(Value::Str(first, _))) = (lora_name, items.first()) {
                if first.as_slice() == name.as_bytes() {
                    items.remove(0);
                }
            }
            (!items.is_empty()).then_some(Value::Tuple(items, id))
        })
        .collect()
}

/// Removes holder `e` from block `k`, dropping the block when it was the last; whether it held.
fn remove_entry(blocks: &mut Table<Holders>, slab: &mut Slab, e: Entry, k: u64) -> bool {
    let Some(h) = blocks.get_mut(&k) else {
        return false;
    };
    match h.remove(slab, e) {
        Removed::NotHeld => false,
        Removed::Kept => true,
        Removed::Empty => {
            if let Some(h) = blocks.remove(&k) {
                h.release(slab);
            }
            true
        }
    }
}

/// Engine mode: `slot` holds block `k` (once).
fn add_holder(blocks: &mut Table<Holders>, slab: &mut Slab, slot: &mut Slot, e: Entry, k: u64) {
    match blocks.get_mut(&k) {
        None => {
            blocks.insert(k, Holders::one(e));
        }
        Some(h) => {
            if h.contains(slab, e) {
                return;
            }
            h.insert(slab, e);
        }
    }
    slot.held += 1;
}

fn drop_holder(blocks: &mut Table<Holders>, slab: &mut Slab, slot: &mut Slot, e: Entry, k: u64) -> bool {
    let found = remove_entry(blocks, slab, e, k);
    if found {
        slot.held -= 1;
    }
    found
}

/// Tokens mode: one more engine hash of `slot` stands for index hash `k`.
fn add_ref(blocks: &mut Table<Holders>, slab: &mut Slab, slot: &mut Slot, e: Entry, k: u64) {
    let held_before = slot.held;
    add_holder(blocks, slab, slot, e, k);
    if slot.held == held_before {
        *slot.dups.entry(k).or_insert(0) += 1;
    }
}

/// Tokens mode: one engine hash of `slot` standing for `k` is gone.
fn drop_ref(blocks: &mut Table<Holders>, slab: &mut Slab, slot: &mut Slot, e: Entry, k: u64) {
    if let Some(d) = (!slot.dups.is_empty()).then(|| slot.dups.get_mut(&k)).flatten() {
        *d -= 1;
        if *d == 0 {
            slot.dups.remove(&k);
        }
        return;
    }
    drop_holder(blocks, slab, slot, e, k);
}

#[cfg(test)]
mod tests {
    use super::super::parse::{parse, Format};
    use super::*;

    fn apply_json(core: &mut Core, worker: &str, json: &str) -> usize {
        let mut scratch = Vec::new();
        let batch = parse(json.as_bytes(), Format::Json, &mut scratch, core.take_spare()).expect("valid");
        core.apply(worker, batch)
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> String {
        let parent = parent.map_or("null".to_string(), |p| p.to_string());
        format!(
            r#"{{"type": "BlockStored", "block_hashes": {hashes:?}, "parent_block_hash": {parent},
                "token_ids": {tokens:?}, "block_size": 2, "lora_id": null, "medium": "{medium}",
                "lora_name": null}}"#
        )
    }

    fn scores(core: &Core, keys: &[u64]) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        core.find_matches(keys, None, &mut out);
        out.into_iter()
            .map(|(w, n)| (core.name(w).to_string(), n))
            .collect()
    }

    #[test]
    fn engine_mode_removes_one_block_not_its_subtree() {
        let mut core = Core::new(2, Mode::Engine);
        let ev = stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6], "GPU");
        apply_json(&mut core, "a", &format!("[0, [{ev}]]"));
        apply_json(&mut core, "b", &format!("[0, [{ev}]]"));
        assert_eq!(scores(&core, &[10, 11, 12]), vec![("a".into(), 3), ("b".into(), 3)]);
        apply_json(&mut core, "a", r#"[0, [{"type": "BlockRemoved", "block_hashes": [11, 99], "medium": "GPU"}]]"#);
        assert_eq!(scores(&core, &[10, 11, 12]), vec![("a".into(), 1), ("b".into(), 3)]);
        assert_eq!(scores(&core, &[12]), vec![("a".into(), 1), ("b".into(), 1)]);
        assert_eq!(core.stats.unknown_removes, 1);
        apply_json(&mut core, "b", r#"[0, [{"type": "AllBlocksCleared"}]]"#);
        assert_eq!(scores(&core, &[10]), vec![("a".into(), 1)]);
        assert_eq!(core.len(), 2);
    }

    #[test]
    fn tokens_mode_chains_through_the_workers_parent_and_keeps_duplicates() {
        let mut core = Core::new(2, Mode::Tokens);
        // Two workers, different engine hashes, same tokens: the same index blocks.
        apply_json(&mut core, "a", &format!("[0, [{}]]", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")));
        apply_json(&mut core, "b", &format!("[0, [{}]]", stored(&[70], None, &[5, 6], "GPU")));
        apply_json(&mut core, "b", &format!("[0, [{}]]", stored(&[80], Some(70), &[7, 8], "CPU")));
        assert_eq!(core.len(), 2);
        let mut chain = Chain::new(Algo::Xxh3, 2, 0, None, None, None);
        let mut d = Vec::new();
        chain.run(&[5, 6, 7, 8], None, 0, &mut d);
        let keys: Vec<u64> = d.iter().map(|x| x.event_hash()).collect();
        assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
        // A second engine hash for the same content: removing one keeps the block.
        apply_json(&mut core, "a", &format!("[0, [{}]]", stored(&[3], Some(1), &[7, 8], "GPU")));
        apply_json(&mut core, "a", r#"[0, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}]]"#);
        assert_eq!(scores(&core, &keys)[0], ("a".into(), 2));
        apply_json(&mut core, "a", r#"[0, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}]]"#);
        assert_eq!(scores(&core, &keys)[0], ("a".into(), 1));
        // Unknown parent: counted, skipped.
        apply_json(&mut core, "a", &format!("[0, [{}]]", stored(&[9], Some(12345), &[1, 1], "GPU")));
        assert_eq!(core.stats.unknown_parents, 1);
        core.remove_worker("b");
        assert_eq!(scores(&core, &keys), vec![("a".into(), 1)]);
        assert_eq!(core.worker_names().len(), 1);
    }

    #[test]
    fn many_workers_use_several_words() {
        let mut core = Core::new(2, Mode::Engine);
        for w in 0..150u32 {
            let n = 1 + (w as usize % 3);
            let hashes: Vec<u64> = (0..n as u64).collect();
            let tokens: Vec<u32> = (0..2 * n as u32).collect();
            apply_json(&mut core, &format!("w{w}"), &format!("[0, [{}]]", stored(&hashes, None, &tokens, "GPU")));
        }
        let mut out = Vec::new();
        core.find_matches(&[0, 1, 2], None, &mut out);
        assert_eq!(out.len(), 150);
        for &(w, n) in &out {
            assert_eq!(n, 1 + w % 3);
        }
        core.find_matches(&[0], Some("CPU"), &mut out);
        assert!(out.is_empty());
    }
}
