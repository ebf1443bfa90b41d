//! The core's rules end to end: payloads (JSON) applied, then queried.

use super::super::parse::{parse, Format};
use super::*;
use crate::hash::algo::{Algo, Chain};

fn apply_json(core: &mut Core, worker: &str, json: &str) -> usize {
    let mut scratch = Vec::new();
    let batch = parse(
        json.as_bytes(),
        Format::Json,
        &mut scratch,
        core.take_spare(),
    )
    .expect("valid");
    core.apply(worker, batch)
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> String {
    let parent = parent.map_or("null".to_string(), |p| p.to_string());
    format!(
        r#"{{"type": "BlockStored", "block_hashes": {hashes:?}, "parent_block_hash": {parent},
            "token_ids": {tokens:?}, "block_size": 2, "lora_id": null, "medium": "{medium}",
            "lora_name": null}}"#
    )
}

fn scores(core: &Core, keys: &[u64]) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    core.find_matches(keys, None, false, &mut out);
    out.into_iter()
        .map(|(w, n)| (core.name(w).to_string(), n))
        .collect()
}

#[test]
fn engine_mode_removes_one_block_not_its_subtree() {
    let mut core = Core::new(2, Mode::Engine);
    let ev = stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6], "GPU");
    apply_json(&mut core, "a", &format!("[0, [{ev}]]"));
    apply_json(&mut core, "b", &format!("[0, [{ev}]]"));
    assert_eq!(
        scores(&core, &[10, 11, 12]),
        vec![("a".into(), 3), ("b".into(), 3)]
    );
    apply_json(
        &mut core,
        "a",
        r#"[0, [{"type": "BlockRemoved", "block_hashes": [11, 99], "medium": "GPU"}]]"#,
    );
    assert_eq!(
        scores(&core, &[10, 11, 12]),
        vec![("a".into(), 1), ("b".into(), 3)]
    );
    assert_eq!(scores(&core, &[12]), vec![("a".into(), 1), ("b".into(), 1)]);
    assert_eq!(core.stats.unknown_removes, 1);
    apply_json(&mut core, "b", r#"[0, [{"type": "AllBlocksCleared"}]]"#);
    assert_eq!(scores(&core, &[10]), vec![("a".into(), 1)]);
    assert_eq!(core.len(), 2);
}

#[test]
fn tokens_mode_chains_through_the_workers_parent_and_keeps_duplicates() {
    let mut core = Core::new(2, Mode::Tokens);
    // Two workers, different engine hashes, same tokens: the same index blocks.
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")),
    );
    apply_json(
        &mut core,
        "b",
        &format!("[0, [{}]]", stored(&[70], None, &[5, 6], "GPU")),
    );
    apply_json(
        &mut core,
        "b",
        &format!("[0, [{}]]", stored(&[80], Some(70), &[7, 8], "CPU")),
    );
    assert_eq!(core.len(), 2);
    let mut chain = Chain::new(Algo::Xxh3, 2, 0, None, None, None);
    let mut d = Vec::new();
    chain.run(&[5, 6, 7, 8], None, 0, &mut d);
    let keys: Vec<u64> = d.iter().map(|x| x.event_hash()).collect();
    assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
    // A second engine hash for the same content: removing one keeps the block.
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[3], Some(1), &[7, 8], "GPU")),
    );
    apply_json(
        &mut core,
        "a",
        r#"[0, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}]]"#,
    );
    assert_eq!(scores(&core, &keys)[0], ("a".into(), 2));
    apply_json(
        &mut core,
        "a",
        r#"[0, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}]]"#,
    );
    assert_eq!(scores(&core, &keys)[0], ("a".into(), 1));
    // Unknown parent: counted, skipped.
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[9], Some(12345), &[1, 1], "GPU")),
    );
    assert_eq!(core.stats.unknown_parents, 1);
    core.remove_worker("b");
    assert_eq!(scores(&core, &keys), vec![("a".into(), 1)]);
    assert_eq!(core.worker_names().len(), 1);
}

