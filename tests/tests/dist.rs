//! The files in dist/ checked by the tools that will read them: the systemd unit by
//! `systemd-analyze verify`, the alert rules by `promtool check rules` and their unit test by
//! `promtool test rules`, and the dashboard's and rules' metric names against the README's
//! metrics table, so a renamed metric cannot leave a dashboard panel empty.

use std::{path::PathBuf, process::Command};

use limiter_tests::agent;

fn dist(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../dist")
        .join(path)
}

fn run(program: &str, args: &[&std::ffi::OsStr]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program} (installed by `cargo xtask setup`): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} {args:?} failed:\n{text}");
    text
}

#[test]
fn systemd_accepts_the_unit() {
    // verify checks that ExecStart exists, so the unit is verified with the agent under test
    // in /usr/bin/limiter's place; and that the man page is installed, which is the package
    // check's business (`cargo xtask test` unpacks the .deb and looks for it).
    let dir = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(dist("limiter.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/limiter "));
    let unit = unit.replace(
        "ExecStart=/usr/bin/limiter ",
        &format!("ExecStart={} ", agent::binary().display()),
    );
    let path = dir.path().join("limiter.service");
    std::fs::write(&path, unit).unwrap();
    let text = run(
        "systemd-analyze",
        &["verify".as_ref(), "--man=no".as_ref(), path.as_os_str()],
    );
    assert!(
        !text.contains("limiter.service:"),
        "systemd-analyze has remarks about the unit:\n{text}"
    );
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_test_passes() {
    run(
        "promtool",
        &[
            "check".as_ref(),
            "rules".as_ref(),
            dist("prometheus/alerts.yml").as_os_str(),
        ],
    );
    run(
        "promtool",
        &[
            "test".as_ref(),
            "rules".as_ref(),
            dist("prometheus/alerts_test.yml").as_os_str(),
        ],
    );
}

#[test]
fn dashboards_and_rules_use_only_documented_metrics() {
    let readme = std::fs::read_to_string(dist("../README.md")).unwrap();
    let documented: Vec<&str> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `limiter_"))
        .filter_map(|l| l.split('`').next())
        .collect();
    assert!(documented.len() > 10, "the README's metrics table moved");
    let dashboard = std::fs::read_to_string(dist("grafana/limiter.json")).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    assert!(parsed["panels"].as_array().is_some_and(|p| p.len() >= 6));
    let rules = std::fs::read_to_string(dist("prometheus/alerts.yml")).unwrap();
    for (name, text) in [("dashboard", &dashboard), ("alerts", &rules)] {
        for used in text.split("limiter_").skip(1) {
            let metric: String = used
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // Histograms are queried through their _bucket series.
            let base = metric.strip_suffix("_bucket").unwrap_or(&metric);
            assert!(
                documented.contains(&base),
                "the {name} uses limiter_{metric}, which the README does not list"
            );
        }
    }
}
