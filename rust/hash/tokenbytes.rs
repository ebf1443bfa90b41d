//! Writing token ids as pickle or CBOR ints without a branch per token.
//!
//! Token magnitudes are random, so "which encoding" branches mispredict about half the time.
//! Each encoder instead returns the encoded bytes packed little-endian in a u64 plus how many of
//! them count; all 8 are stored and the cursor advances by the count.

/// The most bytes one token takes (pickle LONG1 with a 5-byte payload).
pub const MAX_TOKEN_BYTES: usize = 7;

/// Appends `encode(t)` for every token.
#[inline(always)]
pub fn extend(buf: &mut Vec<u8>, tokens: &[u32], encode: impl Fn(u32) -> (u64, usize)) {
    // The slack of 8 lets every token store a whole u64.
    buf.reserve(tokens.len() * MAX_TOKEN_BYTES + 8);
    // SAFETY: each store writes 8 bytes at most len + n*MAX_TOKEN_BYTES + 1 bytes in, inside the
    // reservation; set_len only covers bytes that were written.
    unsafe {
        let start = buf.as_mut_ptr();
        let mut at = buf.len();
        for &t in tokens {
            let (word, n) = encode(t);
            start.add(at).cast::<u64>().write_unaligned(word.to_le());
            at += n;
        }
        buf.set_len(at);
    }
}

/// Writes `encode(t)` at `buf[at..]` and returns where the next token goes. `buf` must have
/// room for a whole u64 at `at`.
#[inline(always)]
pub fn put(buf: &mut [u8], at: usize, t: u32, encode: impl Fn(u32) -> (u64, usize)) -> usize {
    let (word, n) = encode(t);
    buf[at..at + 8].copy_from_slice(&word.to_le_bytes());
    at + n
}

/// pickle: BININT1 (K), BININT2 (M), BININT (J) or, above i32, LONG1 with 5 bytes.
#[inline(always)]
pub fn pickle(t: u32) -> (u64, usize) {
    const OPCODE: [u64; 3] = [b'K' as u64, b'M' as u64, b'J' as u64];
    const LEN: [usize; 4] = [2, 3, 5, 7];
    let class = (t > 0xff) as usize + (t > 0xffff) as usize + (t > 0x7fff_ffff) as usize;
    let word = if class == 3 {
        // LONG1, length 5, the 4 bytes, a zero sign byte (already zero above t).
        0x058a | (t as u64) << 16
    } else {
        OPCODE[class.min(2)] | (t as u64) << 8
    };
    (word, LEN[class])
}

/// CBOR major type 0: the value itself below 24, else 0x18/0x19/0x1a and 1/2/4 big-endian bytes.
#[inline(always)]
pub fn cbor(t: u32) -> (u64, usize) {
    const HEAD: [u64; 4] = [0, 0x18, 0x19, 0x1a];
    const SHIFT: [u32; 4] = [0, 24, 16, 0];
    const LEN: [usize; 4] = [1, 2, 3, 5];
    let class = (t >= 24) as usize + (t > 0xff) as usize + (t > 0xffff) as usize;
    let big_endian = t.swap_bytes() as u64;
    let word = if class == 0 {
        t as u64
    } else {
        HEAD[class] | (big_endian >> SHIFT[class]) << 8
    };
    (word, LEN[class])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::testing::hex;

    /// The bytes `encode` says count, as a Vec.
    fn bytes_of(encode: impl Fn(u32) -> (u64, usize), t: u32) -> Vec<u8> {
        let (word, n) = encode(t);
        assert!(n <= MAX_TOKEN_BYTES);
        word.to_le_bytes()[..n].to_vec()
    }

    /// Python's pickle opcodes (Lib/pickle.py save_long): BININT1 below 256, BININT2 below 65536,
    /// BININT (signed) below 2**31, then LONG1 with a little-endian two's complement payload.
    /// CBOR major type 0 (RFC 8949 3.1): the value below 24, else 1, 2 or 4 big-endian bytes.
    #[test]
    fn ints_at_every_boundary() {
        for (t, pickled, cbor_head) in [
            (0, "4b00", "00"),
            (23, "4b17", "17"),
            (24, "4b18", "1818"),
            (0xff, "4bff", "18ff"),
            (0x100, "4d0001", "190100"),
            (0xffff, "4dffff", "19ffff"),
            (0x1_0000, "4a00000100", "1a00010000"),
            (0x7fff_ffff, "4affffff7f", "1a7fffffff"),
            (0x8000_0000, "8a050000008000", "1a80000000"),
            (u32::MAX, "8a05ffffffff00", "1affffffff"),
        ] {
            assert_eq!(bytes_of(pickle, t), hex(pickled), "pickle {t}");
            assert_eq!(bytes_of(cbor, t), hex(cbor_head), "cbor {t}");
        }
    }

    /// Every token stores 8 bytes and advances by its own length: the result is the
    /// concatenation, after what the buffer held, whatever the mix of lengths.
    #[test]
    fn extend_concatenates_after_existing_bytes() {
        let tokens = [
            0,
            u32::MAX,
            23,
            24,
            0xff,
            0x100,
            0xffff,
            0x1_0000,
            0x7fff_ffff,
            0x8000_0000,
            5,
        ];
        for encode in [pickle as fn(u32) -> (u64, usize), cbor] {
            let mut buf = b"head".to_vec();
            extend(&mut buf, &tokens, encode);
            let want: Vec<u8> = b"head"
                .iter()
                .copied()
                .chain(tokens.iter().flat_map(|&t| bytes_of(encode, t)))
                .collect();
            assert_eq!(buf, want);
            extend(&mut buf, &[], encode);
            assert_eq!(buf, want);
        }
        // All at the longest form: the reservation's worst case.
        let mut buf = Vec::new();
        extend(&mut buf, &[u32::MAX; 1000], pickle);
        assert_eq!(buf.len(), 1000 * MAX_TOKEN_BYTES);
        assert!(buf
            .chunks(MAX_TOKEN_BYTES)
            .all(|c| c == hex("8a05ffffffff00")));
    }

    #[test]
    fn put_writes_in_place_and_returns_the_next_position() {
        let mut buf = [0xeeu8; 20];
        let at = put(&mut buf, 0, 0x100, cbor);
        let at = put(&mut buf, at, 7, cbor);
        assert_eq!(at, 4);
        assert_eq!(buf[..4], hex("19010007")[..]);
        // The whole u64 is stored: the byte after the last token is scratch, not kept.
        assert_eq!(buf[12..], [0xee; 8]);
    }

    #[test]
    #[should_panic]
    fn put_needs_room_for_a_whole_word() {
        let mut buf = [0u8; 8];
        put(&mut buf, 1, 1, cbor);
    }
}
