//! JSON payloads, transcoded to msgpack (serde_json) so that one reader decides both formats
//! (`parse`); a JSON string where a block hash goes is then base64 bytes, as msgspec writes bytes.

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};

/// Writes the msgpack form of one JSON document to `out`; `None` if it is not JSON.
pub(crate) fn json_to_msgpack(b: &[u8], out: &mut Vec<u8>) -> Option<()> {
    let mut de = serde_json::Deserializer::from_slice(b);
    Transcode { out }.deserialize(&mut de).ok()?;
    de.end().ok()
}

struct Transcode<'w> {
    out: &'w mut Vec<u8>,
}

impl Transcode<'_> {
    /// Writes a 32-bit container header and returns where to patch in its length.
    fn open(&mut self, marker: u8) -> usize {
        self.out.push(marker);
        self.out.extend_from_slice(&[0; 4]);
        self.out.len() - 4
    }

    fn close(&mut self, at: usize, n: u32) {
        self.out[at..at + 4].copy_from_slice(&n.to_be_bytes());
    }
}

impl<'de> DeserializeSeed<'de> for Transcode<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Transcode<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.out.push(0xc0);
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        self.out.push(if v { 0xc3 } else { 0xc2 });
        Ok(())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.out.push(0xcf);
        self.out.extend_from_slice(&v.to_be_bytes());
        Ok(())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        if v >= 0 {
            return self.visit_u64(v as u64);
        }
        self.out.push(0xd3);
        self.out.extend_from_slice(&v.to_be_bytes());
        Ok(())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        self.out.push(0xcb);
        self.out.extend_from_slice(&v.to_be_bytes());
        Ok(())
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.out.push(0xdb);
        self.out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        self.out.extend_from_slice(v.as_bytes());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        let at = self.open(0xdd);
        let mut n = 0u32;
        while seq
            .next_element_seed(Transcode { out: self.out })?
            .is_some()
        {
            n += 1;
        }
        self.close(at, n);
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        let at = self.open(0xdf);
        let mut n = 0u32;
        while map.next_key_seed(Transcode { out: self.out })?.is_some() {
            map.next_value_seed(Transcode { out: self.out })?;
            n += 1;
        }
        self.close(at, n);
        Ok(())
    }
}
