//! The chained block hash algorithms, on plain Rust data (no GIL needed).
//!
//! - `xxh3` (kvbridge's own, the default): h[-1] = seed salted by lora/namespace like Dynamo's,
//!   h[i] = XXH3_64(u32 LE tokens of block i, seed = s[i]) with s[i] = h[i-1], or, for a block
//!   with extra keys, s[i] = XXH3_64(canonical CBOR of the extra keys, seed = h[i-1]).
//!   Seeding with the parent chains the blocks without copying tokens next to the parent, so a
//!   token buffer is hashed in place.
//! - `dynamo`: Dynamo's LocalBlockHash (content only, not chained): XXH3_64 over u32 LE tokens,
//!   followed by the block's sorted multimodal hashes as u64 LE, seed 1337 salted by lora/namespace.
//! - `dynamo_seq`: Dynamo's SequenceHash: seq[0] = local[0], seq[i] = XXH3_64(seq[i-1] LE ++
//!   local[i] LE, seed 1337).
//! - `sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`: vLLM's hash_block_tokens,
//!   H((parent or NONE_HASH, tuple(tokens), extra_keys)) over pickle protocol 5 or canonical CBOR,
//!   H = SHA-256 or XXH3-128 (big-endian digest).

use xxhash_rust::xxh3::{xxh3_128, xxh3_64_with_seed};

use super::cbor;
use super::pickle::{self, Pickler};
use super::sha256;
use super::value::{Id, Value};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Algo {
    Xxh3,
    Dynamo,
    DynamoSeq,
    Sha256,
    Sha256Cbor,
    Xxhash,
    XxhashCbor,
}

pub const ALGORITHMS: [(&str, Algo); 7] = [
    ("xxh3", Algo::Xxh3),
    ("dynamo", Algo::Dynamo),
    ("dynamo_seq", Algo::DynamoSeq),
    ("sha256", Algo::Sha256),
    ("sha256_cbor", Algo::Sha256Cbor),
    ("xxhash", Algo::Xxhash),
    ("xxhash_cbor", Algo::XxhashCbor),
];

/// Dynamo's XXH3_SEED.
pub const DYNAMO_SEED: u64 = 1337;

impl Algo {
    pub fn parse(name: &str) -> Option<Algo> {
        ALGORITHMS.iter().find(|(n, _)| *n == name).map(|&(_, a)| a)
    }

    pub fn name(self) -> &'static str {
        ALGORITHMS
            .iter()
            .find(|(_, a)| *a == self)
            .map(|&(n, _)| n)
            .unwrap()
    }

    pub fn is_vllm(self) -> bool {
        matches!(
            self,
            Algo::Sha256 | Algo::Sha256Cbor | Algo::Xxhash | Algo::XxhashCbor
        )
    }

    pub fn is_dynamo(self) -> bool {
        matches!(self, Algo::Dynamo | Algo::DynamoSeq)
    }

    /// Whether extra keys end up as CBOR (and so must be valid UTF-8 text).
    pub fn cbor_extras(self) -> bool {
        matches!(self, Algo::Xxh3 | Algo::Sha256Cbor | Algo::XxhashCbor)
    }

    /// Bytes in a full digest; the 64-bit algorithms' digest is the hash big-endian.
    pub fn digest_len(self) -> usize {
        match self {
            Algo::Sha256 | Algo::Sha256Cbor => 32,
            Algo::Xxhash | Algo::XxhashCbor => 16,
            _ => 8,
        }
    }

    /// vLLM's hash function over the serialised bytes in `data`, which it may pad in place.
    fn digest(self, data: &mut Vec<u8>) -> Digest {
        match self {
            Algo::Sha256 | Algo::Sha256Cbor => Digest::new(&sha256::in_place(data)),
            Algo::Xxhash | Algo::XxhashCbor => Digest::new(&xxh3_128(data).to_be_bytes()),
            _ => unreachable!("{} does not serialise blocks", self.name()),
        }
    }
}

