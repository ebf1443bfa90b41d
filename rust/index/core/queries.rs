//! Reading the index: per worker, how many leading blocks of a prompt it would hit. Workers
//! whose hit is their group 0's leading run share one bitset walk over the blocks; hybrid
//! workers (window groups, several main groups, groups of larger blocks) are scored one by
//! one by vLLM's rule (`index::groups`).

use super::super::groups::{scaled_step, window_step, Step};
use super::super::holders::{Bits, Filter, Holders};
use super::super::keys::QueryKeys;
use super::Core;
use crate::reader::eq_bytes;

/// How far ahead a query prefetches blocks' slots, and their slab entries.
const AHEAD: usize = 16;
const HALF: usize = AHEAD / 2;

impl Core {
    /// The classes a query counts, for the bitset walk over plain workers (group 0 only) and
    /// for hybrid ones (every group): in `medium` (`None`: any; `Some(None)`: the medium None),
    /// remote copies only if `remote`. None when no class can match.
    fn filters(&self, medium: Option<Option<&str>>, remote: bool) -> Option<(Filter, Filter)> {
        let m = match medium {
            None => None,
            Some(name) => Some(self.find_medium(name)?),
        };
        let none = Filter {
            all: false,
            mask: [0; 4],
        };
        let (mut plain, mut any) = (none, none);
        let mut all = true;
        for (i, c) in self.classes.iter().enumerate() {
            if m.is_some_and(|m| m != c.medium) || (c.remote && !remote) {
                all = false;
                continue;
            }
            any.set(i as u8);
            if c.group == 0 {
                plain.set(i as u8);
            } else {
                all = false;
            }
        }
        plain.all = all;
        Some((plain, any))
    }

    /// Per worker with a hit: how many leading blocks of `keys` it would hit (see `filters` for
    /// `medium` and `remote`), as (worker id, count) in worker id order.
    pub fn find_matches(
        &self,
        keys: &[u64],
        medium: Option<Option<&str>>,
        remote: bool,
        out: &mut Vec<(u32, u32)>,
    ) {
        self.find_matches_of(&mut { keys }, medium, remote, out)
    }

    /// `find_matches` of keys made as the walk reaches them (`keys::TokenKeys`): the walk of
    /// workers without groups hashes no further than it goes (plus what it looks ahead).
    pub fn find_matches_of(
        &self,
        keys: &mut impl QueryKeys,
        medium: Option<Option<&str>>,
        remote: bool,
        out: &mut Vec<(u32, u32)>,
    ) {
        out.clear();
        let Some((plain, any)) = self.filters(medium, remote) else {
            return;
        };
        let mut sorted = self.plain_matches(keys, &plain, out);
        if self.hybrid.iter().any(|&w| w != 0) {
            self.hybrid_matches(keys.all(), &any, out);
            sorted = false;
        }
        if !sorted {
            out.sort_unstable();
        }
    }

    /// `find_matches_by_medium` for every medium into `out` ((worker id, medium id, count),
    /// sorted), `one` its scratch: a router's read, allocating nothing once warm.
    pub fn find_matches_by_medium_into(
        &self,
        keys: &[u64],
        remote: bool,
        one: &mut Vec<(u32, u32)>,
        out: &mut Vec<(u32, u8, u32)>,
    ) {
        out.clear();
        for (m, name) in self.media.iter().enumerate() {
            self.find_matches(keys, Some(name.as_deref()), remote, one);
            out.extend(one.iter().map(|&(w, n)| (w, m as u8, n)));
        }
        if self.media.len() > 1 {
            out.sort_unstable();
        }
    }

    /// `find_matches` once per medium (or for `medium` only): (worker id, medium id, count).
    pub fn find_matches_by_medium(
        &self,
        keys: &[u64],
        medium: Option<&str>,
        remote: bool,
    ) -> Vec<(u32, u8, u32)> {
        let mut out = Vec::new();
        let mut one = Vec::new();
        for (m, name) in self.media.iter().enumerate() {
            if medium.is_some_and(|want| {
                name.as_deref()
                    .is_none_or(|n| !eq_bytes(n.as_bytes(), want.as_bytes()))
            }) {
                continue;
            }
            self.find_matches(keys, Some(name.as_deref()), remote, &mut one);
            out.extend(one.iter().map(|&(w, n)| (w, m as u8, n)));
        }
        out.sort_unstable();
        out
    }

