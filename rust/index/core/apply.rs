//! Changing the index: a payload's events applied for a worker. Stores (with the offload
//! connector's placeholders and the re-announce rule), removes and clears; what a worker's
//! groups are, learnt from its stores; workers removed and the index cleared.

use super::super::events::{Batch, Event, Spare, Stored, BAD_GROUP, NO_KIND};
use super::super::groups::{
    alignment, is_plain, kind_of, plan, scale_of, BadKind, Kind, MAX_SCALE, WINDOW_CODES,
};
use super::super::holders::{entry, Removed};
use super::aliases::{canonical_held, held_as};
use super::holding::{add_copy, drop_holder, take_copy};
use super::{Core, LastClass, Mode};
use crate::hash::algo::{index_keys, Algo, Chain, Digest};
use crate::hash::value::Value;

impl Core {
    /// Applies a payload's events for `worker`; returns how many events it had.
    pub fn apply(&mut self, worker: &str, mut batch: Batch) -> usize {
        self.stats.payloads += 1;
        let Some(w) = self.worker_id(worker) else {
            self.stats.too_many_workers += 1;
            return 0;
        };
        let n = batch.events.len();
        self.stats.events += n as u64;
        let mut events = std::mem::take(&mut batch.events);
        let (hashes, tokens) = (&batch.hashes, &batch.tokens);
        match self.mode {
            Mode::Tokens => self.touch(&events, hashes),
            // The events' blocks are the table's slots themselves: asked for all at once, their
            // cache misses overlap (a payload's hashes are a few KB at most).
            Mode::Engine => hashes.iter().for_each(|&h| self.blocks.prefetch(h)),
        }
        let mut last = LastClass::default();
        // A payload that names a window or mamba group makes its worker hybrid for the whole
        // payload: a snapshot lists group 0's chains before the window groups' events.
        let windows = events
            .iter()
            .any(|e| matches!(e, Event::Stored(s) if WINDOW_CODES.contains(&s.kind)));
        for ev in events.drain(..) {
            match ev {
                Event::Stored(s) => self.stored(w, s, hashes, tokens, &mut last, windows),
                Event::Removed {
                    hashes: r,
                    medium,
                    group,
                    remote,
                } => self.removed(w, &hashes[r], medium, group, remote, &mut last),
                Event::Cleared => {
                    self.stats.cleared += 1;
                    self.clear_worker(w);
                }
            }
        }
        batch.events = events;
        self.spare.keep(batch);
        n
    }

    /// The vectors for the next payload's batch (see `parse`).
    pub fn take_spare(&mut self) -> Spare {
        let mut spare = std::mem::take(&mut self.spare);
        // Keyed by the engines' hashes, a store's token ids only count (a third of a block
        // event's apply was decoding them).
        spare.count_tokens = self.mode == Mode::Engine;
        spare
    }

