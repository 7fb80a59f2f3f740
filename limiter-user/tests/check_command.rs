//! `limiter check` against a real agent socket: the verdict is printed and is the exit status.

use std::{collections::BTreeMap, process::Command, sync::Arc, time::Duration};

use limiter::{
    buckets::{ActionConfig, Limiter, LimiterConfig, MonotonicClock, NoBans, resolve_actions},
    protocol::Server,
    settings::ServeConfig,
};

fn limiter_check(socket: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_limiter"))
        .arg("check")
        .args(args)
        .arg("--socket")
        .arg(socket)
        .env("LIMITER_LOG", "off")
        .output()
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn quota_table() -> BTreeMap<String, ActionConfig> {
    #[derive(serde::Deserialize)]
    struct File {
        actions: BTreeMap<String, ActionConfig>,
    }
    toml::from_str::<File>("[actions.sends]\nkind = \"quota\"\nlimit = 5\n")
        .unwrap()
        .actions
}

#[test]
fn exit_status_is_the_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("limiter.sock");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let limiter = Arc::new(Limiter::new(
        LimiterConfig {
            actions: resolve_actions(&quota_table(), &[], false).unwrap(),
            escalation: None,
            mode: limiter::buckets::Enforcement::Enforce,
        },
        Arc::new(MonotonicClock::new()),
        Arc::new(NoBans),
    ));
    let server = runtime
        .block_on(Server::bind(&ServeConfig::unix(&socket), limiter))
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = runtime.spawn(server.run(async {
        let _ = stopped.await;
    }));

    let (code, out, _) = limiter_check(&socket, &["auth", "198.51.100.4", "--cost", "9"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("allowed remaining=1 limit=10"), "{out}");
    let (code, out, _) = limiter_check(&socket, &["auth", "198.51.100.4", "--cost", "2"]);
    assert_eq!(code, 1);
    assert!(out.starts_with("limited remaining=1"), "{out}");
    let (code, out, _) = limiter_check(&socket, &["auth", "198.51.100.4", "--cost", "11"]);
    assert_eq!(code, 1);
    assert!(
        out.contains("cost_exceeds_burst") && out.contains("retry_after_ms=never"),
        "{out}"
    );
    let (code, out, _) = limiter_check(&socket, &["sends", "tenant", "--cost", "5"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("allowed remaining=0 limit=5"), "{out}");
    let (code, out, _) = limiter_check(&socket, &["sends", "tenant", "--cost", "6"]);
    assert_eq!(code, 1);
    assert!(
        out.starts_with("cost_exceeds_limit remaining=0") && out.contains("retry_after_ms=never"),
        "{out}"
    );
    let (code, _, err) = limiter_check(&socket, &["nope", "x"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown action"), "{err}");
    let (code, _, err) = limiter_check(&dir.path().join("absent.sock"), &["auth", "198.51.100.4"]);
    assert_eq!(code, 2);
    assert!(err.contains("connecting"), "{err}");

    stop.send(()).unwrap();
    runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await })
        .unwrap()
        .unwrap();
}
