//! `_native.ResidencyView`: a view of an engine's cache, kept from vLLM payload bytes -- the one
//! place the residency rule runs for the package's views: the relay's (`RelayView`) and each
//! worker's in a subscriber (`WorkerView`, hash-only).
//!
//! The relay forwards vLLM's bytes unchanged and keeps a view of them for snapshots; decoding each
//! batch into Python events and applying them in Python cost it ~10x a plain forwarder's CPU
//! (bench/relay.py). This reads the payload with the scanner (rust/scan.rs: it validates the whole
//! payload against the schema msgspec decodes with, so a payload is applied whole or not at all)
//! and applies the rule per event: per `(medium, group)`, each block's copies; each group's kind
//! and window and largest block size; the full-report re-announce exception; bad `group_idx`,
//! unknown kinds and window kinds without a window skipped and counted (docs/hybrid.md).
//! kvbridge.wire.residency's `Residency` is the plain-Python executable spec of the rule:
//! tests/test_relay_view.py and tests/test_residency.py hold this view to it on random hybrid
//! streams, in both modes.
//!
//! For the relay's snapshots each copy remembers the `BlockStored` it came in: the event's own
//! msgpack bytes (copied out of the payload once per event, shared by its copies, freed with its
//! last copy) and the block's index in it. Python decodes those few events when a snapshot is
//! asked for and cuts the snapshot from them (`kvbridge.engine.relay.RelayView.snapshot`). A
//! hash-only view (`ResidencyView(sources=False)`, a subscriber's, one per worker) keeps no bytes:
//! a subscriber of hundreds of workers must not hold every event's token ids.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashMap;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyString};

use crate::index::table::Table;
use crate::reader::{Hash, Reader};
use crate::scan::{Attrs, Template, CLEARED, REMOVED, STORED};

/// Payloads at least this long are applied with the GIL released.
const DETACH_MIN_BYTES: usize = 16 << 10;
const MAX_GROUPS: i128 = 64;

/// vLLM's `KVCacheSpecKind` values, in kvbridge.wire.residency's classes.
const KINDS: [&[u8]; 10] = [
    b"full_attention",
    b"mla_attention",
    b"sink_full_attention",
    b"sliding_window",
    b"sliding_window_mla",
    b"mamba",
    b"chunked_local_attention",
    b"encoder_only_attention",
    b"cross_attention",
    b"unknown",
];
fn is_window(kind: u8) -> bool {
    kind == 3 || kind == 4
}
/// Groups that cut a worker's hits short (window kinds and mamba): no re-announce exception.
fn is_hybrid(kind: u8) -> bool {
    (3..=5).contains(&kind)
}
fn is_unscored(kind: u8) -> bool {
    kind >= 6
}

/// A block hash as Python sees it: msgpack ints of either width are one int. The key of the rare
/// blocks outside a group's table (negative and bytes hashes) and of further copies; the table
/// holds the others by their u64 alone (`Blocks`).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    /// 0..=u64::MAX: what engines send.
    N(u64),
    /// Negative.
    I(i64),
    #[allow(clippy::box_collection)]
    B(Box<Box<[u8]>>),
}

impl Key {
    fn of(b: &[u8], h: Hash) -> Key {
        match h {
            Hash::U(v) => Key::N(v),
            Hash::I(v) if v >= 0 => Key::N(v as u64),
            Hash::I(v) => Key::I(v),
            Hash::B(s, e) => Key::B(Box::new(b[s..e].into())),
        }
    }

    fn to_object<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Key::N(v) => v.into_pyobject(py)?.into_any(),
            Key::I(v) => v.into_pyobject(py)?.into_any(),
            Key::B(v) => PyBytes::new(py, v).into_any(),
        })
    }
}

/// One multiply over the hash's 64 bits: block hashes are uniformly random already.
#[derive(Clone, Copy, Default)]
struct Mix;
struct MixHasher(u64);
impl BuildHasher for Mix {
    type Hasher = MixHasher;
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}
impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(23) ^ u64::from_le_bytes(w))
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 ^= x;
    }
    fn write_i64(&mut self, x: i64) {
        self.0 ^= x as u64;
    }
    fn write_isize(&mut self, x: isize) {
        // the enum's discriminant
        self.0 ^= (x as u64) << 61;
    }
    fn finish(&self) -> u64 {
        let m = (self.0 ^ 0x2d35_8dcc_aa6c_78a5) as u128 * 0x9e37_79b9_7f4a_7c15u128;
        (m as u64) ^ ((m >> 64) as u64)
    }
}

/// A copy: the source event (index into `View::sources`) and the block's index in it.
type Copy_ = (u32, u32);

/// A block's first copy in 8 bytes, so that a table slot with its key is 16 (four to a cache
/// line: the table is probed at random, and a remove's backward shift reads the slots after the
/// one it empties): the source (high 32 bits), whether further copies are in `Blocks::more`
/// (bit 31), and the block's index in the source (the low 31: an event of 2**31 blocks is not
/// read, `MAX_EVENT_BLOCKS`). The first copy stays while the block is held (removes take the
/// last copy first), and the blocks came in the order of their first copies: a snapshot's order
/// is `(Source::seq, index)`.
#[derive(Clone, Copy)]
struct Entry(u64);

const MORE_BIT: u64 = 1 << 31;
/// Blocks an event may have for the view: their index in it fits `Entry`.
const MAX_EVENT_BLOCKS: usize = 1 << 31;

