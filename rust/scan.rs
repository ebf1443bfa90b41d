//! A hash-only reading of a msgpack `KVEventBatch`, for consumers that keep views of block hashes.
//!
//! A full decode builds a Python int for every token id (16 per block), which is most of what a
//! subscriber spends; a view needs only the block hashes, in order, per event kind, and the few
//! fields its rule reads (kvbridge.wire.residency: medium, group_idx, spec kind and window, whether
//! a store's parent is None), once per run of events that agree on them. This reader
//! walks the bytes once, validates the whole payload against the schema msgspec decodes with
//! (`kvbridge.wire.events`), and only then builds Python objects: the ops and the counts.
//!
//! The contract with the Python side: when this returns a result, `decode_batch` on the same
//! bytes succeeds and yields the same ts, rank, event count and hashes. So it accepts only vLLM
//! 0.33's shape, written the way msgspec and vLLM write it (tag first, known fields, no
//! duplicates, valid UTF-8, no ext types), and answers `None` for anything else -- older
//! positional events, SGLang fields, JSON, garbage -- which the caller then decodes in full.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::index::parse::{eq_bytes, fast_skip};

/// Deeper `Any` values than this (inside extra_keys / metadata) are left to msgspec.
const MAX_DEPTH: u32 = 32;

pub(crate) const STORED: u8 = 0;
pub(crate) const REMOVED: u8 = 1;
pub(crate) const CLEARED: u8 = 2;

#[derive(Clone, Copy)]
pub(crate) enum Hash {
    U(u64),
    I(i64),
    B(usize, usize),
}

#[derive(Clone, Copy)]
enum Ty {
    Hashes,
    OptHash,
    Ints,
    Int,
    OptInt,
    OptStr,
    OptExtraKeys,
    OptIntLists,
    OptMetadata,
}

/// A field of an event: its key as msgspec writes it (fixstr header, then the name), its type,
/// whether it is required, and the attribute slot a view's rule reads it into. Order matches the
/// Struct definitions; bit i of `seen` is field i.
struct Field {
    key: &'static [u8],
    ty: Ty,
    required: bool,
    slot: Option<Slot>,
}

const fn f(key: &'static [u8], ty: Ty, required: bool, slot: Option<Slot>) -> Field {
    Field {
        key,
        ty,
        required,
        slot,
    }
}

const STORED_FIELDS: &[Field] = &[
    f(b"\xacblock_hashes", Ty::Hashes, true, None),
    f(
        b"\xb1parent_block_hash",
        Ty::OptHash,
        true,
        Some(Slot::Parent),
    ),
    f(b"\xa9token_ids", Ty::Ints, true, None),
    f(b"\xaablock_size", Ty::Int, true, Some(Slot::BlockSize)),
    f(b"\xa7lora_id", Ty::OptInt, true, None),
    f(b"\xa6medium", Ty::OptStr, true, Some(Slot::Medium)),
    f(b"\xa9lora_name", Ty::OptStr, true, None),
    f(b"\xaaextra_keys", Ty::OptExtraKeys, false, None),
    f(b"\xa9group_idx", Ty::OptInt, false, Some(Slot::Group)),
    f(
        b"\xb2kv_cache_spec_kind",
        Ty::OptStr,
        false,
        Some(Slot::Spec),
    ),
    f(
        b"\xbckv_cache_spec_sliding_window",
        Ty::OptInt,
        false,
        Some(Slot::Window),
    ),
    f(b"\xa8locality", Ty::OptStr, false, None),
    f(b"\xa9ownership", Ty::OptStr, false, None),
    f(b"\xaasession_id", Ty::OptStr, false, None),
    f(b"\xb3lookahead_token_ids", Ty::OptIntLists, false, None),
    f(b"\xa8metadata", Ty::OptMetadata, false, None),
];
/// The bits of `fields`' required fields, for one test of `seen` per event.
const fn required(fields: &[Field]) -> u32 {
    let mut mask = 0;
    let mut i = 0;
    while i < fields.len() {
        if fields[i].required {
            mask |= 1 << i;
        }
        i += 1;
    }
    mask
}
const STORED_REQUIRED: u32 = required(STORED_FIELDS);
const REMOVED_REQUIRED: u32 = required(REMOVED_FIELDS);