/// Dynamo's request salt: lora name and cache namespace (empty means absent) added to the seed.
pub fn salted(base: u64, lora_name: Option<&str>, cache_namespace: Option<&str>) -> u64 {
    let mut seed = base;
    if let Some(name) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0));
    }
    if let Some(ns) = cache_namespace.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
    }
    seed
}

/// A full digest (up to SHA-256's 32 bytes); a 64-bit hash is stored as 8 bytes big-endian.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Digest {
    bytes: [u8; 32],
    len: u8,
}

impl Digest {
    pub fn new(b: &[u8]) -> Digest {
        let mut bytes = [0u8; 32];
        bytes[..b.len()].copy_from_slice(b);
        Digest {
            bytes,
            len: b.len() as u8,
        }
    }

    pub fn from_u64(v: u64) -> Digest {
        Digest::new(&v.to_be_bytes())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// vLLM's 64-bit event hash: the digest's last 8 bytes, big-endian.
    pub fn event_hash(&self) -> u64 {
        let n = self.len as usize;
        u64::from_be_bytes(self.bytes[n - 8..n].try_into().unwrap())
    }
}

/// One sequence's chain state: everything needed to hash its next block.
#[derive(Clone)]
pub struct Chain {
    pub algo: Algo,
    pub block_size: usize,
    /// xxh3: the salted start seed; dynamo: the salted per-block seed.
    seed: u64,
    /// What vLLM's NONE_HASH (the parent of a sequence's first block) is the hash of. Hashed
    /// only when a sequence starts here: a continued chain never needs it.
    none_seed: Option<Value>,
    /// The last block's digest (the sequence hash for dynamo_seq); None at a sequence start.
    pub parent: Option<Digest>,
    encoder: Encoder,
    scratch: Vec<u8>,
}

impl Chain {
    /// `seed`: xxh3's start seed (before salting); `vllm_seed`: the value NONE_HASH is the hash
    /// of, for vLLM algorithms. Dynamo's seed is fixed.
    pub fn new(
        algo: Algo,
        block_size: usize,
        seed: u64,
        vllm_seed: Option<Value>,
        lora_name: Option<&str>,
        cache_namespace: Option<&str>,
    ) -> Chain {
        Chain {
            algo,
            block_size,
            seed: salted(
                if algo.is_dynamo() { DYNAMO_SEED } else { seed },
                lora_name,
                cache_namespace,
            ),
            none_seed: vllm_seed,
            parent: None,
            encoder: Encoder {
                algo,
                pickler: Pickler::default(),
            },
            scratch: Vec::new(),
        }
    }

    fn none_hash(&mut self) -> Digest {
        let seed = self
            .none_seed
            .as_ref()
            .expect("vLLM chain without a NONE_HASH seed");
        self.scratch.clear();
        self.encoder.value(&mut self.scratch, seed);
        self.algo.digest(&mut self.scratch)
    }

    /// Hashes consecutive full blocks (`tokens.len()` is a multiple of the block size),
    /// continuing from `self.parent`. `extras` has one entry per block. `parent_id` is the
    /// identity of a caller-supplied parent object, which pickle could meet again in block 0's
    /// extra keys.
    pub fn run(
        &mut self,
        tokens: &[u32],
        extras: Option<&[Option<Value>]>,
        parent_id: Id,
        out: &mut Vec<Digest>,
    ) {
        out.reserve(tokens.len() / self.block_size);
        let extra = |i: usize| extras.and_then(|e| e[i].as_ref());
        let blocks = tokens.chunks_exact(self.block_size).enumerate();
        // The parent lives in a local: reading it back from the last pushed digest would put a
        // store-to-load round trip on the critical path of every block.
        if self.algo.is_vllm() {
            let mut parent = match self.parent {
                Some(p) => p,
                None if tokens.is_empty() => return,
                None => self.none_hash(),
            };
            if extras.is_none() && self.algo == Algo::Sha256 && pickle::plain_fits(self.block_size)
            {
                parent = self.sha256_plain(tokens, parent, out);
            } else {
                for (i, block) in blocks {
                    self.scratch.clear();
                    let id = if i == 0 { parent_id } else { 0 };
                    self.encoder
                        .block(&mut self.scratch, parent.as_bytes(), block, extra(i), id);
                    parent = self.algo.digest(&mut self.scratch);
                    out.push(parent);
                }
            }
            self.parent = Some(parent);
        } else {
            self.run_words(tokens, extras, |h| out.push(Digest::from_u64(h)));
        }
    }

