//! Byte-exact `pickle.dumps(obj, protocol=5)` for the objects vLLM hashes: the block tuple
//! `(parent_digest, tuple(tokens), extra_keys)` and its NONE_HASH seed.
//!
//! It mirrors CPython's C pickler (Modules/_pickle.c), not the pure-Python one, because that is
//! what `pickle.dumps` runs:
//! - PROTO 5 is written before framing starts; the first write after it opens a frame whose
//!   9-byte header (FRAME + u64 LE length) is filled in when the frame is committed.
//! - A frame is committed at the start of any `save()` once it holds >= 64 KiB, and at STOP.
//! - A str/bytes payload >= 64 KiB commits the current frame and is written unframed
//!   (`_Pickler_write_bytes`); the next write opens a new frame.
//! - A committed frame shorter than 4 bytes loses its header.
//! - str, bytes and non-empty tuples are memoized (MEMOIZE) by identity; a second sighting of
//!   the same object is a BINGET/LONG_BINGET. Empty tuples, ints, bools and None are not.
//! - ints: BININT1 (0..=0xff), BININT2 (..=0xffff), BININT (i32 range), else LONG1/LONG4.

use super::tokenbytes::{self, MAX_TOKEN_BYTES};
use super::value::{long_bytes, Id, Value};

const FRAME_HEADER: usize = 9;
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const FRAME_SIZE_MIN: usize = 4;

const PROTO_5: [u8; 2] = [0x80, 5];
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE3: u8 = 0x87;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// Reusable pickler state (memo, frame position), so pickling a block allocates nothing.
/// It writes at the end of a caller's buffer: frame positions are absolute indices into it.
#[derive(Default, Clone)]
pub struct Pickler {
    buf: Vec<u8>,
    frame_start: Option<usize>,
    /// Identities in memo order: the memo index is the position.
    memo: Vec<Id>,
}

impl Pickler {
    /// Appends the pickle of `(parent, tuple(tokens), extra)` to `out`. `parent_id` is the
    /// identity of the parent object if the caller handed us one (it could reappear inside
    /// `extra`), else 0.
    pub fn block(
        &mut self,
        out: &mut Vec<u8>,
        parent: &[u8],
        parent_id: Id,
        tokens: &[u32],
        extra: Option<&Value>,
    ) {
        std::mem::swap(&mut self.buf, out);
        self.begin(parent.len() + tokens.len() * MAX_TOKEN_BYTES + 32);
        self.boundary();
        self.save_bytes(parent, parent_id);
        self.save_tokens(tokens);
        match extra {
            None => self.save_atom(&[NONE]),
            Some(v) => self.save(v),
        }
        self.write(&[TUPLE3]);
        self.memoize(0);
        self.finish();
        std::mem::swap(&mut self.buf, out);
    }

    /// Appends the pickle of a single value (vLLM's NONE_HASH is the hash of its pickled seed).
    pub fn value(&mut self, out: &mut Vec<u8>, v: &Value) {
        std::mem::swap(&mut self.buf, out);
        self.begin(64);
        self.save(v);
        self.finish();
        std::mem::swap(&mut self.buf, out);
    }

    /// PROTO goes out before framing starts, so it is never inside a frame.
    fn begin(&mut self, capacity: usize) {
        self.buf.reserve(capacity);
        self.memo.clear();
        self.frame_start = None;
        self.buf.extend_from_slice(&PROTO_5);
    }

    fn finish(&mut self) {
        self.write(&[STOP]);
        self.commit_frame();
    }

    #[inline(always)]
    fn write(&mut self, data: &[u8]) {
        self.open_frame();
        self.buf.extend_from_slice(data);
    }

    /// What any write does first: with no frame open, reserve a frame header.
    #[inline(always)]
    fn open_frame(&mut self) {
        if self.frame_start.is_none() {
            self.frame_start = Some(self.buf.len());
            self.buf.extend_from_slice(&[0u8; FRAME_HEADER]);
        }
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let len = self.buf.len() - start - FRAME_HEADER;
        if len >= FRAME_SIZE_MIN {
            self.buf[start] = FRAME;
            self.buf[start + 1..start + FRAME_HEADER].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.buf.drain(start..start + FRAME_HEADER);
        }
    }