const REMOVED_FIELDS: &[Field] = &[
    f(b"\xacblock_hashes", Ty::Hashes, true, None),
    f(b"\xa6medium", Ty::OptStr, true, Some(Slot::Medium)),
    f(b"\xa9group_idx", Ty::OptInt, false, Some(Slot::Group)),
    f(b"\xa8locality", Ty::OptStr, false, None),
    f(b"\xa9ownership", Ty::OptStr, false, None),
];

pub(crate) struct Reader<'a> {
    pub(crate) b: &'a [u8],
    pub(crate) p: usize,
}

/// `None` everywhere below means "not the fast shape": the caller falls back to a full decode.
impl<'a> Reader<'a> {
    #[inline]
    pub(crate) fn byte(&mut self) -> Option<u8> {
        let v = *self.b.get(self.p)?;
        self.p += 1;
        Some(v)
    }

    #[inline]
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.p.checked_add(n)?;
        let s = self.b.get(self.p..end)?;
        self.p = end;
        Some(s)
    }

    #[inline]
    pub(crate) fn be(&mut self, n: usize) -> Option<u64> {
        let s = self.take(n)?;
        Some(match n {
            8 => u64::from_be_bytes(s.try_into().unwrap()),
            4 => u32::from_be_bytes(s.try_into().unwrap()) as u64,
            _ => s.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64),
        })
    }

    #[inline]
    pub(crate) fn peek(&self) -> Option<u8> {
        self.b.get(self.p).copied()
    }

    pub(crate) fn nil(&mut self) -> bool {
        if self.peek() == Some(0xc0) {
            self.p += 1;
            true
        } else {
            false
        }
    }

    #[inline]
    pub(crate) fn array_len(&mut self) -> Option<usize> {
        match self.byte()? {
            m @ 0x90..=0x9f => Some((m & 0x0f) as usize),
            0xdc => Some(self.be(2)? as usize),
            0xdd => Some(self.be(4)? as usize),
            _ => None,
        }
    }

    /// An array header whose items (each at least a byte) can all be in what is left: a length
    /// beyond the payload is garbage, refused before anything is reserved for it.
    #[inline]
    pub(crate) fn bounded_array_len(&mut self) -> Option<usize> {
        let n = self.array_len()?;
        (n <= self.b.len() - self.p).then_some(n)
    }

    #[inline]
    pub(crate) fn map_len(&mut self) -> Option<usize> {
        match self.byte()? {
            m @ 0x80..=0x8f => Some((m & 0x0f) as usize),
            0xde => Some(self.be(2)? as usize),
            0xdf => Some(self.be(4)? as usize),
            _ => None,
        }
    }

    /// A str, UTF-8 checked (msgspec rejects invalid UTF-8).
    #[inline]
    pub(crate) fn str(&mut self) -> Option<&'a [u8]> {
        let s = self.raw_str()?;
        if !s.is_ascii() {
            std::str::from_utf8(s).ok()?;
        }
        Some(s)
    }

    /// A str's bytes, unchecked: for keys, which must equal a known ASCII name anyway.
    #[inline]
    pub(crate) fn raw_str(&mut self) -> Option<&'a [u8]> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => return None,
        };
        self.take(n)
    }

    #[inline]
    pub(crate) fn int(&mut self) -> Option<Hash> {
        Some(match self.byte()? {
            m @ 0x00..=0x7f => Hash::U(m as u64),
            m @ 0xe0..=0xff => Hash::I(m as i8 as i64),
            0xcc => Hash::U(self.be(1)?),
            0xcd => Hash::U(self.be(2)?),
            0xce => Hash::U(self.be(4)?),
            0xcf => Hash::U(self.be(8)?),
            0xd0 => Hash::I(self.be(1)? as u8 as i8 as i64),
            0xd1 => Hash::I(self.be(2)? as u16 as i16 as i64),
            0xd2 => Hash::I(self.be(4)? as u32 as i32 as i64),
            0xd3 => Hash::I(self.be(8)? as i64),
            _ => return None,
        })
    }

    /// `int | bytes` (ExternalBlockHash). Inlined: a payload has one per block.
    #[inline(always)]
    pub(crate) fn hash(&mut self) -> Option<Hash> {
        // What every engine writes for a 64-bit hash past 2**63, a uint64: read in one go.
        if let Some(&[0xcf, ref v @ ..]) = self.b.get(self.p..self.p + 9) {
            self.p += 9;
            return Some(Hash::U(u64::from_be_bytes(v.try_into().unwrap())));
        }
        let n = match self.peek()? {
            0xc4 => {
                self.p += 1;
                self.be(1)? as usize
            }
            0xc5 => {
                self.p += 1;
                self.be(2)? as usize
            }
            0xc6 => {
                self.p += 1;
                self.be(4)? as usize
            }
            _ => return self.int(),
        };
        let start = self.p;
        self.take(n)?;
        Some(Hash::B(start, start + n))
    }

    /// Any msgpack value msgspec decodes into a plain Python object without question.
    pub(crate) fn any(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            0xc0 | 0xc2 | 0xc3 => self.p += 1,
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => {
                self.int()?;
            }
            0xca => {
                self.take(5)?;
            }
            0xcb => {
                self.take(9)?;
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                self.str()?;
            }
            0xc4..=0xc6 => {
                self.hash()?;
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                for _ in 0..self.array_len()? {
                    self.any(depth + 1)?;
                }
            }
            0x80..=0x8f | 0xde | 0xdf => self.str_map(depth)?,
            _ => return None, // ext types, 0xc1
        }
        Some(())
    }

    /// A map with str keys (hashable for certain, so msgspec builds a dict from it).
    pub(crate) fn str_map(&mut self, depth: u32) -> Option<()> {
        for _ in 0..self.map_len()? {
            self.str()?;
            self.any(depth + 1)?;
        }
        Some(())
    }

    /// A list of ints (token ids): just each marker and its width; this loop is most of the bytes.
    /// The widths token ids come in (fixint, uint16, uint32 mixed at random) go through the
    /// index's table-driven skipper first: a branch per token on the width mispredicts about
    /// every other token. What it leaves (other widths, the payload's last bytes) is read here.
    fn ints(&mut self) -> Option<()> {
        let n = self.array_len()?;
        let (done, p) = fast_skip(self.b, self.p, n);
        self.p = p;
        for _ in done..n {
            match self.byte()? {
                0x00..=0x7f | 0xe0..=0xff => {}
                0xcc | 0xd0 => self.p += 1,
                0xcd | 0xd1 => self.p += 2,
                0xce | 0xd2 => self.p += 4,
                0xcf | 0xd3 => self.p += 8,
                _ => return None,
            }
        }
        if self.p > self.b.len() {
            return None;
        }
        Some(())
    }

    fn value(&mut self, ty: Ty, hashes: &mut Vec<Hash>) -> Option<()> {
        match ty {
            Ty::Hashes => {
                // Bounded by the bytes left (a hash takes one at least): a count from the payload
                // must not size an allocation (2**32 claimed in 37 bytes aborted the process).
                let n = self.bounded_array_len()?;
                hashes.reserve(n);
                for _ in 0..n {
                    let h = self.hash()?;
                    hashes.push(h);
                }
            }
            Ty::OptHash => {
                if !self.nil() {
                    self.hash()?;
                }
            }
            Ty::Ints => self.ints()?,
            Ty::Int => {
                self.int()?;
            }
            Ty::OptInt => {
                if !self.nil() {
                    self.int()?;
                }
            }
            Ty::OptStr => {
                if !self.nil() {
                    self.str()?;
                }
            }
            Ty::OptExtraKeys => {
                if !self.nil() {
                    for _ in 0..self.array_len()? {
                        if !self.nil() {
                            // tuple[Any, ...]
                            for _ in 0..self.array_len()? {
                                self.any(1)?;
                            }
                        }
                    }
                }
            }
            Ty::OptIntLists => {
                if !self.nil() {
                    for _ in 0..self.array_len()? {
                        self.ints()?;
                    }
                }
            }
            Ty::OptMetadata => {
                if !self.nil() {
                    self.str_map(0)?;
                }
            }
        }
        Some(())
    }

    /// A `KVEventBatch`'s head, `[ts, events, rank?]`: its length (2 or 3) and `ts` (a float
    /// of either width); the events are next.
    pub(crate) fn batch_head(&mut self) -> Option<(usize, f64)> {
        let len = self.array_len()?;
        if !(2..=3).contains(&len) {
            return None;
        }
        let ts = match self.byte()? {
            0xcb => f64::from_bits(self.be(8)?),
            0xca => f32::from_bits(self.be(4)? as u32) as f64,
            _ => return None,
        };
        Some((len, ts))
    }

    /// After the events: the rank of a batch of `len` fields, or `None` when the batch does not end
    /// there (msgspec rejects trailing bytes: so do the readers).
    pub(crate) fn batch_tail(&mut self, len: usize) -> Option<Option<Hash>> {
        let rank = if len == 3 && !self.nil() {
            Some(self.int()?)
        } else {
            None
        };
        (self.p == self.b.len()).then_some(rank)
    }

    /// Whether `key` (a fixstr key as msgspec writes it, header and name) is next: consumed if so.
    /// Word compares of the bytes as they are, where reading the str and comparing its name
    /// took a memcmp call per field, 15 times per `BlockStored`.
    #[inline(always)]
    fn skip_key(&mut self, key: &[u8]) -> bool {
        let hit = self
            .b
            .get(self.p..self.p + key.len())
            .is_some_and(|s| eq_bytes(s, key));
        if hit {
            self.p += key.len();
        }
        hit
    }

    /// One event; its hashes go to `hashes`. Returns its kind and what a view's rule reads of it.
    pub(crate) fn event(&mut self, hashes: &mut Vec<Hash>) -> Option<(u8, Attrs<'a>)> {
        let n = self.map_len()?;
        if n == 0 || !(self.skip_key(b"\xa4type") || self.raw_str()? == b"type") {
            return None;
        }
        let (kind, fields, required) = if self.skip_key(b"\xabBlockStored") {
            (STORED, STORED_FIELDS, STORED_REQUIRED)
        } else if self.skip_key(b"\xacBlockRemoved") {
            (REMOVED, REMOVED_FIELDS, REMOVED_REQUIRED)
        } else {
            match self.raw_str()? {
                b"BlockStored" => (STORED, STORED_FIELDS, STORED_REQUIRED),
                b"BlockRemoved" => (REMOVED, REMOVED_FIELDS, REMOVED_REQUIRED),
                b"AllBlocksCleared" => (CLEARED, &[][..], 0),
                _ => return None,
            }
        };
        let mut seen = 0u32;
        let mut next = 0;
        let mut a = Attrs {
            medium: None,
            group: None,
            spec: None,
            window: None,
            block_size: None,
            root: false,
            hashes_at: 0,
        };
        for _ in 1..n {
            // Writers emit fields in declaration order, as msgspec writes keys: try the next one
            // before reading the key and searching.
            let i = if fields.get(next).is_some_and(|f| self.skip_key(f.key)) {
                next
            } else {
                let key = self.raw_str()?;
                fields.iter().position(|f| &f.key[1..] == key)?
            };
            next = i + 1;
            if seen & (1 << i) != 0 {
                return None;
            }
            seen |= 1 << i;
            let f = &fields[i];
            // An attribute is read as `value` would check its type, once.
            match f.slot {
                None => {
                    if matches!(f.ty, Ty::Hashes) {
                        a.hashes_at = self.p;
                    }
                    self.value(f.ty, hashes)?
                }
                Some(Slot::Parent) => {
                    a.root = self.nil();
                    if !a.root {
                        self.hash()?;
                    }
                }
                Some(Slot::BlockSize) => a.block_size = Some(self.int()?),
                Some(Slot::Medium) => a.medium = self.opt_str()?,
                Some(Slot::Spec) => a.spec = self.opt_str()?,
                Some(Slot::Group) => a.group = self.opt_int()?,
                Some(Slot::Window) => a.window = self.opt_int()?,
            }
        }
        if seen & required != required {
            return None;
        }
        Some((kind, a))
    }

    /// The event at `self.p` when its bytes are `t`'s but for the one hash (read by `hash`, and
    /// of the same width): it reads as `t`'s did, every byte before and after the hash being the
    /// same, so its attributes are `t`'s, moved to this event ([`Template::attrs_at`] with the
    /// position answered). None (nothing read) otherwise.
    pub(crate) fn like(&mut self, t: &Template<'a>, hashes: &mut Vec<Hash>) -> Option<usize> {
        let q = self.p;
        let len = t.end - t.start;
        let (ev, was) = (self.b.get(q..q + len)?, &self.b[t.start..t.end]);
        if ev[..t.hash.start] != was[..t.hash.start] || ev[t.hash.end..] != was[t.hash.end..] {
            return None;
        }
        self.p = q + t.hash.start;
        match self.hash() {
            Some(h) if self.p == q + t.hash.end => {
                hashes.push(h);
                self.p = q + len;
                Some(q)
            }
            _ => {
                self.p = q;
                None
            }
        }
    }

    fn opt_str(&mut self) -> Option<Option<&'a [u8]>> {
        if self.nil() {
            Some(None)
        } else {
            self.str().map(Some)
        }
    }

    fn opt_int(&mut self) -> Option<Option<Hash>> {
        if self.nil() {
            Some(None)
        } else {
            self.int().map(Some)
        }
    }
}

