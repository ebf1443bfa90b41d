//! Which (worker, class) pairs hold one block; a class is an interned (medium, KV-cache group,
//! remote?) triple, so single-group data costs what a medium did.
//!
//! Most blocks are held by one or two workers: those fit in the map's 8-byte value. A block held
//! by more moves to a slab entry with one worker bitset per class, so a popular prefix costs a
//! bit per worker and a query ANDs whole words of workers at a time.

use crate::prefetch::prefetch;

/// A holder: worker id in the high 24 bits, class id in the low 8.
pub type Entry = u32;

/// Worker ids stay below this, so no entry collides with the two sentinels below.
pub const MAX_WORKERS: u32 = (1 << 24) - 1;
/// Class ids are a byte.
pub const MAX_CLASSES: usize = 256;

/// The classes a query counts: `all` skips the bit test in the common case.
#[derive(Clone, Copy)]
pub struct Filter {
    pub all: bool,
    pub mask: [u64; 4],
}

impl Filter {
    #[inline(always)]
    pub fn accepts(&self, c: u8) -> bool {
        self.all || (self.mask[(c >> 6) as usize] >> (c & 63)) & 1 != 0
    }

    pub fn set(&mut self, c: u8) {
        self.mask[(c >> 6) as usize] |= 1 << (c & 63);
    }
}

const NONE: u32 = u32::MAX;
const MANY: u32 = u32::MAX - 1;

#[inline]
pub fn entry(worker: u32, medium: u8) -> Entry {
    (worker << 8) | medium as u32
}

#[inline]
pub fn worker_of(e: Entry) -> u32 {
    e >> 8
}

#[inline]
pub fn medium_of(e: Entry) -> u8 {
    e as u8
}

#[inline]
fn set_bit(words: &mut [u64], w: u32) {
    words[w as usize / 64] |= 1 << (w % 64);
}

/// `[a, NONE]`: one holder; `[a, b]`: two; `[MANY, i]`: the set is `Slab::many[i]`.
#[derive(Clone, Copy, Debug)]
pub struct Holders {
    a: u32,
    b: u32,
}

/// A bitset over worker ids; the first 64 workers live inline (most deployments have fewer),
/// so a query reads one cache line per popular block.
#[derive(Default, Clone)]
struct Bitset {
    w0: u64,
    /// Words 1.., trailing zero words trimmed.
    rest: Vec<u64>,
}

impl Bitset {
    fn get(&self, w: u32) -> bool {
        let word = match w / 64 {
            0 => self.w0,
            k => self.rest.get(k as usize - 1).copied().unwrap_or(0),
        };
        word & (1 << (w % 64)) != 0
    }

    fn set(&mut self, w: u32) {
        match w as usize / 64 {
            0 => self.w0 |= 1 << (w % 64),
            k => {
                if self.rest.len() < k {
                    self.rest.resize(k, 0);
                }
                self.rest[k - 1] |= 1 << (w % 64);
            }
        }
    }

    /// Whether `w` was set (and is now not).
    fn unset(&mut self, w: u32) -> bool {
        if !self.get(w) {
            return false;
        }
        match w as usize / 64 {
            0 => self.w0 &= !(1 << (w % 64)),
            k => {
                self.rest[k - 1] &= !(1 << (w % 64));
                while self.rest.last() == Some(&0) {
                    self.rest.pop();
                }
            }
        }
        true
    }

    fn is_empty(&self) -> bool {
        self.w0 == 0 && self.rest.is_empty()
    }

    #[inline]
    fn or_into(&self, out: &mut [u64]) {
        out[0] |= self.w0;
        for (o, w) in out[1..].iter_mut().zip(&self.rest) {
            *o |= w;
        }
    }

    fn workers(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.w0)
            .chain(self.rest.iter().copied())
            .enumerate()
            .flat_map(|(k, word)| Bits(word).map(move |b| (k * 64 + b) as u32))
    }

    fn heap_bytes(&self) -> usize {
        if self.rest.capacity() == 0 {
            0
        } else {
            // 16 bytes of allocator bookkeeping per allocation, an estimate for glibc's malloc.
            self.rest.capacity() * 8 + 16
        }
    }
}

/// Per medium present, the workers holding the block in it: the first medium inline.
#[derive(Default)]
pub struct Many {
    count: u32,
    m0: u8,
    b0: Bitset,
    others: Vec<(u8, Bitset)>,
}

impl Many {
    fn media(&self) -> impl Iterator<Item = (u8, &Bitset)> {
        std::iter::once((self.m0, &self.b0)).chain(self.others.iter().map(|(m, b)| (*m, b)))
    }

