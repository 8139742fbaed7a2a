//! `docs/reference/cli.md` lists exactly the flags the binary takes: the sidecar's table names every flag
//! `leasehold-sidecar --help` prints and no other, and the same for `exec`'s table and
//! `leasehold-sidecar exec --help`.

use std::collections::BTreeSet;
use std::process::Command;

/// The long flags `--help` prints for `args`, but `--help` and `--version`.
fn flags_in_help(args: &[&str]) -> BTreeSet<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar"))
        .args(args)
        .arg("--help")
        .output()
        .expect("run leasehold-sidecar");
    assert!(output.status.success(), "{args:?} --help failed");
    String::from_utf8(output.stdout)
        .expect("utf-8")
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let line = line
                .strip_prefix("-h, ")
                .or(line.strip_prefix("-V, "))
                .unwrap_or(line);
            line.starts_with("--").then(|| long_flag(line))
        })
        .filter(|flag| flag != "--help" && flag != "--version")
        .collect()
}

/// `--name` at the start of `text`.
fn long_flag(text: &str) -> String {
    let name: String = text[2..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    format!("--{name}")
}

/// The long flags named in the first column of the table rows of `section`.
fn flags_in_table(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter(|line| line.starts_with("| `--"))
        .flat_map(|row| {
            let first = row.split(" | ").next().unwrap_or_default();
            first
                .split('`')
                .skip(1)
                .step_by(2)
                // `-- COMMAND` is exec's command, not a flag.
                .filter(|code| {
                    code.strip_prefix("--")
                        .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_alphanumeric()))
                })
                .map(long_flag)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_cli_reference_lists_exactly_the_flags_the_binary_takes() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/reference/cli.md"
    ))
    .expect("docs/reference/cli.md");
    let (sidecar, exec) = page
        .split_once("## `leasehold-sidecar exec`")
        .expect("docs/reference/cli.md has its exec section");
    for (documented, args, what) in [
        (flags_in_table(sidecar), &[][..], "leasehold-sidecar"),
        (
            flags_in_table(exec),
            &["exec"][..],
            "leasehold-sidecar exec",
        ),
    ] {
        let printed = flags_in_help(args);
        assert!(!printed.is_empty(), "{what} --help printed no flags");
        let undocumented: Vec<_> = printed.difference(&documented).collect();
        let unknown: Vec<_> = documented.difference(&printed).collect();
        assert!(
            undocumented.is_empty() && unknown.is_empty(),
            "{what}: flags --help prints that docs/reference/cli.md does not list: {undocumented:?}; \
             flags docs/reference/cli.md lists that --help does not print: {unknown:?}"
        );
    }
}
