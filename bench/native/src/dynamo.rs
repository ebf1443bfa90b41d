//! Dynamo's indexers (dynamo-kv-router 1.6.1) that keep per-worker scores exactly: RadixTree
//! (single-threaded, `&mut`), PositionalIndexer (called directly, one writer), and the two
//! `SyncIndexer`s behind ThreadPoolIndexer, the way Dynamo's router runs them (events on
//! sticky per-worker writer threads, queries inline on the caller's thread). The cuckoo-filter
//! indexers answer approximately and the branch-sharded one spreads a tree over shards of
//! these; neither is measured.

use std::rc::Rc;
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
use crate::{alloc, timed, Builder, Built, Scores};

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
    RouterEvent::new(
        worker as u64,
        KvCacheEvent {
            event_id: id,
            data,
            dp_rank: 0,
        },
    )
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
    let mut s: Scores = o
        .scores
        .into_iter()
        .map(|(k, v)| (k.worker_id as u32, v))
        .collect();
    s.sort_unstable();
    s
}

fn find(f: impl FnOnce() -> OverlapScores) -> (u64, Scores) {
    let (ns, o) = timed(f);
    (ns, scores(o))
}

pub fn builders(w: &Workload) -> Vec<(String, Builder<'_>)> {
    let mut out: Vec<(String, Builder)> = vec![
        ("Dynamo RadixTree".into(), Box::new(move |_| radix(w))),
        (
            format!("Dynamo PositionalIndexer (jump {JUMP}, 1 writer)"),
            Box::new(move |_| positional(w)),
        ),
    ];
    for threads in [1, 2] {
        out.push((
            format!(
                "Dynamo ConcurrentRadixTreeCompressed ({threads} writer thread{})",
                if threads > 1 { "s" } else { "" }
            ),
            Box::new(move |bytes| pooled(w, threads, bytes, ConcurrentRadixTreeCompressed::new)),
        ));
    }
    out.push((
        format!("Dynamo PositionalIndexer (jump {JUMP}, 2 writer threads)"),
        Box::new(move |bytes| pooled(w, 2, bytes, || PositionalIndexer::new(JUMP))),
    ));
    out
}

/// Every event must apply: a store whose parent Dynamo lost would score differently.
fn applied(ok: bool) {
    assert!(ok, "Dynamo rejected an event");
}

/// RadixTree: events applied in the caller's thread.
fn radix(w: &Workload) -> Built<'_> {
    let before = alloc::held();
    let evs = events(w, &w.steps, 0);
    let mut tree = RadixTree::new();
    let t = Instant::now();
    for e in evs {
        applied(tree.apply_event(e).is_ok());
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = alloc::held() - before;
    let tree = Rc::new(tree);
    let bs = w.block_size as u32;
    let t2 = tree.clone();
    Built {
        secs,
        bytes: Some(bytes),
        queries: vec![
            (
                "LocalBlockHash in".into(),
                Box::new(move |q| {
                    let seq = w.queries[q].local_hashes();
                    find(|| tree.find_matches(seq, false))
                }),
            ),
            (
                "tokens in".into(),
                Box::new(move |q| {
                    let tokens = w.queries[q].tokens.clone();
                    find(|| {
                        t2.find_matches(
                            compute_block_hash_for_seq(&tokens, bs, BlockHashOptions::default()),
                            false,
                        )
                    })
                }),
            ),
        ],
    }
}

/// PositionalIndexer with one writer: the per-worker maps a writer thread would own.
fn positional(w: &Workload) -> Built<'_> {
    let before = alloc::held();
    let evs = events(w, &w.steps, 0);
    let pos = PositionalIndexer::new(JUMP);
    let mut lanes = Default::default();
    let t = Instant::now();
    for e in evs {
        applied(pos.apply_event(&mut lanes, e, None).is_ok());
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = alloc::held() - before;
    Built {
        secs,
        bytes: Some(bytes),
        queries: vec![(
            "LocalBlockHash in".into(),
            Box::new(move |q| {
                let _ = &lanes;
                let seq = w.queries[q].local_hashes();
                find(|| pos.find_matches(&seq, false))
            }),
        )],
    }
}

/// A `SyncIndexer` behind ThreadPoolIndexer with `threads` writer threads: apply timed from
/// the first enqueue to the flush that sees the last event applied.
fn pooled<T: SyncIndexer>(
    w: &Workload,
    threads: usize,
    measure: bool,
    make: impl Fn() -> T,
) -> Built<'_> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let bs = w.block_size as u32;
    // Memory from a pass flushed every few steps: applied in one burst, the queues grow to the
    // whole stream, and their capacity stays allocated after.
    let bytes = measure.then(|| {
        let before = alloc::held();
        let pool = ThreadPoolIndexer::new(make(), threads, bs);
        for (i, chunk) in w.steps.chunks(64).enumerate() {
            for e in events(w, chunk, i as u64 * 1_000_000) {
                pool.enqueue_event(e).expect("indexer running");
            }
            rt.block_on(pool.flush());
        }
        alloc::held() - before
    });
    let evs = events(w, &w.steps, 0);
    let pool = ThreadPoolIndexer::new(make(), threads, bs);
    let t = Instant::now();
    for e in evs {
        pool.enqueue_event(e).expect("indexer running");
    }
    rt.block_on(pool.flush());
    let secs = t.elapsed().as_secs_f64();
    Built {
        secs,
        bytes,
        queries: vec![(
            "LocalBlockHash in".into(),
            Box::new(move |q| {
                let seq = w.queries[q].local_hashes();
                find(|| pool.backend().find_matches(&seq, false))
            }),
        )],
    }
}
