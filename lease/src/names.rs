//! Validation of the names that users give us and that end up inside backend keys, SQL
//! statements or paths. Names are checked here once; drivers then only quote them.

use crate::error::{Error, Result};

/// The longest lock name: a Kubernetes object name (DNS subdomain) fits.
pub const MAX_LOCK_NAME: usize = 253;

/// What joins a family's name and a key in the lock name of a keyed lock ([`crate::keyed`]):
/// `FAMILY.keys.KEY` for a plain key, `FAMILY.keyh.HASH` for any other.
pub const PLAIN_KEY_INFIX: &str = ".keys.";
pub const HASHED_KEY_INFIX: &str = ".keyh.";

/// The family whose keys a lock name has the form of, if any. A plain lock named that way is
/// counted with the family by the backends that share a token counter per family: harmless,
/// since a counter shared by several locks still rises for each of them.
pub fn family_of(lock: &str) -> Option<&str> {
    [PLAIN_KEY_INFIX, HASHED_KEY_INFIX]
        .iter()
        .filter_map(|infix| lock.find(infix))
        .min()
        .map(|at| &lock[..at])
        .filter(|family| !family.is_empty())
}

/// The row of a lock table that keeps a family's token floor: at least every token of the
/// family's keys whose rows were deleted as idle, so that a key taken again draws above them.
/// `/` is in no lock name, so it is no lock's row.
pub fn key_floor_row(family: &str) -> String {
    format!("{family}/floor")
}

/// SQL `LIKE` patterns (escape character `|`, which no lock name has: a backslash means
/// different things in different SQL modes) of the names of `family`'s keys.
pub fn key_name_patterns(family: &str) -> [String; 2] {
    let escaped = family
        .replace('|', "||")
        .replace('_', "|_")
        .replace('%', "|%");
    [PLAIN_KEY_INFIX, HASHED_KEY_INFIX].map(|infix| format!("{escaped}{infix}%"))
}

/// The longest SQL identifier accepted; PostgreSQL truncates at 63 bytes, so we refuse there.
pub const MAX_SQL_IDENTIFIER: usize = 63;

/// A lock name: 1-253 characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric.
/// That is a superset of Kubernetes object names and safe inside Redis keys, SQL values
/// and ZooKeeper or etcd paths.
pub fn validate_lock_name(name: &str) -> Result<()> {
    let invalid = |reason| Error::InvalidName {
        what: "lock name",
        value: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("it is empty"));
    }
    if name.len() > MAX_LOCK_NAME {
        return Err(invalid("it is longer than 253 characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(invalid(
            "only letters, digits, '.', '_' and '-' are allowed",
        ));
    }
    let first = name.as_bytes()[0];
    let last = name.as_bytes()[name.len() - 1];
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return Err(invalid("it must start and end with a letter or digit"));
    }
    Ok(())
}

/// A Kubernetes object name for a Lease (and the namespace part of `kubernetes://`): a DNS
/// subdomain, lower-case `[a-z0-9-]` labels separated by '.', at most 253 characters. The API
/// server would refuse anything else, but only after the lock had started.
pub fn validate_lease_name(name: &str) -> Result<()> {
    validate_dns_subdomain("Lease name", name)
}

/// A Kubernetes namespace: a DNS label, `[a-z0-9-]`, at most 63 characters.
pub fn validate_namespace(name: &str) -> Result<()> {
    validate_dns_subdomain("namespace", name)?;
    if name.len() > 63 || name.contains('.') {
        return Err(Error::InvalidName {
            what: "namespace",
            value: name.to_owned(),
            reason: "a namespace is one DNS label: at most 63 of [a-z0-9-]",
        });
    }
    Ok(())
}

fn validate_dns_subdomain(what: &'static str, name: &str) -> Result<()> {
    let invalid = |reason| Error::InvalidName {
        what,
        value: name.to_owned(),
        reason,
    };
    if name.is_empty() || name.len() > MAX_LOCK_NAME {
        return Err(invalid("it must be 1 to 253 characters"));
    }
    for label in name.split('.') {
        let bytes = label.as_bytes();
        let ok = !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-';
        if !ok {
            return Err(invalid(
                "it must be lower-case letters, digits and '-', in '.'-separated parts that start and end alphanumeric",
            ));
        }
    }
    Ok(())
}