    /// `run` for the 64-bit algorithms (xxh3, dynamo, dynamo_seq), each block's hash handed to
    /// `emit` as a word: the index keys by words and needs no `Digest` per block.
    #[inline]
    pub fn run_words(
        &mut self,
        tokens: &[u32],
        extras: Option<&[Option<Value>]>,
        mut emit: impl FnMut(u64),
    ) {
        debug_assert!(!self.algo.is_vllm());
        let mut parent = self.parent.map(|p| p.event_hash());
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            let h = self.next_word(block, extras.and_then(|e| e[i].as_ref()), parent);
            parent = Some(h);
            emit(h);
        }
        self.parent = parent.map(Digest::from_u64);
    }

    /// vLLM's sha256 chain over blocks without extra keys: each block pickled by
    /// `pickle::PlainBlock` and hashed by `sha256::chain`.
    fn sha256_plain(&mut self, tokens: &[u32], parent: Digest, out: &mut Vec<Digest>) -> Digest {
        let bs = self.block_size;
        let stride = pickle::plain_room(bs) + sha256::PAD_ROOM;
        if self.scratch.len() < 2 * stride {
            self.scratch.resize(2 * stride, 0);
        }
        let parent_bytes: &[u8; 32] = parent.as_bytes().try_into().expect("a sha256 digest");
        let mut last = parent;
        let blocks = PlainBlocks {
            tokens,
            block_size: bs,
        };
        let n = tokens.len() / bs;
        sha256::chain(&mut self.scratch, stride, n, parent_bytes, &blocks, |d| {
            last = Digest::new(d);
            out.push(last);
        });
        last
    }

    #[inline(always)]
    fn next_word(&mut self, block: &[u32], extra: Option<&Value>, parent: Option<u64>) -> u64 {
        match self.algo {
            Algo::Xxh3 => {
                let mut seed = parent.unwrap_or(self.seed);
                if let Some(v) = extra {
                    self.scratch.clear();
                    cbor::value(&mut self.scratch, v);
                    seed = xxh3_64_with_seed(&self.scratch, seed);
                }
                xxh3_64_with_seed(le_bytes(block, &mut self.scratch), seed)
            }
            Algo::Dynamo => self.local_hash(block, extra),
            _ => {
                let local = self.local_hash(block, extra);
                let Some(p) = parent else { return local };
                let mut pair = [0u8; 16];
                pair[..8].copy_from_slice(&p.to_le_bytes());
                pair[8..].copy_from_slice(&local.to_le_bytes());
                xxh3_64_with_seed(&pair, DYNAMO_SEED)
            }
        }
    }

    fn local_hash(&mut self, block: &[u32], extra: Option<&Value>) -> u64 {
        let Some(Value::Tuple(items, _)) = extra else {
            return xxh3_64_with_seed(le_bytes(block, &mut self.scratch), self.seed);
        };
        let mut mm: Vec<u64> = items
            .iter()
            .map(|v| v.as_u64().expect("validated mm hash"))
            .collect();
        mm.sort_unstable();
        self.scratch.clear();
        self.scratch
            .extend(block.iter().flat_map(|t| t.to_le_bytes()));
        self.scratch.extend(mm.iter().flat_map(|h| h.to_le_bytes()));
        xxh3_64_with_seed(&self.scratch, self.seed)
    }
}

/// The pickles of consecutive blocks without extra keys, one token per `step`.
struct PlainBlocks<'a> {
    tokens: &'a [u32],
    block_size: usize,
}

struct PlainCursor<'a> {
    pickle: pickle::PlainBlock,
    rest: std::slice::Iter<'a, u32>,
    len: Option<usize>,
}

