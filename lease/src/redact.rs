//! Credentials out of a URL before it is shown in a log line, an error or a status.

/// Replace the password of a URL-shaped string with `***`, even when the string does not parse.
///
/// A password typed without percent-encoding may hold `/`, `?` or `#`, which would end the
/// host part before its `@`: wherever an `@` stands after the host part seems to end, all
/// before the last `@` is taken for the user part (a path or query that holds an `@` is then
/// hidden too, which errs on the side of showing less).
pub fn redact(raw: &str) -> String {
    let Some((scheme, rest)) = raw.split_once("://") else {
        return raw.to_owned();
    };
    let mut authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    if let Some(at) = rest.rfind('@').filter(|&at| at > authority_end) {
        authority_end = at + rest[at..].find(['/', '?', '#']).unwrap_or(rest.len() - at);
    }
    let (authority, tail) = rest.split_at(authority_end);
    let tail = redact_query_passwords(tail);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}{tail}")
            } else {
                format!("{scheme}://***@{host}{tail}")
            }
        }
        None => format!("{scheme}://{authority}{tail}"),
    }
}

/// [`redact`] for a URL already parsed, whose parts are known: its password (or a user part
/// that is a token, as in `redis://TOKEN@host`) and every option named `*password` become
/// `***`, and nothing else changes (an `@` in its path stays part of the path).
pub fn redact_url(url: &url::Url) -> String {
    let mut shown = url.clone();
    let hidden = if shown.password().is_some() {
        shown.set_password(Some("***")).is_ok()
    } else if !shown.username().is_empty() {
        shown.set_username("***").is_ok()
    } else {
        true
    };
    if !hidden {
        return redact(url.as_str());
    }
    // A parsed URL's first `?` starts its query: one in the user part or the path is encoded.
    redact_query_passwords(shown.as_str())
}

/// `...?a=1&sentinel-password=x` with the value of every option named `*password` replaced.
fn redact_query_passwords(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let options: Vec<String> = query
        .split('&')
        .map(|option| match option.split_once('=') {
            Some((key, _)) if key.ends_with("password") => format!("{key}=***"),
            _ => option.to_owned(),
        })
        .collect();
    format!("{path}?{}", options.join("&"))
}

#[cfg(test)]
mod tests {
    use super::{redact, redact_url};

    #[test]
    fn redaction_of_parsed_urls() {
        let shown = |raw: &str| redact_url(&url::Url::parse(raw).unwrap());
        assert_eq!(shown("redis://h:1"), "redis://h:1");
        assert_eq!(shown("redis://:pw@h:1/0"), "redis://:***@h:1/0");
        assert_eq!(shown("redis://tok@h"), "redis://***@h");
        assert_eq!(
            shown("postgres://u:p%2Fw@db/app@prod"),
            "postgres://u:***@db/app@prod"
        );
        assert_eq!(shown("postgres://db/app@prod"), "postgres://db/app@prod");
        assert_eq!(
            shown("redis+sentinel://s/m?prefix=p&sentinel-password=x&min-replicas=1"),
            "redis+sentinel://s/m?prefix=p&sentinel-password=***&min-replicas=1"
        );
    }

    #[test]
    fn redaction() {
        assert_eq!(redact("redis://h:1"), "redis://h:1");
        assert_eq!(redact("redis://:pw@h:1/0"), "redis://:***@h:1/0");
        assert_eq!(redact("redis://tok@h"), "redis://***@h");
        assert_eq!(redact("a://u:p@w@h/x"), "a://u:***@h/x");
        // Passwords typed without percent-encoding, holding what would end the host part.
        assert_eq!(
            redact("etcd://root:pa/ss@e1:2379"),
            "etcd://root:***@e1:2379"
        );
        assert_eq!(redact("redis://:abc/def@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(redact("postgres://u:p#w@db/x"), "postgres://u:***@db/x");
        assert_eq!(redact("zk://u:p?w@z1/locks"), "zk://u:***@z1/locks");
        assert_eq!(redact("redis://tok/en@h"), "redis://***@h");
        assert_eq!(
            redact("redis+sentinel://s/m?prefix=p&sentinel-password=x&min-replicas=1"),
            "redis+sentinel://s/m?prefix=p&sentinel-password=***&min-replicas=1"
        );
    }
}
