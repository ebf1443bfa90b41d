//! The block table: block key -> value, open addressing with linear probing, key and value side
//! by side in one 16-byte slot.
//!
//! Why not hashbrown: a query looks up every block of a prompt, and those lookups are
//! independent, so their cache misses can overlap if the slots are prefetched ahead; hashbrown
//! does not say where a key's slot is. Here the slot of a key is its hash's top bits, known
//! before any memory is read, and a hit is one cache line (hashbrown reads a control group and
//! then the bucket, two).
//!
//! One key value (`EMPTY`) marks free slots; a block with that key lives outside the array.

use std::mem::size_of;

use crate::prefetch::prefetch;

const EMPTY: u64 = 0;
/// Grown past 3/4 full by default: linear probing's clusters stay short.
pub const DEFAULT_MAX_LOAD_PCT: usize = 75;
const MIN_CAPACITY: usize = 16;

#[derive(Clone, Copy)]
struct Slot<V: Copy> {
    key: u64,
    val: V,
}

/// `MAX_LOAD_PCT`: how full (in percent) the slots may get before the table doubles. A table
/// that removes as much as it inserts (the relay's view) pays for every slot of a cluster on each
/// remove's backward shift and each insert's probe: at 3/4 full about six of them.
pub struct Table<V: Copy, const MAX_LOAD_PCT: usize = DEFAULT_MAX_LOAD_PCT> {
    slots: Box<[Slot<V>]>,
    /// 64 - log2(capacity): a key's home slot is the top bits of its mixed hash. 63 for the
    /// empty table, whose "home" (0 or 1) nothing reads: every lookup checks for no slots first.
    shift: u32,
    len: usize,
    /// The value of key `EMPTY`.
    empty_key: Option<V>,
}

impl<V: Copy, const MAX_LOAD_PCT: usize> Default for Table<V, MAX_LOAD_PCT> {
    fn default() -> Self {
        Table {
            slots: Box::new([]),
            shift: 63,
            len: 0,
            empty_key: None,
        }
    }
}

/// The keys are hashes already, but not always good ones (tests use 1, 2, 3): a folded
/// multiply spreads any u64 over the top bits.
#[inline]
fn mix(k: u64) -> u64 {
    let m = (k ^ 0x2d35_8dcc_aa6c_78a5) as u128 * 0x9e37_79b9_7f4a_7c15u128;
    (m as u64) ^ ((m >> 64) as u64)
}