    /// The leading run of group 0 of the workers that are not hybrid: one bitset walk. Whether
    /// `out` came out in worker id order.
    fn plain_matches(
        &self,
        keys: &mut impl QueryKeys,
        filter: &Filter,
        out: &mut Vec<(u32, u32)>,
    ) -> bool {
        let n_words = self.workers.len().div_ceil(64);
        let plain_word = |w: usize| !self.hybrid.get(w).copied().unwrap_or(0);
        if n_words <= 1 {
            // Up to 64 workers: one word per block, and with every class counted (one medium,
            // no groups: the common case) the slab's `words` rather than its entries.
            let slab = &self.slab;
            let mut counts = [0u32; 64];
            let holding = if filter.all {
                self.one_word(
                    keys,
                    plain_word(0),
                    true,
                    |h| h.word0_any(slab),
                    &mut counts,
                )
            } else {
                self.one_word(
                    keys,
                    plain_word(0),
                    false,
                    |h| h.word0(slab, filter),
                    &mut counts,
                )
            };
            // From a range, whose length is known: the answer is written with one check of its
            // room, where pushing checks it at each worker.
            let mut bits = holding;
            out.extend((0..holding.count_ones()).map(|_| {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                (b, counts[b as usize])
            }));
            true
        } else {
            let mut active = vec![0u64; n_words];
            let mut cur = vec![0u64; n_words];
            self.walk(keys, false, |i, h| {
                cur.fill(0);
                h.workers_into(&self.slab, filter, &mut cur);
                let mut any = 0;
                if i == 0 {
                    for (w, (a, c)) in active.iter_mut().zip(&cur).enumerate() {
                        *a = c & plain_word(w);
                        any |= *a;
                    }
                } else {
                    for (w, (a, c)) in active.iter_mut().zip(&cur).enumerate() {
                        emit(out, w, *a & !c, i);
                        *a &= c;
                        any |= *a;
                    }
                }
                any != 0
            });
            for (w, a) in active.iter().enumerate() {
                emit(out, w, *a, keys.total());
            }
            false
        }
    }

    /// The walk of an index of at most 64 workers: `word(holders)` gives a block's holders (of
    /// the classes counted) as one word; `plain`: the workers counted. The walk stops at the
    /// first block nobody is left holding. Returns the workers holding the first block; their
    /// counts go to `counts` by worker id (so the answer comes out in id order without a sort:
    /// a fifth of a query with tens of workers).
    #[inline(always)]
    fn one_word(
        &self,
        keys: &mut impl QueryKeys,
        plain: u64,
        any: bool,
        word: impl Fn(Holders) -> u64,
        counts: &mut [u32; 64],
    ) -> u64 {
        let (mut holding, mut active) = (0u64, 0u64);
        self.walk(keys, any, |i, h| {
            let cur = word(h);
            if i == 0 {
                holding = cur & plain;
                active = holding;
            } else {
                for b in Bits(active & !cur) {
                    counts[b] = i as u32;
                }
                active &= cur;
            }
            active != 0
        });
        // Still active: held to the end (the walk stopped at none before).
        for b in Bits(active) {
            counts[b] = keys.total() as u32;
        }
        holding
    }

    /// Calls `step(i, holders of keys[i])` for i = 0, 1, ... until it returns false or the keys
    /// end (a block the table lacks: `Holders::ABSENT`). The lookups are independent of each
    /// other, so their cache misses can overlap instead of coming one after another: the slot
    /// of the block AHEAD on is requested early, the block HALF on is looked up (its slot has
    /// arrived by then) and its slab entry requested (a popular block's; its word in the slab's
    /// `words` if `any`), and each key is hashed once (its slot index kept in a ring until it
    /// is looked up).
    #[inline(always)]
    fn walk<K: QueryKeys>(
        &self,
        keys: &mut K,
        any: bool,
        mut step: impl FnMut(usize, Holders) -> bool,
    ) {
        let n = keys.total();
        let Some(t) = self.blocks.probe() else {
            // No slots (a block keyed 0 at most): plain lookups.
            for i in 0..n {
                if !step(
                    i,
                    self.blocks
                        .get(&keys.key(i))
                        .copied()
                        .unwrap_or(Holders::ABSENT),
                ) {
                    return;
                }
            }
            return;
        };
        let mut start = [0usize; AHEAD];
        let mut held = [Holders::ABSENT; AHEAD];
        let ask = |j: usize, keys: &mut K, start: &mut [usize; AHEAD]| {
            let s = t.start(keys.key(j));
            t.prefetch_at(s);
            start[j % AHEAD] = s;
        };
        // Key j was made when it was asked for: `key` reads it again.
        let look = |j: usize, keys: &mut K, start: &[usize; AHEAD], held: &mut [Holders; AHEAD]| {
            let h = t
                .get_from(start[j % AHEAD], keys.key(j))
                .copied()
                .unwrap_or(Holders::ABSENT);
            h.prefetch(&self.slab, any);
            held[j % AHEAD] = h;
        };
        for j in 0..n.min(AHEAD) {
            ask(j, keys, &mut start);
        }
        for j in 0..n.min(HALF) {
            look(j, keys, &start, &mut held);
        }
        // Split where the keys to ask for run out, so that the loops test no bounds.
        let far = n.saturating_sub(AHEAD);
        for i in 0..far {
            ask(i + AHEAD, keys, &mut start);
            look(i + HALF, keys, &start, &mut held);
            if !step(i, held[i % AHEAD]) {
                return;
            }
        }
        for i in far..n {
            if i + HALF < n {
                look(i + HALF, keys, &start, &mut held);
            }
            if !step(i, held[i % AHEAD]) {
                return;
            }
        }
    }

