//! A benchmark's report: its figures as Markdown, printed, and with `--write` (`cargo xtask
//! bench SUITE --write`, which sets [`WRITE_ENV`]) put in `docs/benchmarks.md` in place of the
//! suite's previous section. The page holds only what a run wrote: when, where and how it was
//! measured, the table, and each target met or missed, so no figure there is edited by hand.
//! The same run writes the section's row of README's summary table (between its
//! `bench-summaries` markers), so the README's figures are never copied by hand either.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

use anyhow::{Context, Result};

/// The page a report writes its section of, when set.
pub const WRITE_ENV: &str = "LIMITER_BENCH_WRITE";

/// What the page says before any section.
const PAGE_HEADER: &str = "# Benchmarks\n\n\
Every section below is written by its benchmark from one run (`cargo xtask bench SUITE \
--write`), never by hand: the figures, the machine and the commit they were measured on, \
and whether each target was met. Each figure stands beside an anchor measured in the same \
run, and the ratio is what to compare: these machines are shared and their speed moves \
between runs.\n";

pub struct Report {
    /// The section's name in the page (one suite may write several).
    section: &'static str,
    suite: String,
    title: String,
    text: String,
    /// The headline figures, for README's summary row.
    summary: Vec<String>,
}

/// A cost target: a ratio a row must stay at or under.
#[derive(Clone, Copy)]
pub struct Target(pub f64);

impl Target {
    /// The table cell: the target and whether `ratio` meets it.
    pub fn judge(self, ratio: f64) -> String {
        let verdict = if ratio <= self.0 { "met" } else { "missed" };
        format!("≤ {} ({verdict})", self.0)
    }
}

/// A gain target: a ratio a row must reach or pass (how many times cheaper a case is).
#[derive(Clone, Copy)]
pub struct AtLeast(pub f64);

impl AtLeast {
    /// The table cell: the target and whether `ratio` meets it.
    pub fn judge(self, ratio: f64) -> String {
        let verdict = if ratio >= self.0 { "met" } else { "missed" };
        format!("≥ {} ({verdict})", self.0)
    }
}

impl Report {
    /// The report `section` of `suite` (the `cargo xtask bench` subcommand) under `title`;
    /// `method` says what is measured and how, in a paragraph of Markdown.
    pub fn new(section: &'static str, suite: &str, title: &str, method: &str) -> Report {
        let mut text = String::new();
        // An anchor of its own, so README's link does not depend on the title's wording.
        let _ = writeln!(
            text,
            "<a id=\"bench-{section}\"></a>\n\n## {title}\n\n{method}\n\n{}\n",
            provenance(suite)
        );
        Report {
            section,
            suite: suite.to_owned(),
            title: title.to_owned(),
            text,
            summary: Vec::new(),
        }
    }

    /// A headline figure for README's summary row (its figures and targets, briefly).
    pub fn summary(&mut self, figure: String) {
        self.summary.push(figure);
    }

    /// A table; each row has one cell per header.
    pub fn table(&mut self, headers: &[&str], rows: &[Vec<String>]) {
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let cells: Vec<&str> = cells.collect();
            format!("| {} |\n", cells.join(" | "))
        };
        self.text += &line(&mut headers.iter().copied());
        self.text += &line(&mut headers.iter().map(|_| "---"));
        for row in rows {
            self.text += &line(&mut row.iter().map(String::as_str));
        }
        self.text.push('\n');
    }

    /// A paragraph after the tables (what a figure means, a case cut short).
    pub fn note(&mut self, text: &str) {
        let _ = writeln!(self.text, "{text}\n");
    }

    /// Prints the report, and writes it into the page if [`WRITE_ENV`] names one.
    pub fn finish(self) -> Result<()> {
        print!("\n{}", self.text);
        let Some(page) = std::env::var_os(WRITE_ENV).map(PathBuf::from) else {
            return Ok(());
        };
        let old = match std::fs::read_to_string(&page) {
            Ok(old) => old,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => PAGE_HEADER.to_owned(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", page.display())),
        };
        let new = splice(&old, self.section, &self.text);
        write_atomically(&page, &new)?;
        println!("wrote the {} section of {}", self.section, page.display());
        let readme = page
            .parent()
            .and_then(Path::parent)
            .context("the page is not in a docs directory")?
            .join("README.md");
        let old = std::fs::read_to_string(&readme)
            .with_context(|| format!("reading {}", readme.display()))?;
        let new = summary_row(&old, self.section, &self.row())
            .with_context(|| format!("{} has no bench-summaries table", readme.display()))?;
        write_atomically(&readme, &new)?;
        println!("wrote its summary row in {}", readme.display());
        Ok(())
    }

    fn row(&self) -> String {
        format!(
            "| [{}](docs/benchmarks.md#bench-{}) | `cargo xtask bench {} --write` | {} |",
            in_a_row(&self.title),
            self.section,
            self.suite,
            if self.summary.is_empty() {
                "on the page".to_owned()
            } else {
                self.summary.join("; ")
            }
        )
    }
}

