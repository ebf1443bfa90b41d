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

use workload::Workload;

/// One index built from the stream, and the ways it is queried.
pub struct Built<'w> {
    /// Seconds to apply the whole stream.
    pub secs: f64,
    /// Allocator-counted bytes the index holds after the stream (when asked for).
    pub bytes: Option<isize>,
    /// (label, query i -> (ns spent in the indexer's call, its scores)). Each querier copies its
    /// input before the clock starts, as Dynamo's take a fresh Vec: every call starts with its
    /// input in cache.
    pub queries: Vec<(String, Querier<'w>)>,
}

pub type Querier<'w> = Box<dyn FnMut(usize) -> (u64, Scores) + 'w>;

/// Builds one kind of index from the stream; `bytes`: measure its memory.
pub type Builder<'w> = Box<dyn Fn(bool) -> Built<'w> + 'w>;

/// Scores as (worker index, leading blocks held), sorted: the form every answer is compared in.
pub type Scores = Vec<(u32, u32)>;

/// `f`'s result and the ns it took.
#[inline]
pub fn timed<R>(f: impl FnOnce() -> R) -> (u64, R) {
    let t = Instant::now();
    let r = std::hint::black_box(f());
    (t.elapsed().as_nanos() as u64, r)
}

struct Row {
    name: String,
    /// Block events per second, one per repetition of the build.
    apply: Vec<f64>,
    bytes_per_entry: Option<f64>,
    /// Per round, ns per query.
    ns: Vec<Vec<u64>>,
    disagree: usize,
}

impl Row {
    fn apply_best(&self) -> Option<f64> {
        self.apply.iter().copied().max_by(f64::total_cmp)
    }

    /// p50 and p99 of each round, the best round of each: the one least disturbed by the other
    /// processes of a shared machine.
    fn percentiles(&self) -> (u64, u64) {
        let mut p50 = Vec::new();
        let mut p99 = Vec::new();
        for round in &self.ns {
            let mut ns = round.clone();
            ns.sort_unstable();
            let at = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)];
            p50.push(at(0.50));
            p99.push(at(0.99));
        }
        p50.sort_unstable();
        p99.sort_unstable();
        (p50[0], p99[0])
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let cfg = if quick {
        workload::Config::quick()
    } else {
        workload::Config::full()
    };
    // The machine is shared: each build is repeated (the fastest shown), and the query set runs
    // in rounds, each indexer in turn answering all of it, so a change in load falls on every
    // indexer alike. Not query by query in turn: each index would then answer from caches the
    // others just emptied, which a router's index, queried all the time, does not.
    let (reps, mut rounds) = if quick { (1, 2) } else { (3, 5) };
    if let Ok(r) = std::env::var("ROUNDS") {
        rounds = r.parse().expect("ROUNDS: a number");
    }
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
    let longest: usize = w
        .queries
        .iter()
        .map(|q| q.expect.iter().map(|e| e.1).max().unwrap_or(0) as usize)
        .sum();
    let holders: usize = w.queries.iter().map(|q| q.expect.len()).sum();
    eprintln!(
        "queries: longest match {:.1} blocks, {:.1} workers holding the first block (means)",
        longest as f64 / w.queries.len() as f64,
        holders as f64 / w.queries.len() as f64
    );
    // --dump DIR: the payloads and queries for bench/index_boundary.py (the same queries from
    // Python), and nothing measured.
    if let Some(dir) = std::env::args().skip_while(|a| a != "--dump").nth(1) {
        kvb::dump(&w, std::path::Path::new(&dir)).expect("dump");
        return;
    }
    // --only WORD: just the indexers whose name has WORD (while working on one).
    let only: Vec<String> = std::env::args()
        .skip_while(|a| a != "--only")
        .skip(1)
        .collect();
    let builders: Vec<(String, Builder)> = kvb::builders(&w)
        .into_iter()
        .chain(dynamo::builders(&w))
        .filter(|(name, _)| only.is_empty() || only.iter().any(|o| name.contains(o.as_str())))
        .collect();
    let mut rows: Vec<Row> = Vec::new();
    let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); builders.len()];
    let mut kept: Vec<Option<Built>> = builders.iter().map(|_| None).collect();
    for rep in 0..reps {
        for (k, (name, build)) in builders.iter().enumerate() {
            kept[k] = None;
            let b = build(rep == 0);
            if rep == 0 {
                for (label, _) in &b.queries {
                    rows_of[k].push(rows.len());
                    rows.push(Row {
                        name: format!("{name} ({label})"),
                        apply: Vec::new(),
                        bytes_per_entry: b.bytes.map(|x| x as f64 / w.entries_held as f64),
                        ns: Vec::new(),
                        disagree: 0,
                    });
                }
            }
            for &r in &rows_of[k] {
                rows[r].apply.push(w.block_events() as f64 / b.secs);
            }
            kept[k] = Some(b);
        }
    }
    // In row order: builders in order, each one's queries in order.
    let mut queriers: Vec<Querier> = kept
        .into_iter()
        .flatten()
        .flat_map(|b| b.queries)
        .map(|(_, q)| q)
        .collect();
    for round in 0..rounds {
        for (row, q) in rows.iter_mut().zip(queriers.iter_mut()) {
            let mut times = Vec::with_capacity(w.queries.len());
            for i in 0..w.queries.len() {
                let (ns, scores) = q(i);
                times.push(ns);
                if round == 0 && scores != w.queries[i].expect {
                    row.disagree += 1;
                }
            }
            row.ns.push(times);
        }
    }
    print_table(&w, &rows, reps, rounds);
}

