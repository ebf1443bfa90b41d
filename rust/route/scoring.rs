//! A decision's scores: the index's answer read into the router's slots (per worker and tier),
//! or the scores a caller passes; provisional residency merged from where each worker's own hit
//! ends; the tiers weighed (`tiered_overlap`'s rule); the candidates in name order.

use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyMapping, PyString};

use super::residency::{worker_name, ProvisionalResidency};
use super::work::hit_cap;
use super::{Ask, RouterCore};

/// A storage tier as the router weighs it.
pub(super) struct Medium {
    pub(super) name: Option<String>,
    pub(super) weight: f64,
    /// Named "GPU" (what provisional residency counts in; the medium None is a different key
    /// of a score, though it weighs the same).
    pub(super) gpu: bool,
}

/// A worker's score in this decision.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Score {
    None,
    /// Leading blocks (a score given as an int, or provisional residency alone).
    Plain(i64),
    /// Per medium: `entries[start..end]`, and the "GPU" medium raised to at least `gpu` by
    /// provisional residency (0: not raised).
    Media {
        start: u32,
        end: u32,
        gpu: i64,
    },
}

/// What a decision reads of the index under its lock (kept for the allocations).
#[derive(Default)]
pub(super) struct IndexRead {
    /// (worker id, medium id, leading blocks) per hit.
    rows: Vec<(u32, u8, u32)>,
    one: Vec<(u32, u32)>,
    /// (worker id, cache clears) per live worker.
    workers: Vec<(u32, u64)>,
    /// Workers not yet known under their id: (id, name).
    misses: Vec<(u32, Arc<str>)>,
    /// The media the hits are in: (medium id, name).
    media: Vec<(u8, Option<String>)>,
}

impl IndexRead {
    /// The index's live workers and their clears; `cache` (index id -> the router's slot, with
    /// the name it had) says which names are new: a name is copied only then (Arcs compared,
    /// not strings).
    fn workers_of(&mut self, core: &crate::index::core::Core, cache: &[Option<(Arc<str>, u32)>]) {
        self.workers.clear();
        self.misses.clear();
        for (w, name, clears) in core.workers_with_clears() {
            self.workers.push((w, clears));
            let known = cache
                .get(w as usize)
                .and_then(Option::as_ref)
                .is_some_and(|c| Arc::ptr_eq(&c.0, name));
            if !known {
                self.misses.push((w, name.clone()));
            }
        }
    }
}

impl RouterCore {
    /// Scores every worker (index or given scores, resyncing workers left out, provisional
    /// residency merged) and collects the candidates in name order. (num_blocks, num_tokens).
    pub(super) fn score(&mut self, py: Python<'_>, ask: &Ask<'_, '_>) -> PyResult<(i64, i64)> {
        self.epoch += 1;
        self.prov_now = None;
        let epoch = self.epoch;
        self.entries.clear();
        self.scored.clear();
        let (mut num_blocks, mut num_tokens) = (ask.num_blocks, ask.num_tokens);
        if let Some(tokens) = ask.tokens {
            let index = self
                .index
                .as_ref()
                .expect("tokens need a kvbridge.Index")
                .clone_ref(py);
            let remote = self.remote;
            let mut keys = std::mem::take(&mut self.keys);
            let mut read = std::mem::take(&mut self.read);
            let cache = &self.index_slot;
            num_tokens = tokens.len()? as i64;
            // vLLM looks for a hit in the prompt less its last token (KVCacheManager.
            // get_computed_blocks: max_cache_hit_length = num_tokens - 1), and a hybrid worker's
            // window must hold at that length, not at the prompt's: the index is asked about
            // those blocks only, and they are the keys provisional residency and replicas see.
            let hit_cap = hit_cap(num_tokens, self.block_size);
            let got = index.get().route_query(
                py,
                tokens,
                ask.lora_name,
                ask.extra_keys,
                &mut keys,
                |core, keys| {
                    let keys = &keys[..keys.len().min(hit_cap)];
                    core.find_matches_by_medium_into(keys, remote, &mut read.one, &mut read.rows);
                    read.workers_of(core, cache);
                    read.media.clear();
                    for &(_, m, _) in &read.rows {
                        if !read.media.iter().any(|x| x.0 == m) {
                            read.media
                                .push((m, core.medium_name(m).map(str::to_string)));
                        }
                    }
                },
            );
            keys.truncate(hit_cap);
            self.keys = keys;
            let outcome = got.map(|()| self.apply_read(py, &read));
            self.read = read;
            outcome?;
            num_blocks = num_tokens / self.block_size as i64;
        } else {
            if let Some(index) = &self.index {
                let mut read = std::mem::take(&mut self.read);
                let cache = &self.index_slot;
                index.get().route_workers(py, |core| {
                    read.rows.clear();
                    read.workers_of(core, cache);
                });
                self.apply_read(py, &read);
                self.read = read;
            }
            if let Some(scores) = ask.scores {
                for (name, score) in scores.iter() {
                    let name = worker_name("scores", &name)?;
                    let s = self.slot(&name);
                    let score = self.read_score(&name, &score)?;
                    self.set_score(s, score);
                }
            }
        }
        if ask.use_keys {
            if let Some(resync) = ask.resyncing {
                for name in resync.try_iter()? {
                    let name = name?;
                    let name = worker_name("resyncing", &name)?;
                    let s = self.slot(&name);
                    let slot = &mut self.slots[s as usize];
                    if slot.seen == epoch {
                        slot.seen = 0; // its index score may be stale: none
                    }
                }
            }
            for i in 0..self.scored.len() {
                let s = self.scored[i];
                if self.slots[s as usize].seen == epoch {
                    let hit = self.leading(s);
                    let slot = &mut self.slots[s as usize];
                    (slot.hit, slot.hit_at) = (hit, epoch);
                }
            }
            if !self.keys.is_empty() {
                self.merge_provisional(py)?;
            }
        }
        self.candidates(py, ask.workers)?;
        Ok((num_blocks, num_tokens))
    }