    /// CPython checks the frame size at the start of every save(), so a frame can run past
    /// 64 KiB by the tail of the object being saved when the check happens.
    #[inline(always)]
    fn boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.buf.len() - start - FRAME_HEADER >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    /// Large payloads bypass framing altogether, header included.
    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.buf.extend_from_slice(header);
            self.buf.extend_from_slice(data);
        } else {
            self.write(header);
            self.write(data);
        }
    }

    fn memoize(&mut self, id: Id) {
        self.memo.push(id);
        self.write(&[MEMOIZE]);
    }

    /// Writes a BINGET and returns true if `id` was pickled before.
    fn memo_get(&mut self, id: Id) -> bool {
        if id == 0 {
            return false;
        }
        let Some(index) = self.memo.iter().position(|&m| m == id) else {
            return false;
        };
        if index < 256 {
            self.write(&[BINGET, index as u8]);
        } else {
            let i = (index as u32).to_le_bytes();
            self.write(&[LONG_BINGET, i[0], i[1], i[2], i[3]]);
        }
        true
    }

    fn save_atom(&mut self, opcode: &[u8]) {
        self.boundary();
        self.write(opcode);
    }

    fn save(&mut self, v: &Value) {
        self.boundary();
        match v {
            Value::None => self.write(&[NONE]),
            Value::Bool(b) => self.write(&[if *b { NEWTRUE } else { NEWFALSE }]),
            Value::Int(i) => self.write_int(*i),
            Value::BigInt(b) => self.write_long(b),
            Value::Str(s, id) => {
                if !self.memo_get(*id) {
                    let (head, n) =
                        sized_header(SHORT_BINUNICODE, BINUNICODE, BINUNICODE8, s.len());
                    self.write_payload(&head[..n], s);
                    self.memoize(*id);
                }
            }
            Value::Bytes(b, id) => self.save_bytes_body(b, *id),
            Value::Tuple(items, id) => {
                if items.is_empty() {
                    self.write(&[EMPTY_TUPLE]);
                } else if !self.memo_get(*id) {
                    if items.len() > 3 {
                        self.write(&[MARK]);
                    }
                    for item in items {
                        self.save(item);
                    }
                    self.close_tuple(items.len());
                    self.memoize(*id);
                }
            }
        }
    }

    fn save_bytes(&mut self, b: &[u8], id: Id) {
        self.boundary();
        self.save_bytes_body(b, id);
    }

    fn save_bytes_body(&mut self, b: &[u8], id: Id) {
        if !self.memo_get(id) {
            let (head, n) = sized_header(SHORT_BINBYTES, BINBYTES, BINBYTES8, b.len());
            self.write_payload(&head[..n], b);
            self.memoize(id);
        }
    }

    fn close_tuple(&mut self, len: usize) {
        if len <= 3 {
            self.write(&[TUPLE1 + (len as u8 - 1)]);
        } else {
            self.write(&[TUPLE]);
        }
    }

    /// The token tuple: vLLM builds it fresh for every block, so it is never a memo hit.
    fn save_tokens(&mut self, tokens: &[u32]) {
        self.boundary();
        if tokens.is_empty() {
            self.write(&[EMPTY_TUPLE]);
            return;
        }
        if tokens.len() > 3 {
            self.write(&[MARK]);
        }
        let mut rest = tokens;
        while !rest.is_empty() {
            // A boundary check precedes every token, but none can commit while the frame stays
            // under the target, so the tokens that provably fit are written in one run.
            self.boundary();
            self.open_frame();
            let used = self.buf.len() - self.frame_start.unwrap() - FRAME_HEADER;
            let fit = (FRAME_SIZE_TARGET - 1 - used) / MAX_TOKEN_BYTES + 1;
            let (now, later) = rest.split_at(fit.min(rest.len()));
            tokenbytes::extend(&mut self.buf, now, tokenbytes::pickle);
            rest = later;
        }
        self.close_tuple(tokens.len());
        self.memoize(0);
    }

    fn write_int(&mut self, v: i64) {
        if let Ok(t) = u32::try_from(v) {
            let (word, n) = tokenbytes::pickle(t);
            self.write(&word.to_le_bytes()[..n]);
        } else if let Ok(small) = i32::try_from(v) {
            let b = small.to_le_bytes();
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else {
            self.write_long(&long_bytes(v as i128));
        }
    }

    fn write_long(&mut self, le: &[u8]) {
        if le.len() < 256 {
            self.write(&[LONG1, le.len() as u8]);
        } else {
            let n = (le.len() as u32).to_le_bytes();
            self.write(&[LONG4, n[0], n[1], n[2], n[3]]);
        }
        self.write(le);
    }
}