impl<'a> sha256::Messages for PlainBlocks<'a> {
    type Cursor = PlainCursor<'a>;

    #[inline(always)]
    fn start(&self, k: usize, buf: &mut [u8]) -> PlainCursor<'a> {
        let bs = self.block_size;
        PlainCursor {
            pickle: pickle::PlainBlock::start(buf, bs),
            rest: self.tokens[k * bs..(k + 1) * bs].iter(),
            len: None,
        }
    }

    #[inline(always)]
    fn step(&self, c: &mut PlainCursor<'a>, buf: &mut [u8]) -> Option<usize> {
        if c.len.is_none() {
            match c.rest.next() {
                Some(&t) => c.pickle.token(buf, t),
                None => c.len = Some(c.pickle.finish(buf)),
            }
        }
        c.len
    }
}

/// vLLM's serialisation of blocks and seeds: pickle or CBOR, by algorithm.
#[derive(Clone)]
struct Encoder {
    algo: Algo,
    pickler: Pickler,
}

impl Encoder {
    /// Appends `(parent, tuple(block), extra)` serialised.
    fn block(
        &mut self,
        out: &mut Vec<u8>,
        parent: &[u8],
        block: &[u32],
        extra: Option<&Value>,
        parent_id: Id,
    ) {
        match self.algo {
            Algo::Sha256 | Algo::Xxhash => self.pickler.block(out, parent, parent_id, block, extra),
            _ => cbor::block(out, parent, block, extra),
        }
    }

    /// Appends a lone value serialised (NONE_HASH is the hash of the serialised seed).
    fn value(&mut self, out: &mut Vec<u8>, v: &Value) {
        match self.algo {
            Algo::Sha256 | Algo::Xxhash => self.pickler.value(out, v),
            _ => cbor::value(out, v),
        }
    }
}

/// `Chain::run_words`' keys for `Algo::Xxh3` over consecutive full blocks without extra keys,
/// appended to `keys`: block i hashed with seed h[i-1], the first with `seed` (a chain's salted
/// start seed, or its parent's key). The index's token queries take this instead of a `Chain`:
/// a loop with nothing else per block (`run_words` tests for extra keys and the algorithm per
/// block and pushes through a closure, a capacity test each), and for the common block sizes
/// the block's length a constant, so xxh3's dispatch on the input's length folds away (~79 ->
/// ~50 instructions a block of 16). Tokens past the last full block are ignored. Not inlined:
/// Python's query and the native one run the same code (and callgrind can count it alone).
#[inline(never)]
pub fn xxh3_chain(tokens: &[u32], block_size: usize, seed: u64, keys: &mut Vec<u64>) {
    match block_size {
        16 => xxh3_chain_of::<16>(tokens, seed, keys),
        32 => xxh3_chain_of::<32>(tokens, seed, keys),
        64 => xxh3_chain_of::<64>(tokens, seed, keys),
        _ => xxh3_chain_any(tokens, block_size, seed, keys),
    }
}

/// The index's keys (`Algo::Xxh3`, salted by `lora_name`) of `tokens`' full blocks, continuing
/// from `parent`'s key, appended to `keys`: by `xxh3_chain` when no block has an extra key (a
/// block's missing extra key and `None` hash alike), else through a `Chain`. The index's token
/// queries (no parent) and its stores of token ids both take it.
pub fn index_keys(
    tokens: &[u32],
    block_size: usize,
    lora_name: Option<&str>,
    parent: Option<u64>,
    extras: Option<&[Option<Value>]>,
    keys: &mut Vec<u64>,
) {
    match extras.filter(|e| e.iter().any(Option::is_some)) {
        None => {
            let seed = parent.unwrap_or_else(|| salted(0, lora_name, None));
            xxh3_chain(tokens, block_size, seed, keys)
        }
        Some(extras) => {
            let mut chain = Chain::new(Algo::Xxh3, block_size, 0, None, lora_name, None);
            chain.parent = parent.map(Digest::from_u64);
            keys.reserve(tokens.len() / block_size);
            chain.run_words(tokens, Some(extras), |k| keys.push(k));
        }
    }
}

