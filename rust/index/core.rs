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

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use hashbrown::HashMap;

use super::events::{Batch, Event, Spare, Stored, BAD_GROUP, KINDS, NO_KIND};
use super::holders::{
    entry, medium_of, worker_of, Bits, Entry, Filter, Holders, Removed, Slab, MAX_CLASSES,
    MAX_WORKERS,
};
use super::keys::QueryKeys;
use super::table::Table;
use crate::hash::algo::{index_keys, Algo, Chain, Digest};
use crate::hash::value::Value;
use crate::reader::eq_bytes;
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

/// How far ahead a query prefetches blocks' slots, and their slab entries.
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
    bad_groups,
    bad_windows,
    unknown_kinds,
    unscored_group_events,
    unresolved_placeholders,
    unresolved_hashes,
);

/// What a (worker, group) is, as its BlockStored events said (`kv_cache_spec_kind`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Kind {
    #[default]
    Unannounced,
    /// Full attention (and MLA, sink): a hit needs every block of the prefix.
    Main,
    /// A window of `tokens` (mamba: 1): a hit of n of the group's blocks needs blocks
    /// [max(0, n - k), n) with k = max(1, cdiv(tokens - 1, group block size)) (`window_blocks`).
    Window { tokens: u32 },
    /// Known to vLLM but not scored (chunked local, encoder-only, cross attention, unknown).
    Unscored,
}

enum BadKind {
    Kind,
    Window,
}

/// A kind from vLLM's `KVCacheSpecKind` (v1/kv_cache_interface.py), as `parse::KINDS` numbers it.
fn kind_of(code: u8, window: i64) -> Result<Kind, BadKind> {
    let name = KINDS
        .get((code as usize).wrapping_sub(1))
        .copied()
        .unwrap_or(b"");
    Ok(match name {
        b"full_attention" | b"mla_attention" | b"sink_full_attention" => Kind::Main,
        b"sliding_window" | b"sliding_window_mla" if window >= 1 => Kind::Window {
            tokens: u32::try_from(window).unwrap_or(u32::MAX),
        },
        b"sliding_window" | b"sliding_window_mla" => return Err(BadKind::Window),
        // `MambaManager.find_longest_cache_hit`: the block at the hit point, a window of one.
        b"mamba" => Kind::Window { tokens: 1 },
        b"chunked_local_attention"
        | b"encoder_only_attention"
        | b"cross_attention"
        | b"unknown" => Kind::Unscored,
        _ => return Err(BadKind::Kind),
    })
}

/// The blocks (of `group_block_size` tokens) a window of `tokens` needs before a hit's end:
/// vLLM's `SlidingWindowManager._contiguous_blocks_for_hit`, cdiv(W - 1, block_size), counted
/// in the group's own blocks. At least one: vLLM's finder stops at the first held block from
/// the right, so a window of 1 token (cdiv(0, block_size) = 0 blocks) still needs the block
/// at the hit.
fn window_blocks(tokens: u32, group_block_size: u64) -> u32 {
    let k = (u64::from(tokens) - 1).div_ceil(group_block_size.max(1));
    u32::try_from(k).unwrap_or(u32::MAX).max(1)
}

/// The largest group block size, in index blocks, a store may announce: vLLM's block sizes
/// are a few hundred tokens at most; a larger one is bad input (counted as a block-size
/// mismatch), and keeps the alignment (a least common multiple of scales) within u64.
pub const MAX_SCALE: u64 = 1 << 12;

/// The `Stored::kind` codes of `sliding_window`, `sliding_window_mla` and `mamba` (1 + their
/// place in `parse::KINDS`).
const WINDOW_CODES: [u8; 3] = [3, 4, 5];

/// Main groups (a bitset) and window groups (group, blocks of the group's size) of a worker's
/// kinds; `scales[g]`: group g's block size in index blocks (0 or absent: 1). An unannounced
/// group 0 is main: the group every engine without groups writes to.
fn plan(kinds: &[Kind], scales: &[u32], block_size: usize) -> (u64, Vec<(u8, u32)>) {
    let mut main = u64::from(kinds.first().is_none_or(|k| *k == Kind::Unannounced));
    let mut windows = Vec::new();
    for (g, k) in kinds.iter().enumerate() {
        match k {
            Kind::Main => main |= 1 << g,
            Kind::Window { tokens } => {
                let size = block_size as u64 * u64::from(scale_of(scales, g));
                windows.push((g as u8, window_blocks(*tokens, size)));
            }
            _ => {}
        }
    }
    (main, windows)
}

/// Group `g`'s block size in index blocks.
#[inline]
fn scale_of(scales: &[u32], g: usize) -> u32 {
    scales.get(g).copied().unwrap_or(1).max(1)
}

/// vLLM's hit alignment without fine-grained partial hits: the least common multiple of
/// every group's block size (`resolve_kv_cache_block_sizes`: scheduler_block_size =
/// lcm(group block sizes); `HybridKVCacheCoordinator._cache_hit_alignment_tokens`), here in
/// index blocks. Saturates: an alignment past any prompt's length allows only the empty hit.
fn alignment(scales: &[u32]) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    scales.iter().fold(1u64, |a, &s| {
        let s = u64::from(s.max(1));
        (a / gcd(a, s)).saturating_mul(s)
    })
}

/// Whether a worker's hit is its group 0's leading run, as for a single-group engine.
fn is_plain(kinds: &[Kind], scales: &[u32]) -> bool {
    scales.iter().all(|&s| s <= 1)
        && kinds.iter().enumerate().all(|(g, k)| match k {
            Kind::Unannounced => true,
            Kind::Main => g == 0,
            Kind::Window { .. } => false,
            Kind::Unscored => g != 0,
        })
}

/// The window rule one block at a time: given the groups `m` that hold block n - 1, whether a
/// hit of n blocks has each window group hold [max(0, n - blocks), n). `runs`: per window
/// group, how many blocks up to n - 1 it holds without a gap (kept from call to call).
fn window_step(runs: &mut [usize], windows: &[(u8, u32)], n: usize, m: u64) -> bool {
    let mut ok = true;
    for (run, &(g, blocks)) in runs.iter_mut().zip(windows) {
        *run = if m >> g & 1 != 0 { *run + 1 } else { 0 };
        ok &= *run >= n.min(blocks as usize);
    }
    ok
}

enum Step {
    /// A main group lacks one of its blocks: no longer hit from here on.
    Closed,
    /// n is a hit.
    Hit,
    Open,
}

/// `window_step` for groups of larger blocks (`scales[g]` index blocks each, absent: 1): at
/// index block n - 1 only the groups whose blocks end there are read (their block
/// n / scale - 1, keyed by that index block); n is a hit when it is a multiple of `align`
/// (every group's block ends there), every main group held all its blocks so far and each
/// window group holds its last min(n / scale, blocks) blocks. `runs` counts group blocks.
#[inline(never)] // rare (groups of larger blocks): kept out of the common walk's loop
fn scaled_step(
    runs: &mut [usize],
    main: u64,
    windows: &[(u8, u32)],
    scales: &[u32],
    align: u64,
    n: usize,
    m: u64,
) -> Step {
    let ends = |g: usize| n.is_multiple_of(scale_of(scales, g) as usize);
    if Bits(main).any(|g| ends(g) && m >> g & 1 == 0) {
        return Step::Closed;
    }
    let hit = (n as u64).is_multiple_of(align);
    let mut ok = true;
    for (run, &(g, blocks)) in runs.iter_mut().zip(windows) {
        let g = g as usize;
        if ends(g) {
            *run = if m >> g & 1 != 0 { *run + 1 } else { 0 };
        }
        // At a multiple of `align` every group's block ends at n.
        ok &= *run >= (n / scale_of(scales, g) as usize).min(blocks as usize);
    }
    if hit && ok {
        Step::Hit
    } else {
        Step::Open
    }
}

