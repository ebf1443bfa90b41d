//! The index's state and its rules, on plain Rust data (no Python, no lock).
//!
//! - `blocks`: block key -> the (worker, class) pairs holding it (`Holders`, 8 bytes inline); a
//!   class is a (medium, KV-cache group, remote?) triple. The key is the index's own chained
//!   xxh3 hash (`Mode::Tokens`) or the engine's block hash (`Mode::Engine`).
//! - tokens mode: `engine`, one map engine hash -> index hash for the whole index, one engine
//!   hash per block (its "canonical" hash: the first stored for it while it had none), which is
//!   how removals and parents (both given as engine hashes) are found. Engines with the same
//!   hash seed name the same content alike, so this costs per block, not per (block, worker):
//!   a (worker, class) holds block k's canonical hash exactly when the holder set of k has it
//!   and its slot does not list k in `alias_only`.
//! - per worker, per class a `Slot`; in tokens mode it keeps, as `alias`, the engine hashes it
//!   holds that do not reach their block through `engine`: a hash another engine uses for other
//!   content (another seed or algorithm), or a second hash for a block that has one (engines
//!   hash things the index leaves out, e.g. the LoRA path). `dups` counts the hashes past the
//!   first standing for one block in the slot, so the block stays held until the last engine
//!   hash for it is removed. `copies` counts physical copies past the first of one engine hash
//!   (vLLM does not de-duplicate blocks).
//! - per worker, per group the kind its stores announced; a worker whose hit is not simply its
//!   group 0's leading run (a window group, several main groups) is "hybrid" and scored on its
//!   own (vLLM's HybridKVCacheCoordinator rule); the others share one bitset walk, as before.
//!
//! Removing a block removes that block only: a hole in a chain keeps its children, and a
//! query's prefix simply stops at the hole.
//!
//! Neither mode keeps a per-worker list of blocks (the blocks' holder sets are the only record,
//! which keeps an entry to the table's bytes): clearing or removing a worker is one pass over
//! all blocks (and, in tokens mode, over `engine`). Both are rare (a cache reset, a restart, an
//! expired worker).
//!
//! Where the rules are: `apply` (payloads applied: stores and their placeholders, removes,
//! clears; what a worker's groups are), `holding` (a slot's holder entries and copies),
//! `aliases` (tokens mode: the engine-hash map, aliases and duplicate hashes), `queries` (the
//! walks that score a prompt), the group rules in `index::groups`. This file is the state and
//! the lookups every rule shares.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use hashbrown::HashMap;

use super::events::Spare;
use super::groups::Kind;
use super::holders::{Holders, Slab, MAX_CLASSES, MAX_WORKERS};
use super::table::Table;
use crate::reader::eq_bytes;
use xxhash_rust::xxh3::xxh3_64_with_seed;

mod aliases;
mod apply;
mod holding;
mod queries;
#[cfg(test)]
mod tests;

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
    bad_groups,
    bad_windows,
    unknown_kinds,
    unscored_group_events,
    unresolved_placeholders,
    unresolved_hashes,
);

/// The class the last event of a payload named, and how it named it: a payload's events mostly
/// name one, and finding it by name (media compared as strings, then the classes) costs more
/// than comparing with the last.
#[derive(Default)]
pub struct LastClass<'a>(Option<(Option<&'a str>, u8, bool, u8)>);

impl<'a> LastClass<'a> {
    #[inline(always)]
    fn find(
        &mut self,
        core: &Core,
        medium: Option<&'a str>,
        group: u8,
        remote: bool,
    ) -> Option<u8> {
        if let Some((m, g, r, c)) = self.0 {
            let same_medium = match (m, medium) {
                (Some(a), Some(b)) => eq_bytes(a.as_bytes(), b.as_bytes()),
                (a, b) => a.is_none() && b.is_none(),
            };
            if same_medium && g == group && r == remote {
                return Some(c);
            }
        }
        let c = core.find_class(medium, group, remote)?;
        self.0 = Some((medium, group, remote, c));
        Some(c)
    }
}

/// A residency class: the (medium, group, remote?) a holder entry names in its low byte.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Class {
    medium: u8,
    group: u8,
    remote: bool,
}

#[derive(Default)]
struct Slot {
    class: u8,
    /// Tokens mode: the engine hashes held here that are not their block's canonical hash
    /// (`Core::engine`), -> the index hash each stands for. Empty unless engines disagree.
    alias: Map<u64>,
    /// Tokens mode: the blocks held here through `alias` hashes only, not their canonical one.
    alias_only: Map<()>,
    /// Index hashes that more than one engine hash stands for: the number of extra ones.
    dups: Map<u32>,
    /// Physical copies past the first (vLLM stores a chain again after an eviction left a
    /// hole), by engine hash: each removal takes one before the block goes.
    copies: Map<u32>,
    /// Distinct blocks held.
    held: usize,
}

