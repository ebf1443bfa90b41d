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
