//! kvbridge's index core through its native API (rust/native.rs), in both key modes.

use std::rc::Rc;
use std::time::Instant;

use _native::native::NativeIndex;

use crate::msgpack::Writer;
use crate::workload::{Ev, Step, Workload};
use crate::{alloc, timed, Builder, Built, Querier, Scores};

/// A step as the worker publishes it: a msgpack KVEventBatch `[ts, [events], dp_rank]` with
/// vLLM's positional events.
fn payload(w: &Workload, step: &Step, ts: f64) -> Vec<u8> {
    let mut m = Writer(Vec::new());
    m.array(3);
    m.f64(ts);
    m.array(step.events.len());
    for ev in &step.events {
        match ev {
            Ev::Stored { parent, blocks } => {
                m.array(8);
                m.str("BlockStored");
                m.array(blocks.len());
                for &b in blocks {
                    m.uint(w.nodes[b as usize].seq);
                }
                match parent {
                    Some(p) => m.uint(w.nodes[*p as usize].seq),
                    None => m.nil(),
                }
                m.array(blocks.len() * w.block_size);
                for &b in blocks {
                    for &t in w.node_tokens(b) {
                        m.uint(t as u64);
                    }
                }
                m.uint(w.block_size as u64);
                m.nil();
                m.str("GPU");
                m.nil();
            }
            Ev::Removed(blocks) => {
                m.array(3);
                m.str("BlockRemoved");
                m.array(blocks.len());
                for &b in blocks {
                    m.uint(w.nodes[b as usize].seq);
                }
                m.str("GPU");
            }
            Ev::Cleared => {
                m.array(1);
                m.str("AllBlocksCleared");
            }
        }
    }
    m.uint(0);
    m.0
}

/// For bench/index_boundary.py: `payloads.bin`, per step (worker u32, length u32, payload);
/// `queries.bin`, (queries, blocks, block_size) as u32 and then per query its engine hashes
/// (u64), tokens (u32), and the brute-force answer (n u32, then n (worker, count) u32 pairs).
/// Little-endian throughout.
pub fn dump(w: &Workload, dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut p = Vec::new();
    for (i, s) in w.steps.iter().enumerate() {
        let b = payload(w, s, i as f64);
        p.extend_from_slice(&s.worker.to_le_bytes());
        p.extend_from_slice(&(b.len() as u32).to_le_bytes());
        p.extend_from_slice(&b);
    }
    std::fs::write(dir.join("payloads.bin"), p)?;
    let blocks = w.queries.first().map_or(0, |q| q.seq.len());
    let mut q = Vec::new();
    for v in [w.queries.len(), blocks, w.block_size] {
        q.extend_from_slice(&(v as u32).to_le_bytes());
    }
    for query in &w.queries {
        query
            .seq
            .iter()
            .for_each(|h| q.extend_from_slice(&h.to_le_bytes()));
        query
            .tokens
            .iter()
            .for_each(|t| q.extend_from_slice(&t.to_le_bytes()));
        q.extend_from_slice(&(query.expect.len() as u32).to_le_bytes());
        for (wk, n) in &query.expect {
            q.extend_from_slice(&wk.to_le_bytes());
            q.extend_from_slice(&n.to_le_bytes());
        }
    }
    std::fs::write(dir.join("queries.bin"), q)
}

fn name(i: u32) -> String {
    format!("worker-{i}")
}

/// Answers as (worker index, count), sorted; the index's worker ids are its own.
fn scores(idx: &NativeIndex, found: Vec<(u32, u32)>) -> Scores {
    let mut s: Scores = found
        .into_iter()
        .map(|(id, n)| {
            (
                idx.worker_name(id)["worker-".len()..]
                    .parse()
                    .expect("worker-N"),
                n,
            )
        })
        .collect();
    s.sort_unstable();
    s
}

pub fn builders(w: &Workload) -> Vec<(String, Builder<'_>)> {
    let mut out: Vec<(String, Builder)> = Vec::new();
    for engine in [true, false] {
        let key = if engine { "engine" } else { "tokens" };
        for threads in [1, 2] {
            let name = match threads {
                1 => format!("kvbridge key={key}"),
                _ => format!("kvbridge key={key}, 2 threads (parse, apply)"),
            };
            out.push((name, Box::new(move |_| build(w, engine, threads))));
        }
    }
    out
}