    /// Asks the CPU for the table entries a payload's events will change: independent requests
    /// whose cache misses overlap, where the updates that follow (each waiting on the last)
    /// would take them one at a time. Prefetches, not lookups, where a lookup is not needed to
    /// know where to look (a lookup of a block about to be stored mostly misses, which costs
    /// linear probing the most).
    fn touch(&self, events: &[Event<'_>], hashes: &[u64]) {
        for ev in events {
            match ev {
                Event::Stored(s) => {
                    // The parent's index hash is looked up first thing when the event is
                    // applied, the blocks' entries in the shared map when they are stored
                    // (their table slots are asked for once their keys are hashed).
                    if let Some(p) = s.parent {
                        self.engine.prefetch(p);
                    }
                    hashes[s.hashes.clone()]
                        .iter()
                        .for_each(|&e| self.engine.prefetch(e));
                }
                Event::Removed { hashes: r, .. } => {
                    for e in &hashes[r.clone()] {
                        if let Some(&k) = self.engine.get(e) {
                            self.blocks.prefetch(k);
                        }
                    }
                }
                Event::Cleared => {}
            }
        }
    }

    pub fn malformed(&mut self) {
        self.stats.payloads += 1;
        self.stats.malformed_payloads += 1;
    }

    pub fn remove_worker(&mut self, worker: &str) {
        let Some(w) = self.ids.remove(worker) else {
            return;
        };
        self.clear_worker(w);
        self.workers[w as usize] = None;
        while self.workers.last().is_some_and(Option::is_none) {
            self.workers.pop();
        }
        self.free_ids
            .retain(|&id| (id as usize) < self.workers.len());
        if (w as usize) < self.workers.len() {
            self.free_ids.push(w);
        }
    }

    /// Forgets every block and worker; the counters stay.
    pub fn clear(&mut self) {
        let stats = std::mem::take(&mut self.stats);
        *self = Core::new(self.block_size, self.mode);
        self.stats = stats;
    }

    /// Records what a store said group `g` is (None: unchanged) and its block size in index
    /// blocks (None: a placeholder's, which says nothing); returns its kind now.
    #[inline(never)] // a store that says something new is rare: kept out of `stored`
    fn learn(&mut self, w: u32, g: u8, kind: Option<Kind>, scale: Option<u32>) -> Kind {
        let bs = self.block_size;
        let worker = self.workers[w as usize].as_mut().expect("live worker");
        let g = g as usize;
        let mut changed = false;
        if let Some(kind) = kind {
            if worker.kinds.get(g) != Some(&kind) {
                if worker.kinds.len() <= g {
                    worker.kinds.resize(g + 1, Kind::Unannounced);
                }
                worker.kinds[g] = kind;
                changed = true;
            }
        }
        // Scale 1 is the default: only a larger one is news (and needs the vector).
        if let Some(m) = scale.filter(|&m| m > scale_of(&worker.scales, g)) {
            if worker.scales.len() <= g {
                worker.scales.resize(g + 1, 0);
            }
            worker.scales[g] = m;
            worker.align = alignment(&worker.scales);
            changed = true;
        }
        let now = worker.kinds.get(g).copied().unwrap_or_default();
        if changed {
            (worker.main, worker.windows) = plan(&worker.kinds, &worker.scales, bs);
            let hybrid = !is_plain(&worker.kinds, &worker.scales);
            self.set_hybrid(w, hybrid);
        }
        now
    }

    fn set_hybrid(&mut self, w: u32, on: bool) {
        let (word, bit) = (w as usize / 64, 1u64 << (w % 64));
        if on {
            if self.hybrid.len() <= word {
                self.hybrid.resize(word + 1, 0);
            }
            self.hybrid[word] |= bit;
        } else if let Some(x) = self.hybrid.get_mut(word) {
            *x &= !bit;
        }
    }

    fn kind(&self, w: u32, g: u8) -> Kind {
        let worker = self.workers[w as usize].as_ref().expect("live worker");
        worker.kinds.get(g as usize).copied().unwrap_or_default()
    }

    /// `windows`: the payload names a window or mamba group (see `apply`).
    fn stored<'a>(
        &mut self,
        w: u32,
        s: Stored<'a>,
        hashes: &[u64],
        tokens: &[u32],
        last: &mut LastClass<'a>,
        windows: bool,
    ) {
        let keys = &hashes[s.hashes.clone()];
        // Engine mode parsed them without keeping them (`take_spare`): their count is all it reads.
        let n_tokens = s.tokens.len();
        let tokens = if self.mode == Mode::Tokens {
            &tokens[s.tokens.clone()]
        } else {
            &[]
        };
        let n = keys.len();
        let bs = self.block_size;
        if s.group == BAD_GROUP {
            self.stats.bad_groups += 1;
            return;
        }
        let kind = match (s.kind != NO_KIND)
            .then(|| kind_of(s.kind, s.window))
            .transpose()
        {
            Ok(k) => k,
            Err(BadKind::Kind) => {
                self.stats.unknown_kinds += 1;
                return;
            }
            Err(BadKind::Window) => {
                self.stats.bad_windows += 1;
                return;
            }
        };
        // The offload connector's token-less placeholder (offloading/events.py
        // `_placeholder_stored`): only a hash, block_size 0.
        let placeholder = s.block_size == 0 && n_tokens == 0;
        // A group's blocks may be a multiple m of the hash block size (vLLM: each group's
        // `block_size`, hashes at their gcd); its block i is keyed by the hash of its last
        // hash block, index block (i + 1) * m - 1 (kv_cache_utils.py
        // `BlockHashListWithBlockSize`). Anything else is not this index's block size.
        let scale = if s.block_size == bs as i64 {
            Some(1) // nearly every event: no division
        } else {
            (s.block_size > 0 && (s.block_size as u64).is_multiple_of(bs as u64))
                .then(|| s.block_size as u64 / bs as u64)
                .filter(|&m| m <= MAX_SCALE)
                .map(|m| m as u32)
        };
        if !placeholder && scale.is_none() {
            // An event with no blocks changes nothing, wrong size or not (counted as before).
            self.stats.block_size_mismatches += u64::from(n > 0);
            return;
        }
        let kind = if kind.is_none() && scale.is_none_or(|m| m <= 1) {
            self.kind(w, s.group) // most stores: nothing new to learn
        } else {
            self.learn(w, s.group, kind, scale)
        };
        if kind == Kind::Unscored {
            self.stats.unscored_group_events += 1;
        }
        if n == 0 {
            return;
        }
        // Tokens per block of this event (a placeholder's none: its hashes are all it says).
        let ebs = bs * scale.unwrap_or(1) as usize;
        let dense = n_tokens == n * ebs;
        // A window or mamba group lists only the blocks it retains (block_pool.py
        // `cache_full_blocks` skips null blocks) while its token ids cover the whole range.
        let sparse = !dense
            && n_tokens != 0
            && matches!(kind, Kind::Window { .. } | Kind::Unscored)
            && n_tokens > n * ebs
            && n_tokens.is_multiple_of(ebs);
        if !(placeholder || n_tokens == 0 || dense || sparse) {
            self.stats.block_size_mismatches += 1;
            return;
        }
        if n_tokens == 0 && !placeholder {
            self.stats.events_without_tokens += 1;
            if self.mode == Mode::Tokens {
                return;
            }
        }
        if s.bad_tokens {
            self.stats.bad_token_ids += 1;
            if self.mode == Mode::Tokens && dense {
                return;
            }
        }
        if self.mode == Mode::Tokens
            && dense
            && (s.bad_extra_keys || s.extra_keys.as_ref().is_some_and(|e| e.len() != n))
        {
            self.stats.bad_extra_keys += 1;
            return;
        }
        let Some(c) = last.find(self, s.medium, s.group, s.remote).or_else(|| {
            let c = self.class_id(s.medium, s.group, s.remote)?;
            last.0 = Some((s.medium, s.group, s.remote, c));
            Some(c)
        }) else {
            self.stats.too_many_media += 1;
            return;
        };
        let si = self.slot_index(w, c);
        let mut digests = std::mem::take(&mut self.digests);
        digests.clear();
        let mut skipped = 0;
        // The engine hashes that go with `digests`: `keys` but for the unresolved ones.
        let mut resolved = None;
        match self.mode {
            Mode::Engine => {
                if let Some(p) = s.parent {
                    let held = self
                        .blocks
                        .get(&p)
                        .is_some_and(|h| h.held_by_worker(&self.slab, w));
                    if !held {
                        // Keyed by the engine's own hashes, the blocks need no parent: kept.
                        self.stats.unknown_parents += 1;
                    }
                }
                // The keys are the engine's hashes: `digests` stays empty (see below).
            }
            Mode::Tokens if dense && (ebs == bs || extras_none(&s.extra_keys, s.lora_name)) => {
                let parent = match s.parent {
                    None => None,
                    Some(p) => match self.engine_key(w, c, p) {
                        Some(k) => Some(k),
                        None => {
                            // The chain cannot be continued without the parent's index hash.
                            self.stats.unknown_parents += 1;
                            self.digests = digests;
                            return;
                        }
                    },
                };
                if ebs == bs {
                    let extras = s.extra_keys.map(|e| strip_lora(e, s.lora_name));
                    index_keys(
                        tokens,
                        bs,
                        s.lora_name,
                        parent,
                        extras.as_deref(),
                        &mut digests,
                    );
                } else {
                    // A block of m hash blocks is keyed by its last one's index hash, which
                    // is what a group of the index's size stores for that position (and what
                    // the engine hash of the block stands for in every group). No extra keys
                    // here (see `extras_none`).
                    let m = ebs / bs;
                    let mut i = 0usize;
                    let mut chain = Chain::new(Algo::Xxh3, bs, 0, None, s.lora_name, None);
                    chain.parent = parent.map(Digest::from_u64);
                    chain.run_words(tokens, None, |k| {
                        i += 1;
                        if i.is_multiple_of(m) {
                            digests.push(k);
                        }
                    });
                }
                digests.iter().for_each(|&k| self.blocks.prefetch(k));
            }
            Mode::Tokens => {
                // Placeholders, sparse groups and larger blocks with extra keys: each hash
                // stands for the block the worker stored under it with tokens (the same hash
                // in another group or medium).
                let mut engines = Vec::with_capacity(n);
                for &e in keys {
                    match self.engine_key(w, c, e) {
                        Some(k) => {
                            engines.push(e);
                            digests.push(k);
                        }
                        None => skipped += 1,
                    }
                }
                resolved = Some(engines);
                if placeholder {
                    self.stats.unresolved_placeholders += skipped;
                } else {
                    self.stats.unresolved_hashes += skipped;
                }
            }
        }
        let mode = self.mode;
        let e = entry(w, c);
        // In a worker with window (or mamba) groups those groups cut hits short, so vLLM often
        // recomputes a chain from block 0 that its main group still holds: a real second copy
        // that looks exactly like a re-announce. There every store is a copy.
        let plain = !windows
            && self.workers[w as usize]
                .as_ref()
                .is_some_and(|x| x.windows.is_empty());
        // vLLM's kv_cache_report_mode="full" re-announces reused prefix blocks from block 0
        // (block_pool.py `emit_cached_block_events`) without storing anything: not a copy.
        let reannounce = plain && s.parent.is_none() && skipped == 0 && {
            let (blocks, slab, slot, map) = self.parts(w, si);
            keys.iter().all(|k| match mode {
                Mode::Engine => blocks.get(k).is_some_and(|h| h.contains(slab, e)),
                Mode::Tokens => held_as(map, blocks, slab, slot, e, *k).is_some(),
            })
        };
        if !reannounce {
            match mode {
                Mode::Engine => {
                    let (blocks, slab, slot, _) = self.parts(w, si);
                    keys.iter()
                        .for_each(|&engine| add_copy(blocks, slab, slot, e, engine));
                }
                Mode::Tokens => {
                    for (&engine, &k) in resolved.as_deref().unwrap_or(keys).iter().zip(&digests) {
                        self.add_copy_tokens(w, si, engine, k);
                    }
                }
            }
        }
        self.digests = digests;
        self.stats.blocks_stored += n as u64 - skipped;
    }

