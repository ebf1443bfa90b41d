//! Reading the NATS protocol for kvbridge's nats-py client (python/kvbridge/bus/natsclient.py), in
//! one call where nats-py 2.16 runs a Python loop:
//!
//! - `scan_nats_msgs`: the complete `MSG`/`HMSG` frames at the head of the read buffer, cut
//!   the way nats-py's `Parser.parse` cuts them. Only the form the server writes is taken here
//!   (single spaces, decimal sid and sizes); the first thing that is anything else (`PING`,
//!   `INFO`, `-ERR`, a partial frame, an odd control line) stops the scan and is left to
//!   nats-py's parser, so its rules for those stay its own.
//! - `parse_nats_headers`: a header block (`NATS/1.0\r\nName: value\r\n...\r\n`) into the dict
//!   nats-py's `Client._process_headers` builds. Only the common form is taken: all bytes ASCII
//!   and no inline status (`NATS/1.0 503`); for anything else this answers `None` and the caller
//!   asks nats-py, so the rules for status lines and non-ASCII values stay nats-py's alone.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple};

/// nats-py's MAX_CONTROL_LINE_SIZE: a control line longer than this is not ours to judge.
const MAX_CONTROL_LINE: usize = 4096;

/// One message frame at the head of `buf`: byte ranges of its parts and the frame's length.
#[derive(Debug, PartialEq, Eq)]
struct Frame {
    sid: u64,
    subject: std::ops::Range<usize>,
    reply: std::ops::Range<usize>,
    /// None for `MSG`.
    headers: Option<std::ops::Range<usize>>,
    payload: std::ops::Range<usize>,
    len: usize,
}

fn decimal(tok: &[u8]) -> Option<u64> {
    if tok.is_empty() || tok.len() > 18 {
        return None;
    }
    tok.iter().try_fold(0u64, |n, &c| {
        c.is_ascii_digit().then(|| n * 10 + (c - b'0') as u64)
    })
}

/// What is at the head of the read buffer.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    Frame(Frame),
    /// The start of a frame in the server's form that has not all arrived.
    Partial,
    /// Anything else: nats-py's parser decides.
    Other,
}

fn head(buf: &[u8]) -> Head {
    let with_headers = if buf.starts_with(b"MSG ") {
        false
    } else if buf.starts_with(b"HMSG ") {
        true
    } else if !buf.is_empty() && (b"MSG ".starts_with(buf) || b"HMSG ".starts_with(buf)) {
        return Head::Partial;
    } else {
        return Head::Other;
    };
    let window = &buf[..buf.len().min(MAX_CONTROL_LINE)];
    let Some(eol) = window.windows(2).position(|w| w == b"\r\n") else {
        return if window.len() < MAX_CONTROL_LINE {
            Head::Partial
        } else {
            Head::Other
        };
    };
    match frame(buf, with_headers, eol) {
        // nats-py's HMSG pattern can run past the control line when the next bytes are digits
        // and a line end; a server's header block starts with its version line, so anything
        // else is left to nats-py to read its own way.
        Some(Frame {
            headers: Some(h), ..
        }) if buf.len() < h.start + 5 => Head::Partial,
        Some(Frame {
            headers: Some(h), ..
        }) if !buf[h.start..].starts_with(b"NATS/") => Head::Other,
        Some(f) if f.len <= buf.len() => Head::Frame(f),
        Some(_) => Head::Partial,
        None => Head::Other,
    }
}