/// The largest n <= masks.len() the window rule accepts (n = 0 always is).
#[cfg(test)]
fn window_hit(masks: &[u64], windows: &[(u8, u32)]) -> usize {
    let mut runs = vec![0; windows.len()];
    (1..=masks.len())
        .filter(|&n| window_step(&mut runs, windows, n, masks[n - 1]))
        .last()
        .unwrap_or(0)
}

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

    /// The classes a query counts, for the bitset walk over plain workers (group 0 only) and
    /// for hybrid ones (every group): in `medium` (`None`: any; `Some(None)`: the medium None),
    /// remote copies only if `remote`. None when no class can match.
    fn filters(&self, medium: Option<Option<&str>>, remote: bool) -> Option<(Filter, Filter)> {
        let m = match medium {
            None => None,
            Some(name) => Some(self.find_medium(name)?),
        };
        let none = Filter {
            all: false,
            mask: [0; 4],
        };
        let (mut plain, mut any) = (none, none);
        let mut all = true;
        for (i, c) in self.classes.iter().enumerate() {
            if m.is_some_and(|m| m != c.medium) || (c.remote && !remote) {
                all = false;
                continue;
            }
            any.set(i as u8);
            if c.group == 0 {
                plain.set(i as u8);
            } else {
                all = false;
            }
        }
        plain.all = all;
        Some((plain, any))
    }

    /// Per worker with a hit: how many leading blocks of `keys` it would hit (see `filters` for
    /// `medium` and `remote`), as (worker id, count) in worker id order.
    pub fn find_matches(
        &self,
        keys: &[u64],
        medium: Option<Option<&str>>,
        remote: bool,
        out: &mut Vec<(u32, u32)>,
    ) {
        self.find_matches_of(&mut { keys }, medium, remote, out)
    }

    /// `find_matches` of keys made as the walk reaches them (`keys::TokenKeys`): the walk of
    /// workers without groups hashes no further than it goes (plus what it looks ahead).
    pub fn find_matches_of(
        &self,
        keys: &mut impl QueryKeys,
        medium: Option<Option<&str>>,
        remote: bool,
        out: &mut Vec<(u32, u32)>,
    ) {
        out.clear();
        let Some((plain, any)) = self.filters(medium, remote) else {
            return;
        };
        let mut sorted = self.plain_matches(keys, &plain, out);
        if self.hybrid.iter().any(|&w| w != 0) {
            self.hybrid_matches(keys.all(), &any, out);
            sorted = false;
        }
        if !sorted {
            out.sort_unstable();
        }
    }

    /// `find_matches` once per medium (or for `medium` only): (worker id, medium id, count).
    pub fn find_matches_by_medium(
        &self,
        keys: &[u64],
        medium: Option<&str>,
        remote: bool,
    ) -> Vec<(u32, u8, u32)> {
        let mut out = Vec::new();
        let mut one = Vec::new();
        for (m, name) in self.media.iter().enumerate() {
            if medium.is_some_and(|want| {
                name.as_deref()
                    .is_none_or(|n| !eq_bytes(n.as_bytes(), want.as_bytes()))
            }) {
                continue;
            }
            self.find_matches(keys, Some(name.as_deref()), remote, &mut one);
            out.extend(one.iter().map(|&(w, n)| (w, m as u8, n)));
        }
        out.sort_unstable();
        out
    }

    /// The leading run of group 0 of the workers that are not hybrid: one bitset walk. Whether
    /// `out` came out in worker id order.
    fn plain_matches(
        &self,
        keys: &mut impl QueryKeys,
        filter: &Filter,
        out: &mut Vec<(u32, u32)>,
    ) -> bool {
        let n_words = self.workers.len().div_ceil(64);
        let plain_word = |w: usize| !self.hybrid.get(w).copied().unwrap_or(0);
        if n_words <= 1 {
            // Up to 64 workers: one word per block, and with every class counted (one medium,
            // no groups: the common case) the slab's `words` rather than its entries.
            let slab = &self.slab;
            let mut counts = [0u32; 64];
            let holding = if filter.all {
                self.one_word(
                    keys,
                    plain_word(0),
                    true,
                    |h| h.word0_any(slab),
                    &mut counts,
                )
            } else {
                self.one_word(
                    keys,
                    plain_word(0),
                    false,
                    |h| h.word0(slab, filter),
                    &mut counts,
                )
            };
            // From a range, whose length is known: the answer is written with one check of its
            // room, where pushing checks it at each worker.
            let mut bits = holding;
            out.extend((0..holding.count_ones()).map(|_| {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                (b, counts[b as usize])
            }));
            true
        } else {
            let mut active = vec![0u64; n_words];
            let mut cur = vec![0u64; n_words];
            self.walk(keys, false, |i, h| {
                cur.fill(0);
                h.workers_into(&self.slab, filter, &mut cur);
                let mut any = 0;
                if i == 0 {
                    for (w, (a, c)) in active.iter_mut().zip(&cur).enumerate() {
                        *a = c & plain_word(w);
                        any |= *a;
                    }
                } else {
                    for (w, (a, c)) in active.iter_mut().zip(&cur).enumerate() {
                        emit(out, w, *a & !c, i);
                        *a &= c;
                        any |= *a;
                    }
                }
                any != 0
            });
            for (w, a) in active.iter().enumerate() {
                emit(out, w, *a, keys.total());
            }
            false
        }
    }

    /// The walk of an index of at most 64 workers: `word(holders)` gives a block's holders (of
    /// the classes counted) as one word; `plain`: the workers counted. The walk stops at the
    /// first block nobody is left holding. Returns the workers holding the first block; their
    /// counts go to `counts` by worker id (so the answer comes out in id order without a sort:
    /// a fifth of a query with tens of workers).
    #[inline(always)]
    fn one_word(
        &self,
        keys: &mut impl QueryKeys,
        plain: u64,
        any: bool,
        word: impl Fn(Holders) -> u64,
        counts: &mut [u32; 64],
    ) -> u64 {
        let (mut holding, mut active) = (0u64, 0u64);
        self.walk(keys, any, |i, h| {
            let cur = word(h);
            if i == 0 {
                holding = cur & plain;
                active = holding;
            } else {
                for b in Bits(active & !cur) {
                    counts[b] = i as u32;
                }
                active &= cur;
            }
            active != 0
        });
        // Still active: held to the end (the walk stopped at none before).
        for b in Bits(active) {
            counts[b] = keys.total() as u32;
        }
        holding
    }

    /// Calls `step(i, holders of keys[i])` for i = 0, 1, ... until it returns false or the keys
    /// end (a block the table lacks: `Holders::ABSENT`). The lookups are independent of each
    /// other, so their cache misses can overlap instead of coming one after another: the slot
    /// of the block AHEAD on is requested early, the block HALF on is looked up (its slot has
    /// arrived by then) and its slab entry requested (a popular block's; its word in the slab's
    /// `words` if `any`), and each key is hashed once (its slot index kept in a ring until it
    /// is looked up).
    #[inline(always)]
    fn walk<K: QueryKeys>(
        &self,
        keys: &mut K,
        any: bool,
        mut step: impl FnMut(usize, Holders) -> bool,
    ) {
        let n = keys.total();
        let Some(t) = self.blocks.probe() else {
            // No slots (a block keyed 0 at most): plain lookups.
            for i in 0..n {
                if !step(
                    i,
                    self.blocks
                        .get(&keys.key(i))
                        .copied()
                        .unwrap_or(Holders::ABSENT),
                ) {
                    return;
                }
            }
            return;
        };
        let mut start = [0usize; AHEAD];
        let mut held = [Holders::ABSENT; AHEAD];
        let ask = |j: usize, keys: &mut K, start: &mut [usize; AHEAD]| {
            let s = t.start(keys.key(j));
            t.prefetch_at(s);
            start[j % AHEAD] = s;
        };
        // Key j was made when it was asked for: `key` reads it again.
        let look = |j: usize, keys: &mut K, start: &[usize; AHEAD], held: &mut [Holders; AHEAD]| {
            let h = t
                .get_from(start[j % AHEAD], keys.key(j))
                .copied()
                .unwrap_or(Holders::ABSENT);
            h.prefetch(&self.slab, any);
            held[j % AHEAD] = h;
        };
        for j in 0..n.min(AHEAD) {
            ask(j, keys, &mut start);
        }
        for j in 0..n.min(HALF) {
            look(j, keys, &start, &mut held);
        }
        // Split where the keys to ask for run out, so that the loops test no bounds.
        let far = n.saturating_sub(AHEAD);
        for i in 0..far {
            ask(i + AHEAD, keys, &mut start);
            look(i + HALF, keys, &start, &mut held);
            if !step(i, held[i % AHEAD]) {
                return;
            }
        }
        for i in far..n {
            if i + HALF < n {
                look(i + HALF, keys, &start, &mut held);
            }
            if !step(i, held[i % AHEAD]) {
                return;
            }
        }
    }

    /// Hybrid workers, vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`: F = the
    /// leading blocks every main group holds (all of `keys` when there is no main group), then
    /// the largest n <= F each window group accepts. One lookup per block for all of them.
    /// With groups of larger blocks (scale m: index blocks per group block) a group is read
    /// only at its own block ends (index block (i + 1) * m - 1 is its block i's key), and n
    /// must be a multiple of the worker's alignment (the lcm of its scales, see `alignment`).
    #[inline(never)] // its own function: the plain walk's code does not change with it
    fn hybrid_matches(&self, keys: &[u64], filter: &Filter, out: &mut Vec<(u32, u32)>) {
        struct Walk<'c> {
            w: u32,
            main: u64,
            windows: &'c [(u8, u32)],
            /// The groups whose holding decides the hit (main and window).
            groups: u64,
            /// Where its window groups' runs are in `runs`.
            runs: usize,
            best: usize,
            open: bool,
        }
        // Workers with groups of larger blocks walk apart (`scaled`: their worker's scales and
        // alignment, by walk), so the others' loop stays as it was.
        let mut walks: Vec<Walk> = Vec::new();
        let mut scaled: Vec<(Walk, &[u32], u64)> = Vec::new();
        let mut n_runs = 0;
        for (word, &bits) in self.hybrid.iter().enumerate() {
            for b in Bits(bits) {
                let w = (word * 64 + b) as u32;
                let Some(worker) = self.workers.get(w as usize).and_then(Option::as_ref) else {
                    continue;
                };
                let (main, windows) = (worker.main, &worker.windows[..]);
                let groups = windows.iter().fold(main, |g, &(x, _)| g | 1 << x);
                if groups != 0 {
                    let walk = Walk {
                        w,
                        main,
                        windows,
                        groups,
                        runs: n_runs,
                        best: 0,
                        open: true,
                    };
                    if worker.scales.iter().all(|&m| m <= 1) {
                        walks.push(walk);
                    } else {
                        scaled.push((walk, &worker.scales[..], worker.align));
                    }
                    n_runs += windows.len();
                }
            }
        }
        let words = self.workers.len().div_ceil(64);
        let n_groups = self.class_group.iter().max().map_or(0, |&g| g as usize + 1);
        let mut held = vec![0u64; words * n_groups];
        let mut runs = vec![0usize; n_runs];
        let mut open = walks.len() + scaled.len();
        // The groups of `walk` that hold the block `held` describes, as bits by group.
        let mask = |held: &[u64], walk: &Walk| {
            let (word, bit) = (walk.w as usize / 64, walk.w % 64);
            Bits(walk.groups).fold(0u64, |m, g| {
                m | (held.get(g * words + word).map_or(0, |x| x >> bit & 1) << g)
            })
        };
        for (i, k) in keys.iter().enumerate() {
            if open == 0 {
                break;
            }
            held.fill(0);
            if let Some(h) = self.blocks.get(k) {
                h.groups_into(&self.slab, filter, &self.class_group, words, &mut held);
            }
            for walk in walks.iter_mut().filter(|x| x.open) {
                let m = mask(&held, walk);
                if m & walk.main != walk.main {
                    walk.open = false;
                    open -= 1;
                    continue;
                }
                let runs = &mut runs[walk.runs..walk.runs + walk.windows.len()];
                if window_step(runs, walk.windows, i + 1, m) {
                    walk.best = i + 1;
                }
            }
            for (walk, scales, align) in scaled.iter_mut().filter(|x| x.0.open) {
                let m = mask(&held, walk);
                let runs = &mut runs[walk.runs..walk.runs + walk.windows.len()];
                match scaled_step(runs, walk.main, walk.windows, scales, *align, i + 1, m) {
                    Step::Closed => {
                        walk.open = false;
                        open -= 1;
                    }
                    Step::Hit => walk.best = i + 1,
                    Step::Open => {}
                }
            }
        }
        let both = walks.iter().chain(scaled.iter().map(|x| &x.0));
        out.extend(both.filter(|x| x.best > 0).map(|x| (x.w, x.best as u32)));
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
        match self.mode {
            Mode::Tokens => self.touch(&events, hashes),
            // The events' blocks are the table's slots themselves: asked for all at once, their
            // cache misses overlap (a payload's hashes are a few KB at most).
            Mode::Engine => hashes.iter().for_each(|&h| self.blocks.prefetch(h)),
        }
        let mut last = LastClass::default();
        // A payload that names a window or mamba group makes its worker hybrid for the whole
        // payload: a snapshot lists group 0's chains before the window groups' events.
        let windows = events
            .iter()
            .any(|e| matches!(e, Event::Stored(s) if WINDOW_CODES.contains(&s.kind)));
        for ev in events.drain(..) {
            match ev {
                Event::Stored(s) => self.stored(w, s, hashes, tokens, &mut last, windows),
                Event::Removed {
                    hashes: r,
                    medium,
                    group,
                    remote,
                } => self.removed(w, &hashes[r], medium, group, remote, &mut last),
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
        let mut spare = std::mem::take(&mut self.spare);
        // Keyed by the engines' hashes, a store's token ids only count (a third of a block
        // event's apply was decoding them).
        spare.count_tokens = self.mode == Mode::Engine;
        spare
    }

    /// Asks the CPU for the table entries a payload's events will change: independent requests
    /// whose cache misses overlap, where the updates that follow (each waiting on the last)
    /// would take them one at a time. Prefetches, not lookups, where a lookup is not needed to
    /// know where to look (a lookup of a block about to be stored mostly misses, which costs
    /// linear probing the most).
    fn touch(&self, events: &[Event<'_>], hashes: &[u64]) {
        for ev in events {
            match ev {
                Event::Stored(s) => {
                    // The parent's index hash is looked up first thing when the event is
                    // applied, the blocks' entries in the shared map when they are stored
                    // (their table slots are asked for once their keys are hashed).
                    if let Some(p) = s.parent {
                        self.engine.prefetch(p);
                    }
                    hashes[s.hashes.clone()]
                        .iter()
                        .for_each(|&e| self.engine.prefetch(e));
                }
                Event::Removed { hashes: r, .. } => {
                    for e in &hashes[r.clone()] {
                        if let Some(&k) = self.engine.get(e) {
                            self.blocks.prefetch(k);
                        }
                    }
                }
                Event::Cleared => {}
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
        self.free_ids
            .retain(|&id| (id as usize) < self.workers.len());
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

    /// Records what a store said group `g` is (None: unchanged) and its block size in index
    /// blocks (None: a placeholder's, which says nothing); returns its kind now.
    #[inline(never)] // a store that says something new is rare: kept out of `stored`
    fn learn(&mut self, w: u32, g: u8, kind: Option<Kind>, scale: Option<u32>) -> Kind {
        let bs = self.block_size;
        let worker = self.workers[w as usize].as_mut().expect("live worker");
        let g = g as usize;
        let mut changed = false;
        if let Some(kind) = kind {
            if worker.kinds.get(g) != Some(&kind) {
                if worker.kinds.len() <= g {
                    worker.kinds.resize(g + 1, Kind::Unannounced);
                }
                worker.kinds[g] = kind;
                changed = true;
            }
        }
        // Scale 1 is the default: only a larger one is news (and needs the vector).
        if let Some(m) = scale.filter(|&m| m > scale_of(&worker.scales, g)) {
            if worker.scales.len() <= g {
                worker.scales.resize(g + 1, 0);
            }
            worker.scales[g] = m;
            worker.align = alignment(&worker.scales);
            changed = true;
        }
        let now = worker.kinds.get(g).copied().unwrap_or_default();
        if changed {
            (worker.main, worker.windows) = plan(&worker.kinds, &worker.scales, bs);
            let hybrid = !is_plain(&worker.kinds, &worker.scales);
            self.set_hybrid(w, hybrid);
        }
        now
    }

    fn set_hybrid(&mut self, w: u32, on: bool) {
        let (word, bit) = (w as usize / 64, 1u64 << (w % 64));
        if on {
            if self.hybrid.len() <= word {
                self.hybrid.resize(word + 1, 0);
            }
            self.hybrid[word] |= bit;
        } else if let Some(x) = self.hybrid.get_mut(word) {
            *x &= !bit;
        }
    }

    fn kind(&self, w: u32, g: u8) -> Kind {
        let worker = self.workers[w as usize].as_ref().expect("live worker");
        worker.kinds.get(g as usize).copied().unwrap_or_default()
    }

    /// `windows`: the payload names a window or mamba group (see `apply`).
    fn stored<'a>(
        &mut self,
        w: u32,
        s: Stored<'a>,
        hashes: &[u64],
        tokens: &[u32],
        last: &mut LastClass<'a>,
        windows: bool,
    ) {
        let keys = &hashes[s.hashes.clone()];
        // Engine mode parsed them without keeping them (`take_spare`): their count is all it reads.
        let n_tokens = s.tokens.len();
        let tokens = if self.mode == Mode::Tokens {
            &tokens[s.tokens.clone()]
        } else {
            &[]
        };
        let n = keys.len();
        let bs = self.block_size;
        if s.group == BAD_GROUP {
            self.stats.bad_groups += 1;
            return;
        }
        let kind = match (s.kind != NO_KIND)
            .then(|| kind_of(s.kind, s.window))
            .transpose()
        {
            Ok(k) => k,
            Err(BadKind::Kind) => {
                self.stats.unknown_kinds += 1;
                return;
            }
            Err(BadKind::Window) => {
                self.stats.bad_windows += 1;
                return;
            }
        };
        // The offload connector's token-less placeholder (offloading/events.py
        // `_placeholder_stored`): only a hash, block_size 0.
        let placeholder = s.block_size == 0 && n_tokens == 0;
        // A group's blocks may be a multiple m of the hash block size (vLLM: each group's
        // `block_size`, hashes at their gcd); its block i is keyed by the hash of its last
        // hash block, index block (i + 1) * m - 1 (kv_cache_utils.py
        // `BlockHashListWithBlockSize`). Anything else is not this index's block size.
        let scale = if s.block_size == bs as i64 {
            Some(1) // nearly every event: no division
        } else {
            (s.block_size > 0 && (s.block_size as u64).is_multiple_of(bs as u64))
                .then(|| s.block_size as u64 / bs as u64)
                .filter(|&m| m <= MAX_SCALE)
                .map(|m| m as u32)
        };
        if !placeholder && scale.is_none() {
            // An event with no blocks changes nothing, wrong size or not (counted as before).
            self.stats.block_size_mismatches += u64::from(n > 0);
            return;
        }
        let kind = if kind.is_none() && scale.is_none_or(|m| m <= 1) {
            self.kind(w, s.group) // most stores: nothing new to learn
        } else {
            self.learn(w, s.group, kind, scale)
        };
        if kind == Kind::Unscored {
            self.stats.unscored_group_events += 1;
        }
        if n == 0 {
            return;
        }
        // Tokens per block of this event (a placeholder's none: its hashes are all it says).
        let ebs = bs * scale.unwrap_or(1) as usize;
        let dense = n_tokens == n * ebs;
        // A window or mamba group lists only the blocks it retains (block_pool.py
        // `cache_full_blocks` skips null blocks) while its token ids cover the whole range.
        let sparse = !dense
            && n_tokens != 0
            && matches!(kind, Kind::Window { .. } | Kind::Unscored)
            && n_tokens > n * ebs
            && n_tokens.is_multiple_of(ebs);
        if !(placeholder || n_tokens == 0 || dense || sparse) {
            self.stats.block_size_mismatches += 1;
            return;
        }
        if n_tokens == 0 && !placeholder {
            self.stats.events_without_tokens += 1;
            if self.mode == Mode::Tokens {
                return;
            }
        }
        if s.bad_tokens {
            self.stats.bad_token_ids += 1;
            if self.mode == Mode::Tokens && dense {
                return;
            }
        }
        if self.mode == Mode::Tokens
            && dense
            && (s.bad_extra_keys || s.extra_keys.as_ref().is_some_and(|e| e.len() != n))
        {
            self.stats.bad_extra_keys += 1;
            return;
        }
        let Some(c) = last.find(self, s.medium, s.group, s.remote).or_else(|| {
            let c = self.class_id(s.medium, s.group, s.remote)?;
            last.0 = Some((s.medium, s.group, s.remote, c));
            Some(c)
        }) else {
            self.stats.too_many_media += 1;
            return;
        };
        let si = self.slot_index(w, c);
        let mut digests = std::mem::take(&mut self.digests);
        digests.clear();
        let mut skipped = 0;
        // The engine hashes that go with `digests`: `keys` but for the unresolved ones.
        let mut resolved = None;
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
                // The keys are the engine's hashes: `digests` stays empty (see below).
            }
            Mode::Tokens if dense && (ebs == bs || extras_none(&s.extra_keys, s.lora_name)) => {
                let parent = match s.parent {
                    None => None,
                    Some(p) => match self.engine_key(w, c, p) {
                        Some(k) => Some(k),
                        None => {
                            // The chain cannot be continued without the parent's index hash.
                            self.stats.unknown_parents += 1;
                            self.digests = digests;
                            return;
                        }
                    },
                };
                if ebs == bs {
                    let extras = s.extra_keys.map(|e| strip_lora(e, s.lora_name));
                    index_keys(
                        tokens,
                        bs,
                        s.lora_name,
                        parent,
                        extras.as_deref(),
                        &mut digests,
                    );
                } else {
                    // A block of m hash blocks is keyed by its last one's index hash, which
                    // is what a group of the index's size stores for that position (and what
                    // the engine hash of the block stands for in every group). No extra keys
                    // here (see `extras_none`).
                    let m = ebs / bs;
                    let mut i = 0usize;
                    let mut chain = Chain::new(Algo::Xxh3, bs, 0, None, s.lora_name, None);
                    chain.parent = parent.map(Digest::from_u64);
                    chain.run_words(tokens, None, |k| {
                        i += 1;
                        if i.is_multiple_of(m) {
                            digests.push(k);
                        }
                    });
                }
                digests.iter().for_each(|&k| self.blocks.prefetch(k));
            }
            Mode::Tokens => {
                // Placeholders, sparse groups and larger blocks with extra keys: each hash
                // stands for the block the worker stored under it with tokens (the same hash
                // in another group or medium).
                let mut engines = Vec::with_capacity(n);
                for &e in keys {
                    match self.engine_key(w, c, e) {
                        Some(k) => {
                            engines.push(e);
                            digests.push(k);
                        }
                        None => skipped += 1,
                    }
                }
                resolved = Some(engines);
                if placeholder {
                    self.stats.unresolved_placeholders += skipped;
                } else {
                    self.stats.unresolved_hashes += skipped;
                }
            }
        }
        let mode = self.mode;
        let e = entry(w, c);
        // In a worker with window (or mamba) groups those groups cut hits short, so vLLM often
        // recomputes a chain from block 0 that its main group still holds: a real second copy
        // that looks exactly like a re-announce. There every store is a copy.
        let plain = !windows
            && self.workers[w as usize]
                .as_ref()
                .is_some_and(|x| x.windows.is_empty());
        // vLLM's kv_cache_report_mode="full" re-announces reused prefix blocks from block 0
        // (block_pool.py `emit_cached_block_events`) without storing anything: not a copy.
        let reannounce = plain && s.parent.is_none() && skipped == 0 && {
            let (blocks, slab, slot, map) = self.parts(w, si);
            keys.iter().all(|k| match mode {
                Mode::Engine => blocks.get(k).is_some_and(|h| h.contains(slab, e)),
                Mode::Tokens => held_as(map, blocks, slab, slot, e, *k).is_some(),
            })
        };
        if !reannounce {
            match mode {
                Mode::Engine => {
                    let (blocks, slab, slot, _) = self.parts(w, si);
                    keys.iter()
                        .for_each(|&engine| add_copy(blocks, slab, slot, e, engine));
                }
                Mode::Tokens => {
                    for (&engine, &k) in resolved.as_deref().unwrap_or(keys).iter().zip(&digests) {
                        self.add_copy_tokens(w, si, engine, k);
                    }
                }
            }
        }
        self.digests = digests;
        self.stats.blocks_stored += n as u64 - skipped;
    }

    /// The index hash worker `w` stored engine hash `p` under: class `c` first, then its
    /// others (groups share hashes; a parent may be held in another medium).
    fn engine_key(&self, w: u32, c: u8, p: u64) -> Option<u64> {
        let slots = &self.workers[w as usize].as_ref()?.slots;
        let same = slots.iter().find(|s| s.class == c);
        same.into_iter()
            .chain(slots.iter().filter(|s| s.class != c))
            .find_map(|s| {
                held_as(
                    &self.engine,
                    &self.blocks,
                    &self.slab,
                    s,
                    entry(w, s.class),
                    p,
                )
            })
            .map(|(k, _)| k)
    }

    /// Tokens mode: one more physical copy, in worker `w`'s slot `si`, of the block engine hash
    /// `engine` stands for, index hash `k`.
    fn add_copy_tokens(&mut self, w: u32, si: usize, engine: u64, k: u64) {
        // A slot without aliases (what engines that agree give, whatever other slots hold):
        // the shared map and the block table, one probe each. Else, and for an engine hash
        // that now stands for other content, or a block that has a canonical hash already,
        // the general rule below.
        let plain = |x: &Worker| x.slots[si].alias.is_empty() && x.slots[si].alias_only.is_empty();
        if self.workers[w as usize].as_ref().is_some_and(plain) {
            let (&mut c, fresh) = self.engine.get_or_insert(engine, k);
            if fresh || c == k {
                let (blocks, slab, slot, _) = self.parts(w, si);
                let e = entry(w, slot.class);
                let (h, new_block) = blocks.get_or_insert(k, Holders::one(e));
                if new_block {
                    slot.held += 1;
                    return;
                }
                if !fresh {
                    if h.contains(slab, e) {
                        *slot.copies.entry(engine).or_insert(0) += 1;
                    } else {
                        h.insert(slab, e);
                        slot.held += 1;
                    }
                    return;
                }
                // The block has a canonical hash already: `engine` will be an alias.
                self.engine.remove(&engine);
            }
        }
        let (blocks, slab, slot, map) = self.parts(w, si);
        let e = entry(w, slot.class);
        match held_as(map, blocks, slab, slot, e, engine) {
            Some((old, _)) if old == k => {
                *slot.copies.entry(engine).or_insert(0) += 1;
                return;
            }
            Some((old, canonical)) => {
                // The engine hash now stands for other content: its copies of the old go.
                slot.copies.remove(&engine);
                self.unref(w, si, engine, old, canonical);
            }
            None => {}
        }
        self.add_ref(w, si, engine, k);
    }

    /// Tokens mode: one physical copy of the block stored under `engine` in worker `w`'s slot
    /// `si` is gone; whether there was one.
    fn drop_copy_tokens(&mut self, w: u32, si: usize, engine: u64) -> bool {
        let Core {
            blocks,
            slab,
            workers,
            engine: map,
            aliased,
            ..
        } = self;
        let slot = &mut workers[w as usize].as_mut().expect("live worker").slots[si];
        if take_copy(slot, engine) {
            return true;
        }
        let e = entry(w, slot.class);
        if slot.alias.is_empty() && slot.alias_only.is_empty() && slot.dups.is_empty() {
            // A slot with one hash per block, each its block's canonical one: the block's
            // holders lose the slot, and the canonical hash goes with its last holder.
            let Some(&k) = map.get(&engine) else {
                return false;
            };
            let held = match drop_holder(blocks, slab, slot, e, k) {
                Removed::NotHeld => return false,
                // No alias-only holder anywhere: any holder left holds it canonically, and
                // the removal said whether there is one (no lookup of the block again).
                Removed::Kept if *aliased == 0 => true,
                Removed::Empty => false,
                Removed::Kept => canonical_held(blocks, slab, workers, *aliased, k),
            };
            if !held {
                map.remove(&engine);
            }
            return true;
        }
        match held_as(map, blocks, slab, slot, e, engine) {
            Some((k, canonical)) => {
                self.unref(w, si, engine, k, canonical);
                true
            }
            None => false,
        }
    }

    /// Tokens mode: slot `si` of worker `w`, which does not hold `engine`, now holds it, standing
    /// for index hash `k`: as the block's canonical hash if it is that (or the block has none),
    /// otherwise as an alias.
    fn add_ref(&mut self, w: u32, si: usize, engine: u64, k: u64) {
        let canonical = match self.engine.get(&engine) {
            Some(&c) => c == k,
            None => {
                let free =
                    !canonical_held(&self.blocks, &self.slab, &self.workers, self.aliased, k);
                if free {
                    self.engine.insert(engine, k);
                }
                free
            }
        };
        let (blocks, slab, slot, _) = self.parts(w, si);
        let e = entry(w, slot.class);
        let held = blocks.get(&k).is_some_and(|h| h.contains(slab, e));
        if held {
            // Held through other hashes already: one more for the same block.
            *slot.dups.entry(k).or_insert(0) += 1;
        } else {
            add_holder(blocks, slab, slot, e, k);
        }
        let mut aliased = 0isize;
        if canonical {
            // Held before, it was through aliases only (the slot did not hold `engine`).
            if held && slot.alias_only.remove(&k).is_some() {
                aliased -= 1;
            }
        } else {
            slot.alias.insert(engine, k);
            if !held {
                slot.alias_only.insert(k, ());
                aliased += 1;
            }
        }
        self.aliased = self.aliased.wrapping_add_signed(aliased);
    }

    /// Tokens mode: slot `si` of worker `w` no longer holds `engine`, which stood for `k`
    /// (`canonical`: as its block's canonical hash). The canonical hash leaves `engine` with the
    /// last slot holding it.
    fn unref(&mut self, w: u32, si: usize, engine: u64, k: u64, canonical: bool) {
        let (blocks, slab, slot, _) = self.parts(w, si);
        let e = entry(w, slot.class);
        if !canonical {
            slot.alias.remove(&engine);
        }
        let mut aliased = 0isize;
        if let Some(d) = (!slot.dups.is_empty())
            .then(|| slot.dups.get_mut(&k))
            .flatten()
        {
            // Other hashes of the slot still stand for k.
            *d -= 1;
            if *d == 0 {
                slot.dups.remove(&k);
            }
            if canonical {
                slot.alias_only.insert(k, ());
                aliased += 1;
            }
        } else {
            drop_holder(blocks, slab, slot, e, k);
            if !canonical && slot.alias_only.remove(&k).is_some() {
                aliased -= 1;
            }
        }
        self.aliased = self.aliased.wrapping_add_signed(aliased);
        if canonical && !canonical_held(&self.blocks, &self.slab, &self.workers, self.aliased, k) {
            self.engine.remove(&engine);
        }
    }

    fn removed<'a>(
        &mut self,
        w: u32,
        keys: &[u64],
        medium: Option<&'a str>,
        group: u8,
        remote: bool,
        last: &mut LastClass<'a>,
    ) {
        if group == BAD_GROUP {
            self.stats.bad_groups += 1;
            return;
        }
        if self.kind(w, group) == Kind::Unscored {
            self.stats.unscored_group_events += 1;
        }
        let slot_i = last.find(self, medium, group, remote).and_then(|c| {
            let slots = &self.workers[w as usize].as_ref()?.slots;
            slots.iter().position(|s| s.class == c)
        });
        let Some(si) = slot_i else {
            self.stats.unknown_removes += keys.len() as u64;
            return;
        };
        let mut found = 0;
        match self.mode {
            Mode::Engine => {
                let (blocks, slab, slot, _) = self.parts(w, si);
                let e = entry(w, slot.class);
                for &engine in keys {
                    let gone = take_copy(slot, engine)
                        || drop_holder(blocks, slab, slot, e, engine) != Removed::NotHeld;
                    found += u64::from(gone);
                }
            }
            Mode::Tokens => {
                for &engine in keys {
                    found += u64::from(self.drop_copy_tokens(w, si, engine));
                }
            }
        }
        self.stats.blocks_removed += found;
        self.stats.unknown_removes += keys.len() as u64 - found;
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

    /// Drops everything worker `w` holds, in every class, and what its groups were.
    fn clear_worker(&mut self, w: u32) {
        self.set_hybrid(w, false);
        let Core {
            blocks,
            slab,
            workers,
            mode,
            engine,
            aliased,
            ..
        } = self;
        let worker = workers[w as usize].as_mut().expect("live worker");
        worker.clears += 1;
        worker.kinds.clear();
        worker.scales.clear();
        worker.align = 1;
        (worker.main, worker.windows) = plan(&[], &[], 1);
        if worker.slots.iter().all(|s| s.held == 0) {
            worker.slots.clear();
            return;
        }
        *aliased -= worker
            .slots
            .iter()
            .map(|s| s.alias_only.len())
            .sum::<usize>();
        worker.slots.clear();
        // Only the blocks know who holds them: one pass over all of them.
        blocks.retain(|_, h| {
            if h.remove_worker(slab, w) {
                h.release(slab);
                return false;
            }
            true
        });
        if *mode == Mode::Tokens {
            // The canonical hashes of the blocks no one else holds through them go.
            engine.retain(|_, k| canonical_held(blocks, slab, workers, *aliased, *k));
        }
    }
}

fn emit(out: &mut Vec<(u32, u32)>, word: usize, bits: u64, count: usize) {
    for b in Bits(bits) {
        out.push(((word * 64 + b) as u32, count as u32));
    }
}

/// Whether a store's blocks carry no extra keys but the LoRA name. vLLM's extra keys of a
/// block larger than the hash block (multimodal `(identifier, offset)` pairs, offsets from
/// the block's start; prompt-embeds digests of the whole block) cannot be split into the
/// smaller blocks' keys, so such a store is placed through the engine hashes instead.
fn extras_none(extras: &Option<Vec<Option<Value>>>, lora_name: Option<&str>) -> bool {
    // Rare (a LoRA or multimodal request on a group of larger blocks): the copy is cheap.
    extras
        .as_ref()
        .is_none_or(|e| strip_lora(e.clone(), lora_name).iter().all(Option::is_none))
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
/// In one probe of the table (most removes drop a block's last holder).
#[inline]
fn remove_entry(blocks: &mut Table<Holders>, slab: &mut Slab, e: Entry, k: u64) -> Removed {
    let removed = blocks.update(&k, |h| {
        let r = h.remove(slab, e);
        if r == Removed::Empty {
            h.release(slab);
        }
        let empty = r == Removed::Empty;
        (r, empty)
    });
    removed.unwrap_or(Removed::NotHeld)
}

/// `slot` holds block `k` (once); whether it did not before. One probe of the table (most
/// stores are of a block no one holds).
#[inline]
fn add_holder(
    blocks: &mut Table<Holders>,
    slab: &mut Slab,
    slot: &mut Slot,
    e: Entry,
    k: u64,
) -> bool {
    let (h, fresh) = blocks.get_or_insert(k, Holders::one(e));
    if !fresh {
        if h.contains(slab, e) {
            return false;
        }
        h.insert(slab, e);
    }
    slot.held += 1;
    true
}

/// What `remove_entry` did; the slot's count follows.
#[inline]
fn drop_holder(
    blocks: &mut Table<Holders>,
    slab: &mut Slab,
    slot: &mut Slot,
    e: Entry,
    k: u64,
) -> Removed {
    let r = remove_entry(blocks, slab, e, k);
    if r != Removed::NotHeld {
        slot.held -= 1;
    }
    r
}

/// Engine mode: one more physical copy of block `engine` in `slot`.
#[inline]
fn add_copy(blocks: &mut Table<Holders>, slab: &mut Slab, slot: &mut Slot, e: Entry, engine: u64) {
    if !add_holder(blocks, slab, slot, e, engine) {
        *slot.copies.entry(engine).or_insert(0) += 1;
    }
}

/// Takes one of the copies past the first `slot` holds of `engine`, if it has any.
#[inline]
fn take_copy(slot: &mut Slot, engine: u64) -> bool {
    let Some(n) = (!slot.copies.is_empty())
        .then(|| slot.copies.get_mut(&engine))
        .flatten()
    else {
        return false;
    };
    *n -= 1;
    if *n == 0 {
        slot.copies.remove(&engine);
    }
    true
}

/// Tokens mode: what `slot` (holder entry `e`) holds engine hash `engine` as: the index hash it
/// stands for, and whether as its block's canonical hash (through `map`, `Core::engine`)
/// rather than as one of the slot's aliases. None when the slot does not hold it.
#[inline]
fn held_as(
    map: &Table<u64>,
    blocks: &Table<Holders>,
    slab: &Slab,
    slot: &Slot,
    e: Entry,
    engine: u64,
) -> Option<(u64, bool)> {
    if let Some(&k) = (!slot.alias.is_empty())
        .then(|| slot.alias.get(&engine))
        .flatten()
    {
        return Some((k, false));
    }
    let &k = map.get(&engine)?;
    let through_alias = !slot.alias_only.is_empty() && slot.alias_only.contains_key(&k);
    (!through_alias && blocks.get(&k).is_some_and(|h| h.contains(slab, e))).then_some((k, true))
}

/// Tokens mode: whether some slot holds block `k` through its canonical hash, i.e. its holder
/// set has a slot that does not list it in `alias_only` (`aliased`: how many such entries
/// there are in all; while none, any holder does).
fn canonical_held(
    blocks: &Table<Holders>,
    slab: &Slab,
    workers: &[Option<Worker>],
    aliased: usize,
    k: u64,
) -> bool {
    let Some(h) = blocks.get(&k) else {
        return false;
    };
    aliased == 0
        || h.entries(slab).any(|e| {
            let worker = workers.get(worker_of(e) as usize).and_then(Option::as_ref);
            let slot = worker.and_then(|x| x.slots.iter().find(|s| s.class == medium_of(e)));
            slot.is_some_and(|s| !s.alias_only.contains_key(&k))
        })
}

#[cfg(test)]
mod tests {
    use super::super::parse::{parse, Format};
    use super::*;

    fn apply_json(core: &mut Core, worker: &str, json: &str) -> usize {
        let mut scratch = Vec::new();
        let batch = parse(
            json.as_bytes(),
            Format::Json,
            &mut scratch,
            core.take_spare(),
        )
        .expect("valid");
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
        core.find_matches(keys, None, false, &mut out);
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
        assert_eq!(
            scores(&core, &[10, 11, 12]),
            vec![("a".into(), 3), ("b".into(), 3)]
        );
        apply_json(
            &mut core,
            "a",
            r#"[0, [{"type": "BlockRemoved", "block_hashes": [11, 99], "medium": "GPU"}]]"#,
        );
        assert_eq!(
            scores(&core, &[10, 11, 12]),
            vec![("a".into(), 1), ("b".into(), 3)]
        );
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
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")),
        );
        apply_json(
            &mut core,
            "b",
            &format!("[0, [{}]]", stored(&[70], None, &[5, 6], "GPU")),
        );
        apply_json(
            &mut core,
            "b",
            &format!("[0, [{}]]", stored(&[80], Some(70), &[7, 8], "CPU")),
        );
        assert_eq!(core.len(), 2);
        let mut chain = Chain::new(Algo::Xxh3, 2, 0, None, None, None);
        let mut d = Vec::new();
        chain.run(&[5, 6, 7, 8], None, 0, &mut d);
        let keys: Vec<u64> = d.iter().map(|x| x.event_hash()).collect();
        assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
        // A second engine hash for the same content: removing one keeps the block.
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[3], Some(1), &[7, 8], "GPU")),
        );
        apply_json(
            &mut core,
            "a",
            r#"[0, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}]]"#,
        );
        assert_eq!(scores(&core, &keys)[0], ("a".into(), 2));
        apply_json(
            &mut core,
            "a",
            r#"[0, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}]]"#,
        );
        assert_eq!(scores(&core, &keys)[0], ("a".into(), 1));
        // Unknown parent: counted, skipped.
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[9], Some(12345), &[1, 1], "GPU")),
        );
        assert_eq!(core.stats.unknown_parents, 1);
        core.remove_worker("b");
        assert_eq!(scores(&core, &keys), vec![("a".into(), 1)]);
        assert_eq!(core.worker_names().len(), 1);
    }

    fn keys_of(tokens: &[u32]) -> Vec<u64> {
        let mut d = Vec::new();
        Chain::new(Algo::Xxh3, 2, 0, None, None, None).run(tokens, None, 0, &mut d);
        d.iter().map(|x| x.event_hash()).collect()
    }

    fn remove(core: &mut Core, worker: &str, hashes: &[u64]) {
        let ev =
            format!(r#"{{"type": "BlockRemoved", "block_hashes": {hashes:?}, "medium": "GPU"}}"#);
        apply_json(core, worker, &format!("[0, [{ev}]]"));
    }

    #[test]
    fn engines_with_other_hashes_for_the_same_tokens() {
        // a's hashes are the blocks' canonical ones (stored first); b's, another seed, aliases.
        let mut core = Core::new(2, Mode::Tokens);
        let stores = [
            ("a", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")),
            ("b", stored(&[71], None, &[5, 6], "GPU")),
            ("b", stored(&[72], Some(71), &[7, 8], "GPU")),
        ];
        for (w, ev) in stores {
            apply_json(&mut core, w, &format!("[0, [{ev}]]"));
        }
        let keys = keys_of(&[5, 6, 7, 8]);
        assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
        assert_eq!((core.engine.len(), core.aliased), (2, 2));
        // A hash only the other worker stored is unknown here, whatever block it stands for.
        remove(&mut core, "a", &[72]);
        remove(&mut core, "b", &[2]);
        assert_eq!(core.stats.unknown_removes, 2);
        assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
        // a leaves block 1: b still holds it through its alias, and chains on it.
        remove(&mut core, "a", &[2]);
        assert_eq!(scores(&core, &keys), vec![("a".into(), 1), ("b".into(), 2)]);
        assert_eq!(core.engine.len(), 1, "no one holds hash 2 any more");
        apply_json(
            &mut core,
            "b",
            &format!("[0, [{}]]", stored(&[73], Some(72), &[9, 9], "GPU")),
        );
        assert_eq!(
            scores(&core, &keys_of(&[5, 6, 7, 8, 9, 9])),
            vec![("a".into(), 1), ("b".into(), 3)]
        );
        // Block 1 has no canonical hash now: the next worker to store it gives it one (c's),
        // which a later store of a's old hash for it does not disturb.
        apply_json(
            &mut core,
            "c",
            &format!("[0, [{}]]", stored(&[1, 92], None, &[5, 6, 7, 8], "GPU")),
        );
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[2], Some(1), &[7, 8], "GPU")),
        );
        assert_eq!(
            scores(&core, &keys),
            vec![("a".into(), 2), ("b".into(), 2), ("c".into(), 2)]
        );
        remove(&mut core, "c", &[92]);
        remove(&mut core, "a", &[2]);
        assert_eq!(
            scores(&core, &keys),
            vec![("a".into(), 1), ("b".into(), 2), ("c".into(), 1)]
        );
        // Everything gone, nothing left behind.
        remove(&mut core, "a", &[1]);
        remove(&mut core, "b", &[71, 72, 73]);
        remove(&mut core, "c", &[1]);
        assert_eq!((core.len(), core.engine.len(), core.aliased), (0, 0, 0));
        assert_eq!(core.stats.unknown_removes, 2);
    }

    #[test]
    fn one_engine_hash_for_other_tokens_in_another_worker() {
        for clear in [false, true] {
            let mut core = Core::new(2, Mode::Tokens);
            apply_json(
                &mut core,
                "a",
                &format!("[0, [{}]]", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")),
            );
            apply_json(
                &mut core,
                "b",
                &format!("[0, [{}]]", stored(&[1], None, &[3, 4], "GPU")),
            );
            // b's parent 1 is its own block [3, 4], not a's [5, 6].
            apply_json(
                &mut core,
                "b",
                &format!("[0, [{}]]", stored(&[2], Some(1), &[7, 8], "CPU")),
            );
            let (ka, kb) = (keys_of(&[5, 6, 7, 8]), keys_of(&[3, 4, 7, 8]));
            assert_eq!(scores(&core, &ka), vec![("a".into(), 2)]);
            assert_eq!(scores(&core, &kb), vec![("b".into(), 2)]);
            if clear {
                apply_json(&mut core, "a", r#"[0, [{"type": "AllBlocksCleared"}]]"#);
                assert!(scores(&core, &ka).is_empty());
                assert_eq!(scores(&core, &kb), vec![("b".into(), 2)]);
                remove(&mut core, "b", &[1]);
                assert_eq!(scores(&core, &kb[1..]), vec![("b".into(), 1)]);
            } else {
                remove(&mut core, "b", &[1]);
                assert_eq!(scores(&core, &ka), vec![("a".into(), 2)]);
                assert!(scores(&core, &kb).is_empty());
                remove(&mut core, "a", &[1, 2]);
                assert!(scores(&core, &ka).is_empty());
                // b's hash 2 stands for its own block (in CPU) still.
                assert_eq!(scores(&core, &kb[1..]), vec![("b".into(), 1)]);
            }
            let cpu = r#"{"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"}"#;
            apply_json(&mut core, "b", &format!("[0, [{cpu}]]"));
            assert_eq!((core.len(), core.engine.len(), core.aliased), (0, 0, 0));
            assert_eq!(core.stats.unknown_removes, 0);
        }
    }

    fn grouped(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        group: u8,
        kind: &str,
        window: i64,
    ) -> String {
        let parent = parent.map_or("null".to_string(), |p| p.to_string());
        format!(
            r#"{{"type": "BlockStored", "block_hashes": {hashes:?}, "parent_block_hash": {parent},
                "token_ids": {tokens:?}, "block_size": 2, "lora_id": null, "medium": "GPU",
                "lora_name": null, "group_idx": {group}, "kv_cache_spec_kind": "{kind}",
                "kv_cache_spec_sliding_window": {window}}}"#
        )
    }

    fn removed(hashes: &[u64], group: u8) -> String {
        format!(
            r#"{{"type": "BlockRemoved", "block_hashes": {hashes:?}, "medium": "GPU", "group_idx": {group}}}"#
        )
    }

    #[test]
    fn window_hit_is_the_largest_prefix_every_window_accepts() {
        let g1 = |held: &[bool]| {
            held.iter()
                .map(|&h| 1 | (u64::from(h) << 1))
                .collect::<Vec<u64>>()
        };
        // One window group (bit 1) needing 2 blocks.
        assert_eq!(window_hit(&g1(&[true, true, true, true]), &[(1, 2)]), 4);
        assert_eq!(window_hit(&g1(&[false, false, true, true]), &[(1, 2)]), 4);
        assert_eq!(window_hit(&g1(&[false, true, true, false]), &[(1, 2)]), 3);
        assert_eq!(window_hit(&g1(&[true, false, false, false]), &[(1, 2)]), 1); // fewer at the start
        assert_eq!(window_hit(&g1(&[false, true, false, false]), &[(1, 2)]), 0);
        assert_eq!(window_hit(&g1(&[true, true, false]), &[]), 3);
        // Two windows: the largest n both accept.
        let masks = [0b011, 0b111, 0b101, 0b011];
        assert_eq!(window_hit(&masks, &[(1, 1), (2, 1)]), 2);
        assert_eq!(window_hit(&masks, &[(1, 1), (2, 2)]), 0); // group 2 lacks block 0
        assert_eq!(window_hit(&masks, &[(2, 2)]), 3);
    }

    #[test]
    fn kinds_decide_the_plan() {
        let code = |name: &[u8]| {
            KINDS
                .iter()
                .position(|k| *k == name)
                .map_or(u8::MAX, |i| i as u8 + 1)
        };
        assert_eq!(
            kind_of(code(b"sliding_window"), 5).ok(),
            Some(Kind::Window { tokens: 5 })
        );
        assert_eq!(
            kind_of(code(b"mamba"), 0).ok(),
            Some(Kind::Window { tokens: 1 })
        );
        assert_eq!(
            kind_of(code(b"sink_full_attention"), 0).ok(),
            Some(Kind::Main)
        );
        assert!(matches!(
            kind_of(code(b"sliding_window_mla"), 0),
            Err(BadKind::Window)
        ));
        assert!(matches!(
            kind_of(code(b"sliding_window"), -3),
            Err(BadKind::Window)
        ));
        assert!(matches!(kind_of(code(b"swa"), 4), Err(BadKind::Kind)));
        // cdiv(W - 1, group block size), at least 1.
        assert_eq!(
            (
                window_blocks(5, 2),
                window_blocks(1, 2),
                window_blocks(1, 16)
            ),
            (2, 1, 1)
        );
        assert_eq!(
            (
                window_blocks(9, 4),
                window_blocks(9, 8),
                window_blocks(17, 8)
            ),
            (2, 1, 2)
        );
        assert!(
            is_plain(&[], &[])
                && is_plain(&[Kind::Main, Kind::Unscored, Kind::Unannounced], &[1, 0])
        );
        assert!(!is_plain(&[Kind::Main, Kind::Main], &[]) && !is_plain(&[Kind::Unscored], &[]));
        assert!(!is_plain(
            &[Kind::Unannounced, Kind::Window { tokens: 1 }],
            &[]
        ));
        assert!(
            !is_plain(&[Kind::Main], &[2]),
            "a group of larger blocks is scored apart"
        );
        let (main, windows) = plan(
            &[Kind::Unannounced, Kind::Main, Kind::Window { tokens: 5 }],
            &[],
            2,
        );
        assert_eq!((main, windows), (0b11, vec![(2, 2)]));
        // The same window over blocks twice as large: one block.
        assert_eq!(
            plan(&[Kind::Window { tokens: 5 }], &[2], 2),
            (0, vec![(0, 1)])
        );
        assert_eq!(
            (alignment(&[]), alignment(&[0, 2, 3]), alignment(&[4, 2])),
            (1, 6, 4)
        );
        assert_eq!(
            alignment(&[u32::MAX, u32::MAX - 1, u32::MAX - 2]),
            u64::MAX,
            "saturates"
        );
    }

    #[test]
    fn scaled_hits_land_on_every_groups_block_ends() {
        // Group 0 main at scale 1, group 1 a window of 1 block at scale 2: `held[i]` = groups
        // holding index block i (group 1's keys only count at odd i, its blocks' ends).
        let walk = |held: &[u64], windows: &[(u8, u32)], scales: &[u32]| {
            let mut runs = vec![0; windows.len()];
            let align = alignment(scales);
            let mut best = 0;
            for (i, &m) in held.iter().enumerate() {
                match scaled_step(&mut runs, 1, windows, scales, align, i + 1, m) {
                    Step::Closed => break,
                    Step::Hit => best = i + 1,
                    Step::Open => {}
                }
            }
            best
        };
        assert_eq!(walk(&[1, 3, 1, 3], &[(1, 1)], &[1, 2]), 4);
        assert_eq!(
            walk(&[1, 3, 3, 1], &[(1, 1)], &[1, 2]),
            2,
            "group 1's key at index 2 is no block end"
        );
        assert_eq!(walk(&[1, 1, 1], &[(1, 1)], &[1, 2]), 0);
        assert_eq!(
            walk(&[1, 3, 1], &[(1, 1)], &[1, 2]),
            2,
            "3 is not a multiple of 2"
        );
        // A main group at scale 2 (bits as group 0): misses between its block ends do not count.
        assert_eq!(walk(&[0, 1, 0, 1, 0, 0], &[], &[2]), 4);
        // Window of 2 blocks at scale 2, main at scale 3: align 6.
        let held = [1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3];
        assert_eq!(walk(&held, &[(1, 2)], &[3, 2]), 12);
        let held = [1, 1, 1, 3, 1, 3, 1, 1, 1, 3, 1, 3];
        assert_eq!(
            walk(&held, &[(1, 2)], &[3, 2]),
            12,
            "group 1 holds its blocks 4, 5 (keys 9, 11)"
        );
        let held = [1, 1, 1, 3, 1, 3, 1, 1, 1, 1, 1, 3];
        assert_eq!(walk(&held, &[(1, 2)], &[3, 2]), 6);
    }

    #[test]
    fn hybrid_workers_score_apart_from_plain_ones() {
        for mode in [Mode::Engine, Mode::Tokens] {
            let mut core = Core::new(2, mode);
            let toks = [1, 2, 3, 4, 5, 6, 7, 8];
            let full = grouped(&[1, 2, 3, 4], None, &toks, 0, "full_attention", 0);
            apply_json(&mut core, "plain", &format!("[0, [{full}]]"));
            // W = 3: cdiv(2, 2) = 1 block; the window group holds blocks 0 and 2 (sparse).
            let window = grouped(&[1, 3], None, &toks, 1, "sliding_window", 3);
            apply_json(&mut core, "hybrid", &format!("[0, [{full}, {window}]]"));
            let keys: Vec<u64> = match mode {
                Mode::Engine => vec![1, 2, 3, 4],
                Mode::Tokens => {
                    let mut d = Vec::new();
                    Chain::new(Algo::Xxh3, 2, 0, None, None, None).run(&toks, None, 0, &mut d);
                    d.iter().map(|x| x.event_hash()).collect()
                }
            };
            assert_eq!(
                scores(&core, &keys),
                vec![("plain".into(), 4), ("hybrid".into(), 3)],
                "{mode:?}"
            );
            apply_json(&mut core, "hybrid", &format!("[0, [{}]]", removed(&[1], 1)));
            assert_eq!(scores(&core, &keys)[1], ("hybrid".into(), 3));
            apply_json(&mut core, "hybrid", &format!("[0, [{}]]", removed(&[3], 1)));
            assert_eq!(scores(&core, &keys), vec![("plain".into(), 4)]);
            assert_eq!(core.stats.unresolved_hashes, 0);
        }
    }

    #[test]
    fn window_codes_name_the_window_kinds() {
        for c in WINDOW_CODES {
            let name = KINDS[c as usize - 1];
            assert!(
                matches!(name, b"sliding_window" | b"sliding_window_mla" | b"mamba"),
                "{c}"
            );
        }
    }

    #[test]
    fn copies_and_the_re_announce() {
        for mode in [Mode::Engine, Mode::Tokens] {
            let mut core = Core::new(2, mode);
            let chain = stored(&[1, 2], None, &[1, 2, 3, 4], "GPU");
            apply_json(&mut core, "a", &format!("[0, [{chain}]]"));
            apply_json(&mut core, "a", &format!("[0, [{chain}]]")); // re-announced: no copy
            apply_json(
                &mut core,
                "a",
                &format!("[0, [{}]]", stored(&[2], Some(1), &[3, 4], "GPU")),
            );
            let one = r#"{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}"#;
            apply_json(&mut core, "a", &format!("[0, [{one}]]"));
            assert_eq!(
                core.len(),
                2,
                "{mode:?}: the second copy of block 1 is held"
            );
            apply_json(&mut core, "a", &format!("[0, [{one}]]"));
            assert_eq!(core.len(), 1, "{mode:?}");
            apply_json(&mut core, "a", &format!("[0, [{one}]]"));
            assert_eq!(core.stats.unknown_removes, 1);
        }
    }

    #[test]
    fn bad_groups_change_nothing() {
        let mut core = Core::new(2, Mode::Engine);
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[1], None, &[1, 2], "GPU")),
        );
        for bad in ["-1", "64", "true", "1.5", "\"0\""] {
            let ev = format!(
                r#"{{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": {bad}}}"#
            );
            assert_eq!(
                apply_json(&mut core, "a", &format!("[0, [{ev}]]")),
                1,
                "{bad}"
            );
        }
        assert_eq!(core.stats.bad_groups, 5);
        assert_eq!(core.stats.malformed_payloads, 0);
        assert_eq!(scores(&core, &[1]), vec![("a".into(), 1)]);
    }

    /// Key 0 is the table's free-slot marker, kept apart: found by a query both while it is
    /// the only block (the table has no slots) and among others.
    #[test]
    fn a_block_keyed_zero() {
        let mut core = Core::new(2, Mode::Engine);
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[0], None, &[1, 2], "GPU")),
        );
        assert_eq!(scores(&core, &[0, 7]), vec![("a".into(), 1)]);
        assert_eq!(scores(&core, &[7, 0]), vec![]);
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[7, 8], Some(0), &[3, 4, 5, 6], "GPU")),
        );
        apply_json(
            &mut core,
            "b",
            &format!("[0, [{}]]", stored(&[0, 7], None, &[1, 2, 3, 4], "GPU")),
        );
        assert_eq!(
            scores(&core, &[0, 7, 8, 9]),
            vec![("a".into(), 3), ("b".into(), 2)]
        );
        remove(&mut core, "a", &[0]);
        assert_eq!(scores(&core, &[0, 7, 8]), vec![("b".into(), 2)]);
    }

    #[test]
    fn many_workers_use_several_words() {
        let mut core = Core::new(2, Mode::Engine);
        for w in 0..150u32 {
            let n = 1 + (w as usize % 3);
            let hashes: Vec<u64> = (0..n as u64).collect();
            let tokens: Vec<u32> = (0..2 * n as u32).collect();
            apply_json(
                &mut core,
                &format!("w{w}"),
                &format!("[0, [{}]]", stored(&hashes, None, &tokens, "GPU")),
            );
        }
        let mut out = Vec::new();
        core.find_matches(&[0, 1, 2], None, false, &mut out);
        assert_eq!(out.len(), 150);
        for &(w, n) in &out {
            assert_eq!(n, 1 + w % 3);
        }
        core.find_matches(&[0], Some(Some("CPU")), false, &mut out);
        assert!(out.is_empty());
    }
}