/// `readme` with the summary table's row for section `name` replaced by `row`, or added at
/// the table's end; `None` if README has no table between the markers.
fn summary_row(readme: &str, name: &str, row: &str) -> Option<String> {
    let (open, close) = ("<!-- bench-summaries -->", "<!-- /bench-summaries -->");
    let start = readme.find(open)? + open.len();
    let end = start + readme[start..].find(close)?;
    let link = format!("(docs/benchmarks.md#bench-{name})");
    let mut rows: Vec<&str> = readme[start..end]
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    match rows.iter().position(|l| l.contains(&link)) {
        Some(i) => rows[i] = row,
        None => rows.push(row),
    }
    Some(format!(
        "{}\n{}\n{}",
        &readme[..start],
        rows.join("\n"),
        &readme[end..]
    ))
}

/// `page` with the section `name` (between its markers) replaced by `text`, or appended if
/// the page has none.
fn splice(page: &str, name: &str, text: &str) -> String {
    let (open, close) = (
        format!("<!-- bench:{name} -->"),
        format!("<!-- /bench:{name} -->"),
    );
    let block = format!("{open}\n{text}{close}");
    match (page.find(&open), page.find(&close)) {
        (Some(start), Some(end)) if end > start => {
            format!("{}{block}{}", &page[..start], &page[end + close.len()..])
        }
        _ => format!("{}\n{block}\n", page.trim_end()),
    }
}

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("md.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
}

/// The line that says when, on what and from which commit the figures were measured, and
/// the command that measures them again.
fn provenance(suite: &str) -> String {
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    // `cargo xtask bench --write` checked the tree is this commit; a printed-only run says
    // whether it was.
    let commit = std::env::var("LIMITER_BENCH_COMMIT").unwrap_or_else(|_| described_commit());
    format!(
        "Measured {date} at commit `{commit}` on {cpus} CPUs ({cpu}), kernel {kernel}, by \
         `cargo xtask bench {suite}`."
    )
}

/// `git describe --dirty` of the tests' checkout, or "unknown".
fn described_commit() -> String {
    Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".to_owned(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        )
}

/// A title as a table row reads it: "Kernel datapath" as "kernel datapath", "A connection"
/// as "a connection"; an acronym ("SYN flood") keeps its case.
fn in_a_row(title: &str) -> String {
    let mut chars = title.chars();
    match (chars.next(), chars.clone().next()) {
        (Some(first), second) if !second.is_some_and(char::is_uppercase) => {
            first.to_lowercase().chain(chars).collect()
        }
        _ => title.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_title_in_a_row_starts_lowercase_but_for_an_acronym() {
        assert_eq!(in_a_row("Kernel datapath"), "kernel datapath");
        assert_eq!(
            in_a_row("A connection a cookie let in"),
            "a connection a cookie let in"
        );
        assert_eq!(
            in_a_row("SYN flood to a closed port"),
            "SYN flood to a closed port"
        );
        assert_eq!(in_a_row(""), "");
    }

    #[test]
    fn a_section_is_replaced_in_place_and_others_are_kept() {
        let page = splice(PAGE_HEADER, "kernel", "## K\n\nold\n");
        let page = splice(&page, "flood", "## F\n\nfloods\n");
        let page = splice(&page, "kernel", "## K\n\nnew\n");
        assert!(page.starts_with(PAGE_HEADER.trim_end()));
        assert!(page.contains("new") && !page.contains("old"), "{page}");
        assert!(page.find("## K").unwrap() < page.find("## F").unwrap());
        assert_eq!(page.matches("<!-- bench:kernel -->").count(), 1);
    }

    #[test]
    fn a_summary_row_is_replaced_in_place_or_added() {
        let readme = "# R\n\n<!-- bench-summaries -->\n| suite | command | summary |\n| --- | --- | --- |\n| [k](docs/benchmarks.md#bench-kernel) | c | old |\n<!-- /bench-summaries -->\n\nafter\n";
        let new = summary_row(
            readme,
            "kernel",
            "| [k](docs/benchmarks.md#bench-kernel) | c | new |",
        )
        .unwrap();
        assert!(new.contains("| new |") && !new.contains("| old |"), "{new}");
        let added = summary_row(
            &new,
            "app",
            "| [a](docs/benchmarks.md#bench-app) | c | app |",
        )
        .unwrap();
        let (kernel, app) = (
            added.find("bench-kernel").unwrap(),
            added.find("bench-app").unwrap(),
        );
        assert!(kernel < app && app < added.find("<!-- /bench-summaries -->").unwrap());
        assert!(added.ends_with("-->\n\nafter\n"), "{added}");
        assert_eq!(summary_row("no table", "app", "x"), None);
    }

    #[test]
    fn targets_say_whether_they_were_met() {
        assert_eq!(Target(1.3).judge(1.29), "≤ 1.3 (met)");
        assert_eq!(Target(4.0).judge(4.2), "≤ 4 (missed)");
        assert_eq!(AtLeast(3.0).judge(3.1), "≥ 3 (met)");
        assert_eq!(AtLeast(3.0).judge(1.7), "≥ 3 (missed)");
    }
}
