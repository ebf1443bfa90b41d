//! The keys a query walks: given (engine hashes, or keys already made), or hashed from token ids
//! as the walk reaches them. A query stops at the first block nobody it still counts holds (56
//! of 128 blocks on average in bench/native's workload); hashing every block of a prompt first
//! was about half of a token query.

use crate::hash::algo::xxh3_chain;

/// Blocks hashed at a time when the walk needs a key not made yet: enough for xxh3's loop to
/// run at speed, few enough that a query ending early hashes little beyond its end.
const CHUNK: usize = 8;

/// A query's index keys, as `Core`'s walk asks for them.
pub trait QueryKeys {
    /// How many blocks the query has.
    fn total(&self) -> usize;
    /// Block `i`'s key (`i < total()`).
    fn key(&mut self, i: usize) -> u64;
    /// Every block's key.
    fn all(&mut self) -> &[u64];
}

impl QueryKeys for &[u64] {
    #[inline(always)]
    fn total(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn key(&mut self, i: usize) -> u64 {
        self[i]
    }
    fn all(&mut self) -> &[u64] {
        self
    }
}

/// The `key="tokens"` keys of `tokens`' full blocks without extra keys (the chained xxh3 of
/// `hash::algo::index_keys`), made `CHUNK` blocks at a time as they are asked for.
pub struct TokenKeys<'a> {
    tokens: &'a [u32],
    block_size: usize,
    /// The key before block 0's: the LoRA name's salt.
    seed: u64,
    keys: &'a mut Vec<u64>,
}

impl<'a> TokenKeys<'a> {
    /// `keys` is scratch space (cleared here); `seed` is `salted(0, lora_name, None)`.
    pub fn new(tokens: &'a [u32], block_size: usize, seed: u64, keys: &'a mut Vec<u64>) -> Self {
        assert!(block_size > 0, "a block holds at least one token");
        keys.clear();
        TokenKeys {
            tokens,
            block_size,
            seed,
            keys,
        }
    }

    /// Hashes on from the last key made to block `n` at least (`CHUNK` blocks at least, the
    /// query's end at most).
    #[inline(never)]
    fn grow(&mut self, n: usize) {
        let bs = self.block_size;
        let have = self.keys.len();
        let n = n.max(have + CHUNK).min(self.total());
        let seed = self.keys.last().copied().unwrap_or(self.seed);
        xxh3_chain(&self.tokens[have * bs..n * bs], bs, seed, self.keys);
    }
}

impl QueryKeys for TokenKeys<'_> {
    #[inline(always)]
    fn total(&self) -> usize {
        self.tokens.len() / self.block_size
    }
    #[inline(always)]
    fn key(&mut self, i: usize) -> u64 {
        if i >= self.keys.len() {
            self.grow(i + 1);
        }
        self.keys[i]
    }
    fn all(&mut self) -> &[u64] {
        if self.keys.len() < self.total() {
            self.grow(self.total());
        }
        self.keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::algo::{index_keys, salted};

    #[test]
    fn token_keys_are_index_keys_made_in_any_order() {
        let tokens: Vec<u32> = (0..16 * 40 + 7)
            .map(|i| (i * 7919) as u32 % 150_000)
            .collect();
        for lora in [None, Some("adapter")] {
            let mut want = Vec::new();
            index_keys(&tokens, 16, lora, None, None, &mut want);
            assert_eq!(want.len(), 40);
            let seed = salted(0, lora, None);
            // Asked one by one, out of order, then whole: always the same keys.
            let mut scratch = vec![99];
            let mut k = TokenKeys::new(&tokens, 16, seed, &mut scratch);
            assert_eq!(k.total(), 40);
            for i in [0, 3, 2, 9, 8, 17, 16, 39, 1] {
                assert_eq!(k.key(i), want[i], "key {i}");
            }
            assert_eq!(k.all(), &want[..]);
            let mut scratch = Vec::new();
            let mut k = TokenKeys::new(&tokens, 16, seed, &mut scratch);
            assert_eq!(k.all(), &want[..]);
            let mut scratch = Vec::new();
            let mut k = TokenKeys::new(&tokens[..15], 16, seed, &mut scratch);
            assert_eq!((k.total(), k.all().len()), (0, 0));
        }
    }
}
