//! `--record`: each named section (all of them when none is named) runs in a process of its
//! own, its output shown as it comes and then written into `docs/benchmarks.md`, between the
//! section's markers (`<!-- bench:NAME -->` and `<!-- /bench:NAME -->`), under a line saying
//! when, from which commit and on what machine it was measured. The page's figures are thereby
//! always a run's output, never edited by hand. With `--repeat N` a section runs N times and
//! each figure is recorded as the lowest and highest of the N runs.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// Where the figures are recorded, from the repository's root (where `scripts/bench` runs).
pub(crate) const PAGE: &str = "docs/benchmarks.md";

/// The first line every run prints, left out of the record (the record's own line says more).
const BANNER: &str = "leasehold benchmark on ";

/// What `--record` was asked for.
#[derive(Debug, PartialEq)]
pub(crate) struct Recording<'a> {
    pub(crate) sections: Vec<&'a str>,
    pub(crate) repeat: usize,
}

/// `--record [--repeat N] [SECTION]...`, when the arguments start so; an error names what is
/// wrong with them.
pub(crate) fn parse<'a>(args: &[&'a str]) -> Option<Result<Recording<'a>, String>> {
    let rest = args.strip_prefix(&["--record"])?;
    Some(match rest {
        ["--repeat", n, sections @ ..] => match n.parse::<usize>() {
            Ok(repeat @ 1..=10) => Ok(Recording {
                sections: sections.to_vec(),
                repeat,
            }),
            _ => Err(format!(
                "--repeat {n:?}: expected a number of runs from 1 to 10"
            )),
        },
        sections => Ok(Recording {
            sections: sections.to_vec(),
            repeat: 1,
        }),
    })
}

/// Runs each section `repeat` times, each run a process of its own, and records its output
/// in [`PAGE`] as soon as the section is done, so that a run cut short keeps what it measured.
pub(crate) fn record(recording: &Recording, all_sections: &[&str]) -> Result<(), String> {
    let sections = if recording.sections.is_empty() {
        all_sections.to_vec()
    } else {
        recording.sections.clone()
    };
    let page = Path::new(PAGE);
    // A section without its markers is found before anything is measured.
    let text = std::fs::read_to_string(page).map_err(|e| format!("{PAGE}: {e}"))?;
    for section in &sections {
        replace_block(&text, section, "")?;
    }
    let exe = std::env::current_exe().map_err(|e| format!("this benchmark's path: {e}"))?;
    let provenance = provenance();
    for section in sections {
        let mut runs = Vec::new();
        for run in 1..=recording.repeat {
            if recording.repeat > 1 {
                println!("# {section}: run {run} of {}", recording.repeat);
            }
            runs.push(run_section(&exe, section)?);
        }
        let command = match recording.repeat {
            1 => format!("scripts/bench --record {section}"),
            n => format!("scripts/bench --record --repeat {n} {section}"),
        };
        let spread = match recording.repeat {
            1 => String::new(),
            n => format!("; each figure is the lowest and highest of {n} runs"),
        };
        let body = format!(
            "Recorded by `{command}` on {provenance}{spread}:\n\n```text\n{}\n```\n",
            merge_runs(&runs).join("\n")
        );
        let text = std::fs::read_to_string(page).map_err(|e| format!("{PAGE}: {e}"))?;
        let updated = replace_block(&text, section, &body)?;
        // Written beside it and renamed over it, so that an interrupted write cannot leave
        // the page cut short.
        let written = page.with_extension("md.recording");
        std::fs::write(&written, updated)
            .and_then(|()| std::fs::rename(&written, page))
            .map_err(|e| format!("{PAGE}: {e}"))?;
        println!("# {section}: recorded in {PAGE}");
    }
    Ok(())
}

/// One run of one section: its output lines, shown as they come.
fn run_section(exe: &Path, section: &str) -> Result<Vec<String>, String> {
    let mut child = Command::new(exe)
        .arg(section)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the {section} section: {e}"))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(|e| format!("reading the {section} section's output: {e}"))?;
        println!("{line}");
        if !line.starts_with(BANNER) {
            lines.push(line);
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("the {section} section: {e}"))?;
    if !status.success() {
        return Err(format!(
            "the {section} section failed ({status}); {PAGE} keeps its earlier figures"
        ));
    }
    Ok(lines)
}

