//! Request bodies sent compressed (`Content-Encoding: gzip | br | zstd`) on routes that
//! read them whole: the route's limit applies to the decoded bytes, and so does a ratio
//! cap, so a bomb is refused after at most the limit's worth of decoding.

use std::io::Read;

use postern_model::validate::MAX_DECODE_RATIO;

/// A content coding the gateway decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// `gzip` (also `x-gzip`).
    Gzip,
    /// `br`.
    Brotli,
    /// `zstd`.
    Zstd,
}

impl Coding {
    /// The coding a `Content-Encoding` value names: `Ok(None)` for `identity`, `Err` with
    /// the value for a coding the gateway does not decode (or a list of several).
    pub fn from_header(v: &str) -> Result<Option<Coding>, UnknownCoding> {
        match v.trim().to_ascii_lowercase().as_str() {
            "identity" | "" => Ok(None),
            "gzip" | "x-gzip" => Ok(Some(Coding::Gzip)),
            "br" => Ok(Some(Coding::Brotli)),
            "zstd" => Ok(Some(Coding::Zstd)),
            _ => Err(UnknownCoding(v.to_owned())),
        }
    }
}

/// A `Content-Encoding` value the gateway does not decode, as it was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UnknownCoding(pub String);

impl From<&str> for UnknownCoding {
    fn from(v: &str) -> UnknownCoding {
        UnknownCoding(v.to_owned())
    }
}

/// Why a compressed body was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// It decodes to more than the route's limit.
    #[error("the decoded request body is over this route's limit of {0} bytes")]
    TooLarge(u64),
    /// It decodes to more than [`MAX_DECODE_RATIO`] times its encoded size.
    #[error("the request body decodes to more than {MAX_DECODE_RATIO} times its encoded size")]
    Ratio,
    /// It is not valid in its coding.
    #[error("the request body is not valid {0}")]
    Corrupt(&'static str),
}

/// The zstd window a body may ask for (2 MiB; bodies read whole are at most 1 MiB).
const ZSTD_WINDOW_LOG_MAX: u32 = 21;

/// Decodes `input` into at most `limit` bytes and at most [`MAX_DECODE_RATIO`] times its
/// own size.
pub fn decode(coding: Coding, input: &[u8], limit: u64) -> Result<Vec<u8>, DecodeError> {
    let by_ratio = (input.len() as u64).saturating_mul(MAX_DECODE_RATIO);
    let cap = limit.min(by_ratio);
    let name = match coding {
        Coding::Gzip => "gzip",
        Coding::Brotli => "brotli",
        Coding::Zstd => "zstd",
    };
    let corrupt = |_| DecodeError::Corrupt(name);
    let mut out = Vec::new();
    let read = match coding {
        Coding::Gzip => flate2::read::MultiGzDecoder::new(input).take(cap + 1).read_to_end(&mut out),
        Coding::Brotli => brotli::Decompressor::new(input, 16 * 1024).take(cap + 1).read_to_end(&mut out),
        Coding::Zstd => {
            let mut d = zstd::stream::read::Decoder::with_buffer(input).map_err(corrupt)?;
            d.window_log_max(ZSTD_WINDOW_LOG_MAX).map_err(corrupt)?;
            d.take(cap + 1).read_to_end(&mut out)
        }
    };
    read.map_err(corrupt)?;
    if out.len() as u64 > cap {
        return Err(if cap == limit { DecodeError::TooLarge(limit) } else { DecodeError::Ratio });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn decodes_each_coding() {
        let body = br#"{"sku":"A-1","qty":2}"#.repeat(10);
        assert_eq!(decode(Coding::Gzip, &gzip(&body), 1 << 20).unwrap(), body);
        let z = zstd::encode_all(&body[..], 3).unwrap();
        assert_eq!(decode(Coding::Zstd, &z, 1 << 20).unwrap(), body);
        let mut b = Vec::new();
        brotli::BrotliCompress(&mut &body[..], &mut b, &Default::default()).unwrap();
        assert_eq!(decode(Coding::Brotli, &b, 1 << 20).unwrap(), body);
    }

    #[test]
    fn bombs_stop_at_the_limit_or_the_ratio() {
        // 10 MiB of zeros is about 10 KiB of gzip: over the ratio and the limit.
        let bomb = gzip(&vec![0u8; 10 << 20]);
        assert_eq!(decode(Coding::Gzip, &bomb, 64 * 1024), Err(DecodeError::TooLarge(64 * 1024)));
        assert_eq!(decode(Coding::Gzip, &bomb, 1 << 30), Err(DecodeError::Ratio));
        // Text that compresses about as well as JSON does.
        let exact: Vec<u8> =
            (0..4096u32).map(|i| b"abcdefghijklmnopqrstuvwxyz{}:,"[(i * 7919 % 31 % 30) as usize]).collect();
        assert_eq!(decode(Coding::Gzip, &gzip(&exact), 4096).unwrap().len(), 4096);
        assert_eq!(decode(Coding::Gzip, &gzip(&exact), 4095), Err(DecodeError::TooLarge(4095)));
    }

    #[test]
    fn corrupt_and_unknown_codings() {
        assert_eq!(decode(Coding::Gzip, b"not gzip", 1024), Err(DecodeError::Corrupt("gzip")));
        assert_eq!(decode(Coding::Zstd, b"not zstd", 1024), Err(DecodeError::Corrupt("zstd")));
        assert_eq!(Coding::from_header("GZIP"), Ok(Some(Coding::Gzip)));
        assert_eq!(Coding::from_header("identity"), Ok(None));
        assert_eq!(Coding::from_header("deflate"), Err("deflate".into()));
        assert_eq!(Coding::from_header("gzip, br"), Err("gzip, br".into()));
    }
}