    fn bitset_mut(&mut self, m: u8) -> Option<&mut Bitset> {
        if self.m0 == m {
            return Some(&mut self.b0);
        }
        self.others.iter_mut().find(|x| x.0 == m).map(|x| &mut x.1)
    }

    fn contains(&self, e: Entry) -> bool {
        let m = medium_of(e);
        self.media().any(|(x, b)| x == m && b.get(worker_of(e)))
    }

    fn insert(&mut self, e: Entry) {
        let (w, m) = (worker_of(e), medium_of(e));
        if self.count == 0 {
            self.m0 = m;
        }
        match self.bitset_mut(m) {
            Some(b) => b.set(w),
            None => {
                let mut b = Bitset::default();
                b.set(w);
                self.others.push((m, b));
            }
        }
        self.count += 1;
    }

    /// Whether `e` was held (and is now not).
    fn remove(&mut self, e: Entry) -> bool {
        let (w, m) = (worker_of(e), medium_of(e));
        if !self.bitset_mut(m).is_some_and(|b| b.unset(w)) {
            return false;
        }
        self.count -= 1;
        if self.b0.is_empty() {
            if let Some((m0, b0)) = self.others.pop() {
                self.m0 = m0;
                self.b0 = b0;
            }
        } else if !self.others.is_empty() {
            self.others.retain(|x| !x.1.is_empty());
        }
        true
    }

    /// Word 0 of the workers holding the block in any class.
    fn word0_any(&self) -> u64 {
        self.others.iter().fold(self.b0.w0, |w, (_, b)| w | b.w0)
    }

    /// Word 0 of the workers holding the block in a class `filter` accepts.
    #[inline]
    fn word0(&self, filter: &Filter) -> u64 {
        let mut w = if filter.accepts(self.m0) {
            self.b0.w0
        } else {
            0
        };
        for (m, b) in &self.others {
            if filter.accepts(*m) {
                w |= b.w0;
            }
        }
        w
    }

    fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.media()
            .flat_map(|(m, b)| b.workers().map(move |w| entry(w, m)))
    }

    fn heap_bytes(&self) -> usize {
        let others = if self.others.capacity() == 0 {
            0
        } else {
            self.others.capacity() * std::mem::size_of::<(u8, Bitset)>() + 16
        };
        others + self.media().map(|(_, b)| b.heap_bytes()).sum::<usize>()
    }
}

/// The set bits of a word, lowest first.
pub struct Bits(pub u64);

impl Iterator for Bits {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(b)
    }
}

/// Storage for the holder sets of more than two.
#[derive(Default)]
pub struct Slab {
    many: Vec<Many>,
    /// By entry: word 0 (workers 0-63) of its workers in any class. What a query counting
    /// every class in an index of at most 64 workers reads (8 bytes where the entry is 64).
    words: Vec<u64>,
    free: Vec<u32>,
}