/// The attributes a view's rule (kvbridge.wire.residency) reads: which `Attrs` field a field goes to.
#[derive(Clone, Copy)]
enum Slot {
    Parent,
    Medium,
    Group,
    Spec,
    Window,
    BlockSize,
}

/// A one-block `BlockRemoved` read in full (`b[start..end]`), its hash's bytes at `hash`
/// (relative to `start`): vLLM sends one per block, each the one before with another hash.
pub(crate) struct Template<'a> {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) hash: std::ops::Range<usize>,
    pub(crate) attrs: Attrs<'a>,
}

impl<'a> Template<'a> {
    /// `b[start..end]`, read by `event` into `attrs` with one hash: a template when it is a
    /// remove with neither a spec nor a window (their slices or values are not moved by `like`)
    /// and its hashes an array of one.
    pub(crate) fn of(b: &'a [u8], start: usize, end: usize, attrs: Attrs<'a>) -> Option<Self> {
        let at = attrs.hashes_at;
        if at < start || b.get(at) != Some(&0x91) || attrs.spec.is_some() || attrs.window.is_some()
        {
            return None;
        }
        let mut r = Reader { b, p: at + 1 };
        r.hash()?;
        (r.p <= end).then(|| Template {
            start,
            end,
            hash: at + 1 - start..r.p - start,
            attrs,
        })
    }

