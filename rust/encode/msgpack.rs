//! The msgpack byte rules, exactly as msgspec applies them. No Python here.

use pyo3::exceptions::PyTypeError;
use pyo3::PyResult;

/// The int marker for a value needing `bits` bits (9..=64 are the ones used). The payload width
/// is in the marker's low two bits: uint8..uint64 are 0xcc..0xcf, int8..int64 0xd0..0xd3.
/// Token ids straddle the uint16/uint32 boundary at random, so a lookup beats a branch there.
const fn size_classes(signed: bool) -> [u8; 65] {
    let mut table = [0u8; 65];
    let mut bits = 0;
    while bits <= 64 {
        let marker = match bits {
            0..=8 => 0xcc,
            9..=16 => 0xcd,
            17..=32 => 0xce,
            _ => 0xcf,
        };
        table[bits] = if signed { marker + 4 } else { marker };
        bits += 1;
    }
    table
}

const UINT_CLASS: [u8; 65] = size_classes(false);
const INT_CLASS: [u8; 65] = size_classes(true);

/// Marker plus the low bytes of `v` the marker calls for, big-endian, with one unconditional
/// 8-byte store.
#[inline(always)]
fn put_sized(out: &mut Vec<u8>, marker: u8, v: u64) {
    out.reserve(9);
    // SAFETY: 9 bytes are reserved; only the ones written for `v` become part of the vector.
    unsafe {
        let len = out.len();
        let n = write_sized(out.as_mut_ptr().add(len), marker, v);
        out.set_len(len + n);
    }
}

/// Writes `marker` and the low bytes of `v` it calls for, big-endian, at `p` (one unconditional
/// 8-byte store after the marker); returns how many of the bytes count (1 + the width).
///
/// # Safety
/// The 9 bytes from `p` must be writable.
#[inline(always)]
unsafe fn write_sized(p: *mut u8, marker: u8, v: u64) -> usize {
    let width = 1usize << (marker & 3);
    // SAFETY: the caller promises the 9 bytes from `p`: the marker and the 8-byte store after it.
    unsafe {
        *p = marker;
        std::ptr::write_unaligned(
            p.add(1) as *mut [u8; 8],
            (v << (64 - 8 * width)).to_be_bytes(),
        );
    }
    1 + width
}

#[inline(always)]
pub fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else {
        put_sized(out, UINT_CLASS[(64 - v.leading_zeros()) as usize], v);
    }
}

/// `put_uint` for every value, in order: the same bytes, with one reservation for the whole run
/// and a running write position instead of a capacity check and a length update per value (a
/// pool's batch is ~4000 token ids a step; the per-value bookkeeping was a third of the loop).
pub fn put_uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    let n = values.len();
    // Each value takes at most 9 bytes and its 8-byte store reaches at most 9 past its start,
    // so 9 per value bounds every store (values the iterator yields beyond `n` are not written).
    out.reserve(9 * n);
    let start = out.len();
    // SAFETY: at most `n` values are written, each at most 9 bytes from its start, within the
    // 9 * n reserved past `start`; only the bytes written become part of the vector.
    unsafe {
        let base = out.as_mut_ptr().add(start);
        let mut at = 0usize;
        for v in values.take(n) {
            let p = base.add(at);
            if v < 0x80 {
                *p = v as u8;
                at += 1;
            } else {
                at += write_sized(p, UINT_CLASS[(64 - v.leading_zeros()) as usize], v);
            }
        }
        out.set_len(start + at);
    }
}

#[inline(always)]
pub fn put_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        put_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as u8);
    } else {
        // A negative v fits a signed width w when !v needs at most w - 1 bits.
        put_sized(
            out,
            INT_CLASS[(65 - (!v).leading_zeros()) as usize],
            v as u64,
        );
    }
}

/// float64 always: msgspec never writes float32.
#[inline(always)]
pub fn put_float(out: &mut Vec<u8>, x: f64) {
    out.push(0xcb);
    out.extend_from_slice(&x.to_bits().to_be_bytes());
}