    fn removed<'a>(
        &mut self,
        w: u32,
        keys: &[u64],
        medium: Option<&'a str>,
        group: u8,
        remote: bool,
        last: &mut LastClass<'a>,
    ) {
        if group == BAD_GROUP {
            self.stats.bad_groups += 1;
            return;
        }
        if self.kind(w, group) == Kind::Unscored {
            self.stats.unscored_group_events += 1;
        }
        let slot_i = last.find(self, medium, group, remote).and_then(|c| {
            let slots = &self.workers[w as usize].as_ref()?.slots;
            slots.iter().position(|s| s.class == c)
        });
        let Some(si) = slot_i else {
            self.stats.unknown_removes += keys.len() as u64;
            return;
        };
        let mut found = 0;
        match self.mode {
            Mode::Engine => {
                let (blocks, slab, slot, _) = self.parts(w, si);
                let e = entry(w, slot.class);
                for &engine in keys {
                    let gone = take_copy(slot, engine)
                        || drop_holder(blocks, slab, slot, e, engine) != Removed::NotHeld;
                    found += u64::from(gone);
                }
            }
            Mode::Tokens => {
                for &engine in keys {
                    found += u64::from(self.drop_copy_tokens(w, si, engine));
                }
            }
        }
        self.stats.blocks_removed += found;
        self.stats.unknown_removes += keys.len() as u64 - found;
    }

    /// Drops everything worker `w` holds, in every class, and what its groups were.
    fn clear_worker(&mut self, w: u32) {
        self.set_hybrid(w, false);
        let Core {
            blocks,
            slab,
            workers,
            mode,
            engine,
            aliased,
            ..
        } = self;
        let worker = workers[w as usize].as_mut().expect("live worker");
        worker.clears += 1;
        worker.kinds.clear();
        worker.scales.clear();
        worker.align = 1;
        (worker.main, worker.windows) = plan(&[], &[], 1);
        if worker.slots.iter().all(|s| s.held == 0) {
            worker.slots.clear();
            return;
        }
        *aliased -= worker
            .slots
            .iter()
            .map(|s| s.alias_only.len())
            .sum::<usize>();
        worker.slots.clear();
        // Only the blocks know who holds them: one pass over all of them.
        blocks.retain(|_, h| {
            if h.remove_worker(slab, w) {
                h.release(slab);
                return false;
            }
            true
        });
        if *mode == Mode::Tokens {
            // The canonical hashes of the blocks no one else holds through them go.
            engine.retain(|_, k| canonical_held(blocks, slab, workers, *aliased, *k));
        }
    }
}

