//! The SQL backends' URLs: `sqlite://` and `postgres://` or `mysql://` (`mariadb://`), parsed
//! into their configs (table, schema and mode names validated) and shown with credentials
//! redacted.

use std::fmt;

use std::path::PathBuf;

use crate::drivers::sql::server::PEM_OPTIONS;
use crate::drivers::sql::sqlite::SqliteConfig;
use crate::drivers::sql::{Dialect, SqlConfig, SqlMode};
use crate::drivers::url_parts::{DEFAULT_TABLE, Login, invalid_url, query_pairs, server_url};
use crate::error::{Error, Result};
use crate::names::validate_sql_identifier;

impl SqliteConfig {
    /// `sqlite://PATH[?table=NAME]`.
    pub(crate) fn from_url(raw: &str, _scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() {
            return Err(invalid("the SQLite file path is empty".into()));
        }
        let mut table = DEFAULT_TABLE.to_owned();
        for (key, value) in query_pairs(query) {
            match key.as_str() {
                "table" => table = value,
                other => return Err(invalid(format!("unknown option {other:?}"))),
            }
        }
        validate_sql_identifier("table name", &table)?;
        Ok(SqliteConfig {
            path: PathBuf::from(path),
            table,
        })
    }
}

/// The file and the table.
impl fmt::Display for SqliteConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let SqliteConfig { path, table } = self;
        write!(f, "sqlite://{}?table={table}", path.display())
    }
}

/// A PostgreSQL or MySQL/MariaDB database as a resource names it.
pub struct SqlServer<'a> {
    pub dialect: Dialect,
    pub host: &'a str,
    /// The dialect's own port when absent.
    pub port: Option<u16>,
    pub database: &'a str,
    pub login: Login<'a>,
    /// `leasehold_locks` when absent.
    pub table: Option<&'a str>,
    /// PostgreSQL only: the schema of the table.
    pub schema: Option<&'a str>,
    pub mode: SqlMode,
    /// Options for the database driver (TLS: `sslmode`, `sslrootcert`, ...), in its own names.
    pub driver_options: Vec<(&'static str, String)>,
}

impl SqlConfig {
    /// The lock table of `server`.
    pub fn from_parts(server: SqlServer<'_>) -> Result<Self> {
        let SqlServer {
            dialect,
            host,
            port,
            database,
            login,
            table,
            schema,
            mode,
            driver_options,
        } = server;
        let scheme = match dialect {
            Dialect::Postgres => "postgres",
            Dialect::MySql => "mysql",
        };
        let endpoint = match port {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let mut url = server_url(scheme, &endpoint, login, "", "host")?;
        if matches!(database, "" | "." | "..") {
            return Err(Error::InvalidConfig {
                field: "database",
                reason: format!("{database:?} is not a database name"),
            });
        }
        url.path_segments_mut()
            .map_err(|()| Error::InvalidConfig {
                field: "host",
                reason: format!("bad host {host:?}"),
            })?
            .push(database);
        if !driver_options.is_empty() {
            url.query_pairs_mut().extend_pairs(driver_options);
        }
        if schema.is_some() && dialect == Dialect::MySql {
            return Err(Error::InvalidConfig {
                field: "schema",
                reason: "MySQL has no schemas inside a database; name the database instead".into(),
            });
        }
        Self::checked(SqlConfig {
            dialect,
            url,
            table: table.unwrap_or(DEFAULT_TABLE).to_owned(),
            schema: schema.map(str::to_owned),
            mode,
        })
    }

    /// `config` once its table, row table and schema are names SQL can quote.
    fn checked(config: SqlConfig) -> Result<Self> {
        validate_sql_identifier("table name", &config.table)?;
        if config.mode == SqlMode::RowLock {
            validate_sql_identifier(
                "row-lock table name (table + \"_rows\")",
                &crate::drivers::sql::row_table(&config.table),
            )?;
        }
        if let Some(schema) = &config.schema {
            validate_sql_identifier("schema name", schema)?;
        }
        Ok(config)
    }

    /// `postgres://`, `mysql://` or `mariadb://`; options Leasehold does not read go to the
    /// database driver, which must read them: one it would pass over (a misspelt `sslmode`,
    /// which would leave the connection without the TLS it asks for, or a libpq option it does
    /// not know, whose value it would log) is refused.
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        // Errors show the URL with any PEM text given inline hidden.
        let invalid = |reason: String| Error::InvalidUrl {
            url: crate::drivers::sql::server::shown_raw_url(raw),
            reason,
        };
        let dialect = if scheme.starts_with("postgres") {
            crate::drivers::sql::Dialect::Postgres
        } else {
            crate::drivers::sql::Dialect::MySql
        };
        let normalized = match scheme {
            "mariadb" => format!("mysql://{rest}"),
            _ => raw.to_owned(),
        };
        let mut url = url::Url::parse(&normalized).map_err(|e| invalid(e.to_string()))?;
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("the database host is missing".into()));
        }
        if url.path().trim_start_matches('/').is_empty() {
            return Err(invalid("the database name is missing (…/DATABASE)".into()));
        }
        let (mut table, mut schema) = (DEFAULT_TABLE.to_owned(), None);
        let mut mode = crate::drivers::sql::SqlMode::Lease;
        let mut passed_on = Vec::new();
        for (key, value) in url.query_pairs() {
            match &*key {
                "table" => table = value.into_owned(),
                "schema" if dialect == crate::drivers::sql::Dialect::Postgres => {
                    schema = Some(value.into_owned())
                }
                "schema" => {
                    return Err(invalid(
                        "MySQL has no schemas inside a database; put the database in the path"
                            .into(),
                    ));
                }
                "mode" => {
                    mode = crate::drivers::sql::SqlMode::parse(&value).ok_or_else(|| {
                        invalid(format!("mode must be lease or row-lock, got {value:?}"))
                    })?;
                }
                _ if driver_reads(dialect, &key) => {
                    passed_on.push((key.into_owned(), value.into_owned()))
                }
                _ => {
                    return Err(invalid(format!(
                        "{key:?} is not an option the database driver reads; it reads {}",
                        driver_options(dialect).join(", ")
                    )));
                }
            }
        }
        if passed_on.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(passed_on);
        }
        Self::checked(SqlConfig {
            dialect,
            url,
            table,
            schema,
            mode,
        })
    }
}

