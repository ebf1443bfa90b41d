//! Byte-exact `cbor2.dumps(obj, canonical=True)` for the block tuple and its extra keys.
//!
//! Canonical CBOR only constrains maps, floats and sets, none of which occur here, so this is
//! plain CBOR with shortest-form heads: tuples are arrays, ints use the smallest head (major 0,
//! or major 1 holding -1-n), ints beyond 64 bits are bignums (tag 2/3 over big-endian magnitude).

use super::tokenbytes;
use super::value::Value;

const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
const NULL: u8 = 0xf6;
const TRUE: u8 = 0xf5;
const FALSE: u8 = 0xf4;
const POSITIVE_BIGNUM: u8 = 0xc2;
const NEGATIVE_BIGNUM: u8 = 0xc3;

#[inline(always)]
pub fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= 0xffff {
        let b = (n as u16).to_be_bytes();
        out.extend_from_slice(&[m | 25, b[0], b[1]]);
    } else if n <= 0xffff_ffff {
        let b = (n as u32).to_be_bytes();
        out.extend_from_slice(&[m | 26, b[0], b[1], b[2], b[3]]);
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// Appends `[parent, [tokens...], extra]` to `out`.
pub fn block(out: &mut Vec<u8>, parent: &[u8], tokens: &[u32], extra: Option<&Value>) {
    head(out, ARRAY, 3);
    head(out, BYTES, parent.len() as u64);
    out.extend_from_slice(parent);
    head(out, ARRAY, tokens.len() as u64);
    tokenbytes::extend(out, tokens, tokenbytes::cbor);
    match extra {
        None => out.push(NULL),
        Some(v) => value(out, v),
    }
}

pub fn value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::None => out.push(NULL),
        Value::Bool(b) => out.push(if *b { TRUE } else { FALSE }),
        Value::Int(i) if *i >= 0 => head(out, 0, *i as u64),
        // -1 - i, which is !i in two's complement.
        Value::Int(i) => head(out, 1, !*i as u64),
        Value::BigInt(le) => big_int(out, le),
        Value::Str(s, _) => {
            head(out, TEXT, s.len() as u64);
            out.extend_from_slice(s);
        }
        Value::Bytes(b, _) => {
            head(out, BYTES, b.len() as u64);
            out.extend_from_slice(b);
        }
        Value::Tuple(items, _) => {
            head(out, ARRAY, items.len() as u64);
            for item in items {
                value(out, item);
            }
        }
    }
}

/// An int outside i64, from its little-endian two's complement.
fn big_int(out: &mut Vec<u8>, le: &[u8]) {
    let negative = le.last().is_some_and(|b| b & 0x80 != 0);
    // CBOR stores n for n >= 0 and -1-n for n < 0; for two's complement the latter is !n.
    let mut magnitude: Vec<u8> = le
        .iter()
        .rev()
        .map(|&b| if negative { !b } else { b })
        .collect();
    let leading = magnitude.iter().take_while(|&&b| b == 0).count();
    magnitude.drain(..leading);
    if magnitude.len() <= 8 {
        let mut be = [0u8; 8];
        be[8 - magnitude.len()..].copy_from_slice(&magnitude);
        head(out, negative as u8, u64::from_be_bytes(be));
    } else {
        out.push(if negative {
            NEGATIVE_BIGNUM
        } else {
            POSITIVE_BIGNUM
        });
        head(out, BYTES, magnitude.len() as u64);
        out.extend_from_slice(&magnitude);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::testing::hex;
    use crate::hash::value::long_bytes;

    /// Expected bytes from `cbor2.dumps([b"\x01" * 32, [0, 1, 255, 256, 65535, 65536, 2**31,
    /// 2**32 - 1], ("adapter", ("adapter", 7), "adapter", -1, 2**70, b"x", None, True)],
    /// canonical=True)`: shortest heads, tuples as arrays, -1 as major 1, 2**70 as tag 2.
    #[test]
    fn block_is_canonical_cbor() {
        let s = || Value::Str(b"adapter".to_vec(), 1);
        let extra = Value::Tuple(
            vec![
                s(),
                Value::Tuple(vec![s(), Value::Int(7)], 2),
                s(),
                Value::Int(-1),
                Value::BigInt(long_bytes(1i128 << 70)),
                Value::Bytes(b"x".to_vec(), 3),
                Value::None,
                Value::Bool(true),
            ],
            4,
        );
        let mut out = Vec::new();
        block(
            &mut out,
            &[1u8; 32],
            &[0, 1, 255, 256, 65535, 65536, 1 << 31, u32::MAX],
            Some(&extra),
        );
        let expected = hex(concat!(
            "8358200101010101010101010101010101010101010101010101010101010101010101",
            "88000118ff19010019ffff1a000100001a800000001affffffff",
            "886761646170746572826761646170746572076761646170746572",
            "20c2494000000000000000004178f6f5",
        ));
        assert_eq!(out, expected);
    }

    #[test]
    fn heads_use_the_shortest_form() {
        for (n, want) in [
            (0u64, "00"),
            (23, "17"),
            (24, "1818"),
            (255, "18ff"),
            (256, "190100"),
            (65536, "1a00010000"),
            (1 << 32, "1b0000000100000000"),
        ] {
            let mut out = Vec::new();
            head(&mut out, 0, n);
            assert_eq!(out, hex(want), "{n}");
        }
    }
}