/// `threads`: 1, `NativeIndex::apply` payload by payload; 2, `NativeIndex::apply_many` (the
/// payloads read on a second thread while the caller's applies those before).
fn build(w: &Workload, engine: bool, threads: usize) -> Built<'_> {
    let names: Vec<String> = (0..w.workers).map(name).collect();
    let before = alloc::held();
    let payloads: Vec<Vec<u8>> = w
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| payload(w, s, i as f64))
        .collect();
    let items: Vec<(&str, &[u8])> = w
        .steps
        .iter()
        .zip(&payloads)
        .map(|(s, p)| (names[s.worker as usize].as_str(), p.as_slice()))
        .collect();
    let mut idx = NativeIndex::new(w.block_size, engine);
    let t = Instant::now();
    if threads == 1 {
        apply_all(&mut idx, &items);
    } else {
        apply_two_threads(&mut idx, &items);
    }
    let secs = t.elapsed().as_secs_f64();
    drop(items);
    drop(payloads);
    let bytes = alloc::held() - before;
    let idx = Rc::new(idx);
    let mut queries: Vec<(String, Querier)> = Vec::new();
    if threads == 2 {
        // The same index as one thread builds (rust/native.rs tests it): one query row, so
        // that its scores are checked too.
        let i = idx.clone();
        let keyed: Vec<Vec<u64>> = if engine {
            w.queries.iter().map(|q| q.seq.clone()).collect()
        } else {
            let mut keys = Vec::new();
            w.queries
                .iter()
                .map(|q| {
                    idx.hash_tokens(&q.tokens, &mut keys);
                    keys.clone()
                })
                .collect()
        };
        let label = if engine {
            "engine hashes in"
        } else {
            "its keys in"
        };
        queries.push((label.into(), Box::new(move |q| find(&i, &keyed[q].clone()))));
    } else if engine {
        let i = idx.clone();
        queries.push((
            "engine hashes in".into(),
            Box::new(move |q| find(&i, &w.queries[q].seq.clone())),
        ));
    } else {
        let mut keys = Vec::new();
        let keyed: Vec<Vec<u64>> = w
            .queries
            .iter()
            .map(|q| {
                idx.hash_tokens(&q.tokens, &mut keys);
                keys.clone()
            })
            .collect();
        let i = idx.clone();
        queries.push((
            "its keys in".into(),
            Box::new(move |q| find(&i, &keyed[q].clone())),
        ));
        let i = idx.clone();
        let mut keys = Vec::new();
        queries.push((
            "tokens in".into(),
            Box::new(move |q| {
                let tokens = w.queries[q].tokens.clone();
                let (ns, out) = timed(|| {
                    let mut out = Vec::new();
                    i.find_matches_tokens(&tokens, &mut keys, &mut out);
                    out
                });
                (ns, scores(&i, out))
            }),
        ));
    }
    Built {
        secs,
        bytes: Some(bytes),
        queries,
    }
}

/// The timed part of a build, a function of its own so that callgrind can count it alone
/// (`valgrind --tool=callgrind --toggle-collect='*apply_all*' ...`): instruction counts, where
/// the wall time of a shared machine moves too much to compare two builds.
#[inline(never)]
fn apply_all(idx: &mut NativeIndex, items: &[(&str, &[u8])]) {
    for &(worker, p) in items {
        idx.apply(worker, p);
    }
}

/// As `apply_all`, for callgrind (`--toggle-collect='*apply_two_threads*'
/// --toggle-collect='*parse_ahead*'`: the parser thread's instructions are outside this call).
#[inline(never)]
fn apply_two_threads(idx: &mut NativeIndex, items: &[(&str, &[u8])]) {
    let mut counts = Vec::with_capacity(items.len());
    idx.apply_many(items, &mut counts);
}

fn find(idx: &NativeIndex, keys: &[u64]) -> (u64, Scores) {
    let (ns, out) = timed(|| {
        let mut out = Vec::new();
        idx.find_matches(keys, &mut out);
        out
    });
    (ns, scores(idx, out))
}
