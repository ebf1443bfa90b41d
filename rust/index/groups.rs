//! KV-cache groups and the hybrid hit rule (vLLM's `HybridKVCacheCoordinator`): what a
//! (worker, group) is from its stores' `kv_cache_spec_kind`, which groups a hit needs whole
//! (main) and which only a window of (sliding window, mamba), in blocks of each group's own
//! size. Plain functions of a worker's kinds and block sizes; `core` keeps them per worker and
//! its queries walk with `window_step` / `scaled_step`.

use super::events::KINDS;
use super::holders::Bits;

/// What a (worker, group) is, as its BlockStored events said (`kv_cache_spec_kind`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Kind {
    #[default]
    Unannounced,
    /// Full attention (and MLA, sink): a hit needs every block of the prefix.
    Main,
    /// A window of `tokens` (mamba: 1): a hit of n of the group's blocks needs blocks
    /// [max(0, n - k), n) with k = max(1, cdiv(tokens - 1, group block size)) (`window_blocks`).
    Window { tokens: u32 },
    /// Known to vLLM but not scored (chunked local, encoder-only, cross attention, unknown).
    Unscored,
}

pub(super) enum BadKind {
    Kind,
    Window,
}

/// A kind from vLLM's `KVCacheSpecKind` (v1/kv_cache_interface.py), as `events::KINDS` numbers
/// it.
pub(super) fn kind_of(code: u8, window: i64) -> Result<Kind, BadKind> {
    let name = KINDS
        .get((code as usize).wrapping_sub(1))
        .copied()
        .unwrap_or(b"");
    Ok(match name {
        b"full_attention" | b"mla_attention" | b"sink_full_attention" => Kind::Main,
        b"sliding_window" | b"sliding_window_mla" if window >= 1 => Kind::Window {
            tokens: u32::try_from(window).unwrap_or(u32::MAX),
        },
        b"sliding_window" | b"sliding_window_mla" => return Err(BadKind::Window),
        // `MambaManager.find_longest_cache_hit`: the block at the hit point, a window of one.
        b"mamba" => Kind::Window { tokens: 1 },
        b"chunked_local_attention"
        | b"encoder_only_attention"
        | b"cross_attention"
        | b"unknown" => Kind::Unscored,
        _ => return Err(BadKind::Kind),
    })
}

/// The blocks (of `group_block_size` tokens) a window of `tokens` needs before a hit's end:
/// vLLM's `SlidingWindowManager._contiguous_blocks_for_hit`, cdiv(W - 1, block_size), counted
/// in the group's own blocks. At least one: vLLM's finder stops at the first held block from
/// the right, so a window of 1 token (cdiv(0, block_size) = 0 blocks) still needs the block
/// at the hit.
fn window_blocks(tokens: u32, group_block_size: u64) -> u32 {
    let k = (u64::from(tokens) - 1).div_ceil(group_block_size.max(1));
    u32::try_from(k).unwrap_or(u32::MAX).max(1)
}

/// The largest group block size, in index blocks, a store may announce: vLLM's block sizes
/// are a few hundred tokens at most; a larger one is bad input (counted as a block-size
/// mismatch), and keeps the alignment (a least common multiple of scales) within u64.
pub const MAX_SCALE: u64 = 1 << 12;

/// The `Stored::kind` codes of `sliding_window`, `sliding_window_mla` and `mamba` (1 + their
/// place in `events::KINDS`).
pub(super) const WINDOW_CODES: [u8; 3] = [3, 4, 5];

/// Main groups (a bitset) and window groups (group, blocks of the group's size) of a worker's
/// kinds; `scales[g]`: group g's block size in index blocks (0 or absent: 1). An unannounced
/// group 0 is main: the group every engine without groups writes to.
pub(super) fn plan(kinds: &[Kind], scales: &[u32], block_size: usize) -> (u64, Vec<(u8, u32)>) {
    let mut main = u64::from(kinds.first().is_none_or(|k| *k == Kind::Unannounced));
    let mut windows = Vec::new();
    for (g, k) in kinds.iter().enumerate() {
        match k {
            Kind::Main => main |= 1 << g,
            Kind::Window { tokens } => {
                let size = block_size as u64 * u64::from(scale_of(scales, g));
                windows.push((g as u8, window_blocks(*tokens, size)));
            }
            _ => {}
        }
    }
    (main, windows)
}

/// Group `g`'s block size in index blocks.
#[inline]
pub(super) fn scale_of(scales: &[u32], g: usize) -> u32 {
    scales.get(g).copied().unwrap_or(1).max(1)
}

/// vLLM's hit alignment without fine-grained partial hits: the least common multiple of
/// every group's block size (`resolve_kv_cache_block_sizes`: scheduler_block_size =
/// lcm(group block sizes); `HybridKVCacheCoordinator._cache_hit_alignment_tokens`), here in
/// index blocks. Saturates: an alignment past any prompt's length allows only the empty hit.
pub(super) fn alignment(scales: &[u32]) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    scales.iter().fold(1u64, |a, &s| {
        let s = u64::from(s.max(1));
        (a / gcd(a, s)).saturating_mul(s)
    })
}