fn keys_of(tokens: &[u32]) -> Vec<u64> {
    let mut d = Vec::new();
    Chain::new(Algo::Xxh3, 2, 0, None, None, None).run(tokens, None, 0, &mut d);
    d.iter().map(|x| x.event_hash()).collect()
}

fn remove(core: &mut Core, worker: &str, hashes: &[u64]) {
    let ev = format!(r#"{{"type": "BlockRemoved", "block_hashes": {hashes:?}, "medium": "GPU"}}"#);
    apply_json(core, worker, &format!("[0, [{ev}]]"));
}

#[test]
fn engines_with_other_hashes_for_the_same_tokens() {
    // a's hashes are the blocks' canonical ones (stored first); b's, another seed, aliases.
    let mut core = Core::new(2, Mode::Tokens);
    let stores = [
        ("a", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")),
        ("b", stored(&[71], None, &[5, 6], "GPU")),
        ("b", stored(&[72], Some(71), &[7, 8], "GPU")),
    ];
    for (w, ev) in stores {
        apply_json(&mut core, w, &format!("[0, [{ev}]]"));
    }
    let keys = keys_of(&[5, 6, 7, 8]);
    assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
    assert_eq!((core.engine.len(), core.aliased), (2, 2));
    // A hash only the other worker stored is unknown here, whatever block it stands for.
    remove(&mut core, "a", &[72]);
    remove(&mut core, "b", &[2]);
    assert_eq!(core.stats.unknown_removes, 2);
    assert_eq!(scores(&core, &keys), vec![("a".into(), 2), ("b".into(), 2)]);
    // a leaves block 1: b still holds it through its alias, and chains on it.
    remove(&mut core, "a", &[2]);
    assert_eq!(scores(&core, &keys), vec![("a".into(), 1), ("b".into(), 2)]);
    assert_eq!(core.engine.len(), 1, "no one holds hash 2 any more");
    apply_json(
        &mut core,
        "b",
        &format!("[0, [{}]]", stored(&[73], Some(72), &[9, 9], "GPU")),
    );
    assert_eq!(
        scores(&core, &keys_of(&[5, 6, 7, 8, 9, 9])),
        vec![("a".into(), 1), ("b".into(), 3)]
    );
    // Block 1 has no canonical hash now: the next worker to store it gives it one (c's),
    // which a later store of a's old hash for it does not disturb.
    apply_json(
        &mut core,
        "c",
        &format!("[0, [{}]]", stored(&[1, 92], None, &[5, 6, 7, 8], "GPU")),
    );
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[2], Some(1), &[7, 8], "GPU")),
    );
    assert_eq!(
        scores(&core, &keys),
        vec![("a".into(), 2), ("b".into(), 2), ("c".into(), 2)]
    );
    remove(&mut core, "c", &[92]);
    remove(&mut core, "a", &[2]);
    assert_eq!(
        scores(&core, &keys),
        vec![("a".into(), 1), ("b".into(), 2), ("c".into(), 1)]
    );
    // Everything gone, nothing left behind.
    remove(&mut core, "a", &[1]);
    remove(&mut core, "b", &[71, 72, 73]);
    remove(&mut core, "c", &[1]);
    assert_eq!((core.len(), core.engine.len(), core.aliased), (0, 0, 0));
    assert_eq!(core.stats.unknown_removes, 2);
}