struct Worker {
    name: Arc<str>,
    slots: Vec<Slot>,
    /// By group: what its stores said it is.
    kinds: Vec<Kind>,
    /// By group: the largest block size its stores announced, in index blocks (0: none yet,
    /// read as 1). The largest, because vLLM's partial-tail entries
    /// (`FullAttentionManager._cache_partial_tail_block`) come as stores of one hash block.
    scales: Vec<u32>,
    /// `alignment(&scales)`: a hit is a multiple of it (in index blocks).
    align: u64,
    /// Times its cache was cleared (AllBlocksCleared), so a router knows its guesses are void.
    clears: u64,
    /// `plan(&kinds, &scales, ..)`, kept for queries: main groups (bits) and window groups.
    main: u64,
    windows: Vec<(u8, u32)>,
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
    classes: Vec<Class>,
    /// By class: its group (what `Holders::groups_of` maps a class to).
    class_group: Vec<u8>,
    /// Workers whose hit is not their group 0's leading run (a bitset over worker ids): scored
    /// one by one, apart from the bitset walk.
    hybrid: Vec<u64>,
    /// Tokens mode: engine hash -> index hash, a block's canonical engine hash only (see the
    /// module's doc).
    engine: Table<u64>,
    /// Tokens mode: the entries of every slot's `alias_only`. While 0 (engines agree), every
    /// holder of a block holds its canonical hash.
    aliased: usize,
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
            classes: Vec::new(),
            class_group: Vec::new(),
            hybrid: Vec::new(),
            engine: Table::default(),
            aliased: 0,
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
        self.workers
            .iter()
            .flatten()
            .map(|w| w.name.clone())
            .collect()
    }

    /// Each live worker: (id, name, how often its cache was cleared).
    pub fn workers_with_clears(&self) -> impl Iterator<Item = (u32, &Arc<str>, u64)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.as_ref().map(|w| (i as u32, &w.name, w.clears)))
    }

    /// How often `name`'s cache was cleared since the index first heard of it.
    pub fn clears(&self, name: &str) -> Option<u64> {
        let &w = self.ids.get(name)?;
        Some(self.workers[w as usize].as_ref()?.clears)
    }

    pub fn name(&self, id: u32) -> &Arc<str> {
        &self.workers[id as usize]
            .as_ref()
            .expect("live worker")
            .name
    }

    pub fn medium_name(&self, id: u8) -> Option<&str> {
        self.media[id as usize].as_deref()
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
                    + w.kinds.capacity() * std::mem::size_of::<Kind>()
                    + w.scales.capacity() * 4
                    + w.windows.capacity() * std::mem::size_of::<(u8, u32)>()
                    + w.slots
                        .iter()
                        .map(|s| {
                            s.alias.allocation_size()
                                + s.alias_only.allocation_size()
                                + s.dups.allocation_size()
                                + s.copies.allocation_size()
                        })
                        .sum::<usize>()
            })
            .sum();
        std::mem::size_of::<Core>()
            + self.blocks.allocation_size()
            + self.engine.allocation_size()
            + self.slab.heap_bytes()
            + self.workers.capacity() * std::mem::size_of::<Option<Worker>>()
            + self.ids.capacity() * (std::mem::size_of::<(Arc<str>, u32)>() + 1)
            + self.free_ids.capacity() * 4
            + self.classes.capacity() * (std::mem::size_of::<Class>() + 1)
            + self.hybrid.capacity() * 8
            + slots
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
            kinds: Vec::new(),
            scales: Vec::new(),
            align: 1,
            main: 1,
            windows: Vec::new(),
            clears: 0,
        });
        Some(w)
    }

    #[inline]
    fn find_medium(&self, medium: Option<&str>) -> Option<u8> {
        self.media
            .iter()
            .position(|m| match (m.as_deref(), medium) {
                (Some(a), Some(b)) => eq_bytes(a.as_bytes(), b.as_bytes()),
                (a, b) => a.is_none() && b.is_none(),
            })
            .map(|i| i as u8)
    }

    #[inline]
    fn find_class(&self, medium: Option<&str>, group: u8, remote: bool) -> Option<u8> {
        let medium = self.find_medium(medium)?;
        let want = Class {
            medium,
            group,
            remote,
        };
        self.classes
            .iter()
            .position(|c| *c == want)
            .map(|i| i as u8)
    }

    fn class_id(&mut self, medium: Option<&str>, group: u8, remote: bool) -> Option<u8> {
        if let Some(c) = self.find_class(medium, group, remote) {
            return Some(c);
        }
        if self.classes.len() >= MAX_CLASSES {
            return None;
        }
        let medium = match self.find_medium(medium) {
            Some(m) => m,
            None => {
                self.media.push(medium.map(Into::into));
                (self.media.len() - 1) as u8
            }
        };
        self.classes.push(Class {
            medium,
            group,
            remote,
        });
        self.class_group.push(group);
        Some((self.classes.len() - 1) as u8)
    }

    fn worker(&mut self, w: u32) -> &mut Worker {
        self.workers[w as usize].as_mut().expect("live worker")
    }

    fn slot_index(&mut self, w: u32, c: u8) -> usize {
        let slots = &mut self.worker(w).slots;
        match slots.iter().position(|s| s.class == c) {
            Some(i) => i,
            None => {
                slots.push(Slot {
                    class: c,
                    ..Slot::default()
                });
                slots.len() - 1
            }
        }
    }

    /// The block map, the holder slab, worker `w`'s slot `si` and the engine-hash map,
    /// borrowed together.
    fn parts(
        &mut self,
        w: u32,
        si: usize,
    ) -> (&mut Table<Holders>, &mut Slab, &mut Slot, &Table<u64>) {
        let worker = self.workers[w as usize].as_mut().expect("live worker");
        (
            &mut self.blocks,
            &mut self.slab,
            &mut worker.slots[si],
            &self.engine,
        )
    }
}
