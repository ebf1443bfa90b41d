//! Payload bytes -> the events an index needs, with no Python object in between.
//!
//! msgpack is read with the shared `Reader` (rust/reader.rs). It takes every shape
//! `kvbridge.wire.events.decode_batch` takes: vLLM 0.33's tagged-map events (unknown fields skipped),
//! the older positional events (`["BlockStored", hashes, parent, tokens, block_size, lora_id,
//! medium, lora_name | metadata]`), SGLang's map events without medium / lora_name, and
//! map-encoded batches. JSON is transcoded to msgpack first (`json`), so one reader decides
//! both; a JSON string where a block hash goes is base64 bytes, as msgspec writes bytes.
//!
//! A payload either parses whole or not at all (`None`): the index applies none of a payload it
//! cannot read.

use std::ops::Range;

use super::events::{
    Batch, Event, Spare, Stored, BAD_GROUP, KINDS, MAX_GROUPS, NO_KIND, UNKNOWN_KIND,
};
use super::json::json_to_msgpack;
use crate::hash::value::Value;
use crate::reader::{eq_bytes, fast_skip, fast_tokens, other_token, Hash, Reader};

const MAX_DEPTH: u32 = 32;

/// A 64-bit block hash: ints as two's complement, bytes reduced as vLLM reduces a digest to
/// its int event hash (`int.from_bytes(h, "big") & (2**64 - 1)`: the last 8 bytes).
pub fn reduce_bytes(b: &[u8]) -> u64 {
    b.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64)
}

#[derive(Clone, Copy, PartialEq)]
pub enum Format {
    Msgpack,
    Json,
}

/// JSON when the first non-whitespace byte opens an array or object; msgpack otherwise.
pub fn detect(b: &[u8]) -> Format {
    match b
        .iter()
        .find(|c| !matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
    {
        Some(b'[') | Some(b'{') => Format::Json,
        _ => Format::Msgpack,
    }
}

/// `scratch` holds JSON transcoded to msgpack, which the batch's strings borrow from; the
/// batch's vectors are `spare`'s.
pub fn parse<'a>(
    b: &'a [u8],
    format: Format,
    scratch: &'a mut Vec<u8>,
    spare: Spare,
) -> Option<Batch<'a>> {
    match format {
        Format::Msgpack => parse_msgpack(b, spare),
        Format::Json => {
            scratch.clear();
            json_to_msgpack(b, scratch)?;
            let bytes: &'a [u8] = scratch;
            Parser::new(bytes, true, spare).batch()
        }
    }
}

/// `parse` of a msgpack payload, which borrows nothing but the payload (the pipeline's parser
/// thread keeps no scratch for batches it hands over).
pub fn parse_msgpack(b: &[u8], spare: Spare) -> Option<Batch<'_>> {
    Parser::new(b, false, spare).batch()
}

struct Parser<'a> {
    r: Reader<'a>,
    /// Transcoded JSON: strings in hash positions are base64 bytes.
    json: bool,
    out: Batch<'a>,
    /// `Spare::count_tokens`.
    count_tokens: bool,
    /// Set by the current event's token ids / extra keys when they hold what the index cannot
    /// use, though the payload is a valid batch.
    bad_tokens: bool,
    bad_extra_keys: bool,
}

#[derive(Default)]
struct Fields<'a> {
    kind: Option<&'a [u8]>,
    hashes: Option<Range<usize>>,
    parent: Option<u64>,
    tokens: Option<Range<usize>>,
    block_size: Option<i64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    extra_keys: Option<Vec<Option<Value>>>,
    group: u8,
    spec_kind: u8,
    window: i64,
    remote: bool,
}

impl<'a> Parser<'a> {
    fn new(b: &'a [u8], json: bool, spare: Spare) -> Self {
        Parser {
            r: Reader { b, p: 0 },
            json,
            out: Batch {
                events: spare.events,
                hashes: spare.hashes,
                tokens: spare.tokens,
            },
            count_tokens: spare.count_tokens,
            bad_tokens: false,
            bad_extra_keys: false,
        }
    }