/// Whether a store's blocks carry no extra keys but the LoRA name. vLLM's extra keys of a
/// block larger than the hash block (multimodal `(identifier, offset)` pairs, offsets from
/// the block's start; prompt-embeds digests of the whole block) cannot be split into the
/// smaller blocks' keys, so such a store is placed through the engine hashes instead.
fn extras_none(extras: &Option<Vec<Option<Value>>>, lora_name: Option<&str>) -> bool {
    // Rare (a LoRA or multimodal request on a group of larger blocks): the copy is cheap.
    extras
        .as_ref()
        .is_none_or(|e| strip_lora(e.clone(), lora_name).iter().all(Option::is_none))
}

/// vLLM repeats the LoRA name as the first extra key of every block of a LoRA request; the
/// index salts by `lora_name` instead, so queries need not repeat it.
fn strip_lora(keys: Vec<Option<Value>>, lora_name: Option<&str>) -> Vec<Option<Value>> {
    keys.into_iter()
        .map(|k| {
            let Some(Value::Tuple(mut items, id)) = k else {
                return k;
            };
            if let (Some(name), Some(Value::Str(first, _))) = (lora_name, items.first()) {
                if first.as_slice() == name.as_bytes() {
                    items.remove(0);
                }
            }
            (!items.is_empty()).then_some(Value::Tuple(items, id))
        })
        .collect()
}