fn print_table(w: &Workload, rows: &[Row], reps: usize, rounds: usize) {
    println!(
        "apply: best of {reps} builds; find_matches: {} queries x {rounds} rounds, the indexers in turn each round, p50 and p99 of the best round",
        w.queries.len()
    );
    println!();
    println!("| indexer (query input) | apply (M block events/s) | find_matches p50 / p99 (us) | B per (block, worker) | scores vs brute force |");
    println!("|---|---|---|---|---|");
    for r in rows {
        let (p50, p99) = r.percentiles();
        let mem = r
            .bytes_per_entry
            .map_or("-".to_string(), |b| format!("{b:.0}"));
        let agree = if r.disagree == 0 {
            format!("agree ({0}/{0})", w.queries.len())
        } else {
            format!("DISAGREE on {}", r.disagree)
        };
        let apply = r
            .apply_best()
            .map_or("-".to_string(), |a| format!("{:.2}", a / 1e6));
        println!(
            "| {} | {apply} | {:.2} / {:.2} | {mem} | {agree} |",
            r.name,
            p50 as f64 / 1e3,
            p99 as f64 / 1e3
        );
    }
    ratios(rows);
    if rows.iter().any(|r| r.disagree > 0) {
        eprintln!("some scores disagree with brute force");
        std::process::exit(1);
    }
}

/// Each kvbridge row against the best Dynamo figure of each column.
fn ratios(rows: &[Row]) {
    let (ours, theirs): (Vec<&Row>, Vec<&Row>) =
        rows.iter().partition(|r| r.name.starts_with("kvbridge"));
    let best = |f: &dyn Fn(&Row) -> Option<f64>, lower: bool| -> Option<(f64, String)> {
        theirs
            .iter()
            .filter_map(|r| f(r).map(|v| (v, r.name.clone())))
            .min_by(|a, b| {
                if lower {
                    a.0.total_cmp(&b.0)
                } else {
                    b.0.total_cmp(&a.0)
                }
            })
    };
    let apply = best(&|r| r.apply_best(), false);
    let p50 = best(&|r| Some(r.percentiles().0 as f64), true);
    let p99 = best(&|r| Some(r.percentiles().1 as f64), true);
    let mem = best(&|r| r.bytes_per_entry, true);
    println!();
    println!("against the best Dynamo indexer of each column (apply and find_matches: >1 is kvbridge faster; memory: <1 is kvbridge smaller):");
    for r in ours {
        let (o50, o99) = r.percentiles();
        let mut parts = Vec::new();
        if let (Some((v, n)), Some(a)) = (&apply, r.apply_best()) {
            parts.push(format!("apply {:.2}x [{n}]", a / v));
        }
        if let Some((v, n)) = &p50 {
            parts.push(format!("p50 {:.2}x [{n}]", v / o50 as f64));
        }
        if let Some((v, n)) = &p99 {
            parts.push(format!("p99 {:.2}x [{n}]", v / o99 as f64));
        }
        if let (Some((v, n)), Some(b)) = (&mem, r.bytes_per_entry) {
            parts.push(format!("memory {:.2}x [{n}]", b / v));
        }
        println!("- {}: {}", r.name, parts.join(", "));
    }
}