    fn batch(mut self) -> Option<Batch<'a>> {
        match self.r.peek()? {
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = self.r.array_len()?;
                if !(2..=3).contains(&n) {
                    return None;
                }
                self.number()?;
                self.events()?;
                if n == 3 && !self.r.nil() {
                    self.r.int()?;
                }
            }
            _ => {
                // A map-encoded batch: {"ts": ..., "events": [...], "data_parallel_rank": ...}.
                let mut seen = (false, false);
                for _ in 0..self.r.map_len()? {
                    match self.r.str()? {
                        b"ts" => {
                            self.number()?;
                            seen.0 = true;
                        }
                        b"events" => {
                            self.events()?;
                            seen.1 = true;
                        }
                        _ => self.r.any(1)?,
                    }
                }
                if seen != (true, true) {
                    return None;
                }
            }
        }
        (self.r.p == self.r.b.len()).then_some(self.out)
    }

    fn number(&mut self) -> Option<()> {
        match self.r.peek()? {
            0xca => self.r.take(5).map(drop),
            0xcb => self.r.take(9).map(drop),
            _ => self.r.int().map(drop),
        }
    }

    fn events(&mut self) -> Option<()> {
        // Bounded by the bytes left: a count from the payload must not size an allocation.
        let n = self.r.bounded_array_len()?;
        self.out.events.reserve(n);
        for _ in 0..n {
            self.bad_tokens = false;
            self.bad_extra_keys = false;
            let mut ev = match self.r.peek()? {
                0x90..=0x9f | 0xdc | 0xdd => self.positional()?,
                _ => self.tagged()?,
            };
            if let Event::Stored(s) = &mut ev {
                s.bad_tokens = self.bad_tokens;
                s.bad_extra_keys = self.bad_extra_keys;
            }
            self.out.events.push(ev);
        }
        Some(())
    }

    fn tagged(&mut self) -> Option<Event<'a>> {
        let mut f = Fields::default();
        let mut next = 0;
        for _ in 0..self.r.map_len()? {
            // Writers put the fields in declaration order: the next one expected is compared as
            // encoded (str header and name) in one go. Any other key is read and matched by
            // name; keys only need to equal known ASCII names, unknown ones are skipped with
            // their value.
            let (b, p) = (self.r.b, self.r.p);
            let field = match KEY_ORDER.get(next) {
                Some(&(key, field))
                    if b.get(p..p + key.len()).is_some_and(|k| eq_bytes(k, key)) =>
                {
                    self.r.p += key.len();
                    next += 1;
                    field
                }
                _ => {
                    let f = field(self.r.raw_str()?);
                    // An omitted field (msgspec leaves out defaults, e.g. extra_keys=None) puts
                    // the next ones back in step once one of them is matched by name.
                    if let Some(i) = KEY_ORDER.iter().position(|k| k.1 == f && f != Field::Other) {
                        next = i + 1;
                    }
                    f
                }
            };
            match field {
                Field::Type => f.kind = Some(self.r.raw_str()?),
                Field::BlockHashes => f.hashes = Some(self.hashes()?),
                Field::Parent => f.parent = self.opt_hash()?,
                Field::TokenIds => f.tokens = Some(self.tokens()?),
                Field::BlockSize => f.block_size = Some(self.int()?),
                Field::Medium => f.medium = self.opt_str()?,
                Field::LoraName => f.lora_name = self.opt_str()?,
                Field::ExtraKeys => f.extra_keys = self.extra_keys()?,
                Field::GroupIdx => f.group = self.group()?,
                Field::Kind => f.spec_kind = self.kind()?,
                Field::Window => f.window = self.window()?,
                Field::Locality => f.remote = self.opt_str()? == Some("REMOTE"),
                Field::Other => self.r.any(1)?,
            }
        }
        f.into_event()
    }

    fn positional(&mut self) -> Option<Event<'a>> {
        let n = self.r.array_len()?;
        if n == 0 {
            return None;
        }
        let mut f = Fields {
            kind: Some(self.r.str()?),
            ..Fields::default()
        };
        for i in 1..n {
            match (f.kind?, i) {
                (b"BlockStored" | b"BlockRemoved", 1) => f.hashes = Some(self.hashes()?),
                (b"BlockStored", 2) => f.parent = self.opt_hash()?,
                (b"BlockStored", 3) => f.tokens = Some(self.tokens()?),
                (b"BlockStored", 4) => f.block_size = Some(self.int()?),
                (b"BlockStored", 6) | (b"BlockRemoved", 2) => f.medium = self.opt_str()?,
                // vLLM's lora_name, or SGLang's metadata map in the same place.
                (b"BlockStored", 7) if matches!(self.r.peek()?, 0xa0..=0xbf | 0xd9..=0xdb) => {
                    f.lora_name = self.opt_str()?
                }
                _ => self.r.any(1)?,
            }
        }
        f.into_event()
    }

    fn int(&mut self) -> Option<i64> {
        match self.r.int()? {
            // Only ever compared with the index's block size: a huge one is just a mismatch.
            Hash::U(v) => Some(i64::try_from(v).unwrap_or(i64::MAX)),
            Hash::I(v) => Some(v),
            Hash::B(..) => None,
        }
    }

    /// `group_idx`: nil is group 0 (engines without groups); anything but an int 0..=63 is
    /// `BAD_GROUP` (read past, so the rest of the payload still applies).
    fn group(&mut self) -> Option<u8> {
        if self.r.nil() {
            return Some(0);
        }
        match self.r.peek()? {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Some(match self.r.int()? {
                Hash::U(v) if v < MAX_GROUPS as u64 => v as u8,
                _ => BAD_GROUP,
            }),
            _ => {
                self.r.any(1)?;
                Some(BAD_GROUP)
            }
        }
    }

    fn kind(&mut self) -> Option<u8> {
        if self.r.nil() {
            return Some(NO_KIND);
        }
        if matches!(self.r.peek()?, 0xa0..=0xbf | 0xd9..=0xdb) {
            let name = self.r.raw_str()?;
            return Some(
                KINDS
                    .iter()
                    .position(|k| eq_bytes(k, name))
                    .map_or(UNKNOWN_KIND, |i| i as u8 + 1),
            );
        }
        self.r.any(1)?;
        Some(UNKNOWN_KIND)
    }

    fn window(&mut self) -> Option<i64> {
        if self.r.nil() {
            return Some(0);
        }
        match self.r.peek()? {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Some(match self.r.int()? {
                Hash::U(v) => i64::try_from(v).unwrap_or(i64::MAX),
                Hash::I(v) => v,
                Hash::B(..) => 0,
            }),
            _ => {
                self.r.any(1)?;
                Some(0)
            }
        }
    }

    fn opt_str(&mut self) -> Option<Option<&'a str>> {
        if self.r.nil() {
            return Some(None);
        }
        let s = self.r.str()?;
        // SAFETY: Reader::str checked that the bytes are UTF-8.
        Some(Some(unsafe { std::str::from_utf8_unchecked(s) }))
    }

    fn hash(&mut self) -> Option<u64> {
        if self.json && matches!(self.r.peek()?, 0xa0..=0xbf | 0xd9..=0xdb) {
            return base64_reduced(self.r.str()?);
        }
        Some(match self.r.hash()? {
            Hash::U(v) => v,
            Hash::I(v) => v as u64,
            Hash::B(s, e) => reduce_bytes(&self.r.b[s..e]),
        })
    }

    fn opt_hash(&mut self) -> Option<Option<u64>> {
        if self.r.nil() {
            Some(None)
        } else {
            self.hash().map(Some)
        }
    }

    fn hashes(&mut self) -> Option<Range<usize>> {
        let n = self.r.bounded_array_len()?;
        let start = self.out.hashes.len();
        self.out.hashes.reserve(n);
        for _ in 0..n {
            // What engines write for a 64-bit hash of 2**32 or more, a uint64 (the same value
            // `hash` reads, JSON or not), read here without a call; other forms go to `hash`.
            let (b, p) = (self.r.b, self.r.p);
            let h = match b.get(p..p + 9) {
                Some(&[0xcf, ref v @ ..]) => {
                    self.r.p = p + 9;
                    u64::from_be_bytes(v.try_into().unwrap())
                }
                _ => self.hash()?,
            };
            self.out.hashes.push(h);
        }
        Some(start..self.out.hashes.len())
    }

    fn tokens(&mut self) -> Option<Range<usize>> {
        let n = self.r.bounded_array_len()?;
        let start = self.out.tokens.len();
        if self.count_tokens {
            // The same checks, the same chain from one token's width to the next, nothing kept.
            let (done, p) = fast_skip(self.r.b, self.r.p, n);
            self.r.p = p;
            let mut bad = false;
            for _ in done..n {
                bad |= other_token(&mut self.r)?.is_none();
            }
            self.bad_tokens |= bad;
            return Some(start..start + n);
        }
        // Most of a payload's bytes. Token widths vary from token to token (fixint, uint16,
        // uint32 for a vocabulary past 65536), and the next token's position depends on this
        // one's width: a serial chain, which `fast_tokens` keeps short; what it
        // leaves (a payload's last bytes, a width msgspec does not write) is decoded one by one.
        let b = self.r.b;
        let tokens = &mut self.out.tokens;
        tokens.reserve(n);
        // Written in place without zeroing first (a memset of the payload's largest part): the
        // length moves past them only once every one is written.
        let out = &mut tokens.spare_capacity_mut()[..n];
        let (done, mut p) = fast_tokens(b, self.r.p, out);
        let mut bad = false;
        for slot in &mut out[done..] {
            self.r.p = p;
            let t = other_token(&mut self.r)?;
            p = self.r.p;
            bad |= t.is_none();
            slot.write(t.unwrap_or(0));
        }
        // SAFETY: `fast_tokens` wrote out[..done] and the loop out[done..n].
        unsafe { tokens.set_len(start + n) };
        self.r.p = p;
        self.bad_tokens |= bad;
        Some(start..self.out.tokens.len())
    }

    fn extra_keys(&mut self) -> Option<Option<Vec<Option<Value>>>> {
        if self.r.nil() {
            return Some(None);
        }
        let n = self.r.array_len()?;
        let mut out = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            out.push(if self.r.nil() {
                None
            } else {
                Some(self.value(1)?)
            });
        }
        Some(Some(out))
    }

    /// An extra-key value in its canonical form: nil, bool, int, str, bytes and arrays of
    /// these (the form Python query arguments take too, see rust/index/query_keys.rs
    /// `key_value`). Floats and maps are skipped and flag the event: no engine writes them, and
    /// they have no canonical form here.
    fn value(&mut self, depth: u32) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        Some(match self.r.peek()? {
            0xc0 => {
                self.r.p += 1;
                Value::None
            }
            0xc2 | 0xc3 => Value::Bool(self.r.byte()? == 0xc3),
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => match self.r.int()? {
                Hash::I(v) => Value::Int(v),
                Hash::U(v) => match i64::try_from(v) {
                    Ok(v) => Value::Int(v),
                    // 2**63..2**64-1 as Value keeps them: nine LE bytes, a zero sign byte last.
                    Err(_) => {
                        let mut le = v.to_le_bytes().to_vec();
                        le.push(0);
                        Value::BigInt(le)
                    }
                },
                Hash::B(..) => return None,
            },
            0xa0..=0xbf | 0xd9..=0xdb => Value::Str(self.r.str()?.to_vec(), 0),
            0xc4..=0xc6 => match self.r.hash()? {
                Hash::B(s, e) => Value::Bytes(self.r.b[s..e].to_vec(), 0),
                _ => return None,
            },
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = self.r.array_len()?;
                let mut items = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    items.push(self.value(depth + 1)?);
                }
                Value::Tuple(items, 0)
            }
            _ => {
                self.r.any(depth)?;
                self.bad_extra_keys = true;
                Value::None
            }
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Field {
    Type,
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    Kind,
    Window,
    Locality,
    Other,
}