/// When, from what and where: the date, the commit (and whether the tree had changes beside
/// it), and the machine's cores, memory, processor and kernel.
fn provenance() -> String {
    let run = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let date = run("date", &["-u", "+%Y-%m-%d"]).unwrap_or_else(|| "an unknown date".into());
    let commit = match run("git", &["rev-parse", "--short", "HEAD"]) {
        None => "an unknown commit".to_string(),
        Some(commit) => match run("git", &["status", "--porcelain", "--untracked-files=no"]) {
            // Documentation does not change a figure (and the page itself changes as sections
            // are recorded).
            Some(changes) if changes.lines().any(|l| !l.ends_with(".md")) => {
                format!("commit {commit} with uncommitted changes")
            }
            _ => format!("commit {commit}"),
        },
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            let kib: u64 = info
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(format!(", {:.0} GiB", kib as f64 / 1024.0 / 1024.0))
        })
        .unwrap_or_default();
    let processor = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            let name = info
                .lines()
                .find_map(|l| l.strip_prefix("model name"))?
                .trim_start_matches([' ', '\t', ':'])
                .trim()
                .to_string();
            Some(format!(", {name}"))
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|release| format!(", Linux {}", release.trim()))
        .unwrap_or_default();
    format!("{date} from {commit} ({cores} cores{memory}{processor}{kernel})")
}

/// `text` with the block of `section` (between its markers) holding `body` instead; an error
/// when the markers are missing or repeated.
pub(crate) fn replace_block(text: &str, section: &str, body: &str) -> Result<String, String> {
    let begin = format!("<!-- bench:{section} -->\n");
    let end = format!("<!-- /bench:{section} -->");
    let missing = || {
        format!(
            "{PAGE} has no block for the {section} section: add the lines `{}` and `{end}` \
             where its figures go",
            begin.trim_end()
        )
    };
    let start = text.find(&begin).ok_or_else(missing)? + begin.len();
    let stop = start + text[start..].find(&end).ok_or_else(missing)?;
    if text[stop..].matches(&end).count() > 1 || text.matches(&begin).count() > 1 {
        return Err(format!(
            "{PAGE} has more than one block for the {section} section"
        ));
    }
    Ok(format!("{}{body}{}", &text[..start], &text[stop..]))
}

/// The runs of one section as one output: where every run printed a line of the same words
/// (the figures aside), the line with each figure as its lowest and highest (`1.02–1.31`, or
/// one value where all runs agree); otherwise the last run's line.
pub(crate) fn merge_runs(runs: &[Vec<String>]) -> Vec<String> {
    let Some(last) = runs.last() else {
        return Vec::new();
    };
    if runs.iter().any(|run| run.len() != last.len()) {
        return last.clone();
    }
    (0..last.len())
        .map(|i| merge_line(runs.iter().map(|run| run[i].as_str())))
        .collect()
}

/// A line split into its words (between figures) and its figures. A figure is a decimal number
/// not glued to a name before it (`k1` is a word), with its sign when one stands before it
/// (`+0.05`, `-0.01`); a unit after it (`3s`, `0.78x`) is a word of its own.
fn split_figures(line: &str) -> (Vec<&str>, Vec<&str>) {
    let bytes = line.as_bytes();
    let (mut words, mut figures) = (Vec::new(), Vec::new());
    let (mut i, mut word_start) = (0, 0);
    while i < bytes.len() {
        let starts_figure = bytes[i].is_ascii_digit()
            && (i == 0
                || !(bytes[i - 1].is_ascii_alphanumeric()
                    || bytes[i - 1] == b'_'
                    || bytes[i - 1] == b'.'));
        if !starts_figure {
            i += 1;
            continue;
        }
        let signed = i > 0
            && matches!(bytes[i - 1], b'+' | b'-')
            && (i == 1 || matches!(bytes[i - 2], b' ' | b'(' | b'\t'));
        let start = if signed { i - 1 } else { i };
        let mut end = i;
        while end < bytes.len() && bytes[end].is_ascii_digit() {
            end += 1;
        }
        if end + 1 < bytes.len() && bytes[end] == b'.' && bytes[end + 1].is_ascii_digit() {
            end += 1;
            while end < bytes.len() && bytes[end].is_ascii_digit() {
                end += 1;
            }
        }
        words.push(&line[word_start..start]);
        figures.push(&line[start..end]);
        word_start = end;
        i = end;
    }
    words.push(&line[word_start..]);
    (words, figures)
}