/// Header of a str/bin/array/map. `fix` is the fix-form base and `fix_max` its exclusive
/// bound (bin has no fix form); `first` is the 8-bit form's marker (0 when there is none).
fn put_header(
    out: &mut Vec<u8>,
    len: usize,
    fix: u8,
    fix_max: usize,
    first: u8,
    wide: [u8; 2],
) -> PyResult<()> {
    if len < fix_max {
        out.push(fix | len as u8);
    } else if first != 0 && len <= 0xff {
        out.extend_from_slice(&[first, len as u8]);
    } else if len <= 0xffff {
        out.push(wide[0]);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else if len <= 0xffff_ffff {
        out.push(wide[1]);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    } else {
        return Err(PyTypeError::new_err(
            "msgpack cannot hold a value longer than 2**32 - 1",
        ));
    }
    Ok(())
}

pub fn put_str(out: &mut Vec<u8>, s: &[u8]) -> PyResult<()> {
    put_header(out, s.len(), 0xa0, 32, 0xd9, [0xda, 0xdb])?;
    out.extend_from_slice(s);
    Ok(())
}

pub fn put_bin(out: &mut Vec<u8>, b: &[u8]) -> PyResult<()> {
    put_header(out, b.len(), 0, 0, 0xc4, [0xc5, 0xc6])?;
    out.extend_from_slice(b);
    Ok(())
}

pub fn put_array_header(out: &mut Vec<u8>, len: usize) -> PyResult<()> {
    put_header(out, len, 0x90, 16, 0, [0xdc, 0xdd])
}

pub fn put_map_header(out: &mut Vec<u8>, len: usize) -> PyResult<()> {
    put_header(out, len, 0x80, 16, 0, [0xde, 0xdf])
}

/// Rewrite the count of a map header written for `sized_for` entries, keeping its width.
pub fn patch_map_header(out: &mut [u8], at: usize, sized_for: usize, count: usize) {
    if sized_for < 16 {
        out[at] = 0x80 | count as u8;
    } else if sized_for <= 0xffff {
        out[at + 1..at + 3].copy_from_slice(&(count as u16).to_be_bytes());
    } else {
        out[at + 1..at + 5].copy_from_slice(&(count as u32).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    //! Expected bytes are the msgpack spec's formats
    //! (github.com/msgpack/msgpack/blob/master/spec.md) at each boundary, in the smallest form,
    //! as msgspec writes them.
    use super::*;
    use crate::hash::testing::hex;

    fn written(write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out);
        out
    }

    #[test]
    fn unsigned_ints_take_the_smallest_form() {
        for (v, want) in [
            (0u64, "00"),
            (0x7f, "7f"),
            (0x80, "cc80"),
            (0xff, "ccff"),
            (0x100, "cd0100"),
            (0xffff, "cdffff"),
            (0x1_0000, "ce00010000"),
            (0xffff_ffff, "ceffffffff"),
            (0x1_0000_0000, "cf0000000100000000"),
            (u64::MAX, "cfffffffffffffffff"),
        ] {
            assert_eq!(written(|o| put_uint(o, v)), hex(want), "{v}");
        }
    }

    #[test]
    fn signed_ints_use_unsigned_forms_from_zero_and_negative_fixint_down_to_minus_32() {
        for (v, want) in [
            (0i64, "00"),
            (0x7f, "7f"),
            (0x80, "cc80"),
            (0x100, "cd0100"),
            (0x1_0000, "ce00010000"),
            (i64::MAX, "cf7fffffffffffffff"),
            (-1, "ff"),
            (-32, "e0"),
            (-33, "d0df"),
            (-128, "d080"),
            (-129, "d1ff7f"),
            (-32768, "d18000"),
            (-32769, "d2ffff7fff"),
            (i32::MIN as i64, "d280000000"),
            (i32::MIN as i64 - 1, "d3ffffffff7fffffff"),
            (i64::MIN, "d38000000000000000"),
        ] {
            assert_eq!(written(|o| put_int(o, v)), hex(want), "{v}");
        }
    }

    /// The table-driven forms against the spec's rule, at every power of two and its neighbours,
    /// and several values in a row (each store writes 8 bytes past the value's end).
    #[test]
    fn ints_match_the_spec_rule_at_every_width_boundary() {
        fn unsigned(v: u64) -> Vec<u8> {
            match v {
                0..=0x7f => vec![v as u8],
                0x80..=0xff => vec![0xcc, v as u8],
                0x100..=0xffff => [&[0xcd][..], &(v as u16).to_be_bytes()].concat(),
                0x1_0000..=0xffff_ffff => [&[0xce][..], &(v as u32).to_be_bytes()].concat(),
                _ => [&[0xcf][..], &v.to_be_bytes()].concat(),
            }
        }
        fn signed(v: i64) -> Vec<u8> {
            match v {
                0.. => unsigned(v as u64),
                -32..=-1 => vec![v as u8],
                -0x80..=-33 => vec![0xd0, v as u8],
                -0x8000..=-0x81 => [&[0xd1][..], &(v as i16).to_be_bytes()].concat(),
                -0x8000_0000..=-0x8001 => [&[0xd2][..], &(v as i32).to_be_bytes()].concat(),
                _ => [&[0xd3][..], &v.to_be_bytes()].concat(),
            }
        }
        let mut out = Vec::new();
        let mut want = Vec::new();
        for bit in 0..64 {
            for v in [(1u64 << bit) - 1, 1 << bit, (1 << bit) + 1] {
                put_uint(&mut out, v);
                want.extend(unsigned(v));
                for s in [v as i64, (v as i64).wrapping_neg()] {
                    put_int(&mut out, s);
                    want.extend(signed(s));
                }
            }
        }
        assert_eq!(out, want);
    }

    /// A run written at once is the values written one by one, after bytes already in the vector
    /// and with the vector's capacity just enough (the stores past each value must stay inside).
    #[test]
    fn a_run_of_uints_is_each_written_in_turn() {
        let mut values = vec![0u64, 0x7f, 0x80, u64::MAX, 150_000, 65_535, 65_536];
        for bit in 0..64 {
            values.extend([(1u64 << bit) - 1, 1 << bit, (1 << bit) + 1]);
        }
        for prefix in [0usize, 1, 7] {
            for n in [0, 1, 2, values.len()] {
                let mut want = vec![0xaa; prefix];
                for &v in &values[..n] {
                    put_uint(&mut want, v);
                }
                let mut out = Vec::with_capacity(prefix);
                out.resize(prefix, 0xaa);
                put_uints(&mut out, values[..n].iter().copied());
                assert_eq!(out, want, "prefix {prefix}, {n} values");
            }
        }
    }

    #[test]
    fn floats_are_always_float64() {
        for (x, want) in [
            (0.0f64, "cb0000000000000000"),
            (-0.0, "cb8000000000000000"),
            (1.5, "cb3ff8000000000000"),
            (f64::INFINITY, "cb7ff0000000000000"),
            (f64::MIN_POSITIVE, "cb0010000000000000"),
        ] {
            assert_eq!(written(|o| put_float(o, x)), hex(want), "{x}");
        }
        let nan = f64::from_bits(0x7ff8_0000_0000_0001);
        assert_eq!(written(|o| put_float(o, nan)), hex("cb7ff8000000000001"));
    }

    /// The header bytes of a str of `len` bytes, and that the bytes follow it.
    fn str_header(len: usize) -> Vec<u8> {
        let s = vec![b'a'; len];
        let out = written(|o| put_str(o, &s).unwrap());
        assert_eq!(&out[out.len() - len..], &s[..]);
        out[..out.len() - len].to_vec()
    }

    #[test]
    fn str_lengths() {
        for (len, want) in [
            (0, "a0"),
            (31, "bf"),
            (32, "d920"),
            (0xff, "d9ff"),
            (0x100, "da0100"),
            (0xffff, "daffff"),
            (0x1_0000, "db00010000"),
        ] {
            assert_eq!(str_header(len), hex(want), "{len}");
        }
    }

    #[test]
    fn bin_has_no_fix_form() {
        for (len, want) in [
            (0, "c400"),
            (1, "c401"),
            (0xff, "c4ff"),
            (0x100, "c50100"),
            (0xffff, "c5ffff"),
            (0x1_0000, "c600010000"),
        ] {
            let b = vec![7u8; len];
            let out = written(|o| put_bin(o, &b).unwrap());
            assert_eq!(out[..out.len() - len], hex(want)[..], "{len}");
            assert_eq!(&out[out.len() - len..], &b[..]);
        }
    }

    #[test]
    fn array_and_map_headers_have_no_8_bit_form() {
        for (form, len, array, map) in [
            ("fix", 0, "90", "80"),
            ("fix", 15, "9f", "8f"),
            ("16", 16, "dc0010", "de0010"),
            ("16", 0xff, "dc00ff", "de00ff"),
            ("16", 0xffff, "dcffff", "deffff"),
            ("32", 0x1_0000, "dd00010000", "df00010000"),
            ("32", 0xffff_ffff, "ddffffffff", "dfffffffff"),
        ] {
            let array_header = written(|o| put_array_header(o, len).unwrap());
            assert_eq!(array_header, hex(array), "array{form} {len}");
            let map_header = written(|o| put_map_header(o, len).unwrap());
            assert_eq!(map_header, hex(map), "map{form} {len}");
        }
    }

    #[test]
    fn lengths_past_32_bits_are_refused() {
        let mut out = Vec::new();
        assert!(put_array_header(&mut out, 1 << 32).is_err());
        assert!(put_map_header(&mut out, 1 << 32).is_err());
        assert!(out.is_empty());
    }

    /// A map header written for all of a struct's fields keeps its width when patched down to
    /// the number written: BlockStored's 16 entries make a map16 even when 8 are written.
    #[test]
    fn patched_map_headers_keep_their_width() {
        for (sized_for, count, want) in [
            (5, 3, "83"),
            (15, 0, "80"),
            (16, 8, "de0008"),
            (0xffff, 1, "de0001"),
            (0x1_0000, 0xffff, "df0000ffff"),
        ] {
            let mut out = vec![0xaa];
            put_map_header(&mut out, sized_for).unwrap();
            patch_map_header(&mut out, 1, sized_for, count);
            assert_eq!(out[1..], hex(want)[..], "{sized_for} -> {count}");
            assert_eq!(out[0], 0xaa);
        }
    }
}