    /// Hybrid workers, vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`: F = the
    /// leading blocks every main group holds (all of `keys` when there is no main group), then
    /// the largest n <= F each window group accepts. One lookup per block for all of them.
    /// With groups of larger blocks (scale m: index blocks per group block) a group is read
    /// only at its own block ends (index block (i + 1) * m - 1 is its block i's key), and n
    /// must be a multiple of the worker's alignment (the lcm of its scales, see `alignment`).
    #[inline(never)] // its own function: the plain walk's code does not change with it
    fn hybrid_matches(&self, keys: &[u64], filter: &Filter, out: &mut Vec<(u32, u32)>) {
        struct Walk<'c> {
            w: u32,
            main: u64,
            windows: &'c [(u8, u32)],
            /// The groups whose holding decides the hit (main and window).
            groups: u64,
            /// Where its window groups' runs are in `runs`.
            runs: usize,
            best: usize,
            open: bool,
        }
        // Workers with groups of larger blocks walk apart (`scaled`: their worker's scales and
        // alignment, by walk), so the others' loop stays as it was.
        let mut walks: Vec<Walk> = Vec::new();
        let mut scaled: Vec<(Walk, &[u32], u64)> = Vec::new();
        let mut n_runs = 0;
        for (word, &bits) in self.hybrid.iter().enumerate() {
            for b in Bits(bits) {
                let w = (word * 64 + b) as u32;
                let Some(worker) = self.workers.get(w as usize).and_then(Option::as_ref) else {
                    continue;
                };
                let (main, windows) = (worker.main, &worker.windows[..]);
                let groups = windows.iter().fold(main, |g, &(x, _)| g | 1 << x);
                if groups != 0 {
                    let walk = Walk {
                        w,
                        main,
                        windows,
                        groups,
                        runs: n_runs,
                        best: 0,
                        open: true,
                    };
                    if worker.scales.iter().all(|&m| m <= 1) {
                        walks.push(walk);
                    } else {
                        scaled.push((walk, &worker.scales[..], worker.align));
                    }
                    n_runs += windows.len();
                }
            }
        }
        let words = self.workers.len().div_ceil(64);
        let n_groups = self.class_group.iter().max().map_or(0, |&g| g as usize + 1);
        let mut held = vec![0u64; words * n_groups];
        let mut runs = vec![0usize; n_runs];
        let mut open = walks.len() + scaled.len();
        // The groups of `walk` that hold the block `held` describes, as bits by group.
        let mask = |held: &[u64], walk: &Walk| {
            let (word, bit) = (walk.w as usize / 64, walk.w % 64);
            Bits(walk.groups).fold(0u64, |m, g| {
                m | (held.get(g * words + word).map_or(0, |x| x >> bit & 1) << g)
            })
        };
        for (i, k) in keys.iter().enumerate() {
            if open == 0 {
                break;
            }
            held.fill(0);
            if let Some(h) = self.blocks.get(k) {
                h.groups_into(&self.slab, filter, &self.class_group, words, &mut held);
            }
            for walk in walks.iter_mut().filter(|x| x.open) {
                let m = mask(&held, walk);
                if m & walk.main != walk.main {
                    walk.open = false;
                    open -= 1;
                    continue;
                }
                let runs = &mut runs[walk.runs..walk.runs + walk.windows.len()];
                if window_step(runs, walk.windows, i + 1, m) {
                    walk.best = i + 1;
                }
            }
            for (walk, scales, align) in scaled.iter_mut().filter(|x| x.0.open) {
                let m = mask(&held, walk);
                let runs = &mut runs[walk.runs..walk.runs + walk.windows.len()];
                match scaled_step(runs, walk.main, walk.windows, scales, *align, i + 1, m) {
                    Step::Closed => {
                        walk.open = false;
                        open -= 1;
                    }
                    Step::Hit => walk.best = i + 1,
                    Step::Open => {}
                }
            }
        }
        let both = walks.iter().chain(scaled.iter().map(|x| &x.0));
        out.extend(both.filter(|x| x.best > 0).map(|x| (x.w, x.best as u32)));
    }
}

fn emit(out: &mut Vec<(u32, u32)>, word: usize, bits: u64, count: usize) {
    for b in Bits(bits) {
        out.push(((word * 64 + b) as u32, count as u32));
    }
}