fn merge_line<'a>(lines: impl Iterator<Item = &'a str> + Clone) -> String {
    let last = lines.clone().last().unwrap_or_default();
    let split: Vec<(Vec<&str>, Vec<&str>)> = lines.map(split_figures).collect();
    let (words, _) = &split[split.len() - 1];
    let same_words = split.iter().all(|(w, _)| {
        w.iter()
            .map(|s| s.trim())
            .eq(words.iter().map(|s| s.trim()))
    });
    if !same_words {
        return last.to_string();
    }
    let mut merged = String::new();
    for (k, word) in words.iter().enumerate() {
        merged.push_str(word);
        if k + 1 == words.len() {
            break;
        }
        let values: Vec<&str> = split.iter().map(|(_, f)| f[k]).collect();
        let key = |v: &&str| v.parse::<f64>().unwrap_or(f64::NAN);
        let low = values
            .iter()
            .min_by(|a, b| key(a).total_cmp(&key(b)))
            .expect("a run");
        let high = values
            .iter()
            .max_by(|a, b| key(a).total_cmp(&key(b)))
            .expect("a run");
        if key(low) == key(high) {
            merged.push_str(high);
        } else {
            merged.push_str(&format!("{low}–{high}"));
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arguments_ask_for_a_recording() {
        assert_eq!(parse(&["api"]), None);
        assert_eq!(
            parse(&["--record"]),
            Some(Ok(Recording {
                sections: vec![],
                repeat: 1
            }))
        );
        assert_eq!(
            parse(&["--record", "--repeat", "3", "api", "keyed"]),
            Some(Ok(Recording {
                sections: vec!["api", "keyed"],
                repeat: 3
            }))
        );
        assert!(matches!(
            parse(&["--record", "--repeat", "0"]),
            Some(Err(_))
        ));
        assert!(matches!(
            parse(&["--record", "--repeat", "x", "api"]),
            Some(Err(_))
        ));
    }

    #[test]
    fn a_block_is_replaced_and_nothing_else() {
        let page = "intro\n<!-- bench:api -->\nold\n<!-- /bench:api -->\nwhy\n\
                    <!-- bench:keyed -->\nkept\n<!-- /bench:keyed -->\n";
        let updated = replace_block(page, "api", "new\n").unwrap();
        assert_eq!(
            updated,
            "intro\n<!-- bench:api -->\nnew\n<!-- /bench:api -->\nwhy\n\
             <!-- bench:keyed -->\nkept\n<!-- /bench:keyed -->\n"
        );
        let missing = replace_block(page, "sql", "x").unwrap_err();
        assert!(
            missing.contains("no block for the sql section"),
            "{missing}"
        );
        let twice = format!("{page}<!-- bench:api -->\n<!-- /bench:api -->\n");
        assert!(replace_block(&twice, "api", "x").is_err());
    }

    #[test]
    fn runs_merge_into_each_figures_lowest_and_highest() {
        let runs = vec![
            vec![
                "## api (3s per run)".to_string(),
                "  redis 16 owner(s): 17302 cycles/s p50 0.440 ms 47% ratio".to_string(),
                "  over the call +0.086 ms, k1 -0.010 ms; achieved 0.78x".to_string(),
                "  seed 1 faults (kill 3)".to_string(),
            ],
            vec![
                "## api (3s per run)".to_string(),
                "  redis 16 owner(s): 16001 cycles/s p50 0.512 ms 47% ratio".to_string(),
                "  over the call -0.020 ms, k1 -0.005 ms; achieved 0.81x".to_string(),
                "  seed 2 faults (kill 3, pause 1)".to_string(),
            ],
        ];
        assert_eq!(
            merge_runs(&runs),
            vec![
                "## api (3s per run)",
                "  redis 16 owner(s): 16001–17302 cycles/s p50 0.440–0.512 ms 47% ratio",
                "  over the call -0.020–+0.086 ms, k1 -0.010–-0.005 ms; achieved 0.78–0.81x",
                "  seed 2 faults (kill 3, pause 1)",
            ]
        );
        // Runs that printed different lines are not merged: the last one stands.
        let uneven = vec![
            vec!["a 1".to_string()],
            vec!["a 2".to_string(), "b".to_string()],
        ];
        assert_eq!(merge_runs(&uneven), vec!["a 2", "b"]);
    }

    /// Every section has its one block in the page, so that a recording never stops for a
    /// missing one, and no block is left for a section that is gone.
    #[test]
    fn the_page_has_a_block_for_every_section() {
        let page =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(PAGE))
                .expect("the benchmarks page");
        for section in crate::SECTIONS {
            replace_block(&page, section, "").unwrap_or_else(|e| panic!("{e}"));
        }
        for line in page.lines() {
            let Some(name) = line
                .strip_prefix("<!-- bench:")
                .or_else(|| line.strip_prefix("<!-- /bench:"))
            else {
                continue;
            };
            let name = name.trim_end_matches(" -->");
            assert!(
                crate::SECTIONS.contains(&name),
                "{PAGE} has a marker of no section: {line}"
            );
        }
    }
}
