//! Tokens mode: the engine hashes behind the index's keys. `Core::engine` maps a block's
//! canonical engine hash to its index hash; a slot keeps the hashes that do not reach their
//! block that way as aliases, and counts the extra hashes that stand for one block (`dups`),
//! so a block stays held until the last of them is removed (see `core`'s doc).

use super::super::holders::{entry, medium_of, worker_of, Entry, Holders, Removed, Slab};
use super::super::table::Table;
use super::holding::{add_holder, drop_holder, take_copy};
use super::{Core, Slot, Worker};

impl Core {
    /// The index hash worker `w` stored engine hash `p` under: class `c` first, then its
    /// others (groups share hashes; a parent may be held in another medium).
    pub(super) fn engine_key(&self, w: u32, c: u8, p: u64) -> Option<u64> {
        let slots = &self.workers[w as usize].as_ref()?.slots;
        let same = slots.iter().find(|s| s.class == c);
        same.into_iter()
            .chain(slots.iter().filter(|s| s.class != c))
            .find_map(|s| {
                held_as(
                    &self.engine,
                    &self.blocks,
                    &self.slab,
                    s,
                    entry(w, s.class),
                    p,
                )
            })
            .map(|(k, _)| k)
    }

    /// Tokens mode: one more physical copy, in worker `w`'s slot `si`, of the block engine hash
    /// `engine` stands for, index hash `k`.
    pub(super) fn add_copy_tokens(&mut self, w: u32, si: usize, engine: u64, k: u64) {
        // A slot without aliases (what engines that agree give, whatever other slots hold):
        // the shared map and the block table, one probe each. Else, and for an engine hash
        // that now stands for other content, or a block that has a canonical hash already,
        // the general rule below.
        let plain = |x: &Worker| x.slots[si].alias.is_empty() && x.slots[si].alias_only.is_empty();
        if self.workers[w as usize].as_ref().is_some_and(plain) {
            let (&mut c, fresh) = self.engine.get_or_insert(engine, k);
            if fresh || c == k {
                let (blocks, slab, slot, _) = self.parts(w, si);
                let e = entry(w, slot.class);
                let (h, new_block) = blocks.get_or_insert(k, Holders::one(e));
                if new_block {
                    slot.held += 1;
                    return;
                }
                if !fresh {
                    if h.contains(slab, e) {
                        *slot.copies.entry(engine).or_insert(0) += 1;
                    } else {
                        h.insert(slab, e);
                        slot.held += 1;
                    }
                    return;
                }
                // The block has a canonical hash already: `engine` will be an alias.
                self.engine.remove(&engine);
            }
        }
        let (blocks, slab, slot, map) = self.parts(w, si);
        let e = entry(w, slot.class);
        match held_as(map, blocks, slab, slot, e, engine) {
            Some((old, _)) if old == k => {
                *slot.copies.entry(engine).or_insert(0) += 1;
                return;
            }
            Some((old, canonical)) => {
                // The engine hash now stands for other content: its copies of the old go.
                slot.copies.remove(&engine);
                self.unref(w, si, engine, old, canonical);
            }
            None => {}
        }
        self.add_ref(w, si, engine, k);
    }

    /// Tokens mode: one physical copy of the block stored under `engine` in worker `w`'s slot
    /// `si` is gone; whether there was one.
    pub(super) fn drop_copy_tokens(&mut self, w: u32, si: usize, engine: u64) -> bool {
        let Core {
            blocks,
            slab,
            workers,
            engine: map,
            aliased,
            ..
        } = self;
        let slot = &mut workers[w as usize].as_mut().expect("live worker").slots[si];
        if take_copy(slot, engine) {
            return true;
        }
        let e = entry(w, slot.class);
        if slot.alias.is_empty() && slot.alias_only.is_empty() && slot.dups.is_empty() {
            // A slot with one hash per block, each its block's canonical one: the block's
            // holders lose the slot, and the canonical hash goes with its last holder.
            let Some(&k) = map.get(&engine) else {
                return false;
            };
            let held = match drop_holder(blocks, slab, slot, e, k) {
                Removed::NotHeld => return false,
                // No alias-only holder anywhere: any holder left holds it canonically, and
                // the removal said whether there is one (no lookup of the block again).
                Removed::Kept if *aliased == 0 => true,
                Removed::Empty => false,
                Removed::Kept => canonical_held(blocks, slab, workers, *aliased, k),
            };
            if !held {
                map.remove(&engine);
            }
            return true;
        }
        match held_as(map, blocks, slab, slot, e, engine) {
            Some((k, canonical)) => {
                self.unref(w, si, engine, k, canonical);
                true
            }
            None => false,
        }
    }