/// `PlainBlock`'s bytes before the tokens: PROTO 5, FRAME + length, the parent as
/// SHORT_BINBYTES 32 + MEMOIZE, MARK. The parent sits at `PLAIN_PARENT`.
const PLAIN_HEAD: usize = 47;
pub const PLAIN_PARENT: usize = 13;
/// After the tokens: TUPLE MEMOIZE, NONE, TUPLE3 MEMOIZE, STOP.
const PLAIN_TAIL: [u8; 6] = [TUPLE, MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP];

/// The room `PlainBlock` needs for `n` tokens: the longest pickle and 8 bytes of slack.
pub fn plain_room(n: usize) -> usize {
    PLAIN_HEAD + n * MAX_TOKEN_BYTES + PLAIN_TAIL.len() + 8
}

/// Whether `PlainBlock` writes what `Pickler::block` would for a block of `n` tokens: more
/// than 3 (MARK form) and few enough that the one frame never reaches 64 KiB.
pub fn plain_fits(n: usize) -> bool {
    n > 3 && plain_room(n) < FRAME_SIZE_TARGET
}

/// The hot case of `Pickler::block`, byte for byte: a 32-byte parent, no extra keys, a token
/// count where `plain_fits`. Such a pickle has one fixed shape (no frame boundary, no memo
/// hit), so it is written straight into a buffer (`plain_room` bytes at least) without the
/// pickler's bookkeeping, in steps (`start`, `token` for each token, `finish`) that a chain can
/// spread among the compression rounds of the block before. Everything but the parent is
/// written: its 32 bytes go at `PLAIN_PARENT`, written by the chain once the block before is
/// hashed.
pub struct PlainBlock {
    /// Where the next byte goes.
    at: usize,
}

impl PlainBlock {
    /// Writes the bytes before the tokens; `buf` must hold `plain_room(n_tokens)` bytes.
    #[inline(always)]
    pub fn start(buf: &mut [u8], n_tokens: usize) -> PlainBlock {
        debug_assert!(plain_fits(n_tokens));
        assert!(buf.len() >= plain_room(n_tokens));
        buf[..2].copy_from_slice(&PROTO_5);
        buf[2] = FRAME;
        buf[11..PLAIN_PARENT].copy_from_slice(&[SHORT_BINBYTES, 32]);
        buf[PLAIN_PARENT + 32..PLAIN_HEAD].copy_from_slice(&[MEMOIZE, MARK]);
        PlainBlock { at: PLAIN_HEAD }
    }

    #[inline(always)]
    pub fn token(&mut self, buf: &mut [u8], t: u32) {
        self.at = tokenbytes::put(buf, self.at, t, tokenbytes::pickle);
    }

    /// Writes the bytes after the tokens and the frame length; returns the pickle's length.
    #[inline(always)]
    pub fn finish(&self, buf: &mut [u8]) -> usize {
        let len = self.at + PLAIN_TAIL.len();
        buf[self.at..len].copy_from_slice(&PLAIN_TAIL);
        buf[3..11].copy_from_slice(&((len - 2 - FRAME_HEADER) as u64).to_le_bytes());
        len
    }
}

