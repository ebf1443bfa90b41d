//! Dynamo's indexers (dynamo-kv-router 1.6.1) that keep per-worker scores exactly: RadixTree
//! (single-threaded, `&mut`), PositionalIndexer (called directly, one writer), and the two
//! `SyncIndexer`s behind ThreadPoolIndexer, the way Dynamo's router runs them (events on
//! sticky per-worker writer threads, queries inline on the caller's thread). The cuckoo-filter
//! indexers answer approximately and the branch-sharded one spreads a tree over shards of
//! these; neither is measured.

use std::time::Instant;

use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData,
};
use dynamo_kv_router::{
    compute_block_hash_for_seq, ConcurrentRadixTreeCompressed, LocalBlockHash, OverlapScores,
    PositionalIndexer, RadixTree, RouterEvent, ThreadPoolIndexer,
};

use crate::workload::{Ev, Step, Workload};
use crate::{alloc, time_queries, Row, Scores};

/// Dynamo's example and test jump size for the positional indexer.
const JUMP: usize = 32;

fn event(w: &Workload, worker: u32, id: u64, ev: &Ev) -> RouterEvent {
    let ext = |n: u32| ExternalSequenceBlockHash(w.nodes[n as usize].seq);
    let data = match ev {
        Ev::Stored { parent, blocks } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ext),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|&b| KvCacheStoredBlockData {
                    block_hash: ext(b),
                    tokens_hash: LocalBlockHash(w.nodes[b as usize].local),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        Ev::Removed(blocks) => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: blocks.iter().map(|&b| ext(b)).collect(),
        }),
        Ev::Cleared => KvCacheEventData::Cleared,
    };
    RouterEvent::new(worker as u64, KvCacheEvent { event_id: id, data, dp_rank: 0 })
}

/// The events of `steps`, numbered from `id` on.
fn events(w: &Workload, steps: &[Step], mut id: u64) -> Vec<RouterEvent> {
    let mut out = Vec::new();
    for s in steps {
        for ev in &s.events {
            id += 1;
            out.push(event(w, s.worker, id, ev));
        }
    }
    out
}

fn scores(o: OverlapScores) -> Scores {
    let mut s: Scores = o.scores.into_iter().map(|(k, v)| (k.worker_id as u32, v)).collect();
    s.sort_unstable();
    s
}

fn row(w: &Workload, name: String, secs: f64, bytes: Option<isize>, q: (u64, u64, usize)) -> Row {
    Row {
        name,
        apply_per_s: if secs > 0.0 { w.block_events() as f64 / secs } else { 0.0 },
        p50_ns: q.0,
        p99_ns: q.1,
        bytes_per_entry: bytes.map(|b| b as f64 / w.entries_held as f64),
        disagree: q.2,
    }
}

pub fn run(w: &Workload) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut failed = 0usize;
    let check = |i: usize, s: Scores| s == w.queries[i].expect;
    let hashes = |_: usize, q: &crate::workload::Query| q.local_hashes();

    // RadixTree: events applied in the caller's thread.
    let before = alloc::held();
    let evs = events(w, &w.steps, 0);
    let mut tree = RadixTree::new();
    let t = Instant::now();
    for e in evs {
        failed += tree.apply_event(e).is_err() as usize;
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = alloc::held() - before;
    let q = time_queries(&w.queries, hashes, |s| scores(tree.find_matches(s, false)), check);
    rows.push(row(w, "Dynamo RadixTree (LocalBlockHash in)".into(), secs, Some(bytes), q));
    let bs = w.block_size as u32;
    let q = time_queries(
        &w.queries,
        |_, q| &q.tokens[..],
        |t| scores(tree.find_matches(compute_block_hash_for_seq(t, bs, BlockHashOptions::default()), false)),
        check,
    );
    rows.push(row(w, "Dynamo RadixTree (tokens in)".into(), 0.0, None, q));
    drop(tree);

    // PositionalIndexer with one writer: the per-worker maps a writer thread would own.
    let before = alloc::held();
    let evs = events(w, &w.steps, 0);
    let pos = PositionalIndexer::new(JUMP);
    let mut lanes = Default::default();
    let t = Instant::now();
    for e in evs {
        failed += pos.apply_event(&mut lanes, e, None).is_err() as usize;
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = alloc::held() - before;
    let q = time_queries(&w.queries, hashes, |s| scores(pos.find_matches(&s, false)), check);
    rows.push(row(w, format!("Dynamo PositionalIndexer (jump {JUMP}, 1 writer)"), secs, Some(bytes), q));
    drop((pos, lanes));

    for threads in [1, 2] {
        rows.push(pooled(w, "ConcurrentRadixTreeCompressed", threads, ConcurrentRadixTreeCompressed::new));
    }
    rows.push(pooled(w, "PositionalIndexer", 2, || PositionalIndexer::new(JUMP)));
    if failed > 0 {
        eprintln!("Dynamo rejected {failed} events");
    }
    rows
}

/// A `SyncIndexer` behind ThreadPoolIndexer with `threads` writer threads: apply timed from
/// the first enqueue to the flush that sees the last event applied.
fn pooled<T: SyncIndexer>(w: &Workload, name: &str, threads: usize, make: impl Fn() -> T) -> Row {
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let bs = w.block_size as u32;
    let evs = events(w, &w.steps, 0);
    let pool = ThreadPoolIndexer::new(make(), threads, bs);
    let t = Instant::now();
    for e in evs {
        pool.enqueue_event(e).expect("indexer running");
    }
    rt.block_on(pool.flush());
    let secs = t.elapsed().as_secs_f64();
    let q = time_queries(
        &w.queries,
        |_, q| q.local_hashes(),
        |s| scores(pool.backend().find_matches(&s, false)),
        |i, s| s == w.queries[i].expect,
    );
    drop(pool);
    // Memory from a second pass flushed every few steps: applied in one burst, the queues
    // grow to the whole stream, and their capacity stays allocated after.
    let before = alloc::held();
    let pool = ThreadPoolIndexer::new(make(), threads, bs);
    for (i, chunk) in w.steps.chunks(64).enumerate() {
        for e in events(w, chunk, i as u64 * 1_000_000) {
            pool.enqueue_event(e).expect("indexer running");
        }
        rt.block_on(pool.flush());
    }
    let bytes = alloc::held() - before;
    drop(pool);
    row(w, format!("Dynamo {name} ({threads} writer thread{})", if threads > 1 { "s" } else { "" }), secs, Some(bytes), q)
}