#[test]
fn one_engine_hash_for_other_tokens_in_another_worker() {
    for clear in [false, true] {
        let mut core = Core::new(2, Mode::Tokens);
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[1, 2], None, &[5, 6, 7, 8], "GPU")),
        );
        apply_json(
            &mut core,
            "b",
            &format!("[0, [{}]]", stored(&[1], None, &[3, 4], "GPU")),
        );
        // b's parent 1 is its own block [3, 4], not a's [5, 6].
        apply_json(
            &mut core,
            "b",
            &format!("[0, [{}]]", stored(&[2], Some(1), &[7, 8], "CPU")),
        );
        let (ka, kb) = (keys_of(&[5, 6, 7, 8]), keys_of(&[3, 4, 7, 8]));
        assert_eq!(scores(&core, &ka), vec![("a".into(), 2)]);
        assert_eq!(scores(&core, &kb), vec![("b".into(), 2)]);
        if clear {
            apply_json(&mut core, "a", r#"[0, [{"type": "AllBlocksCleared"}]]"#);
            assert!(scores(&core, &ka).is_empty());
            assert_eq!(scores(&core, &kb), vec![("b".into(), 2)]);
            remove(&mut core, "b", &[1]);
            assert_eq!(scores(&core, &kb[1..]), vec![("b".into(), 1)]);
        } else {
            remove(&mut core, "b", &[1]);
            assert_eq!(scores(&core, &ka), vec![("a".into(), 2)]);
            assert!(scores(&core, &kb).is_empty());
            remove(&mut core, "a", &[1, 2]);
            assert!(scores(&core, &ka).is_empty());
            // b's hash 2 stands for its own block (in CPU) still.
            assert_eq!(scores(&core, &kb[1..]), vec![("b".into(), 1)]);
        }
        let cpu = r#"{"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"}"#;
        apply_json(&mut core, "b", &format!("[0, [{cpu}]]"));
        assert_eq!((core.len(), core.engine.len(), core.aliased), (0, 0, 0));
        assert_eq!(core.stats.unknown_removes, 0);
    }
}

fn grouped(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    group: u8,
    kind: &str,
    window: i64,
) -> String {
    let parent = parent.map_or("null".to_string(), |p| p.to_string());
    format!(
        r#"{{"type": "BlockStored", "block_hashes": {hashes:?}, "parent_block_hash": {parent},
            "token_ids": {tokens:?}, "block_size": 2, "lora_id": null, "medium": "GPU",
            "lora_name": null, "group_idx": {group}, "kv_cache_spec_kind": "{kind}",
            "kv_cache_spec_sliding_window": {window}}}"#
    )
}

fn removed(hashes: &[u64], group: u8) -> String {
    format!(
        r#"{{"type": "BlockRemoved", "block_hashes": {hashes:?}, "medium": "GPU", "group_idx": {group}}}"#
    )
}

#[test]
fn hybrid_workers_score_apart_from_plain_ones() {
    for mode in [Mode::Engine, Mode::Tokens] {
        let mut core = Core::new(2, mode);
        let toks = [1, 2, 3, 4, 5, 6, 7, 8];
        let full = grouped(&[1, 2, 3, 4], None, &toks, 0, "full_attention", 0);
        apply_json(&mut core, "plain", &format!("[0, [{full}]]"));
        // W = 3: cdiv(2, 2) = 1 block; the window group holds blocks 0 and 2 (sparse).
        let window = grouped(&[1, 3], None, &toks, 1, "sliding_window", 3);
        apply_json(&mut core, "hybrid", &format!("[0, [{full}, {window}]]"));
        let keys: Vec<u64> = match mode {
            Mode::Engine => vec![1, 2, 3, 4],
            Mode::Tokens => {
                let mut d = Vec::new();
                Chain::new(Algo::Xxh3, 2, 0, None, None, None).run(&toks, None, 0, &mut d);
                d.iter().map(|x| x.event_hash()).collect()
            }
        };
        assert_eq!(
            scores(&core, &keys),
            vec![("plain".into(), 4), ("hybrid".into(), 3)],
            "{mode:?}"
        );
        apply_json(&mut core, "hybrid", &format!("[0, [{}]]", removed(&[1], 1)));
        assert_eq!(scores(&core, &keys)[1], ("hybrid".into(), 3));
        apply_json(&mut core, "hybrid", &format!("[0, [{}]]", removed(&[3], 1)));
        assert_eq!(scores(&core, &keys), vec![("plain".into(), 4)]);
        assert_eq!(core.stats.unresolved_hashes, 0);
    }
}