/// The 1-, 4- or 8-byte length form of a str/bytes opcode.
fn sized_header(short: u8, long: u8, huge: u8, len: usize) -> ([u8; 9], usize) {
    let mut head = [0u8; 9];
    if len < 256 {
        head[0] = short;
        head[1] = len as u8;
        (head, 2)
    } else if let Ok(n) = u32::try_from(len) {
        head[0] = long;
        head[1..5].copy_from_slice(&n.to_le_bytes());
        (head, 5)
    } else {
        head[0] = huge;
        head[1..9].copy_from_slice(&(len as u64).to_le_bytes());
        (head, 9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::testing::hex;
    use crate::hash::value::long_bytes;

    /// Expected bytes from CPython 3.11's `pickle.dumps(..., protocol=5)` of
    /// `(b"\x01" * 32, (0, 1, 255, 256, 65535, 65536, 2**31, 2**32 - 1),
    ///   (lora, (lora, 7), other, -1, 2**70, b"x", None, True))`
    /// where `lora` is one str object and `other` an equal but distinct one: the second `lora`
    /// is a memo back-reference (BINGET 2), `other` is written out again.
    #[test]
    fn block_pickle_memoizes_by_identity() {
        let lora = Value::Str(b"adapter".to_vec(), 1);
        let other = Value::Str(b"adapter".to_vec(), 2);
        let extra = Value::Tuple(
            vec![
                lora.clone(),
                Value::Tuple(vec![lora, Value::Int(7)], 3),
                other,
                Value::Int(-1),
                Value::BigInt(long_bytes(1i128 << 70)),
                Value::Bytes(b"x".to_vec(), 4),
                Value::None,
                Value::Bool(true),
            ],
            5,
        );
        let tokens = [0, 1, 255, 256, 65535, 65536, 1 << 31, u32::MAX];
        let mut out = b"kept".to_vec();
        let mut pickler = Pickler::default();
        pickler.block(&mut out, &[1u8; 32], 0, &tokens, Some(&extra));
        let expected = hex(concat!(
            "8005957b0000000000000043200101010101010101010101010101010101010101010101010101010101010101",
            "9428",
            "4b004b014bff4d00014dffff4a000001008a0500000080008a05ffffffff007494",
            "288c0761646170746572946802",
            "4b0786948c0761646170746572944affffffff8a09000000000000000040430178944e88749487942e",
        ));
        assert_eq!(&out[..4], b"kept"); // appends
        assert_eq!(out[4..], expected[..]);

        // The pickler is reusable: a second block starts a fresh memo.
        let mut again = Vec::new();
        pickler.block(&mut again, &[1u8; 32], 0, &tokens, Some(&extra));
        assert_eq!(again, expected);
    }

    /// The fast path agrees with the pickler on every block length it takes and on tokens of
    /// every encoding width (1, 2, 4 and 5 payload bytes).
    #[test]
    fn plain_block_matches_pickler() {
        let widths = [7u32, 300, 70_000, 1 << 31, u32::MAX, 0, 255, 65_535, 65_536];
        let parent: [u8; 32] = std::array::from_fn(|i| i as u8 * 7);
        let mut pickler = Pickler::default();
        for n in [4, 5, 16, 17, 64, 1000, 9000] {
            assert!(plain_fits(n));
            let tokens: Vec<u32> = (0..n).map(|i| widths[(i * 5 + n) % widths.len()]).collect();
            let mut want = Vec::new();
            pickler.block(&mut want, &parent, 0, &tokens, None);
            let mut buf = vec![0xa5; plain_room(n)];
            let mut pickle = PlainBlock::start(&mut buf, n);
            for &t in &tokens {
                pickle.token(&mut buf, t);
            }
            let len = pickle.finish(&mut buf);
            buf[PLAIN_PARENT..PLAIN_PARENT + 32].copy_from_slice(&parent);
            assert_eq!(buf[..len], want[..], "{n} tokens");
        }
        assert!(!plain_fits(3) && !plain_fits(10_000));
    }

    /// `pickle.dumps("vllm-none-hash", protocol=5)`: vLLM's default NONE_HASH seed.
    #[test]
    fn seed_pickle() {
        let mut out = Vec::new();
        Pickler::default().value(&mut out, &Value::Str(b"vllm-none-hash".to_vec(), 9));
        assert_eq!(
            out,
            hex("80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e")
        );
    }
}
