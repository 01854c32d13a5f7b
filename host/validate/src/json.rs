//! A strict JSON reader for request bodies: RFC 8259 grammar, UTF-8 only, and the
//! route's caps checked as it reads: nesting depth, string and number lengths. A
//! duplicate object key, an invalid UTF-8 byte or a lone surrogate escape is refused,
//! each with its reason and byte offset.
//!
//! `serde_json` keeps the last of two duplicate keys without a word and does not show a
//! number's length, so this reader is the gateway's own; it builds the
//! [`serde_json::Value`] the schema validator takes, in one pass.

use postern_model::validate::JsonLimits;
use serde_json::{Map, Number, Value};

/// Why a body is not acceptable JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} at byte {offset}")]
pub struct JsonError {
    /// What is wrong.
    pub reason: Reason,
    /// Where, in bytes from the body's start.
    pub offset: usize,
}

/// What is wrong with a JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reason {
    /// Not UTF-8.
    #[error("the body is not valid UTF-8")]
    InvalidUtf8,
    /// A byte the grammar does not allow here.
    #[error("unexpected character")]
    Unexpected,
    /// The body ended inside a value.
    #[error("unexpected end of the body")]
    Eof,
    /// Something after the one top-level value.
    #[error("trailing characters after the JSON value")]
    Trailing,
    /// Nesting over the cap.
    #[error("nested deeper than {0} levels")]
    TooDeep(u32),
    /// A string over the cap.
    #[error("a string is longer than {0} bytes")]
    StringTooLong(u32),
    /// A number over the cap.
    #[error("a number is longer than {0} characters")]
    NumberTooLong(u32),
    /// A number no JSON reader can hold (an overflowing exponent).
    #[error("a number is out of range")]
    NumberRange,
    /// A number of 2^53 or more in magnitude, past 64-bit integers, that is neither a
    /// double's exact value nor its shortest decimal (`100000000000000000001`): it would
    /// be judged as the double next to it, and a backend reading it exactly would see
    /// another number than the one checked.
    #[error("a number of 2^53 or more does not name a double")]
    NumberInexact,
    /// An object has the same key twice.
    #[error("an object has a duplicate key")]
    DuplicateKey,
    /// A `\uD800`-`\uDFFF` escape without its pair.
    #[error("a string has a lone surrogate escape")]
    LoneSurrogate,
    /// An unknown escape or a control character in a string.
    #[error("a string has an invalid escape or control character")]
    BadString,
}

/// Reads one JSON value from `body` under `limits`.
pub fn parse(body: &[u8], limits: &JsonLimits) -> Result<Value, JsonError> {
    parse_counted(body, limits).map(|(v, _)| v)
}

/// Reads one JSON value from `body` under `limits`, and how many values it holds (every
/// scalar, array and object, nested ones included).
pub fn parse_counted(body: &[u8], limits: &JsonLimits) -> Result<(Value, usize), JsonError> {
    let text =
        std::str::from_utf8(body).map_err(|e| JsonError { reason: Reason::InvalidUtf8, offset: e.valid_up_to() })?;
    let mut r = Reader { s: text.as_bytes(), text, i: 0, limits, depth: 0, values: 0 };
    r.ws();
    let v = r.value()?;
    r.ws();
    if r.i != r.s.len() {
        return Err(r.err(Reason::Trailing));
    }
    Ok((v, r.values))
}

/// Where the run of plain string bytes from `i` ends: the first `"`, `\\` or control
/// character, or the end. Eight bytes at a time (SWAR): in each word, a byte equal to
/// `"` or `\\`, or below 0x20, sets its high bit in a mask. Borrows can only mark bytes
/// above a true match, so the lowest mark is always exact.
fn plain_run(s: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero_bytes = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    while let Some(chunk) = s.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let marks = zero_bytes(w ^ (ONES * u64::from(b'"')))
            | zero_bytes(w ^ (ONES * u64::from(b'\\')))
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGH);
        if marks != 0 {
            return i + (marks.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while let Some(&c) = s.get(i) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            break;
        }
        i += 1;
    }
    i
}

/// 2^53: from here on, not every integer is a double.
const EXACT_INTEGERS: f64 = 9_007_199_254_740_992.0;