/// The URL options the database driver reads (sqlx's), beside Leasehold's own: the TLS files
/// it reads of [`PEM_OPTIONS`], then the rest.
fn driver_options(dialect: Dialect) -> Vec<&'static str> {
    let (not_read, others): (&[&str], &[&str]) = match dialect {
        Dialect::Postgres => (
            &["sslca"],
            &[
                "sslmode",
                "ssl-mode",
                "statement-cache-capacity",
                "host",
                "hostaddr",
                "port",
                "dbname",
                "user",
                "password",
                "application_name",
                "options",
                "options[NAME]",
            ],
        ),
        Dialect::MySql => (
            &["sslrootcert", "ssl-root-cert"],
            &[
                "sslmode",
                "ssl-mode",
                "charset",
                "collation",
                "statement-cache-capacity",
                "socket",
                "timezone",
                "time-zone",
            ],
        ),
    };
    let tls_files = PEM_OPTIONS.iter().filter(|o| !not_read.contains(o));
    tls_files.chain(others).copied().collect()
}

/// Whether the database driver reads the URL option `key`.
fn driver_reads(dialect: Dialect, key: &str) -> bool {
    driver_options(dialect).contains(&key)
        || (dialect == Dialect::Postgres && key.starts_with("options[") && key.ends_with(']'))
}

