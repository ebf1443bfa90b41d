//! kvbridge's index core against Dynamo's native indexers (dynamo-kv-router 1.6.1), in Rust,
//! on one event stream and one query set: apply throughput, find_matches latency, memory per
//! (block, worker) entry, and whether every score agrees with brute force.
//!
//! Each side gets its native input: kvbridge the msgpack payloads a vLLM worker publishes
//! (decoding included in its time), Dynamo decoded `RouterEvent`s built before the clock starts;
//! queries are engine block hashes for kvbridge key="engine", token ids or its own keys for
//! key="tokens", `LocalBlockHash`es for Dynamo.
//!
//! `make bench-native` (or `cargo run --release` here; `--quick` for a small run).

mod alloc;
mod dynamo;
mod kvb;
mod msgpack;
mod workload;

use std::time::Instant;

use workload::{Query, Workload};

/// One indexer's figures from one run.
pub struct Row {
    pub name: String,
    /// Block events (blocks stored + block hashes removed) per second, whole stream.
    pub apply_per_s: f64,
    /// Per query, ns: p50 and p99.
    pub p50_ns: u64,
    pub p99_ns: u64,
    /// Allocator-counted bytes held after the stream, per (block, worker) entry held.
    pub bytes_per_entry: Option<f64>,
    /// Queries whose scores differ from brute force.
    pub disagree: usize,
}

/// Scores as (worker index, leading blocks held), sorted: the form every answer is compared in.
pub type Scores = Vec<(u32, u32)>;

pub fn percentiles(mut ns: Vec<u64>) -> (u64, u64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)];
    (at(0.50), at(0.99))
}

/// Times `f` once per query; `prep` builds its input first, off the clock (Dynamo's
/// `RadixTree::find_matches` takes its sequence by value).
pub fn time_queries<'q, I, R>(
    queries: &'q [Query],
    mut prep: impl FnMut(usize, &'q Query) -> I,
    mut f: impl FnMut(I) -> R,
    mut check: impl FnMut(usize, R) -> bool,
) -> (u64, u64, usize) {
    let mut ns = Vec::with_capacity(queries.len());
    let mut disagree = 0;
    for (i, q) in queries.iter().enumerate() {
        let input = prep(i, q);
        let t = Instant::now();
        let r = std::hint::black_box(f(input));
        ns.push(t.elapsed().as_nanos() as u64);
        if !check(i, r) {
            disagree += 1;
        }
    }
    let (p50, p99) = percentiles(ns);
    (p50, p99, disagree)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let cfg = if quick { workload::Config::quick() } else { workload::Config::full() };
    let t = Instant::now();
    let w = Workload::generate(&cfg);
    eprintln!(
        "workload: {} workers, {} steps, {} block events ({} stored, {} removed, {} clears), \
         {} queries x {} blocks, {} (block, worker) entries held at the end; {:.1}s to build",
        cfg.workers,
        w.steps.len(),
        w.block_events(),
        w.stored,
        w.removed,
        w.clears,
        w.queries.len(),
        cfg.query_blocks,
        w.entries_held,
        t.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    rows.extend(kvb::run(&w));
    rows.extend(dynamo::run(&w));
    print_table(&w, &rows);
}

fn print_table(w: &Workload, rows: &[Row]) {
    println!(
        "| indexer | apply (M block events/s) | find_matches p50 / p99 (us) | B per (block, worker) | scores |"
    );
    println!("|---|---|---|---|---|");
    for r in rows {
        let mem = r.bytes_per_entry.map_or("-".to_string(), |b| format!("{b:.0}"));
        let agree = if r.disagree == 0 {
            format!("agree ({}/{})", w.queries.len(), w.queries.len())
        } else {
            format!("DISAGREE on {}", r.disagree)
        };
        let apply = if r.apply_per_s > 0.0 { format!("{:.2}", r.apply_per_s / 1e6) } else { "-".into() };
        println!(
            "| {} | {} | {:.2} / {:.2} | {} | {} |",
            r.name,
            apply,
            r.p50_ns as f64 / 1e3,
            r.p99_ns as f64 / 1e3,
            mem,
            agree
        );
    }
    ratios(rows);
    if rows.iter().any(|r| r.disagree > 0) {
        eprintln!("some scores disagree with brute force");
        std::process::exit(1);
    }
}

/// kvbridge against the best Dynamo figure of each kind (>1: kvbridge better).
fn ratios(rows: &[Row]) {
    let (ours, theirs): (Vec<&Row>, Vec<&Row>) = rows.iter().partition(|r| r.name.starts_with("kvbridge"));
    let best = |f: &dyn Fn(&Row) -> Option<f64>, lower: bool| -> Option<(f64, String)> {
        theirs
            .iter()
            .filter_map(|r| f(r).map(|v| (v, r.name.clone())))
            .min_by(|a, b| if lower { a.0.total_cmp(&b.0) } else { b.0.total_cmp(&a.0) })
    };
    let apply = best(&|r| (r.apply_per_s > 0.0).then_some(r.apply_per_s), false);
    let p50 = best(&|r| Some(r.p50_ns as f64), true);
    let p99 = best(&|r| Some(r.p99_ns as f64), true);
    let mem = best(&|r| r.bytes_per_entry, true);
    println!();
    println!("ratios against the best Dynamo indexer of each column (apply, speed: >1 is kvbridge faster; memory: <1 is kvbridge smaller)");
    for r in ours {
        let mut parts = Vec::new();
        if let (Some((v, n)), true) = (&apply, r.apply_per_s > 0.0) {
            parts.push(format!("apply {:.2}x ({n})", r.apply_per_s / v));
        }
        if let Some((v, n)) = &p50 {
            parts.push(format!("p50 {:.2}x ({n})", v / r.p50_ns as f64));
        }
        if let Some((v, n)) = &p99 {
            parts.push(format!("p99 {:.2}x ({n})", v / r.p99_ns as f64));
        }
        if let (Some((v, n)), Some(b)) = (&mem, r.bytes_per_entry) {
            parts.push(format!("memory {:.2}x ({n})", b / v));
        }
        println!("- {}: {}", r.name, parts.join(", "));
    }
}