/// A SQL identifier (table or schema name): `[A-Za-z_][A-Za-z0-9_]*`, at most 63 characters.
/// Validated identifiers are still quoted when spliced, see [`quote_sql_identifier`].
pub fn validate_sql_identifier(what: &'static str, ident: &str) -> Result<()> {
    let invalid = |reason| Error::InvalidName {
        what,
        value: ident.to_owned(),
        reason,
    };
    let mut bytes = ident.bytes();
    match bytes.next() {
        None => return Err(invalid("it is empty")),
        Some(b) if !(b.is_ascii_alphabetic() || b == b'_') => {
            return Err(invalid("it must start with a letter or '_'"));
        }
        _ => {}
    }
    if ident.len() > MAX_SQL_IDENTIFIER {
        return Err(invalid("it is longer than 63 characters"));
    }
    if !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(invalid("only letters, digits and '_' are allowed"));
    }
    Ok(())
}

/// Double-quote a validated SQL identifier (ANSI quoting; SQLite and PostgreSQL use it).
pub fn quote_sql_identifier(ident: &str) -> String {
    debug_assert!(validate_sql_identifier("identifier", ident).is_ok());
    format!("\"{ident}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_names() {
        assert_eq!(family_of("orders.keys.o-1"), Some("orders"));
        assert_eq!(family_of("orders.keyh.ab12"), Some("orders"));
        assert_eq!(family_of("orders"), None);
        assert_eq!(key_floor_row("orders"), "orders/floor");
        // `_` matches any one character unless escaped.
        assert_eq!(
            key_name_patterns("my_orders"),
            ["my|_orders.keys.%", "my|_orders.keyh.%"]
        );
    }

    #[test]
    fn lock_names() {
        for ok in ["a", "jobs", "nightly-report.v2", "A_b-9", &"x".repeat(253)] {
            assert!(validate_lock_name(ok).is_ok(), "{ok} should be valid");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a b",
            "a/b",
            "a:b",
            "a{b}",
            "é",
            "a\n",
            &"x".repeat(254),
        ] {
            assert!(
                validate_lock_name(bad).is_err(),
                "{bad:?} should be invalid"
            );
        }
    }

    #[test]
    fn sql_identifiers() {
        for ok in ["leasehold_locks", "_t", "T1", &"t".repeat(63)] {
            assert!(validate_sql_identifier("table", ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1t",
            "t-1",
            "t;drop table x",
            "t\"",
            "a.b",
            " t",
            &"t".repeat(64),
        ] {
            let err = validate_sql_identifier("table", bad).unwrap_err();
            assert!(err.to_string().contains("invalid table"), "{err}");
        }
        assert_eq!(quote_sql_identifier("locks"), "\"locks\"");
    }
}

/// The longest ZooKeeper path Leasehold accepts for a lock root.
const MAX_ZOOKEEPER_PATH: usize = 1024;

/// A ZooKeeper path from a user: absolute, no trailing slash, segments of letters, digits, '.',
/// '_' and '-' (never "." or ".."), and not under ZooKeeper's own `/zookeeper`.
pub fn validate_zookeeper_path(path: &str) -> Result<()> {
    let invalid = |reason| Error::InvalidName {
        what: "ZooKeeper path",
        value: path.to_owned(),
        reason,
    };
    let Some(rest) = path.strip_prefix('/') else {
        return Err(invalid("it must start with '/'"));
    };
    if path.len() > MAX_ZOOKEEPER_PATH {
        return Err(invalid("it is longer than 1024 characters"));
    }
    if rest.is_empty() {
        return Err(invalid(
            "the root itself cannot hold locks; name a path such as /leasehold",
        ));
    }
    for segment in rest.split('/') {
        if segment.is_empty() {
            return Err(invalid("it has an empty segment (// or a trailing /)"));
        }
        if segment == "." || segment == ".." {
            return Err(invalid("'.' and '..' are not allowed"));
        }
        if !segment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(invalid(
                "only letters, digits, '.', '_', '-' and '/' are allowed",
            ));
        }
    }
    if rest == "zookeeper" || rest.starts_with("zookeeper/") {
        return Err(invalid("/zookeeper belongs to ZooKeeper itself"));
    }
    Ok(())
}

#[cfg(test)]
mod zookeeper_path_tests {
    use super::validate_zookeeper_path;

    #[test]
    fn zookeeper_paths() {
        for good in ["/leasehold", "/team-a/locks", "/a.b/c_d"] {
            assert!(validate_zookeeper_path(good).is_ok(), "{good}");
        }
        for bad in [
            "leasehold",
            "/",
            "/a/",
            "//a",
            "/a/../b",
            "/a/./b",
            "/zookeeper",
            "/zookeeper/x",
            "/a b",
            "/a\u{0}",
        ] {
            assert!(validate_zookeeper_path(bad).is_err(), "{bad}");
        }
    }
}