impl Entry {
    fn new((src, i): Copy_) -> Entry {
        Entry((src as u64) << 32 | i as u64)
    }

    fn first(self) -> Copy_ {
        ((self.0 >> 32) as u32, (self.0 & (MORE_BIT - 1)) as u32)
    }

    fn has_more(self) -> bool {
        self.0 & MORE_BIT != 0
    }

    fn with_more(self, more: bool) -> Entry {
        Entry(if more {
            self.0 | MORE_BIT
        } else {
            self.0 & !MORE_BIT
        })
    }
}

/// Blocks [`Blocks::prefetch`]ed ahead of the one applied: a batch's lookups are independent, and
/// a view of tens of thousands of blocks misses the cache on nearly every one.
const AHEAD: usize = 8;

/// The view removes a block for about every one it stores (an engine's pool is full): at the
/// index's 3/4 a remove's backward shift and a store's probe each walk ~6 slots of a cluster,
/// at 1/2 ~2. Up to twice the index's 16 bytes a slot per block held (a relay holds one
/// engine's blocks).
const VIEW_MAX_LOAD_PCT: usize = 50;

/// An int hash as the table's key: what `Key::of` makes a `Key::N`.
#[inline]
fn u64_key(h: Hash) -> Option<u64> {
    match h {
        Hash::U(v) => Some(v),
        Hash::I(v) if v >= 0 => Some(v as u64),
        _ => None,
    }
}

/// A `(medium, group)`'s blocks. Hashes of 0..2**64 (what engines send) live in the index's
/// open-addressing table (rust/index/table.rs), where a key's slot follows from the key alone:
/// the slots of a batch's next blocks are prefetched while one is applied (with hashbrown, which
/// this used, each lookup waited for its miss: ~100 ns of the relay's ~300 per block event).
/// A slot is 16 bytes, the key and a packed `Entry`: four to a cache line. Kept at most half
/// full (`VIEW_MAX_LOAD_PCT`). Negative and bytes hashes, rare, in a hashbrown map beside it.
#[derive(Default)]
struct Blocks {
    table: Table<Entry, VIEW_MAX_LOAD_PCT>,
    rare: HashMap<Key, Entry, Mix>,
    /// The further copies of blocks with more than one, oldest first (rare).
    more: HashMap<Key, Vec<Copy_>, Mix>,
}

impl Blocks {
    fn len(&self) -> usize {
        self.table.len() + self.rare.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn prefetch(&self, h: Hash) {
        if let Some(k) = u64_key(h) {
            self.table.prefetch_run(k);
        }
    }

    fn contains(&self, b: &[u8], h: Hash) -> bool {
        match u64_key(h) {
            Some(k) => self.table.get(&k).is_some(),
            None => self.rare.contains_key(&Key::of(b, h)),
        }
    }

    fn get(&self, k: &Key) -> Option<&Entry> {
        match k {
            Key::N(k) => self.table.get(k),
            _ => self.rare.get(k),
        }
    }

    /// `h`'s entry, `e` inserted first if there is none; whether it was.
    #[inline]
    fn get_or_insert(&mut self, b: &[u8], h: Hash, e: Entry) -> (&mut Entry, bool) {
        match u64_key(h) {
            Some(k) => self.table.get_or_insert(k, e),
            None => match self.rare.entry(Key::of(b, h)) {
                hashbrown::hash_map::Entry::Occupied(o) => (o.into_mut(), false),
                hashbrown::hash_map::Entry::Vacant(v) => (v.insert(e), true),
            },
        }
    }

    #[inline]
    fn remove(&mut self, b: &[u8], h: Hash) -> Option<Entry> {
        match u64_key(h) {
            Some(k) => self.table.remove(&k),
            None => self.rare.remove(&Key::of(b, h)),
        }
    }

    /// In no particular order.
    fn iter(&self) -> impl Iterator<Item = (Key, Entry)> + '_ {
        let ints = self.table.iter().map(|(k, e)| (Key::N(k), *e));
        ints.chain(self.rare.iter().map(|(k, e)| (k.clone(), *e)))
    }

    /// The further copies of the block `k`, whose entry is `e`.
    fn more_of(&self, k: &Key, e: Entry) -> &[Copy_] {
        match e.has_more() {
            true => self.more.get(k).map_or(&[], |m| m.as_slice()),
            false => &[],
        }
    }
}

/// Buffers of released sources by size class, reused for new sources: a relay stores and
/// releases ~15 sources of 0.1-5 KiB per engine step, and glibc's malloc and free of those, among
/// the 44 KiB payloads the process keeps for replay, cost it ~5% of its CPU (perf). A class spans
/// a sixteenth of a doubling, so a buffer is at most 1/8 larger than its bytes; what is kept is
/// bounded in count per class and in bytes.
#[derive(Default)]
struct Spare {
    by_class: Vec<Vec<Vec<u8>>>,
    bytes: usize,
}

/// Buffers kept per class at most: a step's releases, with room.
const SPARE_PER_CLASS: usize = 32;
/// Bytes kept in all classes at most.
const SPARE_BYTES: usize = 4 << 20;

/// `(class, capacity)` of a buffer for `n` bytes: `n` rounded up to a sixteenth of the power of
/// two at or above it, which is under an eighth of `n`.
fn size_class(n: usize) -> (usize, usize) {
    let bits = (usize::BITS - n.saturating_sub(1).leading_zeros()).max(4) as usize; // n <= 1 << bits
    let step = 1usize << (bits - 4);
    let m = n.div_ceil(step); // 9..=16 (0..=16 for the smallest)
    (bits * 16 + m, m * step)
}

