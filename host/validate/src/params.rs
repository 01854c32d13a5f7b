//! A parameter's text read as the JSON value its schema expects: `"42"` is the integer 42
//! for `type: integer`, `a,b` a list for a `simple` array. Text that cannot be read as
//! its type is left a string, so the schema's own `type` check names the problem.

use postern_model::validate::{ParamShape, Scalar};
use serde_json::Value;

/// One scalar's text as the type it should have.
pub fn scalar(text: &str, of: Scalar) -> Value {
    let typed = match of {
        Scalar::String => None,
        Scalar::Integer => {
            text.parse::<i64>().map(Value::from).ok().or_else(|| text.parse::<u64>().ok().map(Value::from))
        }
        Scalar::Number => {
            if let Ok(i) = text.parse::<i64>() {
                Some(Value::from(i))
            } else {
                // Rust also reads `inf`, `NaN` and `1.`: only JSON's grammar is a number.
                let json_like = !text.is_empty()
                    && text.bytes().all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b))
                    && text.bytes().next().is_some_and(|b| b == b'-' || b.is_ascii_digit());
                json_like
                    .then(|| text.parse::<f64>().ok())
                    .flatten()
                    .and_then(serde_json::Number::from_f64)
                    .map(Value::Number)
            }
        }
        Scalar::Boolean => match text {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
    };
    typed.unwrap_or_else(|| Value::String(text.to_owned()))
}

/// A path segment or header value (style `simple`): arrays are comma-separated.
pub fn simple(text: &str, shape: ParamShape) -> Value {
    match shape {
        ParamShape::Scalar { of } => scalar(text, of),
        ParamShape::Array { of, .. } => {
            if text.is_empty() {
                Value::Array(Vec::new())
            } else {
                Value::Array(text.split(',').map(|t| scalar(t, of)).collect())
            }
        }
    }
}

/// A query parameter's values, in order (style `form`): an exploded array has one pair
/// per item, an unexploded one a comma-separated list; a scalar takes its first value.
pub fn form(values: &[&str], shape: ParamShape) -> Value {
    match shape {
        ParamShape::Scalar { of } => scalar(values.first().copied().unwrap_or_default(), of),
        ParamShape::Array { of, explode: true } => Value::Array(values.iter().map(|t| scalar(t, of)).collect()),
        ParamShape::Array { of, explode: false } => simple(values.first().copied().unwrap_or_default(), shape_of(of)),
    }
}

fn shape_of(of: Scalar) -> ParamShape {
    ParamShape::Array { of, explode: false }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_text_as_its_type() {
        assert_eq!(scalar("42", Scalar::Integer), json!(42));
        assert_eq!(scalar("4.5", Scalar::Integer), json!("4.5"));
        assert_eq!(scalar("-4.5e1", Scalar::Number), json!(-45.0));
        assert_eq!(scalar("inf", Scalar::Number), json!("inf"));
        assert_eq!(scalar("NaN", Scalar::Number), json!("NaN"));
        assert_eq!(scalar("true", Scalar::Boolean), json!(true));
        assert_eq!(scalar("yes", Scalar::Boolean), json!("yes"));
        assert_eq!(scalar("42", Scalar::String), json!("42"));
    }

    #[test]
    fn arrays_by_style() {
        let ints = ParamShape::Array { of: Scalar::Integer, explode: true };
        assert_eq!(form(&["1", "x"], ints), json!([1, "x"]));
        assert_eq!(form(&["1,2"], ParamShape::Array { of: Scalar::Integer, explode: false }), json!([1, 2]));
        assert_eq!(simple("a,b", ParamShape::Array { of: Scalar::String, explode: false }), json!(["a", "b"]));
        assert_eq!(simple("", ParamShape::Array { of: Scalar::String, explode: false }), json!([]));
        assert_eq!(form(&["7", "8"], ParamShape::Scalar { of: Scalar::Integer }), json!(7));
    }
}
