//! Residency: a slot's hold on blocks, as holder entries in the block table, and the physical
//! copies past the first (vLLM does not de-duplicate blocks).

use super::super::holders::{Entry, Holders, Removed, Slab};
use super::super::table::Table;
use super::Slot;

/// Removes holder `e` from block `k`, dropping the block when it was the last; whether it held.
/// In one probe of the table (most removes drop a block's last holder).
#[inline]
fn remove_entry(blocks: &mut Table<Holders>, slab: &mut Slab, e: Entry, k: u64) -> Removed {
    let removed = blocks.update(&k, |h| {
        let r = h.remove(slab, e);
        if r == Removed::Empty {
            h.release(slab);
        }
        let empty = r == Removed::Empty;
        (r, empty)
    });
    removed.unwrap_or(Removed::NotHeld)
}

/// `slot` holds block `k` (once); whether it did not before. One probe of the table (most
/// stores are of a block no one holds).
#[inline]
pub(super) fn add_holder(
    blocks: &mut Table<Holders>,
    slab: &mut Slab,
    slot: &mut Slot,
    e: Entry,
    k: u64,
) -> bool {
    let (h, fresh) = blocks.get_or_insert(k, Holders::one(e));
    if !fresh {
        if h.contains(slab, e) {
            return false;
        }
        h.insert(slab, e);
    }
    slot.held += 1;
    true
}

/// What `remove_entry` did; the slot's count follows.
#[inline]
pub(super) fn drop_holder(
    blocks: &mut Table<Holders>,
    slab: &mut Slab,
    slot: &mut Slot,
    e: Entry,
    k: u64,
) -> Removed {
    let r = remove_entry(blocks, slab, e, k);
    if r != Removed::NotHeld {
        slot.held -= 1;
    }
    r
}

/// Engine mode: one more physical copy of block `engine` in `slot`.
#[inline]
pub(super) fn add_copy(
    blocks: &mut Table<Holders>,
    slab: &mut Slab,
    slot: &mut Slot,
    e: Entry,
    engine: u64,
) {
    if !add_holder(blocks, slab, slot, e, engine) {
        *slot.copies.entry(engine).or_insert(0) += 1;
    }
}

/// Takes one of the copies past the first `slot` holds of `engine`, if it has any.
#[inline]
pub(super) fn take_copy(slot: &mut Slot, engine: u64) -> bool {
    let Some(n) = (!slot.copies.is_empty())
        .then(|| slot.copies.get_mut(&engine))
        .flatten()
    else {
        return false;
    };
    *n -= 1;
    if *n == 0 {
        slot.copies.remove(&engine);
    }
    true
}