    pub(super) fn set_score(&mut self, s: u32, score: Score) {
        let slot = &mut self.slots[s as usize];
        slot.seen = self.epoch;
        slot.score = score;
        self.scored.push(s);
    }

    pub(super) fn read_score(
        &mut self,
        name: &Bound<'_, PyString>,
        score: &Bound<'_, PyAny>,
    ) -> PyResult<Score> {
        let media = match score.cast::<PyDict>() {
            Ok(d) => Some(d.clone()),
            Err(_) if score.is_instance_of::<PyInt>() => None,
            Err(_) => match score.cast::<PyMapping>() {
                Ok(m) => Some(PyDict::from_sequence(&m.items()?.into_any())?),
                Err(_) => None,
            },
        };
        if let Some(media) = media {
            let start = self.entries.len() as u32;
            for (m, n) in media.iter() {
                let m = if m.is_none() {
                    None
                } else {
                    Some(
                        m.cast::<PyString>()
                            .map_err(|_| {
                                PyTypeError::new_err(format!(
                                    "scores[{}]: a medium is a str or None, got {}",
                                    name.repr().map(|r| r.to_string()).unwrap_or_default(),
                                    m.repr().map(|r| r.to_string()).unwrap_or_default()
                                ))
                            })?
                            .to_str()?
                            .to_string(),
                    )
                };
                let id = self.medium(m.as_deref());
                self.entries.push((id, count(name, &n)?));
            }
            let end = self.entries.len() as u32;
            return Ok(Score::Media { start, end, gpu: 0 });
        }
        Ok(Score::Plain(count(name, score)?))
    }

    /// What the index said, into this decision: its live workers marked (with their clears),
    /// each hit as a per-medium score.
    pub(super) fn apply_read(&mut self, py: Python<'_>, read: &IndexRead) {
        for (w, name) in &read.misses {
            let s = self.slot(&PyString::new(py, name));
            let i = *w as usize;
            if self.index_slot.len() <= i {
                self.index_slot.resize(i + 1, None);
            }
            self.index_slot[i] = Some((name.clone(), s));
        }
        let epoch = self.epoch;
        for &(w, clears) in &read.workers {
            let s = self.index_slot[w as usize].as_ref().expect("cached").1;
            let slot = &mut self.slots[s as usize];
            slot.indexed = epoch;
            slot.clears_now = clears;
        }
        let mut ids = [u32::MAX; 256];
        for (m, name) in &read.media {
            ids[*m as usize] = self.medium(name.as_deref());
        }
        let rows = &read.rows;
        let mut i = 0;
        while i < rows.len() {
            let w = rows[i].0;
            // Every worker with a hit is live, so marked just now.
            let s = self.index_slot[w as usize]
                .as_ref()
                .expect("a live worker")
                .1;
            let start = self.entries.len() as u32;
            while i < rows.len() && rows[i].0 == w {
                self.entries
                    .push((ids[rows[i].1 as usize], rows[i].2 as i64));
                i += 1;
            }
            let end = self.entries.len() as u32;
            self.set_score(s, Score::Media { start, end, gpu: 0 });
        }
    }