/// vLLM's event fields as msgspec writes them, fixstr header and name, in declaration order
/// (BlockStored's; a BlockRemoved's medium comes early and takes the general path).
const KEY_ORDER: [(&[u8], Field); 13] = [
    (b"\xa4type", Field::Type),
    (b"\xacblock_hashes", Field::BlockHashes),
    (b"\xb1parent_block_hash", Field::Parent),
    (b"\xa9token_ids", Field::TokenIds),
    (b"\xaablock_size", Field::BlockSize),
    (b"\xa7lora_id", Field::Other),
    (b"\xa6medium", Field::Medium),
    (b"\xa9lora_name", Field::LoraName),
    (b"\xaaextra_keys", Field::ExtraKeys),
    (b"\xa9group_idx", Field::GroupIdx),
    (b"\xb2kv_cache_spec_kind", Field::Kind),
    (b"\xbckv_cache_spec_sliding_window", Field::Window),
    (b"\xa8locality", Field::Locality),
];

/// An event field by name: one comparison per key (the key's length and first byte pick the
/// candidate), not one per known name.
#[inline]
fn field(key: &[u8]) -> Field {
    let (want, f): (&[u8], Field) = match (key.len(), key.first()) {
        (4, _) => (b"type", Field::Type),
        (12, _) => (b"block_hashes", Field::BlockHashes),
        (17, _) => (b"parent_block_hash", Field::Parent),
        (9, Some(b't')) => (b"token_ids", Field::TokenIds),
        (9, Some(b'g')) => (b"group_idx", Field::GroupIdx),
        (9, _) => (b"lora_name", Field::LoraName),
        (18, _) => (b"kv_cache_spec_kind", Field::Kind),
        (28, _) => (b"kv_cache_spec_sliding_window", Field::Window),
        (8, _) => (b"locality", Field::Locality),
        (10, Some(b'b')) => (b"block_size", Field::BlockSize),
        (10, _) => (b"extra_keys", Field::ExtraKeys),
        (6, _) => (b"medium", Field::Medium),
        _ => return Field::Other,
    };
    if eq_bytes(key, want) {
        f
    } else {
        Field::Other
    }
}