/// The frame whose control line ends at `eol`, if that line is in the server's form (its
/// length may exceed what `buf` holds yet).
fn frame(buf: &[u8], with_headers: bool, eol: usize) -> Option<Frame> {
    let start = if with_headers { 5 } else { 4 };
    let line = &buf[start..eol];
    // Tokens separated by exactly one space: what the server writes.
    let mut toks: [std::ops::Range<usize>; 5] = Default::default();
    let mut n = 0;
    let mut from = start;
    for (i, &c) in line.iter().enumerate() {
        if c == b' ' {
            if n == toks.len() || from == start + i {
                return None;
            }
            toks[n] = from..start + i;
            n += 1;
            from = start + i + 1;
        } else if c.is_ascii_whitespace() || c < 0x20 {
            return None;
        }
    }
    if n == toks.len() || from == eol {
        return None;
    }
    toks[n] = from..eol;
    n += 1;
    let (subject, sid, reply, sizes) = match (with_headers, n) {
        (false, 3) => (&toks[0], &toks[1], None, &toks[2..3]),
        (false, 4) => (&toks[0], &toks[1], Some(&toks[2]), &toks[3..4]),
        (true, 4) => (&toks[0], &toks[1], None, &toks[2..4]),
        (true, 5) => (&toks[0], &toks[1], Some(&toks[2]), &toks[3..5]),
        _ => return None,
    };
    let sid = decimal(&buf[sid.clone()])?;
    let total = decimal(&buf[sizes[sizes.len() - 1].clone()])? as usize;
    let header_size = if with_headers {
        decimal(&buf[sizes[0].clone()])? as usize
    } else {
        0
    };
    if header_size > total || (with_headers && header_size < VERSION_LINE + 2) {
        return None; // not what a server writes (an HMSG always has its version line)
    }
    let body = eol + 2;
    Some(Frame {
        sid,
        subject: subject.clone(),
        reply: reply.cloned().unwrap_or(body..body),
        headers: with_headers.then(|| body..body + header_size),
        payload: body + header_size..body + total,
        // nats-py takes the two bytes after the payload as its CRLF without looking at them.
        len: body.checked_add(total)?.checked_add(2)?,
    })
}