impl Spare {
    /// An empty buffer with room for `n` bytes.
    fn take(&mut self, n: usize) -> Vec<u8> {
        let (class, cap) = size_class(n);
        if let Some(buf) = self.by_class.get_mut(class).and_then(Vec::pop) {
            self.bytes -= buf.capacity();
            return buf;
        }
        Vec::with_capacity(cap)
    }

    /// Keeps `buf` for a later `take` of its class, unless the bounds say drop it.
    fn give(&mut self, mut buf: Vec<u8>) {
        let (class, cap) = size_class(buf.len());
        if buf.capacity() != cap || self.bytes + cap > SPARE_BYTES {
            return;
        }
        if self.by_class.len() <= class {
            self.by_class.resize_with(class + 1, Vec::new);
        }
        let list = &mut self.by_class[class];
        if list.len() < SPARE_PER_CLASS {
            buf.clear();
            self.bytes += cap;
            list.push(buf);
        }
    }
}

struct Group {
    medium: Option<Box<str>>,
    group: u8,
    blocks: Blocks,
}

struct Source {
    /// The event's bytes, in a buffer of its size class (`Spare`).
    raw: Vec<u8>,
    copies: u32,
    /// When it came: sources are reused, their index says nothing of it.
    seq: u64,
}

#[derive(Default)]
struct Stats {
    bad_groups: u64,
    bad_windows: u64,
    unknown_kinds: u64,
    unscored_group_events: u64,
    unknown_removes: u64,
}

#[derive(Default)]
struct View {
    /// `(medium, group)`s holding blocks, in the order they first did (few: a linear search).
    groups: Vec<Group>,
    /// `(group, kind, window)` in the order groups first named a kind.
    kinds: Vec<(u8, u8, Option<i128>)>,
    /// `(group, largest block_size)` of the stores the rule did not skip, for snapshots: groups
    /// may have blocks of different sizes (docs/hybrid.md).
    sizes: Vec<(u8, i128)>,
    /// Whether copies keep their source events (the relay's snapshots); a hash-only view (a
    /// subscriber's, one per worker) keeps none.
    keep_sources: bool,
    sources: Vec<Option<Source>>,
    free: Vec<u32>,
    /// Released sources' buffers, for the next sources of their size.
    spare: Spare,
    /// The group the last event applied to: where the next blocks are prefetched.
    last_group: usize,
    /// Sources made so far (`Source::seq`).
    order: u64,
    stats: Stats,
}

fn int_of(h: Option<Hash>) -> Option<i128> {
    match h? {
        Hash::U(v) => Some(v as i128),
        Hash::I(v) => Some(v as i128),
        Hash::B(..) => None,
    }
}

struct Ev<'a> {
    kind: u8,
    attrs: Attrs<'a>,
    hashes: std::ops::Range<usize>,
    raw: std::ops::Range<usize>,
    /// Events read as this one: consecutive removes of one `(medium, group)` (`read_into`).
    n_events: u32,
}

impl View {
    /// Prefetches the blocks `AHEAD` of batch hash `i` in `blocks`: the batch's next events mostly
    /// go to the group this one does.
    #[inline]
    fn prefetch_ahead(blocks: &Blocks, all: &[Hash], i: usize) {
        if let Some(&h) = all.get(i + AHEAD) {
            blocks.prefetch(h);
        }
    }

    fn kind_of(&self, group: u8) -> Option<u8> {
        self.kinds.iter().find(|k| k.0 == group).map(|k| k.1)
    }

    fn set_kind(&mut self, group: u8, kind: u8, window: Option<i128>) {
        match self.kinds.iter_mut().find(|k| k.0 == group) {
            Some(k) => *k = (group, kind, window),
            None => self.kinds.push((group, kind, window)),
        }
    }

    fn group_of(&mut self, group: Option<Hash>) -> Option<u8> {
        match group {
            None => Some(0),
            Some(h) => match int_of(Some(h)) {
                Some(g) if (0..MAX_GROUPS).contains(&g) => Some(g as u8),
                _ => {
                    self.stats.bad_groups += 1;
                    None
                }
            },
        }
    }

    fn find(&self, medium: Option<&[u8]>, group: u8) -> Option<usize> {
        self.groups
            .iter()
            .position(|g| g.group == group && g.medium.as_deref().map(str::as_bytes) == medium)
    }

    fn new_source(&mut self, raw: &[u8]) -> u32 {
        self.order += 1;
        let mut buf = self.spare.take(raw.len());
        buf.extend_from_slice(raw);
        let s = Some(Source {
            raw: buf,
            copies: 0,
            seq: self.order,
        });
        match self.free.pop() {
            Some(i) => {
                self.sources[i as usize] = s;
                i
            }
            None => {
                self.sources.push(s);
                (self.sources.len() - 1) as u32
            }
        }
    }