impl<V: Copy, const MAX_LOAD_PCT: usize> Table<V, MAX_LOAD_PCT> {
    #[inline]
    fn home(&self, k: u64) -> usize {
        (mix(k) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot holding `k`, if any.
    #[inline]
    fn find(&self, k: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        slot_of(&self.slots, self.mask(), self.home(k), k)
    }

    pub fn len(&self) -> usize {
        self.len + self.empty_key.is_some() as usize
    }

    /// Asks the CPU to bring `k`'s slot into cache: for a lookup a little later.
    #[inline]
    pub fn prefetch(&self, k: u64) {
        if !self.slots.is_empty() {
            prefetch(self.slots.as_ptr().wrapping_add(self.home(k)));
        }
    }

    /// The table for lookups split in two (`Probe`), None while it has no slots (when a key
    /// 0 may still be held: `get` finds it).
    #[inline]
    pub fn probe(&self) -> Option<Probe<'_, V>> {
        (!self.slots.is_empty()).then(|| Probe {
            slots: &self.slots,
            mask: self.mask(),
            shift: self.shift,
            empty_key: self.empty_key.as_ref(),
        })
    }

    #[inline]
    pub fn get(&self, k: &u64) -> Option<&V> {
        if *k == EMPTY {
            return self.empty_key.as_ref();
        }
        self.find(*k).map(|i| &self.slots[i].val)
    }

    /// Inserts or replaces; the value replaced.
    pub fn insert(&mut self, k: u64, v: V) -> Option<V> {
        match self.get_or_insert(k, v) {
            (_, true) => None,
            (old, false) => Some(std::mem::replace(old, v)),
        }
    }

    /// `k`'s value, `v` inserted first if there is none; whether it was. One probe where a
    /// `get` and then an `insert` would take two.
    /// Inlined, with growing kept out of line: a store's per-block call was a third call
    /// overhead (saving registers) for a probe of two slots.
    #[inline(always)]
    pub fn get_or_insert(&mut self, k: u64, v: V) -> (&mut V, bool) {
        if k == EMPTY {
            let fresh = self.empty_key.is_none();
            return (self.empty_key.get_or_insert(v), fresh);
        }
        if (self.len + 1) * 100 > self.slots.len() * MAX_LOAD_PCT {
            self.grow(v);
        }
        let mask = self.mask();
        let mut i = self.home(k);
        loop {
            let key = self.slots[i].key;
            if key == k {
                return (&mut self.slots[i].val, false);
            }
            if key == EMPTY {
                self.slots[i] = Slot { key: k, val: v };
                self.len += 1;
                return (&mut self.slots[i].val, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// `v`: any value, to fill the new array's free slots with.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, v: V) {
        let cap = (self.slots.len() * 2).max(MIN_CAPACITY);
        let old = std::mem::replace(
            &mut self.slots,
            vec![Slot { key: EMPTY, val: v }; cap].into_boxed_slice(),
        );
        self.shift = 64 - cap.trailing_zeros();
        self.len = 0;
        for s in old.iter().filter(|s| s.key != EMPTY) {
            self.insert(s.key, s.val);
        }
    }

    pub fn remove(&mut self, k: &u64) -> Option<V> {
        if *k == EMPTY {
            return self.empty_key.take();
        }
        let hole = self.find(*k)?;
        Some(self.remove_at(hole))
    }

    /// Calls `f` on `k`'s value (None: no such key) and removes the entry if `f` says so: one
    /// probe where a `get_mut` and then a `remove` would take two.
    #[inline(always)]
    pub fn update<R>(&mut self, k: &u64, f: impl FnOnce(&mut V) -> (R, bool)) -> Option<R> {
        if *k == EMPTY {
            let (r, remove) = f(self.empty_key.as_mut()?);
            if remove {
                self.empty_key = None;
            }
            return Some(r);
        }
        let i = self.find(*k)?;
        let (r, remove) = f(&mut self.slots[i].val);
        if remove {
            self.remove_at(i);
        }
        Some(r)
    }

    /// Empties slot `hole` (holding a key); its value.
    fn remove_at(&mut self, mut hole: usize) -> V {
        let v = self.slots[hole].val;
        self.len -= 1;
        // Backward shift: later slots of the cluster whose home is at or before the hole move
        // into it, so a lookup never stops at a hole before reaching its key.
        let mask = self.mask();
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let key = self.slots[i].key;
            if key == EMPTY {
                break;
            }
            let home = self.home(key);
            // Distance from home to i, and from the hole to i, both going forward.
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[i];
                hole = i;
            }
        }
        self.slots[hole].key = EMPTY;
        v
    }

    /// Keeps the entries for which `f` says true; `f` may change the values it keeps.
    pub fn retain(&mut self, mut f: impl FnMut(&u64, &mut V) -> bool) {
        let mut drop = Vec::new();
        for s in self.slots.iter_mut().filter(|s| s.key != EMPTY) {
            if !f(&s.key, &mut s.val) {
                drop.push(s.key);
            }
        }
        for k in drop {
            self.remove(&k);
        }
        if let Some(v) = self.empty_key.as_mut() {
            if !f(&EMPTY, v) {
                self.empty_key = None;
            }
        }
    }

    /// Bytes of the slot array.
    pub fn allocation_size(&self) -> usize {
        self.slots.len() * size_of::<Slot<V>>()
    }

    /// `prefetch`, and the cache line after `k`'s slot's too: where a lookup at a high load, or
    /// a remove's backward shift, goes on reading (the relay's view removes as much as it inserts).
    #[inline]
    pub fn prefetch_run(&self, k: u64) {
        if !self.slots.is_empty() {
            // The second line may be past the slots' end: a hint, no memory is read for it.
            let p = self.slots.as_ptr().wrapping_add(self.home(k)) as *const u8;
            prefetch(p);
            prefetch(p.wrapping_add(64));
        }
    }

    /// Every entry, key `EMPTY`'s too, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        let slots = self
            .slots
            .iter()
            .filter(|s| s.key != EMPTY)
            .map(|s| (s.key, &s.val));
        slots.chain(self.empty_key.iter().map(|v| (EMPTY, v)))
    }
}

/// Lookups in two steps, for many keys at once: `start` (hashing the key, where its slot is)
/// and `prefetch_at` early, `get_from` a little later, once the slot has arrived; where
/// `prefetch` and then `get` would hash each key twice and check for an empty table each time.
pub struct Probe<'t, V: Copy> {
    /// Not empty.
    slots: &'t [Slot<V>],
    mask: usize,
    shift: u32,
    empty_key: Option<&'t V>,
}

