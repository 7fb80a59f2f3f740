//! The packaged `/etc/limiter.toml` (dist/limiter.toml) documents every setting, so it cannot
//! go stale: a new flag of `limiter run` fails this test until the file mentions it.

use clap::CommandFactory;
use limiter::cli::Cli;

const DIST_CONFIG: &str = include_str!("../../dist/limiter.toml");

#[test]
fn the_default_config_mentions_every_flag_of_limiter_run() {
    let command = Cli::command();
    let run = command
        .find_subcommand("run")
        .expect("limiter has a run subcommand");
    let missing: Vec<String> = run
        .get_arguments()
        .filter_map(|arg| arg.get_long())
        // As a commented-out key (`# name = `), or by flag name for the flag-only settings.
        .filter(|long| {
            !DIST_CONFIG.contains(&format!("# {long} = "))
                && !DIST_CONFIG.contains(&format!("--{long}"))
        })
        .map(|long| format!("--{long}"))
        .collect();
    assert!(
        missing.is_empty(),
        "dist/limiter.toml does not mention {missing:?}"
    );
}

#[test]
fn the_default_config_is_valid_toml_with_every_setting_commented_out() {
    let table: toml::Table = toml::from_str(DIST_CONFIG).unwrap();
    // Only the empty [broker] and [cluster] tables are live: the file changes nothing until
    // edited.
    assert_eq!(
        table.keys().collect::<Vec<_>>(),
        ["broker", "cluster"],
        "{table:?}"
    );
    for name in ["broker", "cluster"] {
        assert!(table[name].as_table().unwrap().is_empty(), "{name}");
    }
}