    /// `all`: the batch's hashes, the event's at `ev.hashes`.
    fn store(&mut self, b: &[u8], ev: &Ev<'_>, all: &[Hash], windows: bool) {
        let hashes = &all[ev.hashes.clone()];
        let a = &ev.attrs;
        let Some(group) = self.group_of(a.group) else {
            return;
        };
        if let Some(spec) = a.spec {
            let Some(kind) = KINDS.iter().position(|k| *k == spec) else {
                self.stats.unknown_kinds += 1;
                return;
            };
            let kind = kind as u8;
            let window = if is_window(kind) {
                match int_of(a.window) {
                    Some(w) if w >= 1 => Some(w),
                    _ => {
                        self.stats.bad_windows += 1;
                        return;
                    }
                }
            } else {
                None
            };
            self.set_kind(group, kind, window);
        }
        if self.kind_of(group).is_some_and(is_unscored) {
            self.stats.unscored_group_events += 1;
        }
        if let Some(size) = int_of(a.block_size) {
            match self.sizes.iter_mut().find(|s| s.0 == group) {
                Some(s) => s.1 = s.1.max(size),
                None if size > 0 => self.sizes.push((group, size)),
                None => {}
            }
        }
        if hashes.is_empty() {
            return;
        }
        let at = self.find(a.medium, group);
        // vLLM's full-report re-announce: a parent-None store all of whose blocks are held adds
        // no copies -- in a worker without window or mamba groups only (kvbridge.wire.residency).
        let plain = a.root && !windows && !self.kinds.iter().any(|k| is_hybrid(k.1));
        if let (true, Some(at)) = (plain, at) {
            let held = &self.groups[at].blocks;
            if hashes.iter().all(|&h| held.contains(b, h)) {
                return;
            }
        }
        let at = at.unwrap_or_else(|| {
            self.groups.push(Group {
                medium: a.medium.map(|m| String::from_utf8_lossy(m).into()),
                group,
                blocks: Blocks::default(),
            });
            self.groups.len() - 1
        });
        let src = if self.keep_sources {
            let src = self.new_source(&b[ev.raw.clone()]);
            self.sources[src as usize].as_mut().unwrap().copies = hashes.len() as u32;
            src
        } else {
            0 // no source: every copy names none
        };
        self.last_group = at;
        let blocks = &mut self.groups[at].blocks;
        for (i, &h) in hashes.iter().enumerate() {
            Self::prefetch_ahead(blocks, all, ev.hashes.start + i);
            let copy = (src, i as u32);
            let (e, fresh) = blocks.get_or_insert(b, h, Entry::new(copy));
            if !fresh {
                *e = e.with_more(true);
                blocks.more.entry(Key::of(b, h)).or_default().push(copy);
            }
        }
    }

    /// `all`: the batch's hashes, the event's at `ev.hashes`.
    fn remove(&mut self, b: &[u8], ev: &Ev<'_>, all: &[Hash]) {
        let hashes = &all[ev.hashes.clone()];
        let a = &ev.attrs;
        let Some(group) = self.group_of(a.group) else {
            return;
        };
        if self.kind_of(group).is_some_and(is_unscored) {
            self.stats.unscored_group_events += ev.n_events as u64;
        }
        let Some(at) = self.find(a.medium, group) else {
            self.stats.unknown_removes += hashes.len() as u64;
            return;
        };
        self.last_group = at;
        let View {
            groups,
            keep_sources,
            sources,
            free,
            spare,
            stats,
            ..
        } = self;
        let blocks = &mut groups[at].blocks;
        for (i, &h) in hashes.iter().enumerate() {
            Self::prefetch_ahead(blocks, all, ev.hashes.start + i);
            // Taken out in one probe: a block has one copy but for rare ones, which are put back.
            let Some(entry) = blocks.remove(b, h) else {
                stats.unknown_removes += 1;
                continue;
            };
            // The last copy goes first, as the Python view popped it.
            let (src, _) = if entry.has_more() {
                let key = Key::of(b, h);
                let list = blocks
                    .more
                    .get_mut(&key)
                    .expect("a block with more copies has their list");
                let c = list.pop().expect("a list of further copies is never empty");
                let more = !list.is_empty();
                if !more {
                    blocks.more.remove(&key);
                }
                blocks.get_or_insert(b, h, entry.with_more(more)); // its first copy as it was
                c
            } else {
                entry.first()
            };
            if !*keep_sources {
                continue;
            }
            let slot = &mut sources[src as usize];
            let s = slot.as_mut().expect("a copy's source is alive");
            s.copies -= 1;
            if s.copies == 0 {
                if let Some(s) = slot.take() {
                    spare.give(s.raw);
                }
                free.push(src);
            }
        }
        if blocks.is_empty() {
            groups.remove(at);
        }
    }

    fn clear(&mut self) {
        self.groups.clear();
        self.kinds.clear();
        self.sizes.clear();
        self.sources.clear();
        self.free.clear();
    }

    /// Applies a batch [`read`] from `b`, whole. Returns `(events, block hashes)`.
    fn apply_read(&mut self, b: &[u8], read: &Read) -> (usize, usize) {
        // The first blocks' slots, which the events' own look-ahead does not cover.
        if let Some(g) = self.groups.get(self.last_group) {
            for &h in read.hashes.iter().take(AHEAD) {
                g.blocks.prefetch(h);
            }
        }
        for at in &read.evs {
            let ev = at.at(b);
            match ev.kind {
                STORED => self.store(b, &ev, &read.hashes, read.windows),
                REMOVED => self.remove(b, &ev, &read.hashes),
                CLEARED => self.clear(),
                _ => unreachable!(),
            }
        }
        (read.n_events, read.hashes.len())
    }
}

/// An event as read, by offsets into its payload, so that a [`Read`] outlives the borrow.
struct EvAt {
    kind: u8,
    medium: Option<std::ops::Range<usize>>,
    spec: Option<std::ops::Range<usize>>,
    group: Option<Hash>,
    window: Option<Hash>,
    block_size: Option<Hash>,
    root: bool,
    hashes: std::ops::Range<usize>,
    raw: std::ops::Range<usize>,
    n_events: u32,
}

