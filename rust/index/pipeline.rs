//! Applying many payloads on two threads: a scoped parser thread reads the payloads ahead into
//! `Batch`es while the caller's thread applies the ones before to the index, as Dynamo's router
//! spreads its events over writer threads. The index itself stays single-writer: only reading
//! a payload (its msgpack scan, the token ids' decode) moves to the other thread.
//!
//! Same results, order and counters as applying the payloads one by one (`apply_one`): the
//! parse of a payload depends on its bytes and the key mode only, and the applier takes the
//! batches in payload order.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use super::core::{Core, Mode};
use super::events::{Batch, Spare};
use super::parse::{detect, parse, parse_msgpack, Format};

/// Below this many payload bytes in all, the second thread costs more (its start, the
/// hand-offs) than it saves: applied one by one on the caller's thread.
pub const MIN_BYTES: usize = 64 << 10;
/// Payload bytes parsed into one hand-off: a 16th of the whole, within these bounds. Each
/// hand-off may wake the other thread (a futex wake, then that thread's restart, tens of µs on
/// a busy VM): with 32 KiB chunks and 2 ahead the applier waited for the parser a third of its
/// time on bench/native's stream (key="tokens"); larger chunks are parsed further ahead of
/// their apply (out of the applier's caches). Between the two: wall time on the shared VM did
/// not tell 32, 64 and 128 KiB apart.
const CHUNK_BYTES: (usize, usize) = (8 << 10, 64 << 10);
/// Chunks parsed ahead of the one being applied, to ride over the parser's waits for a core
/// (a few hundred KiB of payloads' batches held at once).
const CHUNKS_AHEAD: usize = 4;

/// What the parser thread made of one payload.
enum Parsed<'p> {
    Batch(Batch<'p>),
    Malformed,
    /// A JSON payload, parsed on the applier's thread: its batch borrows the transcoded bytes,
    /// which would have to travel with it.
    Json,
}

/// One payload, parsed and applied on the caller's thread; its number of events, 0 for a
/// payload that is not a batch (counted).
pub fn apply_one(
    core: &mut Core,
    worker: &str,
    payload: &[u8],
    format: Format,
    scratch: &mut Vec<u8>,
) -> usize {
    match parse(payload, format, scratch, core.take_spare()) {
        Some(batch) => core.apply(worker, batch),
        None => {
            core.malformed();
            0
        }
    }
}

/// Applies `items` (worker, payload) in order, pushing each payload's number of events to
/// `counts`; `format` None detects each payload's (`detect`). Two threads from `MIN_BYTES` of
/// payloads, else one.
pub fn apply_many(
    core: &mut Core,
    items: &[(&str, &[u8])],
    format: Option<Format>,
    counts: &mut Vec<usize>,
) {
    let bytes: usize = items.iter().map(|i| i.1.len()).sum();
    if items.len() < 2 || bytes < MIN_BYTES {
        let mut scratch = Vec::new();
        for &(worker, payload) in items {
            let f = format.unwrap_or_else(|| detect(payload));
            counts.push(apply_one(core, worker, payload, f, &mut scratch));
        }
        return;
    }
    let chunk_bytes = (bytes / 16).clamp(CHUNK_BYTES.0, CHUNK_BYTES.1);
    pipelined(core, items, format, counts, chunk_bytes);
}

