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
    let width = 1usize << (marker & 3);
    out.reserve(9);
    // SAFETY: 9 bytes are reserved; only 1 + width of them become part of the vector.
    unsafe {
        let len = out.len();
        let p = out.as_mut_ptr().add(len);
        *p = marker;
        std::ptr::write_unaligned(
            p.add(1) as *mut [u8; 8],
            (v << (64 - 8 * width)).to_be_bytes(),
        );
        out.set_len(len + 1 + width);
    }
}

#[inline(always)]
pub fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else {
        put_sized(out, UINT_CLASS[(64 - v.leading_zeros()) as usize], v);
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