impl Slab {
    fn add(&mut self, m: Many) -> u32 {
        let word = m.word0_any();
        match self.free.pop() {
            Some(i) => {
                self.many[i as usize] = m;
                self.words[i as usize] = word;
                i
            }
            None => {
                self.many.push(m);
                self.words.push(word);
                (self.many.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, i: u32) {
        self.many[i as usize] = Many::default();
        self.words[i as usize] = 0;
        self.free.push(i);
    }

    /// Entry `i`'s word in `words` again, after a change.
    fn sync(&mut self, i: u32) {
        self.words[i as usize] = self.many[i as usize].word0_any();
    }

    pub fn heap_bytes(&self) -> usize {
        self.many.capacity() * std::mem::size_of::<Many>()
            + self.words.capacity() * 8
            + self.free.capacity() * 4
            + self
                .many
                .iter()
                .filter(|m| m.count > 0)
                .map(Many::heap_bytes)
                .sum::<usize>()
    }
}

/// What `Holders::remove` did.
#[derive(PartialEq, Eq, Debug)]
pub enum Removed {
    NotHeld,
    Kept,
    /// The last holder left: the caller drops the block.
    Empty,
}

impl Holders {
    /// No holder at all: what a query reads for a block the table does not have.
    pub const ABSENT: Holders = Holders { a: NONE, b: NONE };

    pub fn one(e: Entry) -> Holders {
        Holders { a: e, b: NONE }
    }

    #[inline]
    pub fn contains(&self, slab: &Slab, e: Entry) -> bool {
        if self.a == MANY {
            slab.many[self.b as usize].contains(e)
        } else {
            self.a == e || self.b == e
        }
    }

    /// Adds `e`, which must not be held yet.
    pub fn insert(&mut self, slab: &mut Slab, e: Entry) {
        if self.a == MANY {
            slab.many[self.b as usize].insert(e);
            slab.sync(self.b);
        } else if self.b == NONE {
            self.b = e;
        } else {
            let mut m = Many::default();
            for x in [self.a, self.b, e] {
                m.insert(x);
            }
            *self = Holders {
                a: MANY,
                b: slab.add(m),
            };
        }
    }

    pub fn remove(&mut self, slab: &mut Slab, e: Entry) -> Removed {
        if self.a == MANY {
            let i = self.b;
            let m = &mut slab.many[i as usize];
            if !m.remove(e) {
                return Removed::NotHeld;
            }
            if m.count <= 2 {
                let mut rest = [NONE; 2];
                for (r, e) in rest.iter_mut().zip(m.entries()) {
                    *r = e;
                }
                let [a, b] = rest;
                slab.release(i);
                *self = Holders { a, b };
            } else {
                slab.sync(i);
            }
            Removed::Kept
        } else if self.b == e {
            self.b = NONE;
            Removed::Kept
        } else if self.a == e {
            if self.b == NONE {
                return Removed::Empty;
            }
            self.a = self.b;
            self.b = NONE;
            Removed::Kept
        } else {
            Removed::NotHeld
        }
    }

    /// Drops every entry of worker `w`; returns whether the set is now empty.
    pub fn remove_worker(&mut self, slab: &mut Slab, w: u32) -> bool {
        let mine: Vec<Entry> = self.entries(slab).filter(|&e| worker_of(e) == w).collect();
        for e in mine {
            if self.remove(slab, e) == Removed::Empty {
                return true;
            }
        }
        false
    }

    /// Frees the slab entry of a set being dropped.
    pub fn release(self, slab: &mut Slab) {
        if self.a == MANY {
            slab.release(self.b);
        }
    }

    pub fn entries<'s>(&self, slab: &'s Slab) -> Box<dyn Iterator<Item = Entry> + 's> {
        if self.a == MANY {
            Box::new(slab.many[self.b as usize].entries())
        } else {
            let (a, b) = (self.a, self.b);
            Box::new([a, b].into_iter().filter(|&x| x != NONE))
        }
    }

    pub fn held_by_worker(&self, slab: &Slab, w: u32) -> bool {
        if self.a == MANY {
            slab.many[self.b as usize].media().any(|(_, b)| b.get(w))
        } else {
            worker_of(self.a) == w || (self.b != NONE && worker_of(self.b) == w)
        }
    }

    /// Asks the CPU to bring the slab entry of a set of more than two into cache (a query reads
    /// it a little later; the block's slot was read first, so its miss would come second): its
    /// word in `words` if `any` (for `word0_any`), else the entry.
    #[inline]
    pub fn prefetch(&self, slab: &Slab, any: bool) {
        if self.a == MANY {
            if any {
                prefetch(slab.words.as_ptr().wrapping_add(self.b as usize));
            } else {
                prefetch(slab.many.as_ptr().wrapping_add(self.b as usize));
            }
        }
    }

    /// `word0` for a filter that accepts every class: the slab's `words` rather than its
    /// entry.
    #[inline(always)]
    pub fn word0_any(&self, slab: &Slab) -> u64 {
        if self.a == MANY {
            return slab.words[self.b as usize];
        }
        let bit = |e: Entry| {
            if e != NONE {
                1u64 << (worker_of(e) & 63)
            } else {
                0
            }
        };
        bit(self.a) | bit(self.b)
    }

    /// `workers_into` for an index whose worker ids are all below 64: the one word, without
    /// the loops over words.
    #[inline(always)]
    pub fn word0(&self, slab: &Slab, filter: &Filter) -> u64 {
        if self.a == MANY {
            return slab.many[self.b as usize].word0(filter);
        }
        let bit = |e: Entry| {
            if e != NONE && filter.accepts(medium_of(e)) {
                1u64 << (worker_of(e) & 63)
            } else {
                0
            }
        };
        bit(self.a) | bit(self.b)
    }

    /// ORs into `out` (a bitset over worker ids) the workers holding this block in a class
    /// `filter` accepts.
    #[inline]
    pub fn workers_into(&self, slab: &Slab, filter: &Filter, out: &mut [u64]) {
        if self.a == MANY {
            for (m, b) in slab.many[self.b as usize].media() {
                if filter.accepts(m) {
                    b.or_into(out);
                }
            }
        } else {
            for e in [self.a, self.b] {
                if e != NONE && filter.accepts(medium_of(e)) {
                    set_bit(out, worker_of(e));
                }
            }
        }
    }

    /// ORs into `out` the workers holding this block per group: group g's bitset over worker
    /// ids is `out[g * words..(g + 1) * words]` (`group_of[class]` names a class's group), over
    /// the classes `filter` accepts. One pass for all workers, where asking each would take one
    /// pass per worker.
    pub fn groups_into(
        &self,
        slab: &Slab,
        filter: &Filter,
        group_of: &[u8],
        words: usize,
        out: &mut [u64],
    ) {
        if self.a == MANY {
            for (m, b) in slab.many[self.b as usize].media() {
                if filter.accepts(m) {
                    let g = group_of[m as usize] as usize;
                    b.or_into(&mut out[g * words..(g + 1) * words]);
                }
            }
        } else {
            for e in [self.a, self.b] {
                if e != NONE && filter.accepts(medium_of(e)) {
                    let g = group_of[medium_of(e) as usize] as usize;
                    set_bit(&mut out[g * words..(g + 1) * words], worker_of(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(h: &Holders, slab: &Slab) -> Vec<Entry> {
        let mut v: Vec<Entry> = h.entries(slab).collect();
        v.sort();
        v
    }

    #[test]
    fn grows_to_many_and_back() {
        let mut slab = Slab::default();
        let es: Vec<Entry> = (0..70).map(|w| entry(w * 3, (w % 2) as u8)).collect();
        let mut h = Holders::one(es[0]);
        for &e in &es[1..] {
            assert!(!h.contains(&slab, e));
            h.insert(&mut slab, e);
            assert!(h.contains(&slab, e));
        }
        let mut want = es.clone();
        want.sort();
        assert_eq!(sorted(&h, &slab), want);
        let mut out = vec![0u64; 4];
        let mut odd_class = Filter {
            all: false,
            mask: [0; 4],
        };
        odd_class.set(1);
        h.workers_into(&slab, &odd_class, &mut out);
        let got: Vec<u32> = (0..256)
            .filter(|&w| out[w / 64] & (1 << (w % 64)) != 0)
            .map(|w| w as u32)
            .collect();
        let odd: Vec<u32> = (0..70).filter(|w| w % 2 == 1).map(|w| w * 3).collect();
        assert_eq!(got, odd);
        for &e in &es[..69] {
            assert_ne!(h.remove(&mut slab, e), Removed::NotHeld);
            assert_eq!(h.remove(&mut slab, e), Removed::NotHeld);
        }
        assert_eq!(sorted(&h, &slab), vec![es[69]]);
        assert_eq!(h.remove(&mut slab, es[69]), Removed::Empty);
        assert_eq!(slab.free.len(), 1);
    }

    /// The one-word reads a query of at most 64 workers (ids below 64) makes (`word0_any`, from the slab's
    /// `words`, and `word0`) against word 0 of `workers_into`, through sets growing into the
    /// slab and back, entries freed and reused.
    #[test]
    fn one_word_reads_agree_with_workers_into() {
        let mut slab = Slab::default();
        let mut sets: Vec<Option<Holders>> = vec![None; 12];
        let all = Filter {
            all: true,
            mask: [0; 4],
        };
        let mut class1 = Filter {
            all: false,
            mask: [0; 4],
        };
        class1.set(1);
        let word = |h: &Holders, slab: &Slab, f: &Filter| {
            let mut out = vec![0u64; 2];
            h.workers_into(slab, f, &mut out);
            out[0]
        };
        let mut x = 11u64;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (i, w, m) = (
                (x >> 33) as usize % sets.len(),
                (x >> 40) as u32 % 64,
                (x >> 50) as u8 % 3,
            );
            let e = entry(w, m);
            match &mut sets[i] {
                None => sets[i] = Some(Holders::one(e)),
                Some(h) if h.contains(&slab, e) => {
                    if h.remove(&mut slab, e) == Removed::Empty {
                        h.release(&mut slab);
                        sets[i] = None;
                    }
                }
                Some(h) => h.insert(&mut slab, e),
            }
            for h in sets.iter().flatten() {
                assert_eq!(h.word0_any(&slab), word(h, &slab, &all));
                assert_eq!(h.word0(&slab, &class1), word(h, &slab, &class1));
            }
        }
        assert!(sets.iter().flatten().any(|h| h.a == MANY));
        assert_eq!(Holders::ABSENT.word0_any(&slab), 0);
        assert_eq!(Holders::ABSENT.word0(&slab, &all), 0);
    }

    #[test]
    fn remove_worker_drops_all_media() {
        let mut slab = Slab::default();
        let mut h = Holders::one(entry(5, 0));
        h.insert(&mut slab, entry(5, 1));
        h.insert(&mut slab, entry(6, 0));
        assert!(h.held_by_worker(&slab, 5));
        assert!(!h.remove_worker(&mut slab, 5));
        assert!(!h.held_by_worker(&slab, 5));
        assert_eq!(sorted(&h, &slab), vec![entry(6, 0)]);
        assert!(h.remove_worker(&mut slab, 6));
    }
}