fn pipelined<'p>(
    core: &mut Core,
    items: &[(&str, &'p [u8])],
    format: Option<Format>,
    counts: &mut Vec<usize>,
    chunk_bytes: usize,
) {
    let count_tokens = core.mode == Mode::Engine;
    let (ready, parsed) = sync_channel::<Vec<Parsed<'p>>>(CHUNKS_AHEAD);
    // Emptied chunks and their batches' vectors, back to the parser for the next ones. Never
    // full (at most CHUNKS_AHEAD + 2 chunks exist), so the applier never waits on it.
    let (recycle, returned) = sync_channel::<(Vec<Parsed<'p>>, Vec<Spare>)>(CHUNKS_AHEAD + 2);
    std::thread::scope(|s| {
        // Each side ends when the other's end of the channel is gone, so a panic on either
        // thread ends both and `scope` passes it on.
        s.spawn(move || parse_ahead(items, format, count_tokens, chunk_bytes, ready, returned));
        let mut scratch = Vec::new();
        let mut next = items.iter();
        for mut chunk in parsed.iter() {
            let mut spares = Vec::with_capacity(chunk.len());
            for p in chunk.drain(..) {
                let Some(&(worker, payload)) = next.next() else {
                    unreachable!("one parsed message per payload");
                };
                counts.push(match p {
                    Parsed::Batch(batch) => {
                        let n = core.apply(worker, batch);
                        spares.push(core.take_spare());
                        n
                    }
                    Parsed::Malformed => {
                        core.malformed();
                        0
                    }
                    Parsed::Json => apply_one(core, worker, payload, Format::Json, &mut scratch),
                });
            }
            // An error only once the parser has finished: nothing left to reuse them for.
            let _ = recycle.try_send((chunk, spares));
        }
    });
}

// Not inlined: callgrind counts the parser thread's instructions by this name
// (`--toggle-collect='*parse_ahead*'`).
#[inline(never)]
fn parse_ahead<'p>(
    items: &[(&str, &'p [u8])],
    format: Option<Format>,
    count_tokens: bool,
    chunk_bytes: usize,
    ready: SyncSender<Vec<Parsed<'p>>>,
    returned: Receiver<(Vec<Parsed<'p>>, Vec<Spare>)>,
) {
    let mut spares: Vec<Spare> = Vec::new();
    let mut chunks: Vec<Vec<Parsed<'p>>> = Vec::new();
    let mut chunk = Vec::new();
    let mut bytes = 0;
    for (i, &(_, payload)) in items.iter().enumerate() {
        let p = match format.unwrap_or_else(|| detect(payload)) {
            Format::Json => Parsed::Json,
            Format::Msgpack => {
                if spares.is_empty() {
                    while let Ok((c, s)) = returned.try_recv() {
                        chunks.push(c);
                        spares.extend(s);
                    }
                }
                let mut spare = spares.pop().unwrap_or_default();
                // As `Core::take_spare` says for the mode.
                spare.count_tokens = count_tokens;
                parse_msgpack(payload, spare).map_or(Parsed::Malformed, Parsed::Batch)
            }
        };
        chunk.push(p);
        bytes += payload.len();
        if bytes >= chunk_bytes || i + 1 == items.len() {
            let next = chunks.pop().unwrap_or_default();
            if ready.send(std::mem::replace(&mut chunk, next)).is_err() {
                return; // the applier is gone (a panic): stop
            }
            bytes = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The equivalence with one-by-one applying over a random stream is tested through the
    /// native API (rust/native.rs); here, the chunking's edges: one payload per chunk, all in
    /// one, and a stream of malformed and JSON payloads only.
    #[test]
    fn any_chunking_gives_the_same_counts_and_stats() {
        let json = br#"[0, [{"type": "BlockStored", "block_hashes": [10, 11],
            "parent_block_hash": null, "token_ids": [1, 2, 3, 4], "block_size": 2,
            "lora_id": null, "medium": "GPU"}]]"#;
        let mut msgpack = Vec::new();
        super::super::json::json_to_msgpack(json, &mut msgpack).expect("json");
        let items: Vec<(&str, &[u8])> = vec![
            ("a", &msgpack[..]),
            ("b", b"\xc1 not a batch"),
            ("c", &json[..]),
            ("a", b"[1, 2"),
            ("b", &msgpack[..]),
        ];
        for mode in [Mode::Engine, Mode::Tokens] {
            let mut one = Core::new(2, mode);
            let mut want = Vec::new();
            let mut scratch = Vec::new();
            for &(w, p) in &items {
                want.push(apply_one(&mut one, w, p, detect(p), &mut scratch));
            }
            assert_eq!(want, [1, 0, 1, 0, 1]);
            for chunk_bytes in [1, 40, 1 << 20] {
                let mut two = Core::new(2, mode);
                let mut got = Vec::new();
                pipelined(&mut two, &items, None, &mut got, chunk_bytes);
                assert_eq!(got, want);
                assert_eq!(two.stats.pairs(), one.stats.pairs());
                assert_eq!(two.len(), one.len());
            }
            // A format given for all: the JSON payloads are not msgpack, so malformed.
            let mut two = Core::new(2, mode);
            let mut got = Vec::new();
            pipelined(&mut two, &items, Some(Format::Msgpack), &mut got, 1);
            assert_eq!(got, [1, 0, 0, 0, 1]);
            assert_eq!(two.stats.malformed_payloads, 3);
        }
    }
}