/// Whether a worker's hit is its group 0's leading run, as for a single-group engine.
pub(super) fn is_plain(kinds: &[Kind], scales: &[u32]) -> bool {
    scales.iter().all(|&s| s <= 1)
        && kinds.iter().enumerate().all(|(g, k)| match k {
            Kind::Unannounced => true,
            Kind::Main => g == 0,
            Kind::Window { .. } => false,
            Kind::Unscored => g != 0,
        })
}

/// The window rule one block at a time: given the groups `m` that hold block n - 1, whether a
/// hit of n blocks has each window group hold [max(0, n - blocks), n). `runs`: per window
/// group, how many blocks up to n - 1 it holds without a gap (kept from call to call).
pub(super) fn window_step(runs: &mut [usize], windows: &[(u8, u32)], n: usize, m: u64) -> bool {
    let mut ok = true;
    for (run, &(g, blocks)) in runs.iter_mut().zip(windows) {
        *run = if m >> g & 1 != 0 { *run + 1 } else { 0 };
        ok &= *run >= n.min(blocks as usize);
    }
    ok
}

pub(super) enum Step {
    /// A main group lacks one of its blocks: no longer hit from here on.
    Closed,
    /// n is a hit.
    Hit,
    Open,
}

/// `window_step` for groups of larger blocks (`scales[g]` index blocks each, absent: 1): at
/// index block n - 1 only the groups whose blocks end there are read (their block
/// n / scale - 1, keyed by that index block); n is a hit when it is a multiple of `align`
/// (every group's block ends there), every main group held all its blocks so far and each
/// window group holds its last min(n / scale, blocks) blocks. `runs` counts group blocks.
#[inline(never)] // rare (groups of larger blocks): kept out of the common walk's loop
pub(super) fn scaled_step(
    runs: &mut [usize],
    main: u64,
    windows: &[(u8, u32)],
    scales: &[u32],
    align: u64,
    n: usize,
    m: u64,
) -> Step {
    let ends = |g: usize| n.is_multiple_of(scale_of(scales, g) as usize);
    if Bits(main).any(|g| ends(g) && m >> g & 1 == 0) {
        return Step::Closed;
    }
    let hit = (n as u64).is_multiple_of(align);
    let mut ok = true;
    for (run, &(g, blocks)) in runs.iter_mut().zip(windows) {
        let g = g as usize;
        if ends(g) {
            *run = if m >> g & 1 != 0 { *run + 1 } else { 0 };
        }
        // At a multiple of `align` every group's block ends at n.
        ok &= *run >= (n / scale_of(scales, g) as usize).min(blocks as usize);
    }
    if hit && ok {
        Step::Hit
    } else {
        Step::Open
    }
}