    /// The attributes of an event `like` matched at `q` in `b` (the template's payload): the
    /// template's, its medium's slice moved by as much as the event is. Apart from `like`: a remove
    /// that joins the run before has no use for them (most of vLLM's).
    pub(crate) fn attrs_at(&self, b: &'a [u8], q: usize) -> Attrs<'a> {
        let mut a = self.attrs;
        a.medium = a.medium.map(|m| {
            let at = m.as_ptr() as usize - b.as_ptr() as usize + (q - self.start);
            &b[at..at + m.len()]
        });
        a.hashes_at += q - self.start;
        a
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Attrs<'a> {
    pub(crate) medium: Option<&'a [u8]>,
    pub(crate) group: Option<Hash>,
    pub(crate) spec: Option<&'a [u8]>,
    pub(crate) window: Option<Hash>,
    /// A store's `block_size` (the relay's view keeps each group's largest).
    pub(crate) block_size: Option<Hash>,
    /// A store with parent None: the re-announce rule looks at it alone.
    pub(crate) root: bool,
    /// Where the `block_hashes` value starts (0: no such field read).
    pub(crate) hashes_at: usize,
}

fn int_value(h: Option<Hash>) -> Option<i128> {
    match h? {
        Hash::U(v) => Some(v as i128),
        Hash::I(v) => Some(v as i128),
        Hash::B(..) => None,
    }
}

impl Attrs<'_> {
    /// Whether an event with these attributes extends an op that began with `self`'s.
    fn joins(&self, op: &Attrs<'_>) -> bool {
        !self.root
            && self.medium == op.medium
            && self.spec == op.spec
            && int_value(self.group) == int_value(op.group)
            && int_value(self.window) == int_value(op.window)
    }
}

struct Op<'a> {
    kind: u8,
    /// End index into `Scan::hashes`.
    end: usize,
    attrs: Attrs<'a>,
    /// Leading hashes from a parent-None store (the first event's, when `attrs.root`).
    root: usize,
    n_events: usize,
}

