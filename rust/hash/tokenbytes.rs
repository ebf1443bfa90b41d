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
    // SAFETY: the reservation covers `store`'s reach; set_len only covers bytes it wrote.
    unsafe {
        let used = store(buf.as_mut_ptr().add(buf.len()), tokens, encode);
        buf.set_len(buf.len() + used);
    }
}

/// Writes `encode(t)` for every token at the start of `buf` and returns the bytes used. `buf`
/// must have 8 bytes of slack past the longest encoding (`tokens.len() * MAX_TOKEN_BYTES + 8`).
#[inline(always)]
pub fn write(buf: &mut [u8], tokens: &[u32], encode: impl Fn(u32) -> (u64, usize)) -> usize {
    assert!(buf.len() >= tokens.len() * MAX_TOKEN_BYTES + 8);
    // SAFETY: `buf` covers `store`'s reach, by the assertion.
    unsafe { store(buf.as_mut_ptr(), tokens, encode) }
}

/// Stores every token's 8-byte word at `dst` + the bytes used so far; returns the bytes used.
/// SAFETY: `dst` must be writable for `tokens.len() * MAX_TOKEN_BYTES + 8` bytes (the store for
/// token k lands at most k * MAX_TOKEN_BYTES bytes in).
#[inline(always)]
unsafe fn store(dst: *mut u8, tokens: &[u32], encode: impl Fn(u32) -> (u64, usize)) -> usize {
    let mut at = 0;
    for &t in tokens {
        let (word, n) = encode(t);
        dst.add(at).cast::<u64>().write_unaligned(word.to_le());
        at += n;
    }
    at
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
