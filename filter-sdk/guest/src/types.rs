//! What a filter is given: the request head, the caller's identity, facts about the
//! request, and the backend's response head.

use crate::prelude::*;

/// Header fields in order: lowercase names, raw value bytes; a name may repeat.
pub type Fields = Vec<(String, Vec<u8>)>;

/// The first value of `name` in `fields`, compared case-insensitively.
pub(crate) fn find<'a>(fields: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    fields.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
}

/// Every value of `name` in `fields`, in order, compared case-insensitively.
pub(crate) fn find_all<'a>(fields: &'a [(String, Vec<u8>)], name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
    fields.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
}

/// The request head as the gateway received it.
///
/// Credentials and hop-by-hop headers are already removed by the gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// Method, e.g. `GET`.
    pub method: String,
    /// Path without the query, as received (percent-encoding kept).
    pub path: String,
    /// Query string without the `?`, if there is one.
    pub query: Option<String>,
    /// The host the client addressed (`Host` or `:authority`).
    pub authority: Option<String>,
    /// Request headers in order: lowercase names, raw value bytes.
    pub headers: Fields,
}

impl Request {
    /// The first value of header `name` (case-insensitive), as bytes.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find(&self.headers, name)
    }

    /// The first value of header `name` (case-insensitive), if it is valid UTF-8.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| core::str::from_utf8(v).ok())
    }

    /// Every value of header `name` (case-insensitive), in order.
    pub fn header_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        find_all(&self.headers, name)
    }

    /// Whether header `name` (case-insensitive) is present.
    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }
}

/// The verified caller, when the route authenticates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// End user (`sub`).
    pub subject: Option<String>,
    /// OAuth client or API key's app.
    pub client_id: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// API key id.
    pub key_id: Option<String>,
    /// Plan.
    pub plan: Option<String>,
    /// Granted scopes.
    pub scopes: Vec<String>,
}

impl Identity {
    /// Whether `scope` was granted.
    pub fn has_scope(&self, scope: &str) -> bool {
        self.scopes.iter().any(|s| s == scope)
    }

    /// Sets the subject (builder style, handy in tests).
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Sets the client id (builder style, handy in tests).
    pub fn with_client_id(mut self, client_id: impl Into<String>) -> Self {
        self.client_id = Some(client_id.into());
        self
    }

    /// Sets the tenant (builder style, handy in tests).
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Sets the API key id (builder style, handy in tests).
    pub fn with_key_id(mut self, key_id: impl Into<String>) -> Self {
        self.key_id = Some(key_id.into());
        self
    }

    /// Sets the plan (builder style, handy in tests).
    pub fn with_plan(mut self, plan: impl Into<String>) -> Self {
        self.plan = Some(plan.into());
        self
    }

    /// Adds a granted scope (builder style, handy in tests).
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scopes.push(scope.into());
        self
    }
}

/// Facts about this request and this attachment of the filter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Context {
    /// The route, `team/name`.
    pub route_id: String,
    /// The request id returned to the client as `x-request-id`.
    pub request_id: String,
    /// The verified caller, if the route authenticates.
    pub identity: Option<Identity>,
}

impl Context {
    /// The verified caller's tenant, if there is a caller and it has one.
    pub fn tenant(&self) -> Option<&str> {
        self.identity.as_ref().and_then(|i| i.tenant.as_deref())
    }

    /// Sets the verified caller (builder style, handy in tests).
    pub fn with_identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// Sets the route id (builder style, handy in tests).
    pub fn with_route_id(mut self, route_id: impl Into<String>) -> Self {
        self.route_id = route_id.into();
        self
    }

    /// Sets the request id (builder style, handy in tests).
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = request_id.into();
        self
    }
}

/// The backend's response head.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead {
    /// Status.
    pub status: u16,
    /// Response headers in order: lowercase names, raw value bytes.
    pub headers: Fields,
}

impl ResponseHead {
    /// A response head with `status` and no headers (handy in tests).
    pub fn new(status: u16) -> Self {
        Self { status, headers: Vec::new() }
    }

    /// Adds a header (builder style, handy in tests). The name is lowercased.
    pub fn with_header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.to_ascii_lowercase(), value.as_ref().to_vec()));
        self
    }

    /// The first value of header `name` (case-insensitive), as bytes.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find(&self.headers, name)
    }

    /// The first value of header `name` (case-insensitive), if it is valid UTF-8.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| core::str::from_utf8(v).ok())
    }
}