/// `(frames, used, partial)`: every complete `MSG`/`HMSG` frame at the head of `buf` (at most
/// `max_frames`), each as nats-py's parser hands it to `Client._process_msg`:
/// `(sid, subject, reply, payload, headers or None)`; `used`: how many bytes they took;
/// `partial`: what follows them is the start of a frame still arriving (wait for more bytes),
/// rather than something for nats-py's parser.
#[pyfunction]
#[pyo3(signature = (buf, max_frames = 4096))]
fn scan_nats_msgs<'py>(
    py: Python<'py>,
    buf: &Bound<'py, PyByteArray>,
    max_frames: usize,
) -> PyResult<(Bound<'py, PyList>, usize, bool)> {
    // The frames are found first, on the bytes as they are, with no Python call in between;
    // making their objects then may run Python code (a collection's finalizers), so each copy
    // reads the buffer afresh and checks it still holds the frame.
    let mut frames = Vec::new();
    let mut used = 0;
    let mut partial = false;
    {
        // SAFETY: the GIL is held and nothing in this block calls into Python.
        let bytes = unsafe { buf.as_bytes() };
        while frames.len() < max_frames {
            match head(&bytes[used..]) {
                Head::Frame(f) => {
                    let len = f.len;
                    frames.push((used, f));
                    used += len;
                }
                Head::Partial => {
                    partial = true;
                    break;
                }
                Head::Other => break,
            }
        }
    }
    let copy = |at: usize, r: &std::ops::Range<usize>| -> PyResult<Bound<'py, PyBytes>> {
        // SAFETY: the GIL is held; the slice lives only for this copy, which calls no Python code.
        let bytes = unsafe { buf.as_bytes() };
        match bytes.get(at + r.start..at + r.end) {
            Some(b) => Ok(PyBytes::new(py, b)),
            None => Err(pyo3::exceptions::PyRuntimeError::new_err(
                "read buffer changed while it was being cut",
            )),
        }
    };
    let out = PyList::empty(py);
    for (at, f) in &frames {
        let headers = match &f.headers {
            Some(r) => copy(*at, r)?.into_any(),
            None => py.None().into_bound(py),
        };
        let item = PyTuple::new(
            py,
            [
                f.sid.into_pyobject(py)?.into_any(),
                copy(*at, &f.subject)?.into_any(),
                copy(*at, &f.reply)?.into_any(),
                copy(*at, &f.payload)?.into_any(),
                headers,
            ],
        )?;
        out.append(item)?;
    }
    Ok((out, used, partial))
}

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
    m.add_function(wrap_pyfunction!(parse_nats_headers, m)?)?;
    m.add_function(wrap_pyfunction!(scan_nats_msgs, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(b: &[u8]) -> Option<Vec<(String, String)>> {
        header_pairs(b).map(|v| {
            v.into_iter()
                .map(|(k, v)| {
                    (
                        String::from_utf8(k.to_vec()).unwrap(),
                        String::from_utf8(v.to_vec()).unwrap(),
                    )
                })
                .collect()
        })
    }

    #[test]
    fn frames_as_the_server_writes_them_and_nothing_else() {
        let frame = |b: &[u8]| match head(b) {
            Head::Frame(f) => Some(f),
            _ => None,
        };
        let f = frame(b"MSG a.b 7 5\r\nhello\r\nPING\r\n").unwrap();
        assert_eq!(
            (f.sid, f.subject, f.reply, f.headers, f.payload, f.len),
            (7, 4..7, 13..13, None, 13..18, 20)
        );
        let f = frame(b"MSG a 1 _INBOX.x 0\r\n\r\n").unwrap();
        assert_eq!((f.reply, f.payload, f.len), (8..16, 20..20, 22));
        let b = b"HMSG s 2 r 12 14\r\nNATS/1.0\r\n\r\nhi\r\n";
        let f = frame(b).unwrap();
        assert_eq!(
            (&b[f.headers.clone().unwrap()], &b[f.payload.clone()], f.len),
            (&b"NATS/1.0\r\n\r\n"[..], &b"hi"[..], b.len())
        );
        // Still arriving: wait. Other ops, and control lines that are not the server's form: left alone.
        for b in [
            &b"MSG a 1 5\r\nhel"[..],
            b"MSG a 1 5",
            b"HMS",
            b"M",
            b"HMSG a 1 2 3\r",
            b"HMSG a 1 12 12\r\nNAT",
        ] {
            assert_eq!(head(b), Head::Partial, "{:?}", String::from_utf8_lossy(b));
        }
        let long = [&b"MSG "[..], &[b'a'; MAX_CONTROL_LINE]].concat();
        assert_eq!(head(&long), Head::Other);
        for b in [
            &b"PING\r\n"[..],
            b"MSGX",
            b"",
            b"MSG  a 1 5\r\nhello\r\n",
            b"MSG a\t1 5\r\nhello\r\n",
            b"MSG a x 5\r\nhello\r\n",
            b"MSG a 1\r\n",
            b"MSG a 1 r s 5\r\nhello\r\n",
            b"HMSG a 1 9 5\r\nhello\r\n",
            b"HMSG s 2 0 2\r\nhi\r\n",
            b"HMSG s 2 3 5\r\n1\r\nhi\r\n",
            b"MSG a 1 5 \r\nhello\r\n",
            b"msg a 1 5\r\nhello\r\n",
        ] {
            assert_eq!(head(b), Head::Other, "{:?}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn plain_headers_and_the_odd_lines_nats_py_skips() {
        let got = pairs(b"NATS/1.0\r\nKv-Seq: 5\r\n  Kv-Epoch :\tab \r\nno colon\r\nbad key: x\r\n\x1cx: y\r\n:empty\r\n\r\n");
        let want = [("Kv-Seq", "5"), ("Kv-Epoch", "ab"), ("", "empty")];
        assert_eq!(
            got,
            Some(
                want.iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect()
            )
        );
        assert_eq!(pairs(b"NATS/1.0\r\n"), Some(vec![]));
        assert_eq!(pairs(b"NATS/1.0 503\r\n\r\n"), None);
        assert_eq!(pairs(b"NATS/1.0\r\nK: \xc3\xa9\r\n\r\n"), None);
        assert_eq!(pairs(b"NATS/1.0"), None);
    }
}
