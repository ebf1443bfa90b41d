//! kvbridge's index core through its native API (rust/native.rs), in both key modes.

use std::time::Instant;

use _native::native::NativeIndex;

use crate::msgpack::Writer;
use crate::workload::{Ev, Step, Workload};
use crate::{alloc, time_queries, Row, Scores};

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

fn name(i: u32) -> String {
    format!("worker-{i}")
}

/// Answers as (worker index, count), sorted; the index's worker ids are its own.
fn scores(idx: &NativeIndex, found: Vec<(u32, u32)>) -> Scores {
    let mut s: Scores = found
        .into_iter()
        .map(|(id, n)| (idx.worker_name(id)["worker-".len()..].parse().expect("worker-N"), n))
        .collect();
    s.sort_unstable();
    s
}

pub fn run(w: &Workload) -> Vec<Row> {
    let names: Vec<String> = (0..w.workers).map(name).collect();
    let mut rows = Vec::new();
    for engine in [true, false] {
        let before = alloc::held();
        let payloads: Vec<Vec<u8>> = w.steps.iter().enumerate().map(|(i, s)| payload(w, s, i as f64)).collect();
        let mut idx = NativeIndex::new(w.block_size, engine);
        let t = Instant::now();
        for (s, p) in w.steps.iter().zip(&payloads) {
            idx.apply(&names[s.worker as usize], p);
        }
        let secs = t.elapsed().as_secs_f64();
        drop(payloads);
        let bytes = (alloc::held() - before) as f64;
        let mode = if engine { "engine" } else { "tokens" };
        eprintln!(
            "kvbridge key={mode}: {:.0} B allocated, memory_bytes() says {} ({} blocks)",
            bytes,
            idx.memory_bytes(),
            idx.len()
        );
        let check = |i: usize, found: Vec<(u32, u32)>| scores(&idx, found) == w.queries[i].expect;
        let (p50, p99, disagree) = if engine {
            time_queries(&w.queries, |_, q| &q.seq[..], |k| find(&idx, k), check)
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
            time_queries(&w.queries, |i, _| &keyed[i][..], |k| find(&idx, k), check)
        };
        rows.push(Row {
            name: format!("kvbridge key={mode} ({} in)", if engine { "engine hashes" } else { "its keys" }),
            apply_per_s: w.block_events() as f64 / secs,
            p50_ns: p50,
            p99_ns: p99,
            bytes_per_entry: Some(bytes / w.entries_held as f64),
            disagree,
        });
        if !engine {
            let mut keys = Vec::new();
            let (p50, p99, disagree) = time_queries(
                &w.queries,
                |_, q| &q.tokens[..],
                |t| {
                    let mut out = Vec::new();
                    idx.find_matches_tokens(t, &mut keys, &mut out);
                    out
                },
                check,
            );
            rows.push(Row {
                name: "kvbridge key=tokens (tokens in)".into(),
                apply_per_s: 0.0,
                p50_ns: p50,
                p99_ns: p99,
                bytes_per_entry: None,
                disagree,
            });
        }
    }
    rows
}

fn find(idx: &NativeIndex, keys: &[u64]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    idx.find_matches(keys, &mut out);
    out
}
