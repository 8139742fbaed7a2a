//! `docs/reference/metrics.md` against a binary's metrics: the names a query uses for what a text
//! exposition describes, and the names a section of the page's tables lists.

use std::collections::BTreeSet;

/// The names a query uses for each metric `exposition` describes (`# TYPE NAME KIND`): a
/// counter's with `_total`.
pub fn described(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter_map(|line| {
            let mut words = line.strip_prefix("# TYPE ")?.split_whitespace();
            let (name, kind) = (words.next()?, words.next()?);
            Some(match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

/// The metric names in the first column of the tables of `section`.
pub fn documented(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|row| row.strip_prefix("| `leasehold_"))
        .filter_map(|rest| rest.split('`').next())
        .map(|name| format!("leasehold_{name}"))
        .collect()
}