struct Scan<'a> {
    ts: f64,
    rank: Option<Hash>,
    n_events: usize,
    hashes: Vec<Hash>,
    /// Consecutive events of one kind and the same attributes merged into one op.
    ops: Vec<Op<'a>>,
}

fn scan(b: &[u8]) -> Option<Scan<'_>> {
    let mut r = Reader { b, p: 0 };
    let (len, ts) = r.batch_head()?;
    let n_events = r.array_len()?;
    let mut hashes = Vec::new();
    let mut ops: Vec<Op> = Vec::new();
    for _ in 0..n_events {
        let start = hashes.len();
        let (kind, attrs) = r.event(&mut hashes)?;
        match ops.last_mut() {
            Some(last) if last.kind == kind && attrs.joins(&last.attrs) => {
                last.end = hashes.len();
                last.n_events += 1;
            }
            _ => ops.push(Op {
                kind,
                end: hashes.len(),
                attrs,
                root: if attrs.root { hashes.len() - start } else { 0 },
                n_events: 1,
            }),
        }
    }
    let rank = r.batch_tail(len)?;
    Some(Scan {
        ts,
        rank,
        n_events,
        hashes,
        ops,
    })
}

fn hash_obj<'py>(py: Python<'py>, b: &[u8], h: Hash) -> PyResult<Bound<'py, PyAny>> {
    Ok(match h {
        Hash::U(v) => v.into_pyobject(py)?.into_any(),
        Hash::I(v) => v.into_pyobject(py)?.into_any(),
        Hash::B(s, e) => PyBytes::new(py, &b[s..e]).into_any(),
    })
}

