//! Response compression on routes that opt in (`compress:`): the client's
//! `Accept-Encoding` picks zstd, brotli or gzip (in that order of preference among those
//! it accepts), and the backend's body is compressed as it streams, frame by frame, each
//! flushed at once: nothing is buffered beyond the encoder's own window. Bodies the
//! backend already encoded, media that is already compressed, small bodies, partial
//! content and answers without a body are left alone.
//!
//! An encoder holds its window and tables for as long as its stream lasts (about 1 MiB
//! for zstd at window log 19), so the node compresses at most
//! `--max-compressing-streams` answers at once ([`Slots`]); past it an answer goes out
//! as the backend sent it, and is counted.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use bytes::Bytes;
use http::header::{ACCEPT_ENCODING, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, ETAG, VARY};
use http::{HeaderMap, HeaderValue, StatusCode};

/// A content coding the gateway compresses responses with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// `zstd`, level 3.
    Zstd,
    /// `br`, quality 4.
    Brotli,
    /// `gzip`, level 5.
    Gzip,
}

impl Coding {
    fn header(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Coding::Zstd => "zstd",
            Coding::Brotli => "br",
            Coding::Gzip => "gzip",
        })
    }
}

/// The coding a request's `Accept-Encoding` admits, by the gateway's preference (zstd,
/// br, gzip); `q=0` refuses a coding, `*` stands for those not named.
pub fn negotiate(headers: &HeaderMap) -> Option<Coding> {
    let mut q = [None::<bool>; 3];
    let mut star = None;
    for v in headers.get_all(ACCEPT_ENCODING) {
        let Ok(v) = v.to_str() else { continue };
        for item in v.split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or_default().trim();
            let accepted = parts
                .filter_map(|p| p.trim().strip_prefix("q=").or_else(|| p.trim().strip_prefix("Q=")))
                .next()
                .is_none_or(|w| w.trim().parse::<f32>().is_ok_and(|w| w > 0.0));
            let slot = match name.to_ascii_lowercase().as_str() {
                "zstd" => 0,
                "br" => 1,
                "gzip" | "x-gzip" => 2,
                "*" => {
                    star = Some(accepted);
                    continue;
                }
                _ => continue,
            };
            q[slot] = Some(accepted);
        }
    }
    [Coding::Zstd, Coding::Brotli, Coding::Gzip]
        .into_iter()
        .zip(q)
        .find_map(|(c, named)| named.or(star).unwrap_or(false).then_some(c))
}

/// Whether a media type is worth compressing: text and structured text, not media that
/// is compressed already (images, audio, video, archives, fonts) nor gRPC.
pub fn compressible(content_type: Option<&HeaderValue>) -> bool {
    let Some(ct) = content_type.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    if essence == "image/svg+xml" {
        return true;
    }
    let (ty, sub) = essence.split_once('/').unwrap_or((&essence, ""));
    match ty {
        "text" => true,
        "application" => {
            matches!(sub, "json" | "xml" | "javascript" | "x-ndjson" | "graphql-response+json" | "wasm")
                || sub.ends_with("+json")
                || sub.ends_with("+xml")
        }
        _ => false,
    }
}

/// Whether to compress this answer, and with what: the route opted in with `min_bytes`,
/// the client accepts a coding, and the answer is a body worth it.
pub fn choose(min_bytes: u64, head: bool, want: Option<Coding>, status: StatusCode, h: &HeaderMap) -> Option<Coding> {
    let coding = want?;
    if head
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status == StatusCode::PARTIAL_CONTENT
        || h.contains_key(CONTENT_ENCODING)
        || h.contains_key(CONTENT_RANGE)
        || no_transform(h)
        || !compressible(h.get(CONTENT_TYPE))
    {
        return None;
    }
    let len = h.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if len.is_some_and(|n| n < min_bytes) {
        return None;
    }
    Some(coding)
}

/// `Cache-Control: no-transform`: a proxy must not change the body (RFC 9110 §7.7).
fn no_transform(h: &HeaderMap) -> bool {
    h.get_all(http::header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|d| d.trim().eq_ignore_ascii_case("no-transform")))
}

