//! Strict HTTP/1 framing on client connections, checked on the bytes before the HTTP
//! parser sees them.
//!
//! hyper reads a request with both `Content-Length` and `Transfer-Encoding` as chunked
//! (RFC 9112 §6.1 allows it) and accepts bare LF line endings. Postern refuses both: a
//! head that is ambiguous to any hop behind or in front of it is a 400 and the
//! connection closes. [`Strict`] holds each request head back until it is complete,
//! checks it, and on a refusal breaks the head's first byte so that hyper answers 400
//! and closes; it follows each request's body (fixed length or chunked) to find the next
//! head. The HTTP/2 preface, `CONNECT`, and anything it cannot follow switch it to
//! passing bytes through untouched, leaving the verdict to hyper.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The longest request head followed; a longer one goes to hyper, which refuses it
/// (its own buffer is smaller).
const MAX_HEAD: usize = 72 * 1024;
/// A byte no method may start with: hyper's parser refuses the request line with 400.
const BROKEN: u8 = 0x01;
const SCRATCH: usize = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for a complete request head.
    Head,
    /// A fixed-length body: this many bytes left.
    Fixed(u64),
    /// A chunk-size line.
    ChunkSize { size: u64, ext: bool },
    /// Chunk data: this many bytes left.
    ChunkData(u64),
    /// The line end after a chunk's data.
    ChunkEnd,
    /// Trailer lines after the last chunk; `len` bytes in the current line.
    Trailers { len: usize },
    /// Bytes pass untouched from here on.
    Pass,
}

/// Why a head is refused (for the debug log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Follow a body of this framing.
    Body(State),
    /// Refuse: both `Content-Length` and `Transfer-Encoding`.
    LengthAndChunked,
    /// Refuse: a line ends in a bare LF.
    BareLf,
}

/// A client connection whose HTTP/1 request heads are checked before hyper reads them.
#[derive(Debug)]
pub struct Strict<IO> {
    inner: IO,
    state: State,
    /// Bytes read from `inner` and not yet handed on; the first `ready` are checked.
    held: Vec<u8>,
    ready: usize,
    scratch: Box<[u8; SCRATCH]>,
    eof: bool,
}

impl<IO> Strict<IO> {
    /// Wraps a client connection.
    pub fn new(inner: IO) -> Strict<IO> {
        Strict { inner, state: State::Head, held: Vec::new(), ready: 0, scratch: Box::new([0; SCRATCH]), eof: false }
    }

    /// Marks as many held bytes ready as the framing allows.
    fn advance(&mut self) {
        while self.ready < self.held.len() {
            let rest = &self.held[self.ready..];
            match self.state {
                State::Pass => self.ready = self.held.len(),
                State::Head => {
                    let Some(end) = head_end(rest) else {
                        if rest.len() > MAX_HEAD {
                            self.state = State::Pass;
                            continue;
                        }
                        return;
                    };
                    let verdict = judge(&rest[..end]);
                    let start = self.ready;
                    self.ready += end;
                    self.state = match verdict {
                        Verdict::Body(s) => s,
                        refused => {
                            tracing::debug!(?refused, "request head refused before parsing");
                            if let Some(first) = self.held[start..].iter().position(|&b| b != b'\r' && b != b'\n')
                                && let Some(b) = self.held.get_mut(start + first)
                            {
                                *b = BROKEN;
                            }
                            State::Pass
                        }
                    };
                }
                State::Fixed(n) | State::ChunkData(n) => {
                    let k = usize::try_from(n).unwrap_or(usize::MAX).min(rest.len());
                    self.ready += k;
                    let left = n - k as u64;
                    self.state = match (self.state, left) {
                        (State::Fixed(_), 0) => State::Head,
                        (State::Fixed(_), l) => State::Fixed(l),
                        (_, 0) => State::ChunkEnd,
                        (_, l) => State::ChunkData(l),
                    };
                }
                State::ChunkSize { .. } | State::ChunkEnd | State::Trailers { .. } => {
                    let b = rest[0];
                    self.ready += 1;
                    self.state = line_byte(self.state, b);
                }
            }
        }
    }
}