fn opt_obj<'py>(py: Python<'py>, b: &[u8], h: Option<Hash>) -> PyResult<Bound<'py, PyAny>> {
    match h {
        Some(h) => hash_obj(py, b, h),
        None => Ok(py.None().into_bound(py)),
    }
}

fn opt_str<'py>(py: Python<'py>, s: Option<&[u8]>) -> Bound<'py, PyAny> {
    match s.and_then(|s| std::str::from_utf8(s).ok()) {
        Some(s) => PyString::new(py, s).into_any(),
        None => py.None().into_bound(py),
    }
}

/// `(ts, data_parallel_rank, n_events, n_blocks, ops)` for a vLLM-shaped msgpack batch, where
/// `ops` is a list of `(kind, hashes, medium, group_idx, root, spec_kind, window, n_events)` in
/// event order (kind 0 stored, 1 removed, 2 all cleared; consecutive events of one kind and the
/// same attributes merged, a parent-None store always starting an op: `root` is its length) --
/// or `None` when the payload needs a full decode. kvbridge.wire.residency.ops_of is the same
/// for decoded events.
#[pyfunction]
fn scan_batch_msgpack<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyBytes>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let b = payload.as_bytes();
    let Some(s) = scan(b) else {
        return Ok(None);
    };
    let ops = PyList::empty(py);
    let mut start = 0;
    for op in &s.ops {
        let list = PyList::empty(py);
        for &h in &s.hashes[start..op.end] {
            list.append(hash_obj(py, b, h)?)?;
        }
        let a = &op.attrs;
        let item = (
            op.kind,
            list,
            opt_str(py, a.medium),
            opt_obj(py, b, a.group)?,
            op.root,
            opt_str(py, a.spec),
            opt_obj(py, b, a.window)?,
            op.n_events,
        );
        ops.append(item)?;
        start = op.end;
    }
    let rank = opt_obj(py, b, s.rank)?;
    let out = (s.ts, rank, s.n_events, s.hashes.len(), ops).into_pyobject(py)?;
    Ok(Some(out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(scan_batch_msgpack, m)?)
}

#[cfg(test)]
mod tests {
    //! The shared `Reader` (also the index's parser): every form at its boundaries, and `None`,
    //! never a panic or a read past the end, for truncated or foreign input.
    use super::*;
    use crate::hash::testing::hex;