/// Marks a response head as compressed: its coding, no length (it streams), `Vary`, and
/// a strong `ETag` made weak (the bytes are no longer the backend's).
pub fn mark(coding: Coding, h: &mut HeaderMap) {
    h.insert(CONTENT_ENCODING, coding.header());
    h.remove(CONTENT_LENGTH);
    h.remove(http::header::ACCEPT_RANGES);
    h.append(VARY, HeaderValue::from_static("accept-encoding"));
    if let Some(tag) = h.get(ETAG).and_then(|v| v.to_str().ok())
        && !tag.starts_with("W/")
        && let Ok(weak) = HeaderValue::from_str(&format!("W/{tag}"))
    {
        h.insert(ETAG, weak);
    }
}

/// The node's places for compressing streams: one is held by each answer being
/// compressed, from its head to its body's end (or drop).
#[derive(Debug)]
pub struct Slots {
    cap: u32,
    busy: AtomicU32,
    /// Answers that would have been compressed, sent as they were: every place was held.
    pub refused: AtomicU64,
}

impl Slots {
    /// `cap` places (0: no answer is compressed).
    pub fn new(cap: u32) -> Arc<Slots> {
        Arc::new(Slots { cap, busy: AtomicU32::new(0), refused: AtomicU64::new(0) })
    }

    /// A place, or `None` (counted) when all are held.
    pub fn take(self: &Arc<Self>) -> Option<Slot> {
        let cap = self.cap;
        match self.busy.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| (n < cap).then_some(n + 1)) {
            Ok(_) => Some(Slot(self.clone())),
            Err(_) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Places held now.
    pub fn busy(&self) -> u32 {
        self.busy.load(Ordering::Relaxed)
    }

    /// The cap.
    pub fn cap(&self) -> u32 {
        self.cap
    }
}

/// One held place; given back when dropped.
#[derive(Debug)]
pub struct Slot(Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A streaming encoder: each chunk in, the compressed bytes so far out (flushed).
pub enum Encoder {
    /// gzip.
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    /// brotli.
    Brotli(Box<brotli::CompressorWriter<Vec<u8>>>),
    /// zstd.
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Encoder::Gzip(_) => "Encoder::Gzip",
            Encoder::Brotli(_) => "Encoder::Brotli",
            Encoder::Zstd(_) => "Encoder::Zstd",
        })
    }
}