    /// The leading blocks a worker holds in any medium, as scored in this decision.
    pub(super) fn leading(&self, s: u32) -> i64 {
        let slot = &self.slots[s as usize];
        if slot.seen != self.epoch {
            return 0;
        }
        match slot.score {
            Score::None => 0,
            Score::Plain(n) => n,
            Score::Media { start, end, gpu } => {
                let most = self.entries[start as usize..end as usize]
                    .iter()
                    .map(|e| e.1)
                    .max()
                    .unwrap_or(0);
                // Provisional residency raises a score only past its leading blocks.
                most.max(gpu)
            }
        }
    }

    /// The overlap in blocks, each counted at the best tier holding it (`tiered_overlap`).
    pub(super) fn overlap(&self, s: u32) -> Option<f64> {
        let slot = &self.slots[s as usize];
        if slot.seen != self.epoch {
            return None;
        }
        Some(match slot.score {
            Score::None => return None,
            Score::Plain(n) => n as f64,
            Score::Media { start, end, gpu } => {
                let entries = &self.entries[start as usize..end as usize];
                if let ([(m, n)], 0) = (entries, gpu) {
                    // one medium (the common case)
                    return Some(*n as f64 * self.media[*m as usize].weight);
                }
                // (n, weight) per medium, the "GPU" one raised by provisional residency.
                let mut tiers: Vec<(i64, f64)> = entries
                    .iter()
                    .map(|&(m, n)| {
                        let m = &self.media[m as usize];
                        (if m.gpu && gpu > n { gpu } else { n }, m.weight)
                    })
                    .collect();
                if gpu > 0 && !entries.iter().any(|e| self.media[e.0 as usize].gpu) {
                    tiers.push((gpu, self.weight_of("GPU")));
                }
                if tiers.len() == 1 {
                    return Some(tiers[0].0 as f64 * tiers[0].1);
                }
                tiers.retain(|t| t.0 > 0);
                tiers.sort_by(|a, b| b.partial_cmp(a).expect("finite weights"));
                let (mut total, mut best) = (0.0, 0.0f64);
                for i in 0..tiers.len() {
                    best = best.max(tiers[i].1);
                    let below = tiers.get(i + 1).map_or(0, |t| t.0);
                    total += best * (tiers[i].0 - below) as f64;
                }
                total
            }
        })
    }

    /// Provisional residency extends each worker's hit by what it was just sent past it (or,
    /// without a hit, from the prompt's first block); what its own hit now covers is confirmed
    /// (those entries end), and a worker whose cache the index saw cleared since loses them.
    pub(super) fn merge_provisional(&mut self, py: Python<'_>) -> PyResult<()> {
        let prov = self.provisional.clone_ref(py);
        let mut prov = prov.bind(py).borrow_mut();
        if !prov.core.enabled() || prov.core.len() == 0 {
            return Ok(());
        }
        let now = prov.now(py)?;
        self.prov_now = Some(now);
        prov.core.prune(now);
        let keys = std::mem::take(&mut self.keys);
        let n = keys.len();
        // Workers with a hit: their run from where it ends. Hits end at a few positions for
        // many workers: each position's holders are looked up once.
        let mut cache: Vec<(usize, Vec<u32>)> = Vec::new();
        let scored = std::mem::take(&mut self.scored);
        for &s in &scored {
            let Some(pid) = self.slots[s as usize].pid else {
                continue;
            };
            let hit = self.leading(s);
            if hit <= 0 || self.slots[s as usize].seen != self.epoch {
                continue;
            }
            let hit = (hit as usize).min(n);
            let mut held_at = |i: usize| {
                let j = match cache.iter().position(|a| a.0 == i) {
                    Some(j) => j,
                    None => {
                        cache.push((i, prov.core.starting(keys[i])));
                        cache.len() - 1
                    }
                };
                cache[j].1.contains(&pid)
            };
            let covered = held_at(hit - 1);
            let run = if hit < n && held_at(hit) {
                1 + prov.core.run(pid, &keys, hit + 1)
            } else {
                0
            };
            if (covered || run > 0) && self.cleared_since(s) {
                prov.core.reset(pid);
                continue;
            }
            if covered {
                prov.core.confirm(pid, &keys[..hit]);
            }
            if run > 0 {
                self.raise(s, (hit + run) as i64);
            }
        }
        self.scored = scored;
        // Workers without one: their run from the first block.
        let starting = prov.core.starting(keys[0]);
        for pid in starting {
            let s = self.prov_to_slot(py, &prov, pid);
            if self.leading(s) > 0 {
                continue;
            }
            let run = prov.core.run(pid, &keys, 0);
            if run == 0 {
                continue;
            }
            if self.cleared_since(s) {
                prov.core.reset(pid);
                continue;
            }
            self.raise(s, run as i64);
        }
        self.keys = keys;
        Ok(())
    }