fn range_in(b: &[u8], s: &[u8]) -> std::ops::Range<usize> {
    let start = s.as_ptr() as usize - b.as_ptr() as usize;
    start..start + s.len()
}

impl EvAt {
    fn at<'b>(&self, b: &'b [u8]) -> Ev<'b> {
        Ev {
            kind: self.kind,
            attrs: Attrs {
                medium: self.medium.clone().map(|r| &b[r]),
                group: self.group,
                spec: self.spec.clone().map(|r| &b[r]),
                window: self.window,
                block_size: self.block_size,
                root: self.root,
                hashes_at: 0,
            },
            hashes: self.hashes.clone(),
            raw: self.raw.clone(),
            n_events: self.n_events,
        }
    }
}

/// A vLLM-shaped msgpack batch read whole and checked against the schema (as `scan` checks it),
/// not yet applied: what a subscriber reads on arrival and applies to its view in seq order.
#[derive(Default)]
struct Read {
    ts: f64,
    rank: Option<Hash>,
    n_events: usize,
    evs: Vec<EvAt>,
    hashes: Vec<Hash>,
    /// The batch names a window or mamba group (the re-announce exception reads it).
    windows: bool,
}

/// Reads a whole batch, or `None` when the payload is not one in vLLM 0.33's shape.
fn read(b: &[u8]) -> Option<Read> {
    let mut out = Read::default();
    read_into(b, &mut out)?;
    Some(out)
}

/// [`read`] into `out`, whose vectors' room is reused: the relay's view reads every payload into
/// the same one (their allocation, growth and freeing per payload were a tenth of its reading).
/// `out` is left partly filled when this answers `None`.
fn read_into(b: &[u8], out: &mut Read) -> Option<()> {
    read_into_with(b, out, true)
}

/// `read_into`, comparing one-block removes with the last one read in full when `templates`
/// (the tests read each payload both ways).
fn read_into_with(b: &[u8], out: &mut Read, templates: bool) -> Option<()> {
    let mut r = Reader { b, p: 0 };
    let (len, ts) = r.batch_head()?;
    // Bounded by the bytes left: the count sizes an allocation.
    let n_events = r.bounded_array_len()?;
    let Read { hashes, evs, .. } = out;
    hashes.clear();
    evs.clear();
    evs.reserve(n_events);
    let mut windows = false;
    let mut tmpl: Option<Template> = None;
    // Whether the template's group is one a run of removes may be merged under (as checked below).
    let mut tmpl_runs = false;
    // Whether the last event read was the template's own or one like it: `evs`' last entry then
    // ends with its hash.
    let mut after_tmpl = false;
    for _ in 0..n_events {
        let (h0, p0) = (hashes.len(), r.p);
        // vLLM's one-block removes differ in their hash alone: one such read in full is the
        // template the next are compared with, bytes against bytes, not read field by field.
        let (kind, a) = match tmpl.as_ref().and_then(|t| Some((t, r.like(t, hashes)?))) {
            Some((t, q)) => {
                // After the template's own event or another like it, this one has their medium
                // and group (the same bytes): the merge's checks below would pass, or fail, as
                // they did for the one before.
                if after_tmpl && tmpl_runs {
                    let last = evs.last_mut().expect("the event before was pushed");
                    last.hashes.end = hashes.len();
                    last.n_events += 1;
                    continue;
                }
                after_tmpl = true;
                (REMOVED, t.attrs_at(b, q))
            }
            None => {
                let (kind, a) = r.event(hashes)?;
                after_tmpl = false;
                if templates && kind == REMOVED && hashes.len() - h0 == 1 {
                    if let Some(t) = Template::of(b, p0, r.p, a) {
                        tmpl_runs = group_runs(a.group);
                        after_tmpl = true;
                        tmpl = Some(t);
                    }
                }
                (kind, a)
            }
        };
        if hashes.len() - h0 >= MAX_EVENT_BLOCKS {
            return None;
        }
        if kind == STORED {
            windows |= a.spec.is_some_and(|s| {
                KINDS
                    .iter()
                    .position(|k| *k == s)
                    .is_some_and(|k| is_hybrid(k as u8))
            });
        }
        // A remove of the same `(medium, group)` as the event before (vLLM sends one block per
        // BlockRemoved): applied as one, the group found once for the run, not once per block.
        // Only a valid group: a bad one is counted per event.
        if let Some(last) = evs.last_mut().filter(|last| {
            kind == REMOVED
                && last.kind == REMOVED
                && last.hashes.end == h0
                && last.group.map(|g| int_of(Some(g))) == a.group.map(|g| int_of(Some(g)))
                && group_runs(a.group)
                && last.medium.clone().map(|m| &b[m]) == a.medium
        }) {
            last.hashes.end = hashes.len();
            last.n_events += 1;
            continue;
        }
        evs.push(EvAt {
            kind,
            medium: a.medium.map(|m| range_in(b, m)),
            spec: a.spec.map(|m| range_in(b, m)),
            group: a.group,
            window: a.window,
            block_size: a.block_size,
            root: a.root,
            hashes: h0..hashes.len(),
            raw: p0..r.p,
            n_events: 1,
        });
    }
    out.rank = r.batch_tail(len)?;
    out.ts = ts;
    out.n_events = n_events;
    out.windows = windows;
    Some(())
}

