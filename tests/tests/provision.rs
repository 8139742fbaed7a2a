//! `leasehold-sidecar --provision`: creates the lock table idempotently, and a user without the
//! privilege to do so gets an error that names the missing privilege.

use std::process::Command;

use leasehold_e2e::{MariaDbServer, PostgresServer, sidecar_binary};
use sqlx::Connection;

fn provision(backend: &str) -> (i32, String, String) {
    provision_locks(backend, &[])
}

fn provision_locks(backend: &str, locks: &[&str]) -> (i32, String, String) {
    let out = Command::new(sidecar_binary())
        .args(["--provision", "--backend", backend])
        .args(locks.iter().flat_map(|lock| ["--lock", lock]))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the sidecar");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn admin(url: &str, statements: &[&str]) {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(url).await.expect("admin");
        for statement in statements {
            sqlx::query(statement)
                .execute(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
    });
}

fn table_exists(url: &str, query: &str) -> bool {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
        sqlx::query(query).execute(&mut conn).await.is_ok()
    })
}

fn count(url: &str, query: &str) -> i64 {
    use sqlx::Row;
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
        let row = sqlx::query(query).fetch_one(&mut conn).await.expect(query);
        row.try_get::<i64, _>(0).expect("count")
    })
}

/// Row-lock mode: both tables, and one seeded row per named lock, however often it runs.
fn row_lock_provisioning_seeds_rows(url: &str) {
    let row_lock = format!("{url}?mode=row-lock");
    for _ in 0..2 {
        let (code, _, stderr) = provision_locks(&row_lock, &["jobs", "reports"]);
        assert_eq!(code, 0, "{stderr}");
    }
    let integer = if url.starts_with("postgres") {
        "BIGINT"
    } else {
        "SIGNED"
    };
    let rows = format!("SELECT CAST(COUNT(*) AS {integer}) FROM leasehold_locks_rows");
    assert_eq!(count(url, &rows), 2);
    let (code, _, stderr) = provision_locks(&row_lock, &["bad name"]);
    assert_eq!(code, 2, "{stderr}");
}

leasehold_e2e::on_each_server! {
    row_lock_provisioning_seeds_rows:
    postgres_row_lock_provisioning_seeds_rows: PostgresServer,
    mariadb_row_lock_provisioning_seeds_rows: MariaDbServer,
}

#[test]
fn postgres_provisioning_is_idempotent_and_names_missing_privileges() {
    let pg = PostgresServer::start();
    let url = format!("{}?table=team_locks", pg.url());
    for _ in 0..2 {
        let (code, stdout, stderr) = provision(&url);
        assert_eq!(code, 0, "{stderr}");
        assert!(stdout.contains("provisioned"), "{stdout}");
    }
    assert!(table_exists(
        &pg.url(),
        "SELECT name, holder, token, expires_at FROM team_locks"
    ));

    // PostgreSQL 15 gives new roles no CREATE on the public schema.
    admin(&pg.url(), &["CREATE ROLE app LOGIN PASSWORD 's3cret-pw'"]);
    let denied = format!("postgres://app:s3cret-pw@127.0.0.1:{}/postgres", pg.port());
    let (code, _, stderr) = provision(&denied);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("missing privilege"), "{stderr}");
    assert!(
        stderr.contains("permission denied for schema public"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cret-pw"),
        "the password leaked: {stderr}"
    );
}

#[test]
fn mariadb_provisioning_is_idempotent_and_names_missing_privileges() {
    let db = MariaDbServer::start();
    for _ in 0..2 {
        let (code, _, stderr) = provision(&db.url());
        assert_eq!(code, 0, "{stderr}");
    }
    assert!(table_exists(
        &db.url(),
        "SELECT name, holder, token, expires_at FROM leasehold_locks"
    ));

    admin(
        &db.url(),
        &[
            "CREATE USER 'app'@'%' IDENTIFIED BY 's3cret-pw'",
            "CREATE USER 'app'@'localhost' IDENTIFIED BY 's3cret-pw'",
            "GRANT SELECT ON leasehold.* TO 'app'@'%'",
            "GRANT SELECT ON leasehold.* TO 'app'@'localhost'",
        ],
    );
    let denied = format!(
        "mysql://app:s3cret-pw@127.0.0.1:{}/leasehold?table=other_locks",
        db.port()
    );
    let (code, _, stderr) = provision(&denied);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("missing privilege"), "{stderr}");
    assert!(stderr.contains("CREATE command denied"), "{stderr}");
    assert!(
        !stderr.contains("s3cret-pw"),
        "the password leaked: {stderr}"
    );
}