impl Encoder {
    /// An encoder for `coding`.
    pub fn new(coding: Coding) -> std::io::Result<Encoder> {
        Ok(match coding {
            Coding::Gzip => Encoder::Gzip(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(5))),
            // A 256 KiB window keeps each stream's memory small.
            Coding::Brotli => Encoder::Brotli(Box::new(brotli::CompressorWriter::new(Vec::new(), 4096, 4, 18))),
            Coding::Zstd => {
                let mut e = zstd::stream::write::Encoder::new(Vec::new(), 3)?;
                e.window_log(19)?;
                Encoder::Zstd(e)
            }
        })
    }

    /// Compresses a chunk and returns what is ready to send (flushed, so the client
    /// sees each chunk as soon as the backend sent it).
    pub fn chunk(&mut self, data: &[u8]) -> std::io::Result<Bytes> {
        let out = match self {
            Encoder::Gzip(e) => {
                e.write_all(data)?;
                e.flush()?;
                e.get_mut()
            }
            Encoder::Brotli(e) => {
                e.write_all(data)?;
                e.flush()?;
                e.get_mut()
            }
            Encoder::Zstd(e) => {
                e.write_all(data)?;
                e.flush()?;
                e.get_mut()
            }
        };
        Ok(Bytes::from(std::mem::take(out)))
    }

    /// Ends the stream: what is left to send.
    pub fn finish(self) -> std::io::Result<Bytes> {
        Ok(Bytes::from(match self {
            Encoder::Gzip(e) => e.finish()?,
            Encoder::Brotli(e) => e.into_inner(),
            Encoder::Zstd(e) => e.finish()?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn accept(v: &str) -> Option<Coding> {
        let mut h = HeaderMap::new();
        h.insert(ACCEPT_ENCODING, HeaderValue::from_str(v).unwrap());
        negotiate(&h)
    }

    #[test]
    fn negotiates_by_preference_and_q() {
        assert_eq!(accept("gzip, deflate, br, zstd"), Some(Coding::Zstd));
        assert_eq!(accept("gzip, br"), Some(Coding::Brotli));
        assert_eq!(accept("gzip"), Some(Coding::Gzip));
        assert_eq!(accept("br;q=0, gzip;q=0.5"), Some(Coding::Gzip));
        assert_eq!(accept("*"), Some(Coding::Zstd));
        assert_eq!(accept("*;q=0, gzip"), Some(Coding::Gzip));
        assert_eq!(accept("identity"), None);
        assert_eq!(accept("gzip;q=0"), None);
        assert_eq!(negotiate(&HeaderMap::new()), None);
    }

    #[test]
    fn chooses_only_bodies_worth_it() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
        let ok = |h: &HeaderMap| choose(1024, false, Some(Coding::Gzip), StatusCode::OK, h);
        assert_eq!(ok(&h), Some(Coding::Gzip));
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("100"));
        assert_eq!(ok(&h), None, "small");
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("5000"));
        assert_eq!(ok(&h), Some(Coding::Gzip));
        assert_eq!(choose(1024, true, Some(Coding::Gzip), StatusCode::OK, &h), None);
        assert_eq!(choose(1024, false, Some(Coding::Gzip), StatusCode::PARTIAL_CONTENT, &h), None);
        assert_eq!(choose(1024, false, None, StatusCode::OK, &h), None);
        let mut img = h.clone();
        img.insert(CONTENT_TYPE, HeaderValue::from_static("image/png"));
        assert_eq!(ok(&img), None, "already compressed");
        let mut enc = h.clone();
        enc.insert(CONTENT_ENCODING, HeaderValue::from_static("br"));
        assert_eq!(ok(&enc), None, "the backend encoded it");
        let mut keep = h.clone();
        keep.insert(http::header::CACHE_CONTROL, HeaderValue::from_static("max-age=60, No-Transform"));
        assert_eq!(ok(&keep), None, "no-transform");
        assert!(compressible(Some(&HeaderValue::from_static("application/problem+json"))));
        assert!(!compressible(Some(&HeaderValue::from_static("application/grpc"))));
        assert!(!compressible(None));
    }

    #[test]
    fn the_node_compresses_at_most_its_cap_at_once() {
        let slots = Slots::new(2);
        let a = slots.take().unwrap();
        let b = slots.take().unwrap();
        assert!(slots.take().is_none() && slots.take().is_none(), "past the cap");
        assert_eq!((slots.busy(), slots.refused.load(Ordering::Relaxed)), (2, 2));
        drop(a);
        let c = slots.take().unwrap();
        assert_eq!(slots.busy(), 2);
        drop((b, c));
        assert_eq!(slots.busy(), 0, "every place given back");
        let none = Slots::new(0);
        assert!(none.take().is_none());
        assert_eq!(none.refused.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn marks_the_head() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("5000"));
        h.insert(ETAG, HeaderValue::from_static("\"v1\""));
        mark(Coding::Brotli, &mut h);
        assert_eq!(h[CONTENT_ENCODING], "br");
        assert!(!h.contains_key(CONTENT_LENGTH));
        assert_eq!(h[ETAG], "W/\"v1\"");
        assert_eq!(h[VARY], "accept-encoding");
    }

    #[test]
    fn each_coding_streams_and_round_trips() {
        let chunks: Vec<Vec<u8>> =
            (0..20).map(|i| format!("{{\"row\":{i},\"name\":\"item {i}\"}}\n").repeat(50).into_bytes()).collect();
        let whole: Vec<u8> = chunks.concat();
        for coding in [Coding::Gzip, Coding::Brotli, Coding::Zstd] {
            let mut e = Encoder::new(coding).unwrap();
            let mut out = Vec::new();
            for c in &chunks {
                let part = e.chunk(c).unwrap();
                // Flushed: every chunk yields bytes at once.
                assert!(!part.is_empty(), "{coding:?}");
                out.extend_from_slice(&part);
            }
            out.extend_from_slice(&e.finish().unwrap());
            assert!(out.len() < whole.len() / 4, "{coding:?}: {} of {}", out.len(), whole.len());
            let mut back = Vec::new();
            match coding {
                Coding::Gzip => flate2::read::GzDecoder::new(&out[..]).read_to_end(&mut back).unwrap(),
                Coding::Brotli => brotli::Decompressor::new(&out[..], 4096).read_to_end(&mut back).unwrap(),
                Coding::Zstd => zstd::stream::read::Decoder::new(&out[..]).unwrap().read_to_end(&mut back).unwrap(),
            };
            assert_eq!(back, whole, "{coding:?}");
        }
    }
}