/// The significant digits of a decimal (no leading or trailing zero) and the power of
/// ten they are scaled by; `None` for an exponent past `i64`.
fn significant(mantissa: &str, exponent: i64) -> Option<(String, i64)> {
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits: String = int.chars().chain(frac.chars()).skip_while(|&c| c == '0').collect();
    let mut scale = exponent.checked_sub(i64::try_from(frac.len()).ok()?)?;
    while digits.ends_with('0') {
        digits.pop();
        scale = scale.checked_add(1)?;
    }
    Some((digits, scale))
}

/// Whether the JSON number `tok` names the double `f` (|f| ≥ 2^53, an integer): it is
/// either the double's exact value (`99999999999999991611392`) or its shortest decimal,
/// in any spelling (`1e23`, `100000000000000000000000`: what JavaScript, Python and Rust
/// print). Only for numbers that large; allocates.
fn names_the_double(tok: &str, f: f64) -> bool {
    let unsigned = tok.strip_prefix('-').unwrap_or(tok);
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].trim_start_matches('+').parse::<i64>().ok()),
        None => (unsigned, Some(0)),
    };
    let Some(sent) = exponent.and_then(|e| significant(mantissa, e)) else { return false };
    // With a precision, Rust prints a double's exact value; without, its shortest
    // decimal that reads back as it. Neither uses an exponent.
    let (exact, shortest) = (format!("{:.0}", f.abs()), format!("{}", f.abs()));
    [exact, shortest].iter().any(|d| significant(d, 0).as_ref() == Some(&sent))
}

struct Reader<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
    limits: &'a JsonLimits,
    depth: u32,
    values: usize,
}