impl<'a> Fields<'a> {
    fn into_event(self) -> Option<Event<'a>> {
        Some(match self.kind? {
            b"BlockStored" => Event::Stored(Stored {
                hashes: self.hashes?,
                parent: self.parent,
                tokens: self.tokens?,
                block_size: self.block_size?,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                bad_tokens: false,
                bad_extra_keys: false,
                group: self.group,
                kind: self.spec_kind,
                window: self.window,
                remote: self.remote,
            }),
            b"BlockRemoved" => Event::Removed {
                hashes: self.hashes?,
                medium: self.medium,
                group: self.group,
                remote: self.remote,
            },
            b"AllBlocksCleared" => Event::Cleared,
            _ => return None,
        })
    }
}

fn base64_reduced(s: &[u8]) -> Option<u64> {
    fn sextet(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let body = s
        .strip_suffix(b"==")
        .or_else(|| s.strip_suffix(b"="))
        .unwrap_or(s);
    let mut acc = 0u64;
    let (mut bits, mut buf) = (0u32, 0u32);
    for &c in body {
        buf = (buf << 6) | sextet(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            acc = (acc << 8) | ((buf >> bits) & 0xff) as u64;
        }
    }
    Some(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_msgpack_agree() {
        let json = br#"[1.5, [{"type": "BlockStored", "block_hashes": [1, "AAAAAAAAAAI="],
            "parent_block_hash": null, "token_ids": [1, 2, 3, 4], "block_size": 2,
            "lora_id": null, "medium": "GPU", "lora_name": "x", "extra_keys": [["x"], null],
            "unknown": {"a": [1.0]}}, ["BlockRemoved", [7], "CPU"], {"type": "AllBlocksCleared"}], 0]"#;
        let mut scratch = Vec::new();
        let b = parse(json, detect(json), &mut scratch, Spare::default()).expect("parses");
        assert_eq!(b.hashes, vec![1, 2, 7]);
        assert_eq!(b.tokens, vec![1, 2, 3, 4]);
        assert_eq!(b.events.len(), 3);
        match &b.events[0] {
            Event::Stored(s) => {
                assert_eq!(s.medium, Some("GPU"));
                assert_eq!(s.lora_name, Some("x"));
                assert_eq!(s.block_size, 2);
                assert_eq!(s.extra_keys.as_ref().map(Vec::len), Some(2));
            }
            _ => panic!("not stored"),
        }
        assert!(matches!(
            b.events[1],
            Event::Removed {
                medium: Some("CPU"),
                ..
            }
        ));
        assert!(matches!(b.events[2], Event::Cleared));
    }

    #[test]
    fn rejects_garbage_and_trailing_bytes() {
        let mut scratch = Vec::new();
        for bad in [
            &b"[1.0, [], 0] x"[..],
            b"{}",
            b"\x92\xcb",
            b"[1.0, [{\"type\": \"Nope\"}]]",
        ] {
            assert!(
                parse(bad, detect(bad), &mut scratch, Spare::default()).is_none(),
                "{bad:?}"
            );
        }
        assert!(parse(
            b"\x92\xcb\0\0\0\0\0\0\0\0\x90",
            Format::Msgpack,
            &mut scratch,
            Spare::default()
        )
        .is_some());
    }

    /// Token ids of every width and signedness a writer may use, at every distance from the
    /// payload's end: the fast decoders (eight at a time, then one by one) and the one-by-one
    /// reader agree.
    #[test]
    fn token_ids_decode_in_every_width() {
        let values: [u64; 12] = [
            0,
            1,
            127,
            128,
            255,
            256,
            65535,
            65536,
            150_000,
            u32::MAX as u64,
            1 << 32,
            5,
        ];
        let mut seed = 0x9e37_79b9_u64;
        for case in 0..800 {
            // Up to 62 ids: the decoders' chunks of eight, the rest one by one.
            let n = case % 23 + case % 3 * 20;
            // Half the cases with a slow form rarely, so most chunks are all fast forms and
            // one with a slow form (read again one by one) is among them.
            let odds = if case % 2 == 0 { 10 } else { 100 };
            let mut body = Vec::new();
            let mut want = Vec::new();
            let mut starts = Vec::new();
            for _ in 0..n {
                starts.push(body.len());
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = values[(seed >> 33) as usize % values.len()];
                // Mostly what msgspec writes; sometimes a wider or signed marker, or a negative.
                match (seed >> 20) % odds {
                    0 => body.extend_from_slice(&[&[0xcf][..], &v.to_be_bytes()].concat()),
                    1 => body.extend_from_slice(&[&[0xd3][..], &(v as i64).to_be_bytes()].concat()),
                    2 => {
                        body.push(0xff); // fixint -1
                        want.push(None);
                        continue;
                    }
                    _ if v < 128 => body.push(v as u8),
                    _ if v < 256 => body.extend_from_slice(&[0xcc, v as u8]),
                    _ if v < 65536 => {
                        body.extend_from_slice(&[&[0xcd][..], &(v as u16).to_be_bytes()].concat())
                    }
                    _ if v <= u32::MAX as u64 => {
                        body.extend_from_slice(&[&[0xce][..], &(v as u32).to_be_bytes()].concat())
                    }
                    _ => body.extend_from_slice(&[&[0xcf][..], &v.to_be_bytes()].concat()),
                }
                want.push(u32::try_from(v).ok());
            }
            let mut bytes = vec![0xdc, 0, n as u8];
            bytes.extend_from_slice(&body);
            let mut p = Parser::new(&bytes, false, Spare::default());
            let range = p.tokens().expect("valid array");
            assert_eq!(p.r.p, bytes.len(), "case {case}");
            let got: Vec<u32> = p.out.tokens[range].to_vec();
            let expect: Vec<u32> = want.iter().map(|t| t.unwrap_or(0)).collect();
            assert_eq!(got, expect, "case {case}: {bytes:x?}");
            assert_eq!(
                p.bad_tokens,
                want.iter().any(Option::is_none),
                "case {case}"
            );
            // Counted only (key="engine"): the same checks and end, nothing kept.
            let counting = Spare {
                count_tokens: true,
                ..Spare::default()
            };
            let mut c = Parser::new(&bytes, false, counting);
            assert_eq!(c.tokens().map(|r| r.len()), Some(n), "case {case}");
            assert_eq!(
                (c.r.p, c.bad_tokens, c.out.tokens.len()),
                (bytes.len(), p.bad_tokens, 0),
                "case {case}"
            );
            // Cut short, or with a marker no token id has (nil): malformed either way.
            let mut nil = bytes.clone();
            nil.insert(3 + starts.get(n / 2).unwrap_or(&0), 0xc0);
            nil[2] += 1;
            for bad in [&bytes[..bytes.len() - usize::from(n > 0)], &nil[..]]
                .into_iter()
                .filter(|_| n > 0)
            {
                for count_tokens in [false, true] {
                    let spare = Spare {
                        count_tokens,
                        ..Spare::default()
                    };
                    assert_eq!(
                        Parser::new(bad, false, spare).tokens(),
                        None,
                        "case {case}, {count_tokens}"
                    );
                }
            }
        }
    }

    #[test]
    fn reduces_bytes_like_vllm() {
        assert_eq!(reduce_bytes(&[0xff; 32]), u64::MAX);
        assert_eq!(reduce_bytes(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 5]), 5);
        assert_eq!(base64_reduced(b"AAAAAAAAAAI="), Some(2));
    }
}
