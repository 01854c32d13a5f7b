use serde_json::json;

use super::*;

fn spec(doc: Value) -> Spec {
    Spec::parse(&doc.to_string()).unwrap()
}

/// A document with one `POST /o` operation `op` taking `schema` as JSON.
fn with_body(version: &str, schema: Value, schemas: Value) -> Spec {
    spec(json!({
        "openapi": version,
        "paths": { "/o": { "post": { "operationId": "op",
            "requestBody": { "content": { "application/json": { "schema": schema } } } } } },
        "components": { "schemas": schemas },
    }))
}

fn op(s: &Spec) -> Result<Op, Vec<SpecError>> {
    s.operation("op", JsonLimits::default(), "teams/t/openapi/o.yaml#op")
}

fn body_schema(s: &Spec) -> Value {
    op(s).unwrap().validation.body.unwrap().media[0].schema.clone().unwrap()
}

fn errors_of(s: &Spec) -> Vec<(String, String)> {
    op(s).unwrap_err().into_iter().map(|e| (e.pointer, e.message)).collect()
}

fn e(pointer: &str, message: &str) -> (String, String) {
    (pointer.to_owned(), message.to_owned())
}

#[test]
fn local_refs_become_defs() {
    let s = with_body(
        "3.0.3",
        json!({ "$ref": "#/components/schemas/Order" }),
        json!({
            "Order": { "type": "object", "properties": { "item": { "$ref": "#/components/schemas/Item" } } },
            "Item": { "type": "string", "x-internal": true },
        }),
    );
    assert_eq!(
        body_schema(&s),
        json!({
            "$schema": SCHEMA_DIALECT,
            "$ref": "#/$defs/~1components~1schemas~1Order",
            "$defs": {
                "/components/schemas/Order": { "type": "object",
                    "properties": { "item": { "$ref": "#/$defs/~1components~1schemas~1Item" } } },
                "/components/schemas/Item": { "type": "string" },
            },
        })
    );
}

#[test]
fn refs_are_percent_decoded_and_their_keys_escaped() {
    let s = with_body("3.1.0", json!({ "$ref": "#/components/schemas/a~1b%20c" }), json!({ "a/b c": {} }));
    assert_eq!(
        body_schema(&s),
        json!({ "$schema": SCHEMA_DIALECT, "$ref": "#/$defs/~1components~1schemas~1a~01b%20c",
            "$defs": { "/components/schemas/a~1b c": {} } })
    );
}

#[test]
fn recursive_schemas_stay_refs() {
    let node = json!({ "type": "object",
        "properties": { "children": { "type": "array", "items": { "$ref": "#/components/schemas/Node" } } } });
    let s = with_body("3.0.3", json!({ "$ref": "#/components/schemas/Node" }), json!({ "Node": node }));
    let mut def = node.clone();
    def["properties"]["children"]["items"]["$ref"] = json!("#/$defs/~1components~1schemas~1Node");
    assert_eq!(
        body_schema(&s),
        json!({ "$schema": SCHEMA_DIALECT, "$ref": "#/$defs/~1components~1schemas~1Node",
            "$defs": { "/components/schemas/Node": def } })
    );
}

#[test]
fn a_ref_cycle_on_the_same_value_is_refused() {
    let s = with_body(
        "3.1.0",
        json!({ "$ref": "#/components/schemas/A" }),
        json!({ "A": { "allOf": [{ "$ref": "#/components/schemas/B" }] }, "B": { "$ref": "#/components/schemas/A" } }),
    );
    assert_eq!(
        errors_of(&s),
        vec![e(
            "/components/schemas/B/$ref",
            "$ref cycle that never descends into the value: /components/schemas/A → /components/schemas/B → /components/schemas/A"
        )]
    );
}

#[test]
fn nullable_is_rewritten() {
    let s = with_body(
        "3.0.3",
        json!({ "type": "object", "properties": {
            "typed": { "type": "integer", "nullable": true },
            "listed": { "type": "string", "enum": ["a"], "nullable": true },
            "untyped": { "minLength": 1, "nullable": true },
            "not": { "type": "string", "nullable": false },
        } }),
        json!({}),
    );
    assert_eq!(
        body_schema(&s)["properties"],
        json!({
            "typed": { "type": ["integer", "null"] },
            "listed": { "type": ["string", "null"], "enum": ["a", null] },
            "untyped": { "anyOf": [{ "minLength": 1 }, { "type": "null" }] },
            "not": { "type": "string" },
        })
    );
}

#[test]
fn json_documents_are_read_as_json() {
    // A surrogate pair escape: valid JSON that YAML's reader refuses.
    let text = r#"{"openapi": "3.0.3", "info": {"title": "fun size \ud83c\udf6b"}, "paths": {}}"#;
    let s = Spec::parse(text).unwrap();
    assert_eq!(s.doc["info"]["title"], "fun size \u{1f36b}");
    assert_eq!(Spec::parse("{").unwrap_err().pointer, "");
}