impl Reader<'_> {
    fn err(&self, reason: Reason) -> JsonError {
        JsonError { reason, offset: self.i }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Result<(), JsonError> {
        match self.peek() {
            Some(c) if c == b => {
                self.i += 1;
                Ok(())
            }
            Some(_) => Err(self.err(Reason::Unexpected)),
            None => Err(self.err(Reason::Eof)),
        }
    }

    fn literal(&mut self, word: &[u8], v: Value) -> Result<Value, JsonError> {
        match self.s.get(self.i..self.i + word.len()) {
            Some(w) if w == word => {
                self.i += word.len();
                Ok(v)
            }
            Some(_) => Err(self.err(Reason::Unexpected)),
            None => Err(self.err(Reason::Eof)),
        }
    }

    fn value(&mut self) -> Result<Value, JsonError> {
        self.values += 1;
        match self.peek() {
            None => Err(self.err(Reason::Eof)),
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(b'"') => self.string().map(Value::String),
            Some(b't') => self.literal(b"true", Value::Bool(true)),
            Some(b'f') => self.literal(b"false", Value::Bool(false)),
            Some(b'n') => self.literal(b"null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err(Reason::Unexpected)),
        }
    }

    fn enter(&mut self) -> Result<(), JsonError> {
        self.depth += 1;
        if self.depth > self.limits.max_depth {
            return Err(self.err(Reason::TooDeep(self.limits.max_depth)));
        }
        Ok(())
    }

    fn object(&mut self) -> Result<Value, JsonError> {
        self.enter()?;
        self.i += 1;
        let mut map = Map::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            self.depth -= 1;
            return Ok(Value::Object(map));
        }
        loop {
            self.ws();
            let at = self.i;
            if self.peek() != Some(b'"') {
                return Err(self.err(if self.peek().is_none() { Reason::Eof } else { Reason::Unexpected }));
            }
            let key = self.string()?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            let v = self.value()?;
            match map.entry(key) {
                serde_json::map::Entry::Vacant(e) => {
                    e.insert(v);
                }
                serde_json::map::Entry::Occupied(_) => {
                    return Err(JsonError { reason: Reason::DuplicateKey, offset: at });
                }
            }
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    self.depth -= 1;
                    return Ok(Value::Object(map));
                }
                Some(_) => return Err(self.err(Reason::Unexpected)),
                None => return Err(self.err(Reason::Eof)),
            }
        }
    }

    fn array(&mut self) -> Result<Value, JsonError> {
        self.enter()?;
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            self.depth -= 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value()?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    self.depth -= 1;
                    return Ok(Value::Array(items));
                }
                Some(_) => return Err(self.err(Reason::Unexpected)),
                None => return Err(self.err(Reason::Eof)),
            }
        }
    }

    fn number(&mut self) -> Result<Value, JsonError> {
        let start = self.i;
        let digits = |r: &mut Self| {
            let from = r.i;
            while let Some(b'0'..=b'9') = r.peek() {
                r.i += 1;
            }
            r.i - from
        };
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                digits(self);
            }
            Some(_) => return Err(self.err(Reason::Unexpected)),
            None => return Err(self.err(Reason::Eof)),
        }
        let mut float = false;
        if self.peek() == Some(b'.') {
            float = true;
            self.i += 1;
            if digits(self) == 0 {
                return Err(self.err(if self.peek().is_none() { Reason::Eof } else { Reason::Unexpected }));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            float = true;
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if digits(self) == 0 {
                return Err(self.err(if self.peek().is_none() { Reason::Eof } else { Reason::Unexpected }));
            }
        }
        let len = self.i - start;
        if len > self.limits.max_number_chars as usize {
            return Err(JsonError { reason: Reason::NumberTooLong(self.limits.max_number_chars), offset: start });
        }
        let tok = &self.text[start..self.i];
        let out_of_range = JsonError { reason: Reason::NumberRange, offset: start };
        // `-0` is the float it reads as elsewhere.
        if !float && tok != "-0" {
            if let Ok(n) = tok.parse::<i64>() {
                return Ok(Value::Number(n.into()));
            }
            if let Ok(n) = tok.parse::<u64>() {
                return Ok(Value::Number(n.into()));
            }
        }
        let f = tok.parse::<f64>().map_err(|_| out_of_range.clone())?;
        // From 2^53 on every double is an integer and they are spaced 2 or more apart:
        // a number there is taken only when it names a double, so that `maximum`,
        // `enum` and `const` (compared exactly by the schema validator) judge the number
        // the client sent, not its neighbour. Below 2^53 a fraction reads as its nearest
        // double, as in every JSON reader without decimals.
        if f.is_finite() && f.abs() >= EXACT_INTEGERS && !names_the_double(tok, f) {
            return Err(JsonError { reason: Reason::NumberInexact, offset: start });
        }
        Number::from_f64(f).map(Value::Number).ok_or(out_of_range)
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let Some(h) = self.s.get(self.i..self.i + 4) else {
            return Err(self.err(Reason::Eof));
        };
        let mut v = 0u32;
        for &c in h {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return Err(self.err(Reason::BadString)),
            };
            v = v * 16 + u32::from(d);
        }
        self.i += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<String, JsonError> {
        let start = self.i;
        self.i += 1;
        let max = self.limits.max_string_bytes as usize;
        let too_long = JsonError { reason: Reason::StringTooLong(self.limits.max_string_bytes), offset: start };
        // The plain run first: most strings have no escape.
        let run = self.i;
        self.i = plain_run(self.s, self.i);
        if self.peek() == Some(b'"') {
            if self.i - run > max {
                return Err(too_long);
            }
            // One allocation of the exact size.
            let out = String::from(&self.text[run..self.i]);
            self.i += 1;
            return Ok(out);
        }
        let mut out = String::from(&self.text[run..self.i]);
        loop {
            if out.len() > max {
                return Err(too_long);
            }
            let Some(c) = self.peek() else {
                return Err(self.err(Reason::Eof));
            };
            match c {
                b'"' => {
                    self.i += 1;
                    return Ok(out);
                }
                b'\\' => {
                    self.i += 1;
                    let Some(e) = self.peek() else {
                        return Err(self.err(Reason::Eof));
                    };
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let at = self.i - 2;
                            let lone = JsonError { reason: Reason::LoneSurrogate, offset: at };
                            let hi = self.hex4()?;
                            let code = match hi {
                                0xD800..=0xDBFF => {
                                    if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                                        return Err(lone);
                                    }
                                    self.i += 2;
                                    let lo = self.hex4()?;
                                    if !(0xDC00..=0xDFFF).contains(&lo) {
                                        return Err(lone);
                                    }
                                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                                }
                                0xDC00..=0xDFFF => return Err(lone),
                                c => c,
                            };
                            char::from_u32(code).ok_or(lone)?
                        }
                        _ => {
                            self.i -= 1;
                            return Err(self.err(Reason::BadString));
                        }
                    };
                    out.push(ch);
                }
                0x00..=0x1f => return Err(self.err(Reason::BadString)),
                _ => {
                    let from = self.i;
                    while let Some(&c) = self.s.get(self.i) {
                        if c == b'"' || c == b'\\' || c < 0x20 {
                            break;
                        }
                        self.i += 1;
                    }
                    out.push_str(&self.text[from..self.i]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> JsonLimits {
        JsonLimits { max_depth: 4, max_string_bytes: 8, max_number_chars: 6 }
    }

    fn reason(s: &str) -> (Reason, usize) {
        let e = parse(s.as_bytes(), &limits()).unwrap_err();
        (e.reason, e.offset)
    }

    #[test]
    fn a_plain_run_stops_at_the_first_quote_backslash_or_control_byte() {
        let naive = |s: &[u8], i: usize| {
            s[i..].iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20).map_or(s.len(), |p| i + p)
        };
        let mut cases: Vec<Vec<u8>> = vec![b"".to_vec(), b"abc".to_vec(), "héllo wörld ünïcode €".as_bytes().to_vec()];
        for stop in [b'"', b'\\', 0x00, 0x1f, b'\n'] {
            for at in 0..20 {
                let mut v: Vec<u8> = (0..24).map(|i| if i % 3 == 0 { 0xc3 } else { b'a' + i as u8 }).collect();
                v[at] = stop;
                // A later match of another kind must not win.
                v[22] = b'"';
                cases.push(v);
            }
        }
        cases.push((0u8..=255).rev().collect());
        for c in &cases {
            for start in 0..c.len().min(9) {
                assert_eq!(plain_run(c, start), naive(c, start), "{c:?} from {start}");
            }
        }
    }

    #[test]
    fn reads_what_serde_json_reads() {
        let big = JsonLimits::default();
        for s in [
            r#"{"a":[1,-2,3.5,1e3,-0,true,false,null,"x\u00e9\ud83d\ude00\n"],"b":{}}"#,
            " [ ] ",
            "\"\"",
            "0",
            "18446744073709551615",
            "-9223372036854775808",
            r#"{"k":"\"\\\/\b\f\n\r\t"}"#,
        ] {
            let ours = parse(s.as_bytes(), &big).unwrap();
            let theirs: Value = serde_json::from_str(s).unwrap();
            assert_eq!(ours, theirs, "{s}");
        }
        assert_eq!(parse(br#"{"a":"\u00e9"}"#, &big).unwrap(), json!({"a": "é"}));
    }

    #[test]
    fn refuses_bad_grammar() {
        assert_eq!(reason("{"), (Reason::Eof, 1));
        assert_eq!(reason("[1,]"), (Reason::Unexpected, 3));
        assert_eq!(reason("01"), (Reason::Trailing, 1));
        assert_eq!(reason("1."), (Reason::Eof, 2));
        assert_eq!(reason("{'a':1}"), (Reason::Unexpected, 1));
        assert_eq!(reason("[1] x"), (Reason::Trailing, 4));
        assert_eq!(reason("nul"), (Reason::Eof, 0));
        assert_eq!(reason("\"a\tb\""), (Reason::BadString, 2));
        assert_eq!(reason(r#""\x""#), (Reason::BadString, 2));
        assert_eq!(reason(""), (Reason::Eof, 0));
    }

    #[test]
    fn each_cap_has_its_reason() {
        assert_eq!(reason("[[[[[1]]]]]"), (Reason::TooDeep(4), 4));
        assert!(parse(b"[[[[1]]]]", &limits()).is_ok());
        assert_eq!(reason(r#"{"a":{"b":{"c":{"d":{}}}}}"#), (Reason::TooDeep(4), 20));
        assert_eq!(reason(r#"{"k":"123456789"}"#), (Reason::StringTooLong(8), 5));
        assert_eq!(reason(r#"{"123456789":1}"#), (Reason::StringTooLong(8), 1));
        assert_eq!(reason(r#"["12345678\n"]"#), (Reason::StringTooLong(8), 1));
        assert!(parse(br#"["12345678"]"#, &limits()).is_ok());
        assert_eq!(reason("[1234567]"), (Reason::NumberTooLong(6), 1));
        assert_eq!(reason("[1.5e+10]"), (Reason::NumberTooLong(6), 1));
        assert!(parse(b"[-1.5e9]", &limits()).is_ok());
        assert_eq!(parse(b"1e400", &JsonLimits::default()).unwrap_err().reason, Reason::NumberRange);
    }

    #[test]
    fn a_number_past_2_pow_53_is_taken_only_when_exactly_a_double() {
        let read = |t: &str| parse(t.as_bytes(), &JsonLimits::default()).map_err(|e| (e.reason, e.offset));
        let inexact = |t: &str| read(&format!("[{t}]")) == Err((Reason::NumberInexact, 1));
        // Rounded to the double 1e20, which a `maximum: 1e20` would let through.
        assert!(inexact("100000000000000000001"));
        assert!(inexact("-100000000000000000001"));
        assert!(inexact("1.00000000000000000001e20"));
        assert!(inexact("9007199254740993.0"), "2^53 + 1 as a fraction reads as 2^53");
        assert!(inexact("100000000000000000000.5"));
        assert!(inexact("1.00000000000000001e23"), "reads as 1.0000000000000001e23, and is not it");
        assert_eq!(read("1.0000000000000001e23"), Ok(serde_json::json!(1.000_000_000_000_000_1e23_f64)));
        // A double's exact value or its shortest decimal, in any spelling: taken, as that
        // double.
        for t in ["100000000000000000000", "1e20", "1E+20", "10.0e19", "0.1e21", "-1e20", "100000000000000000000.000"] {
            assert_eq!(read(t), Ok(serde_json::json!(1e20_f64 * if t.starts_with('-') { -1.0 } else { 1.0 })), "{t}");
        }
        assert_eq!(read("99999999999999991611392"), Ok(serde_json::json!(1e23_f64)));
        assert_eq!(read("1e23"), Ok(serde_json::json!(1e23_f64)));
        assert_eq!(read("100000000000000000000000"), Ok(serde_json::json!(1e23_f64)));
        // What JavaScript prints for 1.2345678901234568e20 (not its exact value).
        assert_eq!(read("123456789012345680000"), Ok(serde_json::json!(1.234_567_890_123_456_8e20_f64)));
        assert_eq!(read("-1.989e30"), Ok(serde_json::json!(-1.989e30_f64)));
        assert_eq!(read("9007199254740992.0"), Ok(serde_json::json!(9_007_199_254_740_992.0_f64)));
        // Integers within 64 bits are read exactly as integers; fractions below 2^53 as
        // their nearest double.
        assert_eq!(read("9007199254740993"), Ok(serde_json::json!(9_007_199_254_740_993_u64)));
        assert_eq!(read("18446744073709551615"), Ok(serde_json::json!(u64::MAX)));
        assert_eq!(read("0.1"), Ok(serde_json::json!(0.1)));
        assert_eq!(read("1e308"), Ok(serde_json::json!(1e308)));
        assert!(inexact("18446744073709551617"), "u64::MAX + 2");
        assert!(inexact("-9223372036854775809"), "i64::MIN - 1 reads as -2^63");
    }

    #[test]
    fn refuses_duplicates_bad_utf8_and_lone_surrogates() {
        assert_eq!(reason(r#"{"a":1,"a":2}"#), (Reason::DuplicateKey, 7));
        // The same key spelt with an escape is the same key.
        assert_eq!(reason(r#"{"a":1,"\u0061":2}"#), (Reason::DuplicateKey, 7));
        let e = parse(b"{\"a\":\"\xff\"}", &limits()).unwrap_err();
        assert_eq!((e.reason, e.offset), (Reason::InvalidUtf8, 6));
        assert_eq!(reason(r#"["\ud800"]"#), (Reason::LoneSurrogate, 2));
        assert_eq!(reason(r#"["\udc00"]"#), (Reason::LoneSurrogate, 2));
        assert_eq!(reason(r#"["\ud800\u0041"]"#), (Reason::LoneSurrogate, 2));
        assert_eq!(
            JsonError { reason: Reason::DuplicateKey, offset: 7 }.to_string(),
            "an object has a duplicate key at byte 7"
        );
    }
}