    /// Tokens mode: slot `si` of worker `w`, which does not hold `engine`, now holds it, standing
    /// for index hash `k`: as the block's canonical hash if it is that (or the block has none),
    /// otherwise as an alias.
    fn add_ref(&mut self, w: u32, si: usize, engine: u64, k: u64) {
        let canonical = match self.engine.get(&engine) {
            Some(&c) => c == k,
            None => {
                let free =
                    !canonical_held(&self.blocks, &self.slab, &self.workers, self.aliased, k);
                if free {
                    self.engine.insert(engine, k);
                }
                free
            }
        };
        let (blocks, slab, slot, _) = self.parts(w, si);
        let e = entry(w, slot.class);
        let held = blocks.get(&k).is_some_and(|h| h.contains(slab, e));
        if held {
            // Held through other hashes already: one more for the same block.
            *slot.dups.entry(k).or_insert(0) += 1;
        } else {
            add_holder(blocks, slab, slot, e, k);
        }
        let mut aliased = 0isize;
        if canonical {
            // Held before, it was through aliases only (the slot did not hold `engine`).
            if held && slot.alias_only.remove(&k).is_some() {
                aliased -= 1;
            }
        } else {
            slot.alias.insert(engine, k);
            if !held {
                slot.alias_only.insert(k, ());
                aliased += 1;
            }
        }
        self.aliased = self.aliased.wrapping_add_signed(aliased);
    }

    /// Tokens mode: slot `si` of worker `w` no longer holds `engine`, which stood for `k`
    /// (`canonical`: as its block's canonical hash). The canonical hash leaves `engine` with the
    /// last slot holding it.
    fn unref(&mut self, w: u32, si: usize, engine: u64, k: u64, canonical: bool) {
        let (blocks, slab, slot, _) = self.parts(w, si);
        let e = entry(w, slot.class);
        if !canonical {
            slot.alias.remove(&engine);
        }
        let mut aliased = 0isize;
        if let Some(d) = (!slot.dups.is_empty())
            .then(|| slot.dups.get_mut(&k))
            .flatten()
        {
            // Other hashes of the slot still stand for k.
            *d -= 1;
            if *d == 0 {
                slot.dups.remove(&k);
            }
            if canonical {
                slot.alias_only.insert(k, ());
                aliased += 1;
            }
        } else {
            drop_holder(blocks, slab, slot, e, k);
            if !canonical && slot.alias_only.remove(&k).is_some() {
                aliased -= 1;
            }
        }
        self.aliased = self.aliased.wrapping_add_signed(aliased);
        if canonical && !canonical_held(&self.blocks, &self.slab, &self.workers, self.aliased, k) {
            self.engine.remove(&engine);
        }
    }
}

/// Tokens mode: what `slot` (holder entry `e`) holds engine hash `engine` as: the index hash it
/// stands for, and whether as its block's canonical hash (through `map`, `Core::engine`)
/// rather than as one of the slot's aliases. None when the slot does not hold it.
#[inline]
pub(super) fn held_as(
    map: &Table<u64>,
    blocks: &Table<Holders>,
    slab: &Slab,
    slot: &Slot,
    e: Entry,
    engine: u64,
) -> Option<(u64, bool)> {
    if let Some(&k) = (!slot.alias.is_empty())
        .then(|| slot.alias.get(&engine))
        .flatten()
    {
        return Some((k, false));
    }
    let &k = map.get(&engine)?;
    let through_alias = !slot.alias_only.is_empty() && slot.alias_only.contains_key(&k);
    (!through_alias && blocks.get(&k).is_some_and(|h| h.contains(slab, e))).then_some((k, true))
}

/// Tokens mode: whether some slot holds block `k` through its canonical hash, i.e. its holder
/// set has a slot that does not list it in `alias_only` (`aliased`: how many such entries
/// there are in all; while none, any holder does).
pub(super) fn canonical_held(
    blocks: &Table<Holders>,
    slab: &Slab,
    workers: &[Option<Worker>],
    aliased: usize,
    k: u64,
) -> bool {
    let Some(h) = blocks.get(&k) else {
        return false;
    };
    aliased == 0
        || h.entries(slab).any(|e| {
            let worker = workers.get(worker_of(e) as usize).and_then(Option::as_ref);
            let slot = worker.and_then(|x| x.slots.iter().find(|s| s.class == medium_of(e)));
            slot.is_some_and(|s| !s.alias_only.contains_key(&k))
        })
}
