//! NATS message headers (`NATS/1.0\r\nName: value\r\n...\r\n`) into a dict, for kvbridge's
//! nats-py client (python/kvbridge/natsclient.py): the same dict nats-py 2.16's own
//! `Client._process_headers` builds, in one call instead of a Python loop over the lines.
//!
//! Only the common form is taken here: all bytes ASCII and no inline status (`NATS/1.0 503`).
//! For anything else this answers `None` and the caller asks nats-py, so the rules for status
//! lines and for decoding non-ASCII values stay nats-py's alone.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

/// `b"NATS/1.0"`: the version line nats-py skips without reading it.
const VERSION_LINE: usize = 8;

/// What Python's `bytes.strip()` removes.
#[inline]
fn bytes_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// What Python's `str.isspace()` is true for, among ASCII characters.
#[inline]
fn str_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t'..=b'\r' | 0x1c..=0x1f)
}

fn strip(mut s: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = s {
        if !bytes_space(*first) {
            break;
        }
        s = rest;
    }
    while let [rest @ .., last] = s {
        if !bytes_space(*last) {
            break;
        }
        s = rest;
    }
    s
}

/// The (name, value) pairs nats-py keeps, in order, or None when the block is not the plain
/// ASCII form (the caller then uses nats-py's parser).
fn header_pairs(block: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    if block.len() <= VERSION_LINE || !block.is_ascii() {
        return None;
    }
    if block[VERSION_LINE] == b' ' {
        return None; // an inline status: nats-py's rules
    }
    let mut out = Vec::with_capacity(8);
    // nats-py: nothing after the version line but (at most) its CRLF means no headers.
    if block.len() - VERSION_LINE <= 2 {
        return Some(out);
    }
    let mut rest = &block[VERSION_LINE + 2..];
    // nats-py splits on CRLF exactly (a lone CR or LF stays inside its line).
    while !rest.is_empty() {
        let (line, next) = match rest.windows(2).position(|w| w == b"\r\n") {
            Some(i) => (&rest[..i], &rest[i + 2..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = next;
        let Some(colon) = line.iter().position(|&c| c == b':') else {
            continue;
        };
        let name = strip(&line[..colon]);
        if name.iter().any(|&c| str_space(c)) {
            continue;
        }
        out.push((name, strip(&line[colon + 1..])));
    }
    Some(out)
}

/// `{name: value}` as nats-py 2.16's `Client._process_headers` returns for this header block
/// ({} where it returns None), or None when the block needs nats-py's own parser.
#[pyfunction]
fn parse_nats_headers<'py>(
    py: Python<'py>,
    block: &Bound<'py, PyBytes>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(pairs) = header_pairs(block.as_bytes()) else {
        return Ok(None);
    };
    let out = PyDict::new(py);
    for (name, value) in pairs {
        // ASCII checked above: these are valid UTF-8.
        let name = PyString::new(py, std::str::from_utf8(name).expect("ascii"));
        let value = PyString::new(py, std::str::from_utf8(value).expect("ascii"));
        out.set_item(name, value)?;
    }
    Ok(Some(out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_nats_headers, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(b: &[u8]) -> Option<Vec<(String, String)>> {
        header_pairs(b).map(|v| {
            v.into_iter()
                .map(|(k, v)| (String::from_utf8(k.to_vec()).unwrap(), String::from_utf8(v.to_vec()).unwrap()))
                .collect()
        })
    }

    #[test]
    fn plain_headers_and_the_odd_lines_nats_py_skips() {
        let got = pairs(b"NATS/1.0\r\nKv-Seq: 5\r\n  Kv-Epoch :\tab \r\nno colon\r\nbad key: x\r\n\x1cx: y\r\n:empty\r\n\r\n");
        let want = [("Kv-Seq", "5"), ("Kv-Epoch", "ab"), ("", "empty")];
        assert_eq!(got, Some(want.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()));
        assert_eq!(pairs(b"NATS/1.0\r\n"), Some(vec![]));
        assert_eq!(pairs(b"NATS/1.0 503\r\n\r\n"), None);
        assert_eq!(pairs(b"NATS/1.0\r\nK: \xc3\xa9\r\n\r\n"), None);
        assert_eq!(pairs(b"NATS/1.0"), None);
    }
}