/// One byte of a chunk-size line, a chunk's line end or a trailer line.
fn line_byte(state: State, b: u8) -> State {
    match (state, b) {
        (State::ChunkSize { size, ext }, b'\n') => {
            let _ = ext;
            if size == 0 { State::Trailers { len: 0 } } else { State::ChunkData(size) }
        }
        (State::ChunkSize { .. }, b'\r') => state,
        (State::ChunkSize { size, ext: false }, b) if b.is_ascii_hexdigit() => {
            let d = u64::from(char::from(b).to_digit(16).unwrap_or(0));
            match size.checked_mul(16).and_then(|s| s.checked_add(d)) {
                Some(size) => State::ChunkSize { size, ext: false },
                None => State::Pass,
            }
        }
        (State::ChunkSize { size, .. }, b';' | b' ' | b'\t') => State::ChunkSize { size, ext: true },
        (State::ChunkSize { size, ext: true }, _) => State::ChunkSize { size, ext: true },
        (State::ChunkSize { .. }, _) => State::Pass,
        (State::ChunkEnd, b'\n') => State::ChunkSize { size: 0, ext: false },
        (State::ChunkEnd, b'\r') => State::ChunkEnd,
        (State::ChunkEnd, _) => State::Pass,
        (State::Trailers { len }, b'\n') => {
            if len == 0 {
                State::Head
            } else {
                State::Trailers { len: 0 }
            }
        }
        (State::Trailers { len }, b'\r') => State::Trailers { len },
        (State::Trailers { len }, _) if len > MAX_HEAD => State::Pass,
        (State::Trailers { len }, _) => State::Trailers { len: len + 1 },
        (s, _) => s,
    }
}

/// The length of a complete request head at the start of `b` (through its empty line),
/// after any empty lines before it.
fn head_end(b: &[u8]) -> Option<usize> {
    let start = b.iter().position(|&c| c != b'\r' && c != b'\n')?;
    let mut i = start;
    while let Some(off) = memchr::memchr(b'\n', &b[i..]) {
        let nl = i + off;
        match b.get(nl + 1) {
            Some(b'\n') => return Some(nl + 2),
            Some(b'\r') if b.get(nl + 2) == Some(&b'\n') => return Some(nl + 3),
            Some(b'\r') | None => {
                if nl + 2 >= b.len() {
                    return None;
                }
            }
            Some(_) => {}
        }
        i = nl + 1;
    }
    None
}

/// Judges one complete request head.
fn judge(head: &[u8]) -> Verdict {
    let start = head.iter().position(|&c| c != b'\r' && c != b'\n').unwrap_or(0);
    let head = &head[start..];
    if head.starts_with(b"PRI * HTTP/2.0") || head.starts_with(b"CONNECT ") {
        return Verdict::Body(State::Pass);
    }
    let mut length: Option<Option<u64>> = None;
    let mut te: Option<bool> = None; // Some(final coding is chunked)
    let mut first = true;
    let mut pos = 0;
    while pos < head.len() {
        let Some(off) = memchr::memchr(b'\n', &head[pos..]) else { break };
        let nl = pos + off;
        if nl == 0 || head[nl - 1] != b'\r' {
            return Verdict::BareLf;
        }
        let line = &head[pos..nl - 1];
        pos = nl + 1;
        if std::mem::take(&mut first) || line.is_empty() {
            continue;
        }
        let Some(colon) = memchr::memchr(b':', line) else { continue };
        let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
        if name.eq_ignore_ascii_case(b"content-length") {
            let n = std::str::from_utf8(value).ok().and_then(|v| v.parse::<u64>().ok());
            length = Some(n.filter(|_| value.iter().all(u8::is_ascii_digit)));
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            let last = value.rsplit(|&c| c == b',').next().map(trim).unwrap_or_default();
            te = Some(last.eq_ignore_ascii_case(b"chunked"));
        }
    }
    match (length, te) {
        (Some(_), Some(_)) => Verdict::LengthAndChunked,
        (_, Some(true)) => Verdict::Body(State::ChunkSize { size: 0, ext: false }),
        // hyper refuses a final coding other than chunked, and a bad length.
        (_, Some(false)) | (Some(None), None) => Verdict::Body(State::Pass),
        (Some(Some(0)), None) | (None, None) => Verdict::Body(State::Head),
        (Some(Some(n)), None) => Verdict::Body(State::Fixed(n)),
    }
}

