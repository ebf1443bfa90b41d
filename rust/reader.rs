//! The msgpack reader every payload reader of the crate shares: the batch scanner (`scan`), the
//! index's parser (`index::parse`), the decoder (`decode`), the residency view (`view`) and the
//! index's query arguments (`index::args`).
//!
//! A `Reader` is a cursor over a payload's bytes. Each read takes one msgpack form and answers
//! `None` for anything else (another form, truncated or foreign input): never a panic or a read
//! past the end, so a caller can give up on a payload at the first `None`. Besides the msgpack
//! forms it reads what vLLM's batches are made of: block hashes (`int | bytes`), a batch's head
//! and tail, keys as msgspec writes them, and lists of token ids, skipped or decoded several at
//! a time (most of a payload's bytes).

use std::mem::MaybeUninit;

/// Deeper `Any` values than this (inside extra_keys / metadata) are left to msgspec.
const MAX_DEPTH: u32 = 32;

/// An `int | bytes` as read: an unsigned or a signed int, or where the bytes are in the payload
/// (`b[start..end]`).
#[derive(Clone, Copy)]
pub(crate) enum Hash {
    U(u64),
    I(i64),
    B(usize, usize),
}

pub(crate) struct Reader<'a> {
    pub(crate) b: &'a [u8],
    pub(crate) p: usize,
}

/// `None` from any read: the next bytes are not the form asked for (the caller gives up on the
/// payload, or falls back to a full decode).
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
    /// table-driven skipper (`fast_skip`) first: a branch per token on the width mispredicts
    /// about every other token. What it leaves (other widths, the payload's last bytes) is read
    /// here.
    pub(crate) fn ints(&mut self) -> Option<()> {
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
    pub(crate) fn skip_key(&mut self, key: &[u8]) -> bool {
        let hit = self
            .b
            .get(self.p..self.p + key.len())
            .is_some_and(|s| eq_bytes(s, key));
        if hit {
            self.p += key.len();
        }
        hit
    }

    pub(crate) fn opt_str(&mut self) -> Option<Option<&'a [u8]>> {
        if self.nil() {
            Some(None)
        } else {
            self.str().map(Some)
        }
    }

    pub(crate) fn opt_int(&mut self) -> Option<Option<Hash>> {
        if self.nil() {
            Some(None)
        } else {
            self.int().map(Some)
        }
    }
}

/// Byte-string equality for the short names a payload repeats per event (field names, kinds,
/// media): a few overlapping word compares instead of a call to memcmp.
#[inline(always)]
pub(crate) fn eq_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let w8 = |s: &[u8], i: usize| u64::from_le_bytes(s[i..i + 8].try_into().unwrap());
    let w4 = |s: &[u8], i: usize| u32::from_le_bytes(s[i..i + 4].try_into().unwrap());
    match n {
        0 => true,
        // The first, middle and last bytes: every byte of a 1-3 byte string.
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=7 => w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4),
        8..=24 => {
            let mid = 8.min(n - 8);
            w8(a, 0) == w8(b, 0) && w8(a, mid) == w8(b, mid) && w8(a, n - 8) == w8(b, n - 8)
        }
        _ => a == b,
    }
}

// --- token ids -------------------------------------------------------------------------------

/// Decodes token ids from `b[p..]` into `out` while they are fixints or uint8/16/32 and 8
/// bytes can be read; returns how many and the position after them.
///
/// A token is at most 5 bytes: one 8-byte little-endian load at its marker holds it whole (the
/// marker is the word's low byte, the value the big-endian bytes after it). The loads sit on
/// the chain from one token's position to the next; a 16-byte window shifted by each width
/// (three tokens a load) kept them off it but cost more in u128 shifts: 2.4 vs 2.8 ns a token.
#[inline]
pub(crate) fn fast_tokens(b: &[u8], mut p: usize, out: &mut [MaybeUninit<u32>]) -> (usize, usize) {
    let mut i = 0;
    // Eight tokens at a time while their 8 x 5 bytes and a last load's 8 fit: no bounds test
    // per token, and one validity test per chunk (a chunk with a form not read here is read
    // again one by one below, which stops at it).
    const CHUNK: usize = 8;
    while i + CHUNK <= out.len() && p + 5 * (CHUNK - 1) + 8 <= b.len() {
        let start = p;
        let mut valid = true;
        for slot in &mut out[i..i + CHUNK] {
            // SAFETY: p <= start + 5 * 7 and start + 43 <= b.len() (a width is at most 5,
            // an invalid marker's too).
            let word = unsafe { b.as_ptr().add(p).cast::<u64>().read_unaligned() };
            let (t, width, ok) = one_token(u64::from_le(word));
            slot.write(t);
            valid &= ok;
            p += width as usize;
        }
        if !valid {
            p = start;
            break;
        }
        i += CHUNK;
    }
    while i < out.len() {
        let Some(word) = b.get(p..p + 8) else { break };
        let (t, width, valid) = one_token(u64::from_le_bytes(word.try_into().unwrap()));
        if !valid {
            break;
        }
        out[i].write(t);
        i += 1;
        p += width as usize;
    }
    (i, p)
}

