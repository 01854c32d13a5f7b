//! Who a bearer token speaks for: its role, as the token list names it.

use std::fmt;

use serde::Deserialize;

/// The role a token grants.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum Role {
    /// `platform`: publish, rollback, keys, usage billing.
    Platform,
    /// `node:<name>` speaks for that node only; `node` (no name) for any node.
    Node(Option<String>),
    /// `team:<name>`: status, its own audit entries, and publish when every change is its
    /// own.
    Team(String),
}

impl Role {
    /// A role by its name: `platform`, `node`, `node:<name>` or `team:<name>`.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "platform" => Some(Role::Platform),
            "node" => Some(Role::Node(None)),
            _ => match (s.strip_prefix("node:"), s.strip_prefix("team:")) {
                (Some(node), _) if !node.is_empty() => Some(Role::Node(Some(node.to_owned()))),
                (_, Some(team)) if !team.is_empty() => Some(Role::Team(team.to_owned())),
                _ => None,
            },
        }
    }

    /// Whether this is a node's token (bound to a node or not).
    pub fn is_node(&self) -> bool {
        matches!(self, Role::Node(_))
    }

    /// Whether a node token may act for `node`: a token bound to a node (`node:<name>`)
    /// speaks only for it; an unbound fleet token (`node`) for any.
    pub fn speaks_for(&self, node: &str) -> bool {
        match self {
            Role::Node(Some(bound)) => bound == node,
            Role::Node(None) => true,
            _ => false,
        }
    }

    /// The team of a team's token.
    pub fn team(&self) -> Option<&str> {
        match self {
            Role::Team(team) => Some(team),
            _ => None,
        }
    }
}

/// A role that is none of the four, as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("role {0:?} must be platform, node:<name>, node or team:<name>")]
pub struct UnknownRole(pub String);

impl TryFrom<String> for Role {
    type Error = UnknownRole;

    fn try_from(s: String) -> Result<Role, UnknownRole> {
        Role::parse(&s).ok_or(UnknownRole(s))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Platform => f.write_str("platform"),
            Role::Node(None) => f.write_str("node"),
            Role::Node(Some(node)) => write!(f, "node:{node}"),
            Role::Team(team) => write!(f, "team:{team}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_tokens_speak_for_their_node() {
        let role = |s: &str| Role::parse(s).unwrap();
        assert!(role("node:a").speaks_for("a"));
        assert!(!role("node:a").speaks_for("b"));
        assert!(role("node").speaks_for("b"));
        assert!(!role("platform").speaks_for("a"));
    }
}
