//! SHA-256 for vLLM's chain, in the caller's buffers: one message padded in place and
//! compressed in one `sha2::compress256` call (the streaming hasher's copying into its own
//! block buffer cost a fifth of the hash of a 2-3 block pickle), and `chain`, a run of block
//! pickles each holding the digest of the one before, hashed close to the speed of SHA-256
//! over one long message (bench/hashing.py's ceiling row).

use sha2::digest::consts::U64;
use sha2::digest::generic_array::GenericArray;

use super::pickle::PLAIN_PARENT;

const IV: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// The most bytes the padding adds to a message (0x80, zeros, 8-byte length).
pub const PAD_ROOM: usize = 72;

/// The digest of `data`, which is padded in place and restored.
pub fn in_place(data: &mut Vec<u8>) -> [u8; 32] {
    let len = data.len();
    data.resize(len + PAD_ROOM, 0);
    let padded = pad(data, len);
    let digest = digest_bytes(&compress_padded(&data[..padded]));
    data.truncate(len);
    digest
}

/// Appends the padding to `buf[..len]` in place (`buf` holds `len + PAD_ROOM` bytes); returns
/// the padded length.
#[inline(always)]
pub fn pad(buf: &mut [u8], len: usize) -> usize {
    let padded = (len + 9).div_ceil(64) * 64;
    // A fixed-size fill is a few vector stores; the zeros needed end before len + 64.
    buf[len..len + 64].fill(0);
    buf[len] = 0x80;
    buf[padded - 8..padded].copy_from_slice(&(len as u64 * 8).to_be_bytes());
    padded
}

/// The final state of a message `pad` has padded, every block compressed in one call.
#[inline(always)]
pub fn compress_padded(padded: &[u8]) -> [u32; 8] {
    // SAFETY: GenericArray<u8, U64> is repr(transparent) over 64 u8 in repr(C) structs: size 64,
    // align 1, so the padded message is exactly len / 64 such blocks.
    let blocks = unsafe {
        std::slice::from_raw_parts(
            padded.as_ptr().cast::<GenericArray<u8, U64>>(),
            padded.len() / 64,
        )
    };
    let mut state = IV;
    sha2::compress256(&mut state, blocks);
    state
}