/// The largest n <= masks.len() the window rule accepts (n = 0 always is).
#[cfg(test)]
fn window_hit(masks: &[u64], windows: &[(u8, u32)]) -> usize {
    let mut runs = vec![0; windows.len()];
    (1..=masks.len())
        .filter(|&n| window_step(&mut runs, windows, n, masks[n - 1]))
        .last()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_hit_is_the_largest_prefix_every_window_accepts() {
        let g1 = |held: &[bool]| {
            held.iter()
                .map(|&h| 1 | (u64::from(h) << 1))
                .collect::<Vec<u64>>()
        };
        // One window group (bit 1) needing 2 blocks.
        assert_eq!(window_hit(&g1(&[true, true, true, true]), &[(1, 2)]), 4);
        assert_eq!(window_hit(&g1(&[false, false, true, true]), &[(1, 2)]), 4);
        assert_eq!(window_hit(&g1(&[false, true, true, false]), &[(1, 2)]), 3);
        assert_eq!(window_hit(&g1(&[true, false, false, false]), &[(1, 2)]), 1); // fewer at the start
        assert_eq!(window_hit(&g1(&[false, true, false, false]), &[(1, 2)]), 0);
        assert_eq!(window_hit(&g1(&[true, true, false]), &[]), 3);
        // Two windows: the largest n both accept.
        let masks = [0b011, 0b111, 0b101, 0b011];
        assert_eq!(window_hit(&masks, &[(1, 1), (2, 1)]), 2);
        assert_eq!(window_hit(&masks, &[(1, 1), (2, 2)]), 0); // group 2 lacks block 0
        assert_eq!(window_hit(&masks, &[(2, 2)]), 3);
    }

    #[test]
    fn kinds_decide_the_plan() {
        let code = |name: &[u8]| {
            KINDS
                .iter()
                .position(|k| *k == name)
                .map_or(u8::MAX, |i| i as u8 + 1)
        };
        assert_eq!(
            kind_of(code(b"sliding_window"), 5).ok(),
            Some(Kind::Window { tokens: 5 })
        );
        assert_eq!(
            kind_of(code(b"mamba"), 0).ok(),
            Some(Kind::Window { tokens: 1 })
        );
        assert_eq!(
            kind_of(code(b"sink_full_attention"), 0).ok(),
            Some(Kind::Main)
        );
        assert!(matches!(
            kind_of(code(b"sliding_window_mla"), 0),
            Err(BadKind::Window)
        ));
        assert!(matches!(
            kind_of(code(b"sliding_window"), -3),
            Err(BadKind::Window)
        ));
        assert!(matches!(kind_of(code(b"swa"), 4), Err(BadKind::Kind)));
        // cdiv(W - 1, group block size), at least 1.
        assert_eq!(
            (
                window_blocks(5, 2),
                window_blocks(1, 2),
                window_blocks(1, 16)
            ),
            (2, 1, 1)
        );
        assert_eq!(
            (
                window_blocks(9, 4),
                window_blocks(9, 8),
                window_blocks(17, 8)
            ),
            (2, 1, 2)
        );
        assert!(
            is_plain(&[], &[])
                && is_plain(&[Kind::Main, Kind::Unscored, Kind::Unannounced], &[1, 0])
        );
        assert!(!is_plain(&[Kind::Main, Kind::Main], &[]) && !is_plain(&[Kind::Unscored], &[]));
        assert!(!is_plain(
            &[Kind::Unannounced, Kind::Window { tokens: 1 }],
            &[]
        ));
        assert!(
            !is_plain(&[Kind::Main], &[2]),
            "a group of larger blocks is scored apart"
        );
        let (main, windows) = plan(
            &[Kind::Unannounced, Kind::Main, Kind::Window { tokens: 5 }],
            &[],
            2,
        );
        assert_eq!((main, windows), (0b11, vec![(2, 2)]));
        // The same window over blocks twice as large: one block.
        assert_eq!(
            plan(&[Kind::Window { tokens: 5 }], &[2], 2),
            (0, vec![(0, 1)])
        );
        assert_eq!(
            (alignment(&[]), alignment(&[0, 2, 3]), alignment(&[4, 2])),
            (1, 6, 4)
        );
        assert_eq!(
            alignment(&[u32::MAX, u32::MAX - 1, u32::MAX - 2]),
            u64::MAX,
            "saturates"
        );
    }

    #[test]
    fn scaled_hits_land_on_every_groups_block_ends() {
        // Group 0 main at scale 1, group 1 a window of 1 block at scale 2: `held[i]` = groups
        // holding index block i (group 1's keys only count at odd i, its blocks' ends).
        let walk = |held: &[u64], windows: &[(u8, u32)], scales: &[u32]| {
            let mut runs = vec![0; windows.len()];
            let align = alignment(scales);
            let mut best = 0;
            for (i, &m) in held.iter().enumerate() {
                match scaled_step(&mut runs, 1, windows, scales, align, i + 1, m) {
                    Step::Closed => break,
                    Step::Hit => best = i + 1,
                    Step::Open => {}
                }
            }
            best
        };
        assert_eq!(walk(&[1, 3, 1, 3], &[(1, 1)], &[1, 2]), 4);
        assert_eq!(
            walk(&[1, 3, 3, 1], &[(1, 1)], &[1, 2]),
            2,
            "group 1's key at index 2 is no block end"
        );
        assert_eq!(walk(&[1, 1, 1], &[(1, 1)], &[1, 2]), 0);
        assert_eq!(
            walk(&[1, 3, 1], &[(1, 1)], &[1, 2]),
            2,
            "3 is not a multiple of 2"
        );
        // A main group at scale 2 (bits as group 0): misses between its block ends do not count.
        assert_eq!(walk(&[0, 1, 0, 1, 0, 0], &[], &[2]), 4);
        // Window of 2 blocks at scale 2, main at scale 3: align 6.
        let held = [1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3];
        assert_eq!(walk(&held, &[(1, 2)], &[3, 2]), 12);
        let held = [1, 1, 1, 3, 1, 3, 1, 1, 1, 3, 1, 3];
        assert_eq!(
            walk(&held, &[(1, 2)], &[3, 2]),
            12,
            "group 1 holds its blocks 4, 5 (keys 9, 11)"
        );
        let held = [1, 1, 1, 3, 1, 3, 1, 1, 1, 1, 1, 3];
        assert_eq!(walk(&held, &[(1, 2)], &[3, 2]), 6);
    }

    #[test]
    fn window_codes_name_the_window_kinds() {
        for c in WINDOW_CODES {
            let name = KINDS[c as usize - 1];
            assert!(
                matches!(name, b"sliding_window" | b"sliding_window_mla" | b"mamba"),
                "{c}"
            );
        }
    }
}