#[test]
fn copies_and_the_re_announce() {
    for mode in [Mode::Engine, Mode::Tokens] {
        let mut core = Core::new(2, mode);
        let chain = stored(&[1, 2], None, &[1, 2, 3, 4], "GPU");
        apply_json(&mut core, "a", &format!("[0, [{chain}]]"));
        apply_json(&mut core, "a", &format!("[0, [{chain}]]")); // re-announced: no copy
        apply_json(
            &mut core,
            "a",
            &format!("[0, [{}]]", stored(&[2], Some(1), &[3, 4], "GPU")),
        );
        let one = r#"{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}"#;
        apply_json(&mut core, "a", &format!("[0, [{one}]]"));
        assert_eq!(
            core.len(),
            2,
            "{mode:?}: the second copy of block 1 is held"
        );
        apply_json(&mut core, "a", &format!("[0, [{one}]]"));
        assert_eq!(core.len(), 1, "{mode:?}");
        apply_json(&mut core, "a", &format!("[0, [{one}]]"));
        assert_eq!(core.stats.unknown_removes, 1);
    }
}

#[test]
fn bad_groups_change_nothing() {
    let mut core = Core::new(2, Mode::Engine);
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[1], None, &[1, 2], "GPU")),
    );
    for bad in ["-1", "64", "true", "1.5", "\"0\""] {
        let ev = format!(
            r#"{{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": {bad}}}"#
        );
        assert_eq!(
            apply_json(&mut core, "a", &format!("[0, [{ev}]]")),
            1,
            "{bad}"
        );
    }
    assert_eq!(core.stats.bad_groups, 5);
    assert_eq!(core.stats.malformed_payloads, 0);
    assert_eq!(scores(&core, &[1]), vec![("a".into(), 1)]);
}

/// Key 0 is the table's free-slot marker, kept apart: found by a query both while it is
/// the only block (the table has no slots) and among others.
#[test]
fn a_block_keyed_zero() {
    let mut core = Core::new(2, Mode::Engine);
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[0], None, &[1, 2], "GPU")),
    );
    assert_eq!(scores(&core, &[0, 7]), vec![("a".into(), 1)]);
    assert_eq!(scores(&core, &[7, 0]), vec![]);
    apply_json(
        &mut core,
        "a",
        &format!("[0, [{}]]", stored(&[7, 8], Some(0), &[3, 4, 5, 6], "GPU")),
    );
    apply_json(
        &mut core,
        "b",
        &format!("[0, [{}]]", stored(&[0, 7], None, &[1, 2, 3, 4], "GPU")),
    );
    assert_eq!(
        scores(&core, &[0, 7, 8, 9]),
        vec![("a".into(), 3), ("b".into(), 2)]
    );
    remove(&mut core, "a", &[0]);
    assert_eq!(scores(&core, &[0, 7, 8]), vec![("b".into(), 2)]);
}

#[test]
fn many_workers_use_several_words() {
    let mut core = Core::new(2, Mode::Engine);
    for w in 0..150u32 {
        let n = 1 + (w as usize % 3);
        let hashes: Vec<u64> = (0..n as u64).collect();
        let tokens: Vec<u32> = (0..2 * n as u32).collect();
        apply_json(
            &mut core,
            &format!("w{w}"),
            &format!("[0, [{}]]", stored(&hashes, None, &tokens, "GPU")),
        );
    }
    let mut out = Vec::new();
    core.find_matches(&[0, 1, 2], None, false, &mut out);
    assert_eq!(out.len(), 150);
    for &(w, n) in &out {
        assert_eq!(n, 1 + w % 3);
    }
    core.find_matches(&[0], Some(Some("CPU")), false, &mut out);
    assert!(out.is_empty());
}
