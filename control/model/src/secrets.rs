//! Secrets stay off command lines: every process of a host can read another's arguments
//! (`/proc/<pid>/cmdline`, `ps`), so a password, a token or a key given as a flag is given
//! to every user of the machine. A secret comes from the environment or a file; a flag
//! whose value looks like one is refused with the way to give it instead.

/// A secret given on the command line, refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{flag}: {what} on the command line is readable by every process of this host (/proc/*/cmdline); give it in {instead}"
)]
pub struct OnCommandLine {
    /// The flag it came with.
    pub flag: &'static str,
    /// What looked secret (never the secret itself).
    pub what: String,
    /// Where it belongs instead.
    pub instead: &'static str,
}

/// Whether `flag` (`--name`) was given on this process's command line, as `--name value`
/// or `--name=value` (a value clap took from the environment was not).
pub fn on_command_line(flag: &str) -> bool {
    given_in(std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()), flag)
}

fn given_in(args: impl Iterator<Item = String>, flag: &str) -> bool {
    args.take_while(|a| a != "--").any(|a| a == flag || a.strip_prefix(flag).is_some_and(|rest| rest.starts_with('=')))
}

/// What in a URL is secret, if anything: a password in its user information, or a query
/// parameter named like a credential (`token`, `key`, `secret`, `password`, `signature`,
/// `sig`, in any case, with any prefix such as `access_` or `api-`).
pub fn in_url(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if let Some((userinfo, _)) = authority.rsplit_once('@')
        && userinfo.contains(':')
    {
        return Some("a password in the URL".into());
    }
    let query = rest.split_once('?').map(|(_, q)| q.split('#').next().unwrap_or_default())?;
    query
        .split('&')
        .map(|kv| kv.split('=').next().unwrap_or_default())
        .find(|name| is_secret_name(name))
        .map(|name| format!("the URL's query parameter {name:?}"))
}

/// Whether a librdkafka setting holds a secret: `sasl.password`, `ssl.key.password`,
/// `ssl.key.pem`, `ssl_key.pem`, `ssl.keystore.password`, `sasl.oauthbearer.client.secret`,
/// `sasl.oauthbearer.config`, `sasl.jaas.config`, and any other named like a credential.
pub fn kafka_setting(key: &str) -> bool {
    let k = key.trim().to_ascii_lowercase();
    ["password", "secret", "token", "credential", "jaas", "key.pem", "oauthbearer.config"].iter().any(|w| k.contains(w))
}

fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["password", "passwd", "secret", "token", "signature", "credential"].iter().any(|w| n.contains(w))
        || n.split(['.', '_', '-']).any(|part| matches!(part, "key" | "sig" | "apikey" | "pass" | "pwd"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_urls_are_found_and_plain_urls_pass() {
        assert_eq!(in_url("http://hooks.example/quota"), None);
        assert_eq!(in_url("postgres://postern@db:5432/usage"), None);
        assert_eq!(in_url("redis://127.0.0.1:6379/0"), None);
        assert_eq!(in_url("https://u:p@hooks.example/quota").as_deref(), Some("a password in the URL"));
        assert_eq!(in_url("postgres://postern:hunter2@db/usage").as_deref(), Some("a password in the URL"));
        assert_eq!(in_url("redis://:pw@127.0.0.1:6379").as_deref(), Some("a password in the URL"));
        for q in ["token=x", "access_token=x", "api-key=x", "sig=x", "X-Amz-Signature=x", "secret=1"] {
            assert!(in_url(&format!("https://h/p?a=1&{q}")).is_some(), "{q}");
        }
        assert_eq!(in_url("https://h/p?keys=3&monkey=1&page=2"), None);
        // An '@' in the path is not user information.
        assert_eq!(in_url("https://h/users/a:b@c"), None);
    }

    #[test]
    fn kafka_secrets_are_found() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "ssl.key.pem",
            "ssl_key.pem",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "sasl.jaas.config",
            " SASL.PASSWORD",
        ] {
            assert!(kafka_setting(k), "{k}");
        }
        for k in ["sasl.username", "security.protocol", "session.timeout.ms", "ssl.ca.location", "ssl.key.location"] {
            assert!(!kafka_setting(k), "{k}");
        }
    }

    #[test]
    fn a_flag_is_on_the_command_line_in_either_spelling() {
        let args = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>().into_iter();
        assert!(given_in(args(&["serve", "--quota-webhook", "u"]), "--quota-webhook"));
        assert!(given_in(args(&["--quota-webhook=u"]), "--quota-webhook"));
        assert!(!given_in(args(&["--quota-webhook-x", "u"]), "--quota-webhook"));
        assert!(!given_in(args(&["--", "--quota-webhook"]), "--quota-webhook"));
        assert!(!given_in(args(&["serve"]), "--quota-webhook"));
    }
}