/// Block i's key written straight into the reserved slot i: through `extend` the loop was not
/// inlined here, so the block's length was not a constant and the chained seed went through
/// memory, a store and a load on the serial chain per block.
#[inline(always)]
fn xxh3_chain_of<const N: usize>(tokens: &[u32], seed: u64, keys: &mut Vec<u64>) {
    let (blocks, _) = tokens.as_chunks::<N>();
    write_chain(blocks, seed, keys)
}

#[inline(always)]
fn xxh3_chain_any(tokens: &[u32], block_size: usize, seed: u64, keys: &mut Vec<u64>) {
    write_chain(tokens.chunks_exact(block_size), seed, keys)
}

#[inline(always)]
fn write_chain<B: AsRef<[u32]>>(
    blocks: impl IntoIterator<Item = B, IntoIter: ExactSizeIterator>,
    mut seed: u64,
    keys: &mut Vec<u64>,
) {
    let blocks = blocks.into_iter();
    let n = blocks.len();
    keys.reserve(n);
    let mut scratch = Vec::new();
    for (slot, block) in keys.spare_capacity_mut()[..n].iter_mut().zip(blocks) {
        seed = xxh3_64_with_seed(le_bytes(block.as_ref(), &mut scratch), seed);
        slot.write(seed);
    }
    // SAFETY: the loop wrote the n slots past the length (zip stops at the shorter, and both
    // have n items).
    unsafe { keys.set_len(keys.len() + n) };
}

/// Tokens as u32 little-endian bytes: the tokens' own memory on little-endian hosts.
#[inline(always)]
fn le_bytes<'a>(block: &'a [u32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8.
        unsafe {
            std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), std::mem::size_of_val(block))
        }
    } else {
        scratch.clear();
        scratch.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        scratch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `xxh3_chain` gives `run_words`' keys: the block sizes it specialises and others, salted
    /// and continued seeds, a partial last block, appended after what `keys` held.
    #[test]
    fn xxh3_chain_is_run_words_without_extra_keys() {
        let tokens: Vec<u32> = (0..700u32).map(|i| i.wrapping_mul(2654435761)).collect();
        for bs in [1, 5, 16, 32, 64, 100] {
            for (lora, parent) in [(None, None), (Some("adapter"), None), (None, Some(77u64))] {
                for n in [0, bs - 1, bs, 3 * bs + 1, tokens.len()] {
                    let mut chain = Chain::new(Algo::Xxh3, bs, 0, None, lora, None);
                    chain.parent = parent.map(Digest::from_u64);
                    let mut want = vec![9];
                    chain.run_words(&tokens[..n / bs * bs], None, |k| want.push(k));
                    let mut got = vec![9];
                    let seed = parent.unwrap_or(salted(0, lora, None));
                    xxh3_chain(&tokens[..n], bs, seed, &mut got);
                    assert_eq!(
                        got, want,
                        "block size {bs}, {n} tokens, {lora:?}, {parent:?}"
                    );
                }
            }
        }
    }

    /// `index_keys` gives a `Chain`'s keys from the same parent, with no extra keys, with
    /// `None` for every block, and with one block's extra key set.
    #[test]
    fn index_keys_are_the_chain_s() {
        let tokens: Vec<u32> = (0..64u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let bs = 16;
        let nones = vec![None; 4];
        let mut one = nones.clone();
        one[2] = Some(Value::Int(7));
        for extras in [None, Some(&nones[..]), Some(&one[..])] {
            for (lora, parent) in [(None, None), (Some("adapter"), Some(77u64))] {
                let mut chain = Chain::new(Algo::Xxh3, bs, 0, None, lora, None);
                chain.parent = parent.map(Digest::from_u64);
                let mut want = vec![9];
                chain.run_words(&tokens, extras, |k| want.push(k));
                let mut got = vec![9];
                index_keys(&tokens, bs, lora, parent, extras, &mut got);
                assert_eq!(got, want, "{extras:?}, {lora:?}, {parent:?}");
            }
        }
    }
}