    /// Raises slot `s`'s score to `sent` leading blocks (counted on the GPU).
    pub(super) fn raise(&mut self, s: u32, sent: i64) {
        let epoch = self.epoch;
        let slot = &mut self.slots[s as usize];
        let score = if slot.seen == epoch {
            slot.score
        } else {
            Score::None
        };
        slot.score = match score {
            Score::Media { start, end, gpu } => Score::Media {
                start,
                end,
                gpu: gpu.max(sent),
            },
            _ => Score::Plain(sent),
        };
        slot.seen = epoch;
    }

    pub(super) fn prov_to_slot(
        &mut self,
        py: Python<'_>,
        prov: &ProvisionalResidency,
        pid: u32,
    ) -> u32 {
        if let Some(&s) = self.prov_slot.get(pid as usize).filter(|&&s| s != u32::MAX) {
            return s;
        }
        let s = self.slot(prov.names[pid as usize].bind(py));
        self.link(pid, s);
        s
    }

    /// Provisional residency's worker `pid` is slot `s` (both ways).
    pub(super) fn link(&mut self, pid: u32, s: u32) {
        if self.prov_slot.len() <= pid as usize {
            self.prov_slot.resize(pid as usize + 1, u32::MAX);
        }
        self.prov_slot[pid as usize] = s;
        self.slots[s as usize].pid = Some(pid);
    }

    /// Whether the index saw the worker's cache cleared (or forgot the worker) since the
    /// router's last decision for it.
    pub(super) fn cleared_since(&mut self, s: u32) -> bool {
        let epoch = self.epoch;
        let slot = &mut self.slots[s as usize];
        let Some(seen) = slot.clears_seen else {
            return false;
        };
        let now = (slot.indexed == epoch).then_some(slot.clears_now);
        slot.clears_seen = Some(now);
        // None -> 0 is the worker's first events reaching the index, not a clear; 0 -> None
        // is the worker removed (expired, restarted).
        !(now == seen || (seen.is_none() && now.unwrap_or(0) == 0))
    }

    pub(super) fn candidates(
        &mut self,
        py: Python<'_>,
        workers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let epoch = self.epoch;
        self.cands.clear();
        if let Some(workers) = workers {
            for w in workers.try_iter()? {
                let w = w?;
                let name = worker_name("workers", &w)?;
                let s = self.slot(&name);
                self.slots[s as usize].asked = epoch;
            }
            let slots = &self.slots;
            self.cands.extend(
                self.order
                    .iter()
                    .filter(|&&s| slots[s as usize].asked == epoch),
            );
            return Ok(());
        }
        let slots = &self.slots;
        self.cands.extend(self.order.iter().filter(|&&s| {
            let slot = &slots[s as usize];
            slot.listed || slot.indexed == epoch || slot.seen == epoch
        }));
        let _ = py;
        Ok(())
    }
}

fn count(name: &Bound<'_, PyString>, n: &Bound<'_, PyAny>) -> PyResult<i64> {
    n.extract::<i64>().map_err(|_| {
        PyTypeError::new_err(format!(
            "scores[{}]: a block count is an int, got {}",
            name.repr().map(|r| r.to_string()).unwrap_or_default(),
            n.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}