fn trim(v: &[u8]) -> &[u8] {
    let s = v.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(v.len());
    let e = v.iter().rposition(|c| !c.is_ascii_whitespace()).map_or(s, |e| e + 1);
    &v[s..e.max(s)]
}

impl<IO: AsyncRead + Unpin> AsyncRead for Strict<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready > 0 {
                let k = this.ready.min(out.remaining());
                out.put_slice(&this.held[..k]);
                this.held.drain(..k);
                this.ready -= k;
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // Whatever is left was never a complete head: hand it on for hyper to judge.
                let k = this.held.len().min(out.remaining());
                out.put_slice(&this.held[..k]);
                this.held.drain(..k);
                return Poll::Ready(Ok(()));
            }
            if this.held.is_empty() {
                // Straight into hyper's buffer when nothing there can need holding back.
                let direct = match this.state {
                    State::Pass => true,
                    State::Fixed(n) => out.remaining() as u64 <= n,
                    _ => false,
                };
                if direct {
                    let before = out.filled().len();
                    ready!(Pin::new(&mut this.inner).poll_read(cx, out))?;
                    let k = (out.filled().len() - before) as u64;
                    if let State::Fixed(n) = this.state {
                        this.state = if k == n { State::Head } else { State::Fixed(n - k) };
                    }
                    return Poll::Ready(Ok(()));
                }
            }
            let mut buf = ReadBuf::new(&mut this.scratch[..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut buf))?;
            if buf.filled().is_empty() {
                this.eof = true;
            } else {
                this.held.extend_from_slice(buf.filled());
                this.advance();
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Strict<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Everything hyper would read from these client bytes, written in `pieces`.
    async fn through(pieces: &[&[u8]]) -> Vec<u8> {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        for p in pieces {
            client.write_all(p).await.unwrap();
        }
        drop(client);
        let mut s = Strict::new(server);
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn good_requests_pass_unchanged_in_any_split() {
        let stream: &[u8] = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhelloGET /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5;e=1\r\nhello\r\n0\r\nx-t: 1\r\n\r\n\r\nGET /c HTTP/1.1\r\nhost: x\r\n\r\n";
        assert_eq!(through(&[stream]).await, stream);
        for cut in 1..stream.len() {
            assert_eq!(through(&[&stream[..cut], &stream[cut..]]).await, stream, "cut at {cut}");
        }
    }

    #[tokio::test]
    async fn length_with_chunked_is_broken_for_hyper_to_refuse() {
        let first: &[u8] = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n";
        let bad: &[u8] =
            b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n";
        let out = through(&[first, bad]).await;
        assert_eq!(&out[..first.len()], first);
        assert_eq!(out[first.len()], BROKEN);
        assert_eq!(&out[first.len() + 1..], &bad[1..]);
        let te_first: &[u8] = b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n";
        assert_eq!(through(&[te_first]).await[0], BROKEN);
    }

    #[tokio::test]
    async fn bare_line_feeds_are_broken() {
        assert_eq!(through(&[b"GET / HTTP/1.1\nhost: x\n\n"]).await[0], BROKEN);
        assert_eq!(through(&[b"GET / HTTP/1.1\r\nhost: x\n\r\n"]).await[0], BROKEN);
    }

    #[test]
    fn heads_are_judged() {
        assert_eq!(judge(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"), Verdict::Body(State::Head));
        assert_eq!(judge(b"PUT / HTTP/1.1\r\nContent-Length: 12\r\n\r\n"), Verdict::Body(State::Fixed(12)));
        assert_eq!(
            judge(b"PUT / HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n"),
            Verdict::Body(State::ChunkSize { size: 0, ext: false })
        );
        assert_eq!(judge(b"PUT / HTTP/1.1\r\ntransfer-encoding: chunked, gzip\r\n\r\n"), Verdict::Body(State::Pass));
        assert_eq!(judge(b"PRI * HTTP/2.0\r\n\r\n"), Verdict::Body(State::Pass));
        assert_eq!(judge(b"\r\nGET / HTTP/1.1\r\n\r\n"), Verdict::Body(State::Head));
    }

    #[test]
    fn heads_end_at_their_empty_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nrest"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\nrest"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nhost: x\r\n"), None);
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r"), None);
        assert_eq!(head_end(b"\r\n"), None);
    }
}