/// The database URL, redacted, with the table and the mode.
impl fmt::Display for SqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let SqlConfig {
            url,
            table,
            schema,
            mode,
            ..
        } = self;
        // PEM text given inline (from a Secret) is never shown; file paths are.
        write!(f, "{}", crate::drivers::sql::server::shown_url(url))?;
        match schema {
            Some(schema) => write!(f, " (table {schema}.{table}")?,
            None => write!(f, " (table {table}")?,
        }
        write!(f, ", {} mode)", mode.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_url::{BackendUrl, DEFAULT_BACKEND};

    #[test]
    fn sqlite_urls() {
        assert_eq!(
            BackendUrl::parse(DEFAULT_BACKEND).unwrap(),
            BackendUrl::Sqlite(SqliteConfig {
                path: "./leasehold.db".into(),
                table: DEFAULT_TABLE.into()
            })
        );
        assert_eq!(
            BackendUrl::parse("sqlite:///var/lib/l.db?table=my_locks").unwrap(),
            BackendUrl::Sqlite(SqliteConfig {
                path: "/var/lib/l.db".into(),
                table: "my_locks".into()
            })
        );
        for bad in [
            "sqlite://",
            "sqlite://x.db?table=a;drop",
            "sqlite://x.db?tabel=a",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }

    /// A Secret's key or certificate given inline is hidden wherever its PEM header starts (a
    /// key exported by `openssl pkcs12 -nodes` begins with "Bag Attributes"), as is any TLS
    /// option's value that is not a plain file name; a file name is shown.
    #[test]
    fn pem_text_given_inline_is_never_shown() {
        let encoded = |text: &str| -> String {
            url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
        };
        let key = "Bag Attributes\n    localKeyID: 01\n-----BEGIN PRIVATE KEY-----\nSECRETKEY\n-----END PRIVATE KEY-----\n";
        for (scheme, option) in [("postgres", "sslkey"), ("mysql", "ssl-key")] {
            let url = format!("{scheme}://u:pw@db/app?{option}={}", encoded(key));
            let shown = BackendUrl::parse(&url).unwrap().to_string();
            assert!(
                !shown.contains("SECRETKEY") && !shown.contains("Bag") && !shown.contains("pw"),
                "{shown}"
            );
            assert!(shown.contains(&format!("{option}=inline-pem")), "{shown}");
        }
        let url = format!(
            "postgres://db/app?sslrootcert={}&sslcert=%2Fetc%2Fclient.pem",
            encoded("no header\nSECRET")
        );
        let shown = BackendUrl::parse(&url).unwrap().to_string();
        assert!(
            !shown.contains("SECRET") && shown.contains("sslcert=%2Fetc%2Fclient.pem"),
            "{shown}"
        );
    }

    /// An option the database driver would pass over is refused: a misspelt `sslmode` would
    /// leave the connection without TLS, and sqlx logs an unknown PostgreSQL option's value.
    #[test]
    fn options_the_database_driver_does_not_read_are_refused() {
        for (url, option) in [
            ("postgres://db/app?sslmod=require", "sslmod"),
            ("postgres://db/app?sslpassword=hunter2", "sslpassword"),
            ("mysql://db/app?ssl-mod=REQUIRED", "ssl-mod"),
            (
                "mariadb://db/app?sslmode=REQUIRED&connect_timeout=3",
                "connect_timeout",
            ),
        ] {
            let error = BackendUrl::parse(url).unwrap_err().to_string();
            assert!(
                error.contains(&format!("{option:?} is not an option"))
                    && !error.contains("hunter2"),
                "{url}: {error}"
            );
        }
        // Refused with a key given inline: the error shows the URL without it.
        let key = url::form_urlencoded::byte_serialize(
            b"-----BEGIN PRIVATE KEY-----\nSECRETKEY\n-----END PRIVATE KEY-----\n",
        )
        .collect::<String>();
        let url = format!("postgres://u:pw@db/app?sslkey={key}&connect_timeout=3");
        let error = BackendUrl::parse(&url).unwrap_err().to_string();
        assert!(
            error.contains("sslkey=inline-pem") && !error.contains("SECRETKEY"),
            "{error}"
        );
        for url in [
            "postgres://db/app?sslmode=require&application_name=locks&options[search_path]=x",
            "mysql://db/app?ssl-mode=REQUIRED&charset=utf8mb4&timezone=%2B00:00",
        ] {
            assert!(BackendUrl::parse(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn sql_urls() {
        let pg = BackendUrl::parse(
            "postgres://app:pw@db:5432/app?schema=locking&table=locks&sslmode=require",
        )
        .unwrap();
        let BackendUrl::Sql(SqlConfig {
            dialect,
            url,
            table,
            schema,
            mode,
        }) = &pg
        else {
            panic!("not sql")
        };
        assert_eq!(*dialect, crate::drivers::sql::Dialect::Postgres);
        assert_eq!(
            (table.as_str(), schema.as_deref()),
            ("locks", Some("locking"))
        );
        assert_eq!(
            url.query(),
            Some("sslmode=require"),
            "driver options pass through"
        );
        assert!(!pg.to_string().contains("pw"), "{pg}");
        assert_eq!(*mode, crate::drivers::sql::SqlMode::Lease);
        let rows = BackendUrl::parse("postgres://db/app?mode=row-lock").unwrap();
        assert!(
            matches!(
                rows,
                BackendUrl::Sql(SqlConfig {
                    mode: crate::drivers::sql::SqlMode::RowLock,
                    ..
                })
            ),
            "{rows}"
        );
        let my = BackendUrl::parse("mariadb://root@127.0.0.1:3306/app").unwrap();
        assert_eq!(my.kind(), "mysql");
        for bad in [
            "postgres://db",
            "postgres:///app",
            "mysql://db/app?schema=x",
            "mysql://db/app?table=a-b",
            "postgres://db/app?schema=a;b",
            "postgres://db/app?mode=sometimes",
            // 60 + "_rows" is past the 63-character identifier limit.
            "postgres://db/app?mode=row-lock&table=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