#[test]
fn integer_formats_become_bounds() {
    let s = with_body(
        "3.0.3",
        json!({ "type": "object", "properties": {
            "a": { "type": "integer", "format": "int32" },
            "b": { "type": "integer", "format": "int32", "minimum": 1 },
            "c": { "type": "integer", "format": "int64", "maximum": 1e30 }
        }}),
        json!({}),
    );
    let got = body_schema(&s);
    let p = &got["properties"];
    assert_eq!(
        p["a"],
        json!({ "type": "integer", "format": "int32", "minimum": -2147483648i64, "maximum": 2147483647 })
    );
    assert_eq!(p["b"]["minimum"], json!(1));
    assert_eq!(p["b"]["maximum"], json!(2147483647));
    assert_eq!(p["c"]["maximum"], json!(i64::MAX));
    assert_eq!(p["c"]["minimum"], json!(i64::MIN));
}

#[test]
fn boolean_exclusive_bounds_become_numbers() {
    let s = with_body(
        "3.0.3",
        json!({ "type": "integer", "maximum": 10, "exclusiveMaximum": true, "minimum": 1,
            "exclusiveMinimum": false, "example": 5, "deprecated": true }),
        json!({}),
    );
    assert_eq!(
        body_schema(&s),
        json!({ "$schema": SCHEMA_DIALECT, "type": "integer", "exclusiveMaximum": 10, "minimum": 1 })
    );
}

#[test]
fn ref_siblings_are_dropped_in_3_0_only() {
    let schema = json!({ "$ref": "#/components/schemas/A", "description": "d" });
    let s = with_body("3.0.3", schema.clone(), json!({ "A": {} }));
    assert_eq!(body_schema(&s)["description"], Value::Null);
    let s = with_body("3.1.0", schema, json!({ "A": {} }));
    assert_eq!(body_schema(&s)["description"], json!("d"));
}

#[test]
fn remote_refs_are_refused() {
    let s = with_body(
        "3.0.3",
        json!({ "type": "object", "properties": { "qty": { "$ref": "common.yaml#/Qty" } } }),
        json!({}),
    );
    assert_eq!(
        errors_of(&s),
        vec![e(
            "/paths/~1o/post/requestBody/content/application~1json/schema/properties/qty/$ref",
            "remote $ref is refused: common.yaml#/Qty"
        )]
    );
    let s = with_body("3.1.0", json!({ "$ref": "#/components/schemas/Gone" }), json!({}));
    assert_eq!(
        errors_of(&s),
        vec![e(
            "/paths/~1o/post/requestBody/content/application~1json/schema/$ref",
            "$ref #/components/schemas/Gone points at nothing in the document"
        )]
    );
    let s = with_body("3.1.0", json!({ "$id": "https://x/y" }), json!({}));
    assert_eq!(
        errors_of(&s),
        vec![e(
            "/paths/~1o/post/requestBody/content/application~1json/schema/$id",
            "$id is not supported by the gateway's validator"
        )]
    );
}

#[test]
fn unknown_and_duplicate_operation_ids_are_refused() {
    let s = with_body("3.1.0", json!({}), json!({}));
    let err = s.operation("nope", JsonLimits::default(), "x").unwrap_err();
    assert_eq!(err, vec![err_at("/paths", "no operation has operationId \"nope\" (known: op)")]);
    let s = spec(json!({ "openapi": "3.1.0", "paths": {
        "/a": { "get": { "operationId": "op" } }, "/b": { "get": { "operationId": "op" } } } }));
    assert_eq!(
        errors_of(&s),
        vec![e("/paths/~1b/get/operationId", "operationId \"op\" is also used at /paths/~1a/get")]
    );
}

fn err_at(pointer: &str, message: &str) -> SpecError {
    err(pointer, message)
}

#[test]
fn parameters_merge_with_the_operation_winning() {
    let s = spec(json!({ "openapi": "3.1.0",
        "paths": { "/o/{id}": {
            "parameters": [
                { "name": "id", "in": "path", "required": true, "schema": { "type": "string" } },
                { "$ref": "#/components/parameters/Limit" },
            ],
            "get": { "operationId": "op", "parameters": [
                { "name": "id", "in": "path", "required": true, "schema": { "type": ["integer", "null"] } },
                { "name": "X-Tag", "in": "header", "schema": { "type": "array", "items": { "type": "string" } } },
                { "name": "Accept", "in": "header", "schema": {} },
                { "name": "s", "in": "cookie", "schema": {} },
            ] } } },
        "components": { "parameters": {
            "Limit": { "$ref": "#/components/parameters/Limit2" },
            "Limit2": { "name": "limit", "in": "query", "explode": false,
                "schema": { "type": "array", "items": { "type": "integer" } } },
        } },
    }));
    let op = op(&s).unwrap();
    assert_eq!((op.method.as_str(), op.path.as_str()), ("GET", "/o/{id}"));
    let got: Vec<_> =
        op.validation.parameters.iter().map(|p| (p.name.as_str(), p.location, p.required, p.shape)).collect();
    assert_eq!(
        got,
        vec![
            ("id", ParamIn::Path, true, ParamShape::Scalar { of: Scalar::Integer }),
            ("limit", ParamIn::Query, false, ParamShape::Array { of: Scalar::Integer, explode: false }),
            ("x-tag", ParamIn::Header, false, ParamShape::Array { of: Scalar::String, explode: false }),
        ]
    );
    assert_eq!(op.validation.parameters[0].schema, json!({ "$schema": SCHEMA_DIALECT, "type": ["integer", "null"] }));
}