/// Whether removes of `group` may be applied as one run: a valid group (a bad one is counted per
/// event).
#[inline]
fn group_runs(group: Option<Hash>) -> bool {
    int_of(group).is_none_or(|g| (0..MAX_GROUPS).contains(&g))
        && (group.is_none() || int_of(group).is_some())
}

/// Reads a whole payload, with the GIL released for a large one.
fn read_detached(py: Python<'_>, b: &[u8]) -> Option<Read> {
    if b.len() >= DETACH_MIN_BYTES {
        py.detach(|| read(b))
    } else {
        read(b)
    }
}

/// A msgpack ``KVEventBatch`` in vLLM 0.33's shape, read whole and checked (as
/// ``scan_batch_msgpack`` checks it) but not applied: ``ResidencyView.apply_read`` applies it
/// without reading the bytes again. What a subscriber reads on arrival (``read_batch``).
#[pyclass(module = "kvbridge._native", frozen)]
pub struct ReadBatch {
    payload: Py<PyBytes>,
    read: Read,
}

#[pymethods]
impl ReadBatch {
    #[getter]
    fn ts(&self) -> f64 {
        self.read.ts
    }

    /// ``data_parallel_rank``.
    #[getter]
    fn rank(&self) -> Option<i128> {
        int_of(self.read.rank)
    }

    #[getter]
    fn n_events(&self) -> usize {
        self.read.n_events
    }

    /// Block hashes stored and removed.
    #[getter]
    fn n_blocks(&self) -> usize {
        self.read.hashes.len()
    }
}

/// Reads a payload for a view, or ``None`` for any payload ``scan_batch_msgpack`` would not read.
#[pyfunction]
fn read_batch(py: Python<'_>, payload: Bound<'_, PyBytes>) -> Option<ReadBatch> {
    let read = read_detached(py, payload.as_bytes())?;
    Some(ReadBatch {
        payload: payload.unbind(),
        read,
    })
}

fn medium_obj<'py>(py: Python<'py>, m: &Option<Box<str>>) -> Bound<'py, PyAny> {
    match m {
        Some(m) => PyString::new(py, m).into_any(),
        None => py.None().into_bound(py),
    }
}

/// What the relay's view holds, kept from payload bytes (module doc). The reading side is
/// `kvbridge.wire.residency.Residency`'s: ``held``, ``kinds``, ``stats``, ``counts()``,
/// ``blocks()``, ``==``.
#[pyclass(module = "kvbridge._native")]
pub struct ResidencyView {
    view: View,
    /// What `apply` reads each payload into (`read_into`).
    scratch: Read,
}

#[pymethods]
impl ResidencyView {
    /// ``sources=False``: a hash-only view, which keeps no event bytes (``sources()`` refuses).
    #[new]
    #[pyo3(signature = (sources = true))]
    fn new(sources: bool) -> Self {
        ResidencyView {
            view: View {
                keep_sources: sources,
                ..View::default()
            },
            scratch: Read::default(),
        }
    }

    /// Whether each copy keeps the bytes of its source event (``ResidencyView(sources=...)``).
    #[getter]
    fn keeps_sources(&self) -> bool {
        self.view.keep_sources
    }

    /// Applies a msgpack ``KVEventBatch`` in vLLM 0.33's shape whole, returning ``(events,
    /// block hashes)``; ``None`` (nothing applied) for any payload ``scan_batch_msgpack`` would
    /// not read either.
    fn apply(&mut self, py: Python<'_>, payload: &Bound<'_, PyBytes>) -> Option<(usize, usize)> {
        let b = payload.as_bytes();
        let ResidencyView { view, scratch } = self;
        let mut apply = || read_into(b, scratch).map(|()| view.apply_read(b, scratch));
        if b.len() >= DETACH_MIN_BYTES {
            py.detach(apply)
        } else {
            apply()
        }
    }

    /// Applies a batch ``read_batch`` read (its bytes are not read again), returning ``(events,
    /// block hashes)``. With the GIL held throughout (the reading, the long part, was done with it
    /// released): a thread reading a subscriber's views never finds one mid-change.
    fn apply_read(&mut self, py: Python<'_>, batch: &Bound<'_, ReadBatch>) -> (usize, usize) {
        let batch = batch.get();
        self.view
            .apply_read(batch.payload.bind(py).as_bytes(), &batch.read)
    }

    /// Forgets every block, kind and size, as an ``AllBlocksCleared`` does (the counters stay).
    fn clear(&mut self) {
        self.view.clear();
    }

