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

use crate::reader::{Hash, Reader};

pub(crate) const STORED: u8 = 0;
pub(crate) const REMOVED: u8 = 1;
pub(crate) const CLEARED: u8 = 2;

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

/// The event schema, read with the shared reader (rust/reader.rs): `None` means "not the fast
/// shape", and the caller falls back to a full decode.
impl<'a> Reader<'a> {
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
}

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