/// The widths of the token ids `fast_tokens` reads, by marker byte (0: not one of its forms).
const FAST_WIDTHS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut m = 0;
    while m < 0x80 {
        t[m] = 1;
        m += 1;
    }
    (t[0xcc], t[0xcd], t[0xce]) = (2, 3, 5);
    t
};

/// `fast_tokens` for ids that are only counted: how many of up to `n` it would read from
/// `b[p..]`, and where they end. It stops where `fast_tokens` does (a marker with 8 bytes
/// readable), so the rest goes to `other_token` alike; a width from a table, not a value, is
/// all that is on the chain from one token to the next. `Reader::ints` (the batch scanner's
/// token ids) skips with it too.
pub(crate) fn fast_skip(b: &[u8], mut p: usize, n: usize) -> (usize, usize) {
    let end = b.len().saturating_sub(7);
    let mut i = 0;
    // Eight tokens at a time while 8 x 5 bytes fit before `end`: no bounds or marker test per
    // token, just the marker, its width and the add. A marker that is not a fast form has width
    // 0, so the position stops there and every later width in the chunk is 0 too: the last
    // width alone says whether the chunk was all fast forms (if not, it is read again below).
    const CHUNK: usize = 8;
    while i + CHUNK <= n && p + 5 * CHUNK <= end {
        let start = p;
        let mut width = 0;
        for _ in 0..CHUNK {
            // SAFETY: p <= start + 5 * 7 < end <= b.len() (a width is at most 5).
            width = FAST_WIDTHS[unsafe { *b.get_unchecked(p) } as usize] as usize;
            p += width;
        }
        if width == 0 {
            p = start;
            break;
        }
        i += CHUNK;
    }
    while i < n && p < end {
        let width = FAST_WIDTHS[b[p] as usize];
        if width == 0 {
            break;
        }
        p += width as usize;
        i += 1;
    }
    (i, p)
}

/// The token at the low end of `v`: (value, width in bytes, whether it is one of the fast
/// forms). Branch-free: widths mix at random in a payload. The width (on the chain to the next
/// token) comes from the marker's low two bits and a constant: uint8/16/32 (0xcc..0xce) are
/// 2, 3 and 5 bytes, a fixint 1.
#[inline(always)]
fn one_token(v: u64) -> (u32, u32, bool) {
    const UINT_WIDTHS: u32 = 0x05_03_02;
    let m = v as u8 as u32;
    let fix = m < 0x80;
    let valid = fix | (m.wrapping_sub(0xcc) < 3);
    let uint_width = (UINT_WIDTHS >> (8 * (m & 3))) & 0xff;
    let width = if fix { 1 } else { uint_width };
    // The bytes after the marker, big-endian: the value is the top (width - 1) of the next four.
    let after = ((v >> 8) as u32).swap_bytes() >> ((40 - 8 * uint_width) & 31);
    (if fix { m } else { after }, width, valid)
}

/// A token id at the payload's very end, or in a width msgspec does not write for one (or out
/// of range: `Some(None)`).
pub(crate) fn other_token(r: &mut Reader) -> Option<Option<u32>> {
    Some(match r.byte()? {
        t @ 0x00..=0x7f => Some(t as u32),
        0xcc => Some(r.be(1)? as u32),
        0xcd => Some(r.be(2)? as u32),
        0xce => Some(r.be(4)? as u32),
        0xcf => u32::try_from(r.be(8)?).ok(),
        0xe0..=0xff => None,
        // Signed markers may hold non-negative values (msgspec never writes these).
        0xd0 => u32::try_from(r.be(1)? as u8 as i8).ok(),
        0xd1 => u32::try_from(r.be(2)? as u16 as i16).ok(),
        0xd2 => u32::try_from(r.be(4)? as u32 as i32).ok(),
        0xd3 => u32::try_from(r.be(8)? as i64).ok(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    //! Every form at its boundaries, and `None`, never a panic or a read past the end, for
    //! truncated or foreign input.
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

    #[test]
    fn short_byte_strings_compare_exactly() {
        let names: [&[u8]; 9] = [
            b"",
            b"a",
            b"GPU",
            b"type",
            b"medium",
            b"token_ids",
            b"block_hashes",
            b"parent_block_hash",
            b"a_name_longer_than_twenty_four_bytes",
        ];
        for a in names {
            for b in names {
                assert_eq!(eq_bytes(a, b), a == b);
            }
            let mut c = a.to_vec();
            for i in 0..c.len() {
                c[i] ^= 1;
                assert!(!eq_bytes(a, &c), "{a:?} vs a change at {i}");
                c[i] ^= 1;
            }
        }
    }
}