/// The digest: the state words big-endian.
#[inline(always)]
pub fn digest_bytes(state: &[u32; 8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(state) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// The messages `chain` hashes, written in steps so that the writing of one can run among the
/// compression rounds of the one before: `start`, then `step` until it returns the length.
/// Everything but the parent's 32 bytes at `PLAIN_PARENT`, which `chain` fills in; `chain`
/// also pads.
pub trait Messages {
    type Cursor;
    /// Begins message `k` in `buf`, which has `stride` bytes (room for the padding included).
    fn start(&self, k: usize, buf: &mut [u8]) -> Self::Cursor;
    /// A small piece of the writing (a few instructions); the message's length once it is
    /// complete.
    fn step(&self, cursor: &mut Self::Cursor, buf: &mut [u8]) -> Option<usize>;
}

/// vLLM's sha256 chain over `n` messages that differ from one another only in the 32 bytes
/// at `PLAIN_PARENT`, each the digest of the one before (`parent` for the first). `emit`
/// receives each digest in order. `scratch` holds two messages of `stride` bytes.
///
/// Software-pipelined: only the parent waits for the message before, so message k + 1 is
/// written in the other half of `scratch` while message k is compressed, and the core runs the
/// writing while the compression's dependent SHA instructions wait on each other.
pub fn chain<M: Messages>(
    scratch: &mut [u8],
    stride: usize,
    n: usize,
    parent: &[u8; 32],
    messages: &M,
    emit: impl FnMut(&[u8; 32]),
) {
    #[cfg(target_arch = "x86_64")]
    if shani::available() {
        // SAFETY: the CPU has the features shani::chain is compiled for.
        return unsafe { shani::chain(scratch, stride, n, parent, messages, emit) };
    }
    portable_chain(scratch, stride, n, parent, messages, emit)
}

/// Message `k` written whole and padded; returns the padded length.
fn write<M: Messages>(messages: &M, k: usize, buf: &mut [u8]) -> usize {
    let mut cursor = messages.start(k, buf);
    loop {
        if let Some(len) = messages.step(&mut cursor, buf) {
            return pad(buf, len);
        }
    }
}

/// `chain` through `sha2::compress256`, the parent copied into each message in memory.
fn portable_chain<M: Messages>(
    scratch: &mut [u8],
    stride: usize,
    n: usize,
    parent: &[u8; 32],
    messages: &M,
    mut emit: impl FnMut(&[u8; 32]),
) {
    if n == 0 {
        return;
    }
    let (mut now, mut ahead) = scratch[..2 * stride].split_at_mut(stride);
    let mut padded = write(messages, 0, now);
    let mut digest = *parent;
    for k in 0..n {
        now[PLAIN_PARENT..PLAIN_PARENT + 32].copy_from_slice(&digest);
        let next = if k + 1 < n {
            write(messages, k + 1, ahead)
        } else {
            0
        };
        digest = digest_bytes(&compress_padded(&now[..padded]));
        emit(&digest);
        padded = next;
        std::mem::swap(&mut now, &mut ahead);
    }
}

/// `chain` with the SHA extensions, adapted from RustCrypto sha2 0.10's x86 backend
/// (MIT/Apache-2.0). The state stays in registers from one message to the next: a message's
/// first 64 bytes are merged with the parent digest in registers rather than through memory,
/// where a 16-byte load overlapping part of a just-written parent would wait for the store to
/// reach the cache, on the critical path of every block. The next message is written one
/// `step` after each four rounds, so the core sees that work interleaved with the rounds: as
/// one run before them it waited behind the SHA instructions queued ahead of it. Finishing it
/// there too (not after the rounds) keeps its last stores, which the next message's first
/// loads read, out of that critical path as well.
#[cfg(target_arch = "x86_64")]
mod shani {
    use std::arch::x86_64::*;

    use super::{pad, Messages, IV, PLAIN_PARENT};

    const K32: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];

    pub fn available() -> bool {
        is_x86_feature_detected!("sha")
            && is_x86_feature_detected!("sse4.1")
            && is_x86_feature_detected!("ssse3")
    }

    // The helpers are `unsafe fn`s rather than `#[target_feature]` ones so that they can be
    // `#[inline(always)]` (the two do not combine): their callers are compiled for the features.

    /// Big-endian 32-bit words <-> bytes.
    ///
    /// # Safety
    /// The CPU has sha, ssse3 and sse4.1 (these helpers run only under `chain`, which
    /// `available()` guards).
    #[inline(always)]
    unsafe fn bswap32(v: __m128i) -> __m128i {
        // SAFETY: the CPU has the features the intrinsics need (this function's contract).
        unsafe {
            _mm_shuffle_epi8(
                v,
                _mm_set_epi64x(0x0C0D_0E0F_0809_0A0B, 0x0405_0607_0001_0203),
            )
        }
    }

    /// The message schedule: the next four words from the previous sixteen.
    ///
    /// # Safety
    /// The CPU has sha, ssse3 and sse4.1 (these helpers run only under `chain`, which
    /// `available()` guards).
    #[inline(always)]
    unsafe fn schedule(v0: __m128i, v1: __m128i, v2: __m128i, v3: __m128i) -> __m128i {
        // SAFETY: the CPU has the features the intrinsics need (this function's contract).
        unsafe {
            let t1 = _mm_sha256msg1_epu32(v0, v1);
            let t2 = _mm_alignr_epi8(v3, v2, 4);
            _mm_sha256msg2_epu32(_mm_add_epi32(t1, t2), v3)
        }
    }

    /// Rounds 4i..4i + 4 (i < 16).
    ///
    /// # Safety
    /// The CPU has sha, ssse3 and sse4.1 (these helpers run only under `chain`, which
    /// `available()` guards), and `i` < 16.
    #[inline(always)]
    unsafe fn rounds4(abef: &mut __m128i, cdgh: &mut __m128i, w: __m128i, i: usize) {
        // SAFETY: the features as above; K32 has 64 words, so words 4i..4i + 4 are inside it
        // for i < 16 (this function's contract).
        unsafe {
            let k = _mm_loadu_si128(K32.as_ptr().add(4 * i).cast());
            let t1 = _mm_add_epi32(w, k);
            *cdgh = _mm_sha256rnds2_epu32(*cdgh, *abef, t1);
            *abef = _mm_sha256rnds2_epu32(*abef, *cdgh, _mm_shuffle_epi32(t1, 0x0E));
        }
    }

    /// One 64-byte block given as its four message vectors (big-endian words), with a step
    /// of `writer` after every four rounds.
    ///
    /// # Safety
    /// The CPU has sha, ssse3 and sse4.1 (these helpers run only under `chain`, which
    /// `available()` guards).
    #[inline(always)]
    unsafe fn block<M: Messages>(
        abef: &mut __m128i,
        cdgh: &mut __m128i,
        w: [__m128i; 4],
        writer: &mut Writer<'_, M>,
    ) {
        // SAFETY: the CPU has the features the intrinsics and helpers need (this function's
        // contract).
        // Every `rounds4` index is below 16.
        unsafe {
            let (abef_save, cdgh_save) = (*abef, *cdgh);
            let [mut w0, mut w1, mut w2, mut w3] = w;
            rounds4(abef, cdgh, w0, 0);
            writer.tick();
            rounds4(abef, cdgh, w1, 1);
            writer.tick();
            rounds4(abef, cdgh, w2, 2);
            writer.tick();
            rounds4(abef, cdgh, w3, 3);
            writer.tick();
            for i in (4..16).step_by(4) {
                w0 = schedule(w0, w1, w2, w3);
                rounds4(abef, cdgh, w0, i);
                writer.tick();
                w1 = schedule(w1, w2, w3, w0);
                rounds4(abef, cdgh, w1, i + 1);
                writer.tick();
                w2 = schedule(w2, w3, w0, w1);
                rounds4(abef, cdgh, w2, i + 2);
                writer.tick();
                w3 = schedule(w3, w0, w1, w2);
                rounds4(abef, cdgh, w3, i + 3);
                writer.tick();
            }
            *abef = _mm_add_epi32(*abef, abef_save);
            *cdgh = _mm_add_epi32(*cdgh, cdgh_save);
        }
    }

    /// The 64 bytes at `bytes` as four message vectors (big-endian words).
    ///
    /// # Safety
    /// `bytes` points at 64 readable bytes, and the CPU has the features as for `bswap32`.
    #[inline(always)]
    unsafe fn load_block(bytes: *const u8) -> [__m128i; 4] {
        let p = bytes.cast::<__m128i>();
        // SAFETY: the four unaligned 16-byte loads cover the 64 bytes the caller vouches for;
        // the features as above.
        [0, 1, 2, 3].map(|i| unsafe { bswap32(_mm_loadu_si128(p.add(i))) })
    }

    /// Writes the message after the one being compressed, a step at a time.
    struct Writer<'b, M: Messages> {
        messages: &'b M,
        buf: &'b mut [u8],
        next: Next<M::Cursor>,
    }

    enum Next<C> {
        Writing(C),
        Padded(usize),
        Last,
    }

    impl<M: Messages> Writer<'_, M> {
        /// One step of the writing, and the padding once it is complete. A method rather than
        /// a closure: a closure called this often was compiled out of line, and the SHA state
        /// went through the stack around every call.
        #[inline(always)]
        fn tick(&mut self) {
            if let Next::Writing(c) = &mut self.next {
                if let Some(len) = self.messages.step(c, self.buf) {
                    self.next = Next::Padded(pad(self.buf, len));
                }
            }
        }

        /// The padded length of the message written (0 after the last message).
        #[inline(always)]
        fn finish(mut self) -> usize {
            loop {
                match self.next {
                    Next::Writing(_) => self.tick(),
                    Next::Padded(padded) => return padded,
                    Next::Last => return 0,
                }
            }
        }
    }

    /// `super::chain` with the SHA extensions.
    ///
    /// # Safety
    /// The CPU has sha, ssse3 and sse4.1 (`available()` says so).
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub unsafe fn chain<M: Messages>(
        scratch: &mut [u8],
        stride: usize,
        n: usize,
        parent: &[u8; 32],
        messages: &M,
        mut emit: impl FnMut(&[u8; 32]),
    ) {
        const _: () = assert!(
            PLAIN_PARENT == 13,
            "the shifts below place the parent at byte 13"
        );
        if n == 0 {
            return;
        }
        // The initial state in the instructions' ABEF/CDGH layout.
        // SAFETY: IV holds 8 words: two 16-byte loads, at words 0 and 4.
        let (dcba, efgh) = unsafe {
            (
                _mm_loadu_si128(IV.as_ptr().cast()),
                _mm_loadu_si128(IV.as_ptr().add(4).cast()),
            )
        };
        let efgh = _mm_shuffle_epi32(efgh, 0x1B);
        let cdab = _mm_shuffle_epi32(dcba, 0xB1);
        let abef_iv = _mm_alignr_epi8(cdab, efgh, 8);
        let cdgh_iv = _mm_blend_epi16(efgh, cdab, 0xF0);
        // Bytes 0..13 of a message's first 16 are the message's own, the rest the parent's.
        let head = _mm_set_epi32(0xff, -1, -1, -1);

        let (mut now, mut ahead) = scratch[..2 * stride].split_at_mut(stride);
        let mut padded = super::write(messages, 0, now);
        // The digest as big-endian bytes in two vectors.
        // SAFETY: two 16-byte loads from the 32 bytes of `parent`.
        let (mut p0, mut p1) = unsafe {
            (
                _mm_loadu_si128(parent.as_ptr().cast()),
                _mm_loadu_si128(parent.as_ptr().add(16).cast()),
            )
        };
        for k in 0..n {
            // The message's blocks are read through `m` while `writer` writes the next message
            // into `ahead`, the other half of `scratch`.
            assert!(padded >= 64 && padded <= now.len() && padded % 64 == 0);
            let m = now.as_ptr().cast::<__m128i>();
            let next = match k + 1 < n {
                true => Next::Writing(messages.start(k + 1, ahead)),
                false => Next::Last,
            };
            let mut writer = Writer {
                messages,
                buf: &mut *ahead,
                next,
            };
            // SAFETY: 16-byte loads at 16-byte units 0, 2 and 3 of the message, which the assert
            // shows is at least 64 bytes long.
            let (m0, m2, m3) = unsafe {
                (
                    _mm_loadu_si128(m),
                    _mm_loadu_si128(m.add(2)),
                    _mm_loadu_si128(m.add(3)),
                )
            };
            let first = [
                _mm_or_si128(_mm_and_si128(m0, head), _mm_slli_si128(p0, 13)),
                _mm_or_si128(_mm_srli_si128(p0, 3), _mm_slli_si128(p1, 13)),
                _mm_or_si128(_mm_andnot_si128(head, m2), _mm_srli_si128(p1, 3)),
                m3,
            ];
            let (mut abef, mut cdgh) = (abef_iv, cdgh_iv);
            // SAFETY: the CPU has the features the helpers need (this function's contract).
            unsafe { block(&mut abef, &mut cdgh, first.map(|c| bswap32(c)), &mut writer) };
            for at in (64..padded).step_by(64) {
                // SAFETY: the features as above; `at` + 64 <= `padded` <= the message's length
                // (the assert), so the block's 64 bytes are inside it.
                unsafe {
                    block(
                        &mut abef,
                        &mut cdgh,
                        load_block(m.cast::<u8>().add(at)),
                        &mut writer,
                    )
                };
            }
            let feba = _mm_shuffle_epi32(abef, 0x1B);
            let dchg = _mm_shuffle_epi32(cdgh, 0xB1);
            // SAFETY: the features as above.
            (p0, p1) = unsafe {
                (
                    bswap32(_mm_blend_epi16(feba, dchg, 0xF0)),
                    bswap32(_mm_alignr_epi8(dchg, feba, 8)),
                )
            };
            let mut digest = [0u8; 32];
            // SAFETY: two 16-byte stores into the 32 bytes of `digest`.
            unsafe {
                _mm_storeu_si128(digest.as_mut_ptr().cast(), p0);
                _mm_storeu_si128(digest.as_mut_ptr().add(16).cast(), p1);
            }
            emit(&digest);
            padded = writer.finish();
            std::mem::swap(&mut now, &mut ahead);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages like vLLM's block pickles (parent at PLAIN_PARENT) of 1-4 SHA blocks, chained
    /// by `chain` (SHA extensions where the CPU has them), by the portable loop, and one by one
    /// through `in_place`: all three agree.
    #[test]
    fn chain_matches_one_by_one() {
        /// Message k: `lens[k]` bytes of a pattern, written one byte per step.
        struct Pattern(Vec<usize>);
        impl Messages for Pattern {
            type Cursor = (usize, usize);
            fn start(&self, k: usize, _: &mut [u8]) -> (usize, usize) {
                (k, 0)
            }
            fn step(&self, (k, i): &mut (usize, usize), buf: &mut [u8]) -> Option<usize> {
                if *i == self.0[*k] {
                    return Some(*i);
                }
                buf[*i] = byte(*k, *i);
                *i += 1;
                None
            }
        }
        fn byte(k: usize, i: usize) -> u8 {
            (k * 31 + i * 7) as u8
        }
        let lens: Vec<usize> = (0..40).map(|k| 47 + (k * 37) % 200).collect();
        let parent: [u8; 32] = std::array::from_fn(|i| i as u8);
        let mut want = Vec::new();
        let mut digest = parent;
        for (k, &len) in lens.iter().enumerate() {
            let mut msg: Vec<u8> = (0..len).map(|i| byte(k, i)).collect();
            msg[PLAIN_PARENT..PLAIN_PARENT + 32].copy_from_slice(&digest);
            digest = in_place(&mut msg);
            want.push(digest);
        }
        let stride = 256 + PAD_ROOM;
        let messages = Pattern(lens);
        let mut scratch = vec![0u8; 2 * stride];
        let mut got = Vec::new();
        chain(&mut scratch, stride, want.len(), &parent, &messages, |d| {
            got.push(*d)
        });
        assert_eq!(got, want);
        let mut portable = Vec::new();
        portable_chain(&mut scratch, stride, want.len(), &parent, &messages, |d| {
            portable.push(*d)
        });
        assert_eq!(portable, want);
    }

    /// `hashlib.sha256(b"abc")`, through pad + compress.
    #[test]
    fn padded_in_place_matches_sha256() {
        let mut abc = b"abc".to_vec();
        assert_eq!(
            in_place(&mut abc).to_vec(),
            crate::hash::testing::hex(
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            )
        );
        assert_eq!(abc, b"abc");
    }
}