/// The slot holding `k` (not `EMPTY`), probing linearly from `start`; None at the first free
/// slot. `slots` is not empty and below its load limit, so a free slot ends every probe.
#[inline(always)]
fn slot_of<V: Copy>(slots: &[Slot<V>], mask: usize, start: usize, k: u64) -> Option<usize> {
    let mut i = start;
    loop {
        let key = slots[i].key;
        if key == k {
            return Some(i);
        }
        if key == EMPTY {
            return None;
        }
        i = (i + 1) & mask;
    }
}

impl<'t, V: Copy> Probe<'t, V> {
    #[inline(always)]
    pub fn start(&self, k: u64) -> usize {
        (mix(k) >> self.shift) as usize
    }

    #[inline(always)]
    pub fn prefetch_at(&self, i: usize) {
        prefetch(self.slots.as_ptr().wrapping_add(i));
    }

    /// The value of `k`, `start` being `start(k)`.
    #[inline(always)]
    pub fn get_from(&self, start: usize, k: u64) -> Option<&'t V> {
        if k == EMPTY {
            return self.empty_key;
        }
        slot_of(self.slots, self.mask, start, k).map(|i| &self.slots[i].val)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_hashmap_through_inserts_and_removes() {
        agrees_with_a_hashmap::<DEFAULT_MAX_LOAD_PCT>();
    }

    /// The relay view's load (rust/view.rs): the table grows at other sizes, the same answers.
    #[test]
    fn agrees_with_a_hashmap_at_half_load() {
        agrees_with_a_hashmap::<50>();
    }

    fn agrees_with_a_hashmap<const L: usize>() {
        let mut t: Table<u32, L> = Table::default();
        let mut m: HashMap<u64, u32> = HashMap::new();
        let mut x = 7u64;
        for step in 0..200_000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Few distinct keys (and key 0 among them): many collisions, removals, reinserts.
            let k = (x >> 33) % 5000;
            if x & (3 << 20) == 1 << 20 {
                assert_eq!(t.insert(k, step), m.insert(k, step));
            } else if x & (3 << 20) == 2 << 20 {
                let (v, fresh) = t.get_or_insert(k, step);
                assert_eq!(fresh, !m.contains_key(&k));
                assert_eq!(*v, *m.entry(k).or_insert(step));
            } else if x & (1 << 40) != 0 {
                // Removes an odd value, adds one to an even one.
                let got = t.update(&k, |v| {
                    let odd = *v % 2 == 1;
                    *v += 1;
                    (*v, odd)
                });
                let want = m.get_mut(&k).map(|v| {
                    *v += 1;
                    *v
                });
                if want.is_some_and(|v| v % 2 == 0) {
                    m.remove(&k);
                }
                assert_eq!(got, want);
            } else {
                assert_eq!(t.remove(&k), m.remove(&k));
            }
            if step % 1000 == 0 {
                t.retain(|k, _| k % 7 != 3);
                m.retain(|k, _| k % 7 != 3);
            }
        }
        assert_eq!(t.len(), m.len());
        // Grown by its own load limit: never fuller than it.
        assert!(
            t.len * 100 <= t.slots.len() * L,
            "{} in {}",
            t.len,
            t.slots.len()
        );
        let p = t.probe().expect("slots");
        for k in 0..5000u64 {
            assert_eq!(t.get(&k), m.get(&k));
            assert_eq!(p.get_from(p.start(k), k), m.get(&k));
        }
    }
}