    fn reader(b: &[u8]) -> Reader<'_> {
        Reader { b, p: 0 }
    }

    /// Whether `read` accepts all of `bytes` exactly, and refuses every strict prefix of them.
    fn whole_and_truncated<T>(
        bytes: &[u8],
        read: impl Fn(&mut Reader<'_>) -> Option<T>,
    ) -> Option<T> {
        for cut in 0..bytes.len() {
            assert!(
                read(&mut reader(&bytes[..cut])).is_none(),
                "{:02x?} cut at {cut}",
                bytes
            );
        }
        let mut r = reader(bytes);
        let out = read(&mut r);
        assert_eq!(r.p, bytes.len(), "{bytes:02x?}");
        out
    }

    #[test]
    fn bytes_take_and_big_endian_stop_at_the_end() {
        let mut r = reader(&[1, 2, 3]);
        assert_eq!(r.peek(), Some(1));
        assert_eq!(r.byte(), Some(1));
        assert_eq!(r.take(3), None);
        assert_eq!(r.p, 1, "a refused take consumes nothing");
        assert_eq!(r.take(usize::MAX), None);
        assert_eq!(r.take(2), Some(&[2, 3][..]));
        assert_eq!((r.byte(), r.peek(), r.take(0)), (None, None, Some(&[][..])));
        for n in [1, 2, 3, 4, 8] {
            let b: Vec<u8> = (1..=n as u8).collect();
            let want = b.iter().fold(0u64, |acc, &x| acc << 8 | x as u64);
            assert_eq!(whole_and_truncated(&b, |r| r.be(n)), Some(want));
        }
    }

    #[test]
    fn a_batch_head_is_two_or_three_fields_and_a_float_of_either_width() {
        let mut r = reader(&[0x92, 0xca, 0x3f, 0xc0, 0, 0, 0x90]);
        assert_eq!(r.batch_head(), Some((2, 1.5)));
        assert_eq!(r.p, 6);
        let mut b = vec![0x93, 0xcb];
        b.extend(2.5f64.to_bits().to_be_bytes());
        assert_eq!(reader(&b).batch_head(), Some((3, 2.5)));
        assert_eq!(reader(&[0x94, 0xca, 0, 0, 0, 0]).batch_head(), None);
        assert_eq!(reader(&[0x92, 0x01]).batch_head(), None); // an int is no ts
    }

    #[test]
    fn a_batch_tail_reads_the_rank_and_refuses_trailing_bytes() {
        assert!(matches!(
            reader(&[0x07]).batch_tail(3),
            Some(Some(Hash::U(7)))
        ));
        assert!(matches!(reader(&[0xc0]).batch_tail(3), Some(None)));
        assert!(matches!(reader(&[]).batch_tail(2), Some(None)));
        assert!(reader(&[0x07]).batch_tail(2).is_none());
        assert!(reader(&[0x07, 0x00]).batch_tail(3).is_none());
    }

    #[test]
    fn nil_consumes_only_nil() {
        let mut r = reader(&[0xc0, 0xc2]);
        assert!(r.nil());
        assert!(!r.nil());
        assert_eq!(r.p, 1);
        assert!(!reader(&[]).nil());
    }

    #[test]
    fn array_and_map_lengths_in_every_form() {
        for (b, n) in [
            ("90", 0),
            ("9f", 15),
            ("dc0010", 16),
            ("dcffff", 0xffff),
            ("dd00010000", 0x1_0000),
            ("ddffffffff", 0xffff_ffff),
        ] {
            let b = hex(b);
            assert_eq!(whole_and_truncated(&b, |r| r.array_len()), Some(n));
            // The same forms, 0x10 lower for fixmap and 2 higher for map16/32.
            let mut m = b.clone();
            m[0] = if m[0] < 0xa0 { m[0] - 0x10 } else { m[0] + 2 };
            assert_eq!(whole_and_truncated(&m, |r| r.map_len()), Some(n));
            assert_eq!(reader(&m).array_len(), None);
            assert_eq!(reader(&b).map_len(), None);
        }
        for marker in [0x00, 0xa0, 0xc0, 0xc4, 0xd9] {
            assert_eq!(reader(&[marker, 0, 0, 0, 0]).array_len(), None);
            assert_eq!(reader(&[marker, 0, 0, 0, 0]).map_len(), None);
        }
    }

    #[test]
    fn bounded_array_length_fits_what_is_left() {
        assert_eq!(reader(&hex("93010203")).bounded_array_len(), Some(3));
        assert_eq!(reader(&hex("930102")).bounded_array_len(), None);
        assert_eq!(reader(&hex("ddffffffff00")).bounded_array_len(), None);
        assert_eq!(reader(&hex("90")).bounded_array_len(), Some(0));
    }

    #[test]
    fn strings_in_every_form_and_utf8_checked() {
        for (head, len) in [
            ("a0", 0),
            ("bf", 31),
            ("d920", 32),
            ("d9ff", 0xff),
            ("da0100", 0x100),
            ("db00010000", 0x1_0000),
        ] {
            let b = [hex(head), vec![b'x'; len]].concat();
            assert_eq!(
                whole_and_truncated(&b, |r| r.str().map(<[u8]>::len)),
                Some(len)
            );
            assert_eq!(reader(&b).raw_str().map(<[u8]>::len), Some(len));
        }
        let utf8 = [&[0xa2][..], "é".as_bytes()].concat();
        assert_eq!(reader(&utf8).str(), Some("é".as_bytes()));
        let invalid = hex("a2c328");
        assert_eq!(reader(&invalid).str(), None);
        assert_eq!(
            reader(&invalid).raw_str(),
            Some(&invalid[1..]),
            "keys are not checked"
        );
        assert_eq!(reader(&hex("c401ff")).str(), None, "bin is not str");
    }

    fn int_of(b: &str) -> Option<(bool, i128)> {
        whole_and_truncated(&hex(b), |r| r.int()).map(|h| match h {
            Hash::U(v) => (false, v as i128),
            Hash::I(v) => (true, v as i128),
            Hash::B(..) => panic!("int() read bytes"),
        })
    }

    #[test]
    fn ints_in_every_form() {
        for (b, signed, v) in [
            ("00", false, 0i128),
            ("7f", false, 0x7f),
            ("ff", true, -1),
            ("e0", true, -32),
            ("ccff", false, 0xff),
            ("cdffff", false, 0xffff),
            ("ceffffffff", false, 0xffff_ffff),
            ("cfffffffffffffffff", false, u64::MAX as i128),
            ("d080", true, -128),
            ("d07f", true, 127),
            ("d18000", true, -32768),
            ("d280000000", true, i32::MIN as i128),
            ("d38000000000000000", true, i64::MIN as i128),
            ("d37fffffffffffffff", true, i64::MAX as i128),
        ] {
            assert_eq!(int_of(b), Some((signed, v)), "{b}");
        }
        for foreign in ["c0", "c2", "ca00000000", "a0", "90", "d400ff"] {
            assert!(reader(&hex(foreign)).int().is_none(), "{foreign}");
        }
    }

    #[test]
    fn hashes_are_ints_or_bytes() {
        let bin = |head: &str, len: usize| [hex(head), vec![9; len]].concat();
        for (b, start) in [
            (bin("c400", 0), 2),
            (bin("c420", 32), 2),
            (bin("c50100", 0x100), 3),
            (bin("c600010000", 0x1_0000), 5),
        ] {
            let Some(Hash::B(s, e)) = whole_and_truncated(&b, |r| r.hash()) else {
                panic!("{:02x?}", &b[..start]);
            };
            assert_eq!((s, e), (start, b.len()));
        }
        // The uint64 fast path, and the same marker cut short, which must not fall back to
        // reading past the end either.
        let u64_max = hex("cfffffffffffffffff");
        assert!(matches!(
            whole_and_truncated(&u64_max, |r| r.hash()),
            Some(Hash::U(u64::MAX))
        ));
        assert!(matches!(reader(&hex("d0ff")).hash(), Some(Hash::I(-1))));
        assert!(reader(&hex("a0")).hash().is_none());
    }

    #[test]
    fn any_value_msgspec_decodes_plainly() {
        for b in [
            "c0",
            "c2",
            "c3",
            "05",
            "ff",
            "cd0100",
            "ca3fc00000",
            "cb3ff8000000000000",
            "a3616263",
            "c40101",
            "93c0c3a0",
            "82a161c0a16290",
            "dc0001c0",
        ] {
            let b = hex(b);
            assert!(whole_and_truncated(&b, |r| r.any(0)).is_some(), "{b:02x?}");
        }
        // Ext types, the never-used marker, non-str map keys.
        for b in ["d40100", "c70101ff", "c1", "810102", "a2c328"] {
            assert!(reader(&hex(b)).any(0).is_none(), "{b}");
        }
    }

    #[test]
    fn nesting_stops_at_max_depth() {
        let nested = |levels: usize| [vec![0x91; levels], vec![0xc0]].concat();
        assert!(reader(&nested(MAX_DEPTH as usize)).any(0).is_some());
        assert!(reader(&nested(MAX_DEPTH as usize + 1)).any(0).is_none());
    }

    #[test]
    fn int_lists_are_checked_against_the_end() {
        assert!(whole_and_truncated(&hex("9300cd0100cfffffffffffffffff"), |r| r.ints()).is_some());
        assert!(reader(&hex("91c0")).ints().is_none());
        assert!(reader(&hex("91a0")).ints().is_none());
    }
}