#[test]
fn unsupported_parameters_are_refused() {
    let s = spec(json!({ "openapi": "3.0.3", "paths": { "/o/{id}": { "get": { "operationId": "op", "parameters": [
        { "name": "q", "in": "query", "style": "deepObject", "schema": { "type": "object" } },
        { "name": "id", "in": "path", "schema": { "type": "string" } },
        { "name": "f", "in": "query", "schema": { "type": "object" } },
        { "name": "c", "in": "query", "content": { "application/json": {} } },
    ] } } } }));
    let at = |i: usize, rest: &str| format!("/paths/~1o~1{{id}}/get/parameters/{i}{rest}");
    assert_eq!(
        errors_of(&s),
        vec![
            e(
                &at(0, "/style"),
                "style \"deepObject\" is not supported by the gateway's validator (a query parameter may be form)"
            ),
            e(&at(1, ""), "a path parameter must be required: true"),
            e(
                &at(2, "/schema/type"),
                "object parameters are not supported by the gateway's validator (give a string, integer, number or boolean, or an array of them)"
            ),
            e(
                &at(3, "/content"),
                "a parameter with content (instead of schema) is not supported by the gateway's validator"
            ),
        ]
    );
}

#[test]
fn read_only_properties_are_not_required() {
    let s = with_body(
        "3.0.3",
        json!({ "type": "object", "required": ["id", "qty"], "properties": {
            "id": { "$ref": "#/components/schemas/Id" }, "qty": { "type": "integer" } } }),
        json!({ "Id": { "type": "string", "readOnly": true } }),
    );
    assert_eq!(body_schema(&s)["required"], json!(["qty"]));
}

#[test]
fn a_3_1_schema_passes_through_but_for_refs() {
    let schema = json!({ "type": ["object", "null"], "exclusiveMaximum": 3, "examples": [{}], "deprecated": true,
        "prefixItems": [{ "const": { "$ref": "data, not a ref" } }], "properties": { "x-name": { "example": 1 } },
        "required": ["x-name"], "$comment": "c", "items": { "$ref": "#/components/schemas/A", "minimum": 1 } });
    let s = with_body("3.1.0", schema.clone(), json!({ "A": { "format": "x", "nullable": true } }));
    let mut want = schema;
    want["$schema"] = json!(SCHEMA_DIALECT);
    want["items"]["$ref"] = json!("#/$defs/~1components~1schemas~1A");
    want["$defs"] = json!({ "/components/schemas/A": { "format": "x", "nullable": true } });
    assert_eq!(body_schema(&s), want);
}

#[test]
fn media_types_are_ordered_most_specific_first() {
    let s = spec(json!({ "openapi": "3.1.0", "paths": { "/o": { "put": { "operationId": "op", "requestBody": {
        "required": true,
        "content": { "*/*": {}, "text/*": {}, "Application/JSON; charset=utf-8": { "schema": true } } } } } } }));
    let body = op(&s).unwrap().validation.body.unwrap();
    assert!(body.required);
    let got: Vec<_> = body.media.iter().map(|m| (m.range.as_str(), m.schema.is_some())).collect();
    assert_eq!(got, vec![("application/json", true), ("text/*", false), ("*/*", false)]);
}

#[test]
fn the_version_is_checked_and_yaml_errors_named() {
    let e = Spec::parse("openapi: 3.1\n").unwrap_err();
    assert_eq!(e.pointer, "/openapi");
    let e = Spec::parse("openapi: 2.0.0\n").unwrap_err();
    assert_eq!(e, err_at("/openapi", "OpenAPI 2.0.0 is not supported: give 3.0.x or 3.1.x"));
    let e = Spec::parse("openapi: [\n").unwrap_err();
    assert!(e.pointer.is_empty() && e.message.contains("line"), "{e}");
    // YAML, with integer keys (response codes) and an anchor.
    let s = Spec::parse(
        "openapi: 3.0.3\npaths:\n  /o:\n    get:\n      operationId: op\n      parameters:\n        - &p { name: n, in: query, schema: { type: boolean } }\n      responses:\n        200: { description: ok }\n",
    )
    .unwrap();
    let p = &op(&s).unwrap().validation.parameters[0];
    assert_eq!(p.shape, ParamShape::Scalar { of: Scalar::Boolean });
}