    /// ``{(medium, group): {hash: copies}}``, built on each call.
    #[getter]
    fn held<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for g in &self.view.groups {
            let d = PyDict::new(py);
            for (k, e) in g.blocks.iter() {
                d.set_item(k.to_object(py)?, 1 + g.blocks.more_of(&k, e).len())?;
            }
            out.set_item((medium_obj(py, &g.medium), g.group), d)?;
        }
        Ok(out)
    }

    /// ``{group: (kind, window or None)}``.
    #[getter]
    fn kinds<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for &(g, k, w) in &self.view.kinds {
            let kind = PyString::new(py, std::str::from_utf8(KINDS[k as usize]).unwrap());
            out.set_item(g, (kind, w))?;
        }
        Ok(out)
    }

    /// ``{group: largest block_size}`` of the stores the rule did not skip, since the last clear.
    #[getter]
    fn sizes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for &(g, size) in &self.view.sizes {
            out.set_item(g, size)?;
        }
        Ok(out)
    }

    /// The skipped and unknown counts, named as `Residency.stats` names them.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.view.stats;
        let out = PyDict::new(py);
        out.set_item("bad_groups", s.bad_groups)?;
        out.set_item("bad_windows", s.bad_windows)?;
        out.set_item("unknown_kinds", s.unknown_kinds)?;
        out.set_item("unscored_group_events", s.unscored_group_events)?;
        out.set_item("unknown_removes", s.unknown_removes)?;
        Ok(out)
    }

    /// How many blocks each ``(medium, group)`` holds (a block with copies once).
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for g in &self.view.groups {
            out.set_item((medium_obj(py, &g.medium), g.group), g.blocks.len())?;
        }
        Ok(out)
    }

    /// Every hash held in some medium and group.
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySet>> {
        let out = PySet::empty(py)?;
        for g in &self.view.groups {
            for (k, _) in g.blocks.iter() {
                out.add(k.to_object(py)?)?;
            }
        }
        Ok(out)
    }

    /// Blocks held, counted once per ``(medium, group)`` that holds them.
    fn __len__(&self) -> usize {
        self.view.groups.iter().map(|g| g.blocks.len()).sum()
    }

    /// ``(groups, sources)`` for a snapshot: ``groups`` lists ``(medium, group, blocks)`` in the
    /// order the ``(medium, group)`` first held a block, ``blocks`` each held ``(hash, copies)``
    /// in the order the block came, ``copies`` ``[(source, index), ...]`` oldest first;
    /// ``sources`` maps each source to the msgpack bytes of the ``BlockStored`` it is.
    /// A hash-only view (``sources=False``) has none: ValueError.
    fn sources<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyDict>)> {
        if !self.view.keep_sources {
            return Err(PyValueError::new_err(
                "a hash-only ResidencyView (sources=False) keeps no source events: no sources() to give",
            ));
        }
        let groups = PyList::empty(py);
        let raws = PyDict::new(py);
        for g in &self.view.groups {
            let mut entries: Vec<(Key, Entry)> = g.blocks.iter().collect();
            let seq = |src: u32| {
                self.view.sources[src as usize]
                    .as_ref()
                    .expect("a copy's source is alive")
                    .seq
            };
            entries.sort_unstable_by_key(|(_, e)| (seq(e.first().0), e.first().1));
            let blocks = PyList::empty(py);
            for (k, e) in entries {
                let copies = PyList::empty(py);
                for &(src, i) in std::iter::once(&e.first()).chain(g.blocks.more_of(&k, e)) {
                    if !raws.contains(src)? {
                        let s = self.view.sources[src as usize]
                            .as_ref()
                            .expect("a copy's source is alive");
                        raws.set_item(src, PyBytes::new(py, &s.raw))?;
                    }
                    copies.append((src, i))?;
                }
                blocks.append((k.to_object(py)?, copies))?;
            }
            groups.append((medium_obj(py, &g.medium), g.group, blocks))?;
        }
        Ok((groups, raws))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        let Ok(other) = other.cast::<ResidencyView>() else {
            return false;
        };
        let (a, b) = (&self.view, &other.borrow().view);
        let mut ka = a.kinds.clone();
        let mut kb = b.kinds.clone();
        ka.sort_unstable();
        kb.sort_unstable();
        ka == kb
            && a.groups.len() == b.groups.len()
            && a.groups.iter().all(|g| {
                let Some(at) = b.find(g.medium.as_deref().map(str::as_bytes), g.group) else {
                    return false;
                };
                let h = &b.groups[at].blocks;
                h.len() == g.blocks.len()
                    && g.blocks.iter().all(|(k, e)| {
                        h.get(&k).is_some_and(|&f| {
                            b.groups[at].blocks.more_of(&k, f).len()
                                == g.blocks.more_of(&k, e).len()
                        })
                    })
            })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "ResidencyView(held={}, kinds={})",
            self.held(py)?.repr()?,
            self.kinds(py)?.repr()?
        ))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ResidencyView>()?;
    m.add_class::<ReadBatch>()?;
    m.add_function(wrap_pyfunction!(read_batch, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_key(h: &Hash) -> (u8, u64, u64) {
        match *h {
            Hash::U(v) => (0, v, 0),
            Hash::I(v) => (1, v as u64, 0),
            Hash::B(a, z) => (2, a as u64, z as u64),
        }
    }

    type Summary = (
        Vec<(u8, u64, u64)>,
        Vec<String>,
        usize,
        Option<(u8, u64, u64)>,
    );

    fn summary(b: &[u8], templates: bool) -> Option<Summary> {
        let mut out = Read::default();
        read_into_with(b, &mut out, templates)?;
        let evs = out.evs.iter().map(|e| {
            let g = e.group.as_ref().map(hash_key);
            format!(
                "{} {:?} {:?} {:?} {:?} {:?} {}",
                e.kind, e.medium, e.spec, g, e.hashes, e.raw, e.n_events
            )
        });
        Some((
            out.hashes.iter().map(hash_key).collect(),
            evs.collect(),
            out.n_events,
            out.rank.as_ref().map(hash_key),
        ))
    }

    #[test]
    fn size_classes_fit_within_an_eighth_and_spares_are_reused_and_bounded() {
        let mut last = (0, 0);
        for n in 1..70_000usize {
            let (class, cap) = size_class(n);
            assert!(cap >= n && cap - n <= n / 8, "{n} -> {cap}");
            assert!(
                class >= last.0 && (class == last.0) == (cap == last.1),
                "{n}: classes in size order"
            );
            last = (class, cap);
        }
        let mut spare = Spare::default();
        let mut buf = spare.take(1000);
        buf.extend_from_slice(&[7; 1000]);
        let at = buf.as_ptr();
        spare.give(buf);
        assert_eq!(spare.bytes, 1024);
        let again = spare.take(980); // the same class: the same buffer, emptied
        assert!(again.is_empty() && again.as_ptr() == at && again.capacity() == 1024);
        assert_eq!(spare.bytes, 0);
        for _ in 0..SPARE_PER_CLASS + 5 {
            let mut b = spare.take(100);
            b.extend_from_slice(&[1; 100]);
            let mut c = Vec::with_capacity(size_class(100).1);
            c.extend_from_slice(&[1; 100]);
            spare.give(b);
            spare.give(c);
        }
        assert_eq!(spare.by_class[size_class(100).0].len(), SPARE_PER_CLASS);
        let mut big = Vec::with_capacity(size_class(SPARE_BYTES).1);
        big.extend_from_slice(&vec![0; SPARE_BYTES]);
        spare.give(big); // over the byte bound: dropped
        assert!(spare.bytes <= SPARE_BYTES);
    }

    #[test]
    fn removes_read_by_template_as_in_full() {
        // Runs of one-block removes, the hash in every width (and a bad marker), other media,
        // groups present or not (a bad one), two hashes now and then, and a byte changed at
        // random in some payloads: read both ways, the same events or the same refusal.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut read, mut refused, mut like) = (0, 0, 0);
        for round in 0..3000 {
            let n = (next() % 12) as usize;
            let mut b = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90 | n as u8];
            for _ in 0..n {
                let group = next() % 6;
                b.push(0x80 | if group < 3 { 4 } else { 3 });
                b.extend_from_slice(b"\xa4type\xacBlockRemoved\xacblock_hashes");
                let two = next() % 10 == 0;
                b.push(if two { 0x92 } else { 0x91 });
                for _ in 0..if two { 2 } else { 1 } {
                    match next() % 12 {
                        0 => b.push(0x07),
                        1 => b.extend_from_slice(&[0xcd, 1, 2]),
                        2 => b.extend_from_slice(&[0xc4, 3, 9, 9, 9]),
                        3 => b.push(0xc1),
                        _ => {
                            b.push(0xcf);
                            b.extend_from_slice(&next().to_be_bytes());
                        }
                    }
                }
                b.extend_from_slice(b"\xa6medium");
                match next() % 8 {
                    0 => b.extend_from_slice(b"\xa3CPU"),
                    1 => b.push(0xc0),
                    _ => b.extend_from_slice(b"\xa3GPU"),
                }
                if group < 3 {
                    b.extend_from_slice(b"\xa9group_idx");
                    b.push([0u8, 1, 0x46][group as usize]);
                }
            }
            b.push(0xc0);
            if round % 4 == 0 && b.len() > 11 {
                let at = 11 + (next() as usize) % (b.len() - 11);
                b[at] = next() as u8;
            }
            let got = summary(&b, true);
            assert_eq!(got, summary(&b, false), "{b:02x?}");
            match got {
                Some(_) => {
                    read += 1;
                    like += usize::from(n > 1);
                }
                None => refused += 1,
            }
        }
        assert!(
            read > 500 && refused > 300 && like > 300,
            "{read} {refused} {like}"
        );
    }

    #[test]
    fn a_template_takes_a_hash_of_its_width_in_any_form() {
        // `like` reads the hash where the template's was and needs it to end where that one
        // did: hashes of one width in every form (uint, int either sign, bytes, and what is not
        // a hash: a float, nil, a bool, a shorter hash and bytes of the template's after it), so
        // a run's template meets each of the others.
        let forms: [[&[u8]; 5]; 4] = [
            [
                &[0xcf, 1, 2, 3, 4, 5, 6, 7, 8],
                &[0xd3, 0xff, 2, 3, 4, 5, 6, 7, 8],
                &[0xd3, 0, 2, 3, 4, 5, 6, 7, 8],
                &[0xc4, 7, 1, 2, 3, 4, 5, 6, 7],
                &[0x07, 1, 2, 3, 4, 5, 6, 7, 8],
            ],
            [
                &[0xce, 1, 2, 3, 4],
                &[0xd2, 0xff, 2, 3, 4],
                &[0xc4, 3, 1, 2, 3],
                &[0xca, 1, 2, 3, 4],
                &[0xcc, 1, 2, 3, 4],
            ],
            [
                &[0xcd, 1, 2],
                &[0xd1, 0xff, 2],
                &[0xc4, 1, 1],
                &[0xd1, 0, 2],
                &[0x07, 1, 2],
            ],
            [&[0x07], &[0xff], &[0xc0], &[0xc2], &[0x05]],
        ];
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut read, mut refused) = (0, 0);
        for _ in 0..4000 {
            let n = (next() % 8) as usize;
            let width = &forms[(next() % 4) as usize];
            let mut b = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90 | n as u8];
            for _ in 0..n {
                b.extend_from_slice(b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91");
                b.extend_from_slice(width[(next() % 5) as usize]);
                b.extend_from_slice(b"\xa6medium\xd9\x03GPU");
            }
            b.push(0xc0);
            let got = summary(&b, true);
            assert_eq!(got, summary(&b, false), "{b:02x?}");
            if got.is_some() {
                read += 1;
            } else {
                refused += 1;
            }
        }
        assert!(read > 1000 && refused > 1000, "{read} {refused}");
    }
}
