//! The agent's HTTP listener against a real agent: the programs loaded (attached nowhere; SYNs
//! are run through the XDP program with BPF_PROG_TEST_RUN so the maps hold real state), the
//! listener on a loopback port of its own, and requests from a real HTTP client. The operator
//! commands are run against the same listener, and against pinned maps with no agent.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use limiter::{
    api::ListKind,
    buckets::{
        ActionConfig, ActionKind, BanIncrement, Enforcement, EscalationConfig, KeyKind,
        LimiterConfig, Window, resolve_actions,
    },
    ops::{self, AdminConnect, Connect, Fallback},
    services::{
        http::{HttpError, HttpServer},
        sweeper::Sweeper,
    },
    settings::{CheckAccess, Settings},
};
use limiter_tests::{
    agent::PinDir,
    frames::Tcp,
    kernel::{TestAgent, XDP_DROP, XDP_PASS, XDP_TX},
};
use reqwest::Method;
use serde_json::{Value, json};

const TOKEN: &str = "correct horse battery staple";
const CHECK_TOKEN: &str = "dash-secret";
const PORT: u16 = 5672;

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))
}

fn v6(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// The broker limiter the tests configure: `export` (2 per minute, keyed by user), `auth`
/// closed (limit 0 on a security action), `sends` (a quota of 5 per UTC day), and escalation
/// to a kernel ban after one failure.
fn limiter_config() -> LimiterConfig {
    let mut table = BTreeMap::new();
    table.insert(
        "sends".to_owned(),
        ActionConfig {
            kind: Some(ActionKind::Quota),
            limit: Some(5),
            key: Some(KeyKind::User),
            ..ActionConfig::default()
        },
    );
    table.insert(
        "export".to_owned(),
        ActionConfig {
            limit: Some(2),
            window: Some(Window(Duration::from_secs(60))),
            key: Some(KeyKind::User),
            overrides: Some(BTreeMap::from([
                ("premium".to_owned(), 4),
                ("scraper".to_owned(), 1),
            ])),
            ..ActionConfig::default()
        },
    );
    table.insert(
        "auth".to_owned(),
        ActionConfig {
            limit: Some(0),
            ..ActionConfig::default()
        },
    );
    LimiterConfig {
        actions: resolve_actions(&table, &[], false).expect("valid actions"),
        escalation: Some(EscalationConfig {
            after: Some(1),
            refused_for: None,
            window: Duration::from_secs(60),
            ban: Duration::from_secs(600),
            increment: BanIncrement::OFF,
            max_addresses: 100,
        }),
        mode: Enforcement::Enforce,
    }
}

/// One HTTP answer, read in full.
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("{} is not JSON ({e}): {}", self.status, self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// A problem answer: its content type, and its detail naming `field`.
    fn assert_problem(&self, status: u16, needle: &str) {
        assert_eq!(self.status, status, "{}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let body = self.json();
        assert_eq!(body["status"], status);
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains(needle), "{needle:?} not in {detail:?}");
    }
}

/// A real agent serving HTTP on a free loopback port.
struct Harness {
    runtime: tokio::runtime::Runtime,
    agent: TestAgent,
    addr: SocketAddr,
    client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<Result<(), HttpError>>>,
}

impl Harness {
    fn new(flags: &[&str]) -> Self {
        Self::build(flags, None, true)
    }

    /// With a check token, which [`Harness::check`] presents.
    fn build(flags: &[&str], pin_dir: Option<PathBuf>, ready: bool) -> Self {
        let mut all = vec!["--check-token", CHECK_TOKEN];
        all.extend_from_slice(flags);
        Self::start(&all, limiter_config(), pin_dir, ready)
    }

    fn start(
        flags: &[&str],
        limiter: LimiterConfig,
        pin_dir: Option<PathBuf>,
        ready: bool,
    ) -> Self {
        // RSTs by XDP_TX: the tests read the action BPF_PROG_TEST_RUN returns.
        let mut all = vec!["--http", "127.0.0.1:0", "--rst-xdp-tx"];
        all.extend_from_slice(flags);
        let agent = limiter_tests::kernel::agent(&all, limiter, pin_dir);
        if ready {
            agent.set_ready();
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let server = runtime
            .block_on(HttpServer::bind(
                Arc::clone(&agent.enforcer),
                Arc::clone(&agent.limiter),
                agent.settings.clone(),
                &agent.sweep,
            ))
            .expect("binding the listener");
        let addr = server.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = runtime.spawn(server.run(async move {
            let _ = stopped.await;
        }));
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        Self {
            runtime,
            agent,
            addr,
            client,
            stop: Some(stop),
            server: Some(server),
        }
    }

    fn send(&self, method: Method, path: &str, token: Option<&str>, body: Option<Value>) -> Answer {
        let mut request = self
            .client
            .request(method, format!("http://{}{path}", self.addr));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        self.runtime.block_on(async {
            let response = request.send().await.expect("an answer");
            Answer {
                status: response.status().as_u16(),
                headers: response.headers().clone(),
                body: response.text().await.expect("a body"),
            }
        })
    }

    fn get(&self, path: &str) -> Answer {
        self.send(Method::GET, path, None, None)
    }

    fn check(&self, body: Value) -> Answer {
        self.send(Method::POST, "/v1/check", Some(CHECK_TOKEN), Some(body))
    }

    /// Runs a SYN from `src` through the XDP program, and if it passes the rest of its
    /// handshake; returns the SYN's XDP action.
    fn syn(&self, src: IpAddr, sport: u16) -> u32 {
        let dst = if src.is_ipv4() {
            IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1))
        } else {
            v6("2001:db8:ffff::1")
        };
        let syn = Tcp::syn(src, sport, dst, PORT);
        limiter_tests::kernel::connect_run(&self.agent.datapath(), &syn)
    }

    fn connect(&self) -> Connect {
        Connect {
            http: self.addr,
            timeout: Duration::from_secs(5),
        }
    }

    fn admin(&self, token: Option<&str>) -> AdminConnect {
        AdminConnect {
            connect: self.connect(),
            admin_token: token.map(str::to_owned),
        }
    }

    /// Stops the listener as the agent does at shutdown; returns what `run` returned.
    fn shut_down(mut self) -> Result<(), HttpError> {
        let _ = self.stop.take().unwrap().send(());
        let server = self.server.take().unwrap();
        self.runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), server).await })
            .expect("the listener stops within 10 s")
            .expect("the listener task")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = self
                .runtime
                .block_on(async { tokio::time::timeout(Duration::from_secs(10), server).await });
        }
    }
}

/// The samples of a text exposition, keyed `name{label="value",...}` with labels sorted.
/// The metric names the README's table documents, without `limiter_`: those of fleet mode, or
/// the others.
fn documented_metrics(fleet: bool) -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    readme
        .lines()
        .filter(|l| l.contains("fleet mode only") == fleet)
        // Series that exist only once something is monitored are not in a first scrape.
        .filter(|l| !l.contains("monitor mode only"))
        .filter_map(|l| l.strip_prefix("| `limiter_"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect()
}

fn samples(text: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("`series value`");
        let key = match series.split_once('{') {
            None => series.to_owned(),
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort_unstable();
                format!("{name}{{{}}}", labels.join(","))
            }
        };
        out.insert(key, value.parse().expect("a number"));
    }
    out
}

fn series(name: &str, labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return name.to_owned();
    }
    let mut labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    labels.sort_unstable();
    format!("{name}{{{}}}", labels.join(","))
}

fn value(samples: &HashMap<String, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let key = series(name, labels);
    *samples
        .get(&key)
        .unwrap_or_else(|| panic!("no sample {key}"))
}

#[test]
fn metrics_read_the_kernel_maps_the_sweeper_and_the_broker_limiter_at_scrape_time() {
    let h = Harness::new(&["--max-conn-per-ip", "2", "--flow-table-size", "1024"]);
    for sport in [40_001, 40_002] {
        assert_eq!(h.syn(v4(10), sport), XDP_PASS);
    }
    assert_eq!(h.syn(v4(10), 40_003), XDP_TX, "over the cap: RST");
    assert_eq!(h.syn(v6("2001:db8::7"), 40_004), XDP_PASS);
    h.agent
        .sweep_pass(&mut Sweeper::new(), &h.agent.settings().sweep)
        .expect("a sweep pass");
    for _ in 0..3 {
        h.check(json!({"action": "export", "key": "alice"}));
    }
    h.agent.limiter.report_auth_failure(v4(99));
    h.agent.limiter.report_auth_failure(v4(99));

    let answer = h.get("/metrics");
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.header("content-type"),
        Some("text/plain; version=0.0.4")
    );
    let text = &answer.body;
    for name in [
        "limiter_packets_total",
        "limiter_connections",
        "limiter_tracked_sources",
        "limiter_flow_table_entries",
        "limiter_flow_table_capacity",
        "limiter_evictions_total",
        "limiter_drift_repairs_total",
        "limiter_bans_active",
        "limiter_sweep_duration_seconds",
        "limiter_build_info",
        "limiter_rate_limit_checks_total",
        "limiter_rate_limit_blocked_total",
        "limiter_rate_limit_keys",
        "limiter_escalation_bans_total",
        "limiter_flow_events_total",
        "limiter_refused_connections_total",
    ] {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "no help for {name}"
        );
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "no type for {name}"
        );
    }
    let s = samples(text);
    assert_eq!(value(&s, "limiter_maps_readable", &[]), 1.0);
    let top = [("profile", "default")];
    assert_eq!(value(&s, "limiter_connections", &top), 3.0);
    assert_eq!(value(&s, "limiter_tracked_sources", &[]), 2.0);
    assert_eq!(value(&s, "limiter_flow_table_entries", &[]), 3.0);
    assert_eq!(value(&s, "limiter_flow_table_capacity", &[]), 1024.0);
    let packets = |direction, verdict, reason| {
        value(
            &s,
            "limiter_packets_total",
            &[
                ("direction", direction),
                ("verdict", verdict),
                ("reason", reason),
            ],
        )
    };
    assert_eq!(packets("ingress", "pass", "admitted"), 3.0);
    assert_eq!(packets("ingress", "rst", "conn_per_ip"), 1.0);
    // The host's three SYN-ACKs, which told the datapath the ISNs to expect.
    assert_eq!(packets("egress", "pass", "tracked"), 3.0);
    assert_eq!(
        value(&s, "limiter_flow_events_total", &[("event", "opened")]),
        3.0
    );
    assert_eq!(
        value(&s, "limiter_flow_events_total", &[("event", "released")]),
        0.0
    );
    // The sweep pass found nothing old enough to evict, and said so.
    assert_eq!(
        value(&s, "limiter_evictions_total", &[("kind", "half_open")]),
        0.0
    );
    assert_eq!(value(&s, "limiter_sweep_duration_seconds_count", &[]), 1.0);
    assert_eq!(value(&s, "limiter_drift_repairs_total", &[]), 0.0);
    assert_eq!(
        value(
            &s,
            "limiter_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    let checks = |outcome| {
        value(
            &s,
            "limiter_rate_limit_checks_total",
            &[("action", "export"), ("outcome", outcome)],
        )
    };
    assert_eq!((checks("allowed"), checks("limited")), (2.0, 1.0));
    assert_eq!(
        value(
            &s,
            "limiter_rate_limit_blocked_total",
            &[("action", "export")]
        ),
        1.0
    );
    assert_eq!(
        value(&s, "limiter_rate_limit_keys", &[("action", "export")]),
        1.0
    );
    // Two failures with escalation after one: one ban, placed in the kernel.
    assert_eq!(value(&s, "limiter_escalation_bans_total", &[]), 1.0);
    assert_eq!(value(&s, "limiter_bans_active", &[]), 1.0);

    // A later scrape reads the maps again: counters move, nothing is cached.
    assert_eq!(h.syn(v4(11), 40_005), XDP_PASS);
    let s = samples(&h.get("/metrics").body);
    assert_eq!(
        value(&s, "limiter_connections", &[("profile", "default")]),
        4.0
    );
    assert_eq!(
        value(
            &s,
            "limiter_packets_total",
            &[
                ("direction", "ingress"),
                ("verdict", "pass"),
                ("reason", "admitted")
            ]
        ),
        4.0
    );
}

#[test]
fn connections_lists_sources_largest_first_in_rfc_5952_form() {
    let h = Harness::new(&["--ipv6-prefix", "128"]);
    for sport in [41_001, 41_002, 41_003] {
        assert_eq!(
            h.syn(v6("2001:0db8:0000:0000:0000:0000:0000:0007"), sport),
            XDP_PASS
        );
    }
    for sport in [41_004, 41_005] {
        assert_eq!(h.syn(v4(20), sport), XDP_PASS);
    }
    assert_eq!(h.syn(v4(21), 41_006), XDP_PASS);

    let answer = h.get("/connections");
    assert_eq!(answer.status, 200);
    let body = answer.json();
    assert_eq!(body["connections"], 6);
    assert_eq!(body["tracked_sources"], 3);
    assert_eq!(
        body["sources"],
        json!([
            {"source": "2001:db8::7", "profile": "default", "connections": 3},
            {"source": "192.0.2.20", "profile": "default", "connections": 2},
            {"source": "192.0.2.21", "profile": "default", "connections": 1},
        ])
    );
    let body = h.get("/connections?limit=1").json();
    assert_eq!(body["sources"].as_array().unwrap().len(), 1);
    assert_eq!(body["tracked_sources"], 3);
    h.get("/connections?limit=0").assert_problem(400, "limit");
    h.get("/connections?limit=many")
        .assert_problem(400, "limit");
}

#[test]
fn rate_limits_show_limits_refusals_bans_and_broker_actions() {
    let h = Harness::new(&[
        "--max-conn-per-ip",
        "1",
        "--syn-rate",
        "50",
        "--ports",
        "5672",
        "--allow",
        "10.9.0.0/16",
        "--admin-token",
        TOKEN,
    ]);
    assert_eq!(h.syn(v4(30), 42_001), XDP_PASS);
    for sport in [42_002, 42_003] {
        assert_eq!(h.syn(v4(30), sport), XDP_TX);
    }
    assert_eq!(h.syn(v4(31), 42_004), XDP_PASS);
    assert_eq!(h.syn(v4(31), 42_005), XDP_TX);
    let ban = h.send(
        Method::POST,
        "/v1/bans",
        Some(TOKEN),
        Some(json!({"addr": "192.0.2.66", "ttl": "10m"})),
    );
    assert_eq!(ban.status, 200, "{}", ban.body);
    for _ in 0..4 {
        h.check(json!({"action": "export", "key": "bob"}));
    }
    h.check(json!({"action": "export", "key": "carol", "cost": 2}));
    h.check(json!({"action": "export", "key": "carol"}));

    let answer = h.get("/rate_limits");
    assert_eq!(answer.status, 200);
    let body = answer.json();
    assert_eq!(body["enabled"], true);
    let kernel = &body["kernel"];
    assert_eq!(kernel["limits"]["max_conn_per_ip"], 1);
    assert_eq!(kernel["limits"]["syn_rate"], 50);
    assert_eq!(kernel["limits"]["syn_burst"], 100);
    assert_eq!(kernel["limits"]["reject_conn"], "rst");
    assert_eq!(kernel["ports"], json!([5672]));
    assert_eq!(kernel["allow"], json!(["10.9.0.0/16"]));
    assert_eq!(
        kernel["top_blocked"]["conn_per_ip"],
        json!([
            {"source": "192.0.2.30", "blocked": 2},
            {"source": "192.0.2.31", "blocked": 1},
        ])
    );
    assert_eq!(kernel["top_blocked"]["syn_rate"], json!([]));
    assert_eq!(kernel["bans_active"], 1);
    assert_eq!(kernel["bans"][0]["source"], "192.0.2.66");
    let left = kernel["bans"][0]["expires_in_ms"].as_u64().unwrap();
    assert!((590_000..=600_000).contains(&left), "{left}");

    let actions = body["broker"]["actions"].as_array().unwrap();
    let export = actions.iter().find(|a| a["name"] == "export").unwrap();
    assert_eq!(export["mode"], "limited");
    assert_eq!(
        (export["limit"].clone(), export["window_ms"].clone()),
        (json!(2), json!(60_000))
    );
    assert_eq!(export["allowed"], 3);
    assert_eq!(export["limited"], 3);
    assert_eq!(
        export["top_blocked"],
        json!([{"key": "bob", "blocked": 2}, {"key": "carol", "blocked": 1}])
    );
    assert_eq!(export["kind"], "rate");
    let sends = actions.iter().find(|a| a["name"] == "sends").unwrap();
    assert_eq!(
        (sends["kind"].clone(), sends["window_ms"].clone()),
        (json!("quota"), json!(86_400_000))
    );
    let auth = actions.iter().find(|a| a["name"] == "auth").unwrap();
    assert_eq!(auth["mode"], "closed");
    assert_eq!(body["broker"]["escalation"]["after"], 1);
    assert_eq!(body["broker"]["escalation"]["ban_ms"], 600_000);

    let body = h.get("/rate_limits?limit=1").json();
    assert_eq!(
        body["kernel"]["top_blocked"]["conn_per_ip"],
        json!([{"source": "192.0.2.30", "blocked": 2}])
    );
    h.get("/rate_limits?limit=-3").assert_problem(400, "limit");
}

#[test]
fn a_keys_override_raises_or_lowers_its_limit_over_http() {
    let h = Harness::new(&[]);
    let admitted = |key: &str| {
        (0..10)
            .take_while(|_| h.check(json!({"action": "export", "key": key})).status == 200)
            .count()
    };
    assert_eq!(admitted("premium"), 4);
    assert_eq!(admitted("scraper"), 1);
    assert_eq!(admitted("gina"), 2);
    let answer = h.check(json!({"action": "premium", "key": "x"}));
    answer.assert_problem(404, "action");
    let answer = h.check(json!({"action": "export", "key": "premium"}));
    answer.assert_problem(429, "export");
    assert_eq!(answer.header("x-ratelimit-limit"), Some("4"));
    let actions = h.get("/rate_limits").json();
    let export = actions["broker"]["actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "export")
        .unwrap()
        .clone();
    assert_eq!(export["overrides"], 2, "{export}");
}

#[test]
fn in_monitor_mode_check_allows_says_what_enforcement_would_have_answered_and_counts_it() {
    let config = LimiterConfig {
        mode: Enforcement::Monitor,
        ..limiter_config()
    };
    let h = Harness::start(&["--check-token", CHECK_TOKEN], config, None, true);
    for _ in 0..2 {
        let answer = h.check(json!({"action": "export", "key": "hank"}));
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.json()["mode"], "monitor");
        assert_eq!(answer.json()["would_refuse"], Value::Null);
    }
    for _ in 0..3 {
        let answer = h.check(json!({"action": "export", "key": "hank"}));
        assert_eq!(answer.status, 200, "{}", answer.body);
        let body = answer.json();
        assert_eq!(
            (body["allowed"].clone(), body["outcome"].clone()),
            (json!(true), json!("allowed"))
        );
        assert_eq!(body["would_refuse"], "limited");
        assert_eq!(answer.header("retry-after"), None);
    }
    // The closed auth action too: judged closed, answered allowed.
    let answer = h.check(json!({"action": "auth", "key": "192.0.2.1"}));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["would_refuse"], "closed");
    let metrics = h.get("/metrics").body;
    for series in [
        r#"limiter_would_refuse_total{profile="action:export",reason="limited"} 3"#,
        r#"limiter_would_refuse_total{profile="action:auth",reason="closed"} 1"#,
        r#"limiter_rate_limit_blocked_total{action="export"} 3"#,
    ] {
        assert!(metrics.contains(series), "{series} in:\n{metrics}");
    }
    let actions = h.get("/rate_limits").json();
    let export = actions["broker"]["actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "export")
        .unwrap()
        .clone();
    assert_eq!(export["enforcement"], "monitor", "{export}");
}

#[test]
fn check_answers_429_with_retry_after_and_problem_details() {
    let h = Harness::new(&[]);
    for remaining in ["1", "0"] {
        let answer = h.check(json!({"action": "export", "key": "dave"}));
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-ratelimit-limit"), Some("2"));
        assert_eq!(answer.header("x-ratelimit-remaining"), Some(remaining));
        assert_eq!(answer.json()["outcome"], "allowed");
    }
    let answer = h.check(json!({"action": "export", "key": "dave"}));
    answer.assert_problem(429, "export");
    let body = answer.json();
    assert_eq!(body["reason"], "limited");
    // Two per minute: the next token comes within 30 s.
    let retry_ms = body["retry_after_ms"].as_u64().unwrap();
    assert!((29_000..=30_000).contains(&retry_ms), "{retry_ms}");
    let retry_after: u64 = answer.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(retry_after, retry_ms.div_ceil(1000));
    assert_eq!(answer.header("x-ratelimit-remaining"), Some("0"));
    let reset: u64 = answer.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert!((59..=60).contains(&reset), "{reset}");

    // Another key has its own bucket.
    assert_eq!(
        h.check(json!({"action": "export", "key": "erin"})).status,
        200
    );

    let answer = h.check(json!({"action": "export", "key": "frank", "cost": 3}));
    answer.assert_problem(422, "cost");
    assert_eq!(answer.json()["reason"], "cost_exceeds_burst");
    assert_eq!(answer.json()["retry_after_ms"], Value::Null);
    assert_eq!(answer.header("retry-after"), None);

    let answer = h.check(json!({"action": "auth", "key": "192.0.2.1"}));
    answer.assert_problem(429, "auth");
    assert_eq!(answer.json()["reason"], "closed");
    assert_eq!(answer.header("retry-after"), None);
    // Escalation is after one failure, yet a refusal over HTTP bans nobody: any local user can
    // reach this endpoint, and must not be able to get someone else's address banned.
    h.check(json!({"action": "auth", "key": "192.0.2.1"}));
    assert!(h.agent.with_maps(|m| m.bans()).unwrap().is_empty());

    h.check(json!({"action": "nope", "key": "x"}))
        .assert_problem(404, "action");
    h.check(json!({"action": "export", "key": "x", "cost": 0}))
        .assert_problem(400, "cost");
    h.check(json!({"action": "auth", "key": "not-an-address"}))
        .assert_problem(400, "key");
    h.check(json!({"action": "export"}))
        .assert_problem(400, "key");
    h.check(json!({"action": "export", "key": "x", "cost": -1}))
        .assert_problem(400, "cost");
    let answer = h.send(Method::POST, "/v1/check", Some(CHECK_TOKEN), None);
    assert_eq!(answer.status, 415, "{}", answer.body);
    // Unlimited actions carry no rate-limit headers.
    let answer = h.check(json!({"action": "publish", "key": "x"}));
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["outcome"], "unlimited");
    assert_eq!(answer.header("x-ratelimit-limit"), None);
}

/// Milliseconds from now to the next midnight UTC, by the wall clock.
fn until_midnight_utc_ms() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    86_400_000 - now % 86_400_000
}

#[test]
fn a_quota_is_answered_with_its_day_and_the_cost_it_can_never_fit() {
    let h = Harness::new(&[]);
    let answer = h.check(json!({"action": "sends", "key": "tenant", "cost": 4}));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-ratelimit-limit"), Some("5"));
    assert_eq!(answer.header("x-ratelimit-remaining"), Some("1"));
    let reset: u64 = answer.header("x-ratelimit-reset").unwrap().parse().unwrap();
    let midnight_s = until_midnight_utc_ms().div_ceil(1000);
    assert!(
        reset.abs_diff(midnight_s) <= 1,
        "{reset} s, midnight in {midnight_s} s"
    );

    // A batch of 2 does not fit the 1 left: refused until midnight, nothing spent.
    let answer = h.check(json!({"action": "sends", "key": "tenant", "cost": 2}));
    answer.assert_problem(429, "sends");
    let body = answer.json();
    assert_eq!(
        (body["reason"].clone(), body["remaining"].clone()),
        (json!("limited"), json!(1))
    );
    let retry_ms = body["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry_ms.abs_diff(until_midnight_utc_ms()) <= 1_000,
        "{retry_ms}"
    );
    let retry_after: u64 = answer.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(retry_after, retry_ms.div_ceil(1000));

    let answer = h.check(json!({"action": "sends", "key": "tenant", "cost": 6}));
    answer.assert_problem(422, "cost");
    assert_eq!(answer.json()["reason"], "cost_exceeds_limit");
    assert_eq!(answer.header("retry-after"), None);
    assert_eq!(
        h.check(json!({"action": "sends", "key": "tenant"})).status,
        200,
        "the one left"
    );
    let metrics = h.get("/metrics").body;
    for series in [
        "limiter_rate_limit_checks_total{action=\"sends\",outcome=\"allowed\"} 2",
        "limiter_rate_limit_checks_total{action=\"sends\",outcome=\"limited\"} 1",
        "limiter_rate_limit_checks_total{action=\"sends\",outcome=\"cost_exceeds_limit\"} 1",
        "limiter_rate_limit_keys{action=\"sends\"} 1",
    ] {
        assert!(metrics.contains(series), "{series} not in\n{metrics}");
    }
}

#[test]
fn admin_changes_need_the_configured_token_and_change_the_kernel() {
    let h = Harness::new(&["--admin-token", TOKEN, "--deny", "203.0.113.0/24"]);
    let banned = v4(77);
    let ban = json!({"addr": "192.0.2.77", "ttl": "10m"});
    for token in [None, Some("wrong"), Some("correct horse battery stapl")] {
        let answer = h.send(Method::POST, "/v1/bans", token, Some(ban.clone()));
        answer.assert_problem(401, "bearer token");
        assert_eq!(answer.header("www-authenticate"), Some("Bearer"));
    }
    // Without a token the body is not even read: a bad body still gets 401.
    h.send(Method::POST, "/v1/bans", None, Some(json!({"addr": 5})))
        .assert_problem(401, "bearer token");
    assert!(h.agent.with_maps(|m| m.bans()).unwrap().is_empty());
    assert_eq!(h.syn(banned, 43_001), XDP_PASS);

    let answer = h.send(Method::POST, "/v1/bans", Some(TOKEN), Some(ban));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["ttl_ms"], 600_000);
    assert_eq!(answer.json()["source"], "192.0.2.77");
    assert_eq!(h.syn(banned, 43_002), XDP_DROP, "banned: dropped");

    for (body, field) in [
        (json!({"addr": "192.0.2.0/24", "ttl": "1m"}), "addr"),
        (json!({"addr": "192.0.2.1", "ttl": "soon"}), "ttl"),
        (json!({"addr": "192.0.2.1", "ttl": "0s"}), "ttl"),
        (json!({"addr": "192.0.2.1"}), "ttl"),
    ] {
        h.send(Method::POST, "/v1/bans", Some(TOKEN), Some(body))
            .assert_problem(400, field);
    }
    assert_eq!(h.agent.with_maps(|m| m.bans()).unwrap().len(), 1);

    // The IPv4-mapped form names the same client.
    let answer = h.send(
        Method::DELETE,
        "/v1/bans/::ffff:192.0.2.77",
        Some(TOKEN),
        None,
    );
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["lifted"], true);
    assert_eq!(h.syn(banned, 43_003), XDP_PASS);
    let answer = h.send(Method::DELETE, "/v1/bans/192.0.2.77", Some(TOKEN), None);
    assert_eq!(answer.json()["lifted"], false);
    h.send(Method::DELETE, "/v1/bans/not-an-ip", Some(TOKEN), None)
        .assert_problem(400, "addr");

    let denied = v4(88);
    assert_eq!(h.syn(denied, 43_004), XDP_PASS);
    let add = |list: &str, cidr: &str| {
        h.send(
            Method::POST,
            &format!("/v1/{list}"),
            Some(TOKEN),
            Some(json!({ "cidr": cidr })),
        )
    };
    let answer = add("deny", "192.0.2.88/32");
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_eq!(answer.json()["changed"], true);
    assert_eq!(h.syn(denied, 43_005), XDP_DROP, "denylisted: dropped");
    assert_eq!(add("deny", "192.0.2.88").json()["changed"], false);
    add("deny", "192.0.2.1/24").assert_problem(400, "cidr");
    add("allow", "nonsense").assert_problem(400, "cidr");
    let answer = add("allow", "2001:0db8:0:0::/64");
    assert_eq!(answer.status, 201);
    assert_eq!(answer.json()["cidr"], "2001:db8::/64");
    assert!(
        h.agent
            .policy()
            .allow
            .contains(&"2001:db8::/64".parse().unwrap())
    );

    let del = |list: &str, cidr: &str| {
        h.send(
            Method::DELETE,
            &format!("/v1/{list}?cidr={}", cidr.replace('/', "%2F")),
            Some(TOKEN),
            None,
        )
    };
    assert_eq!(del("deny", "192.0.2.88/32").json()["changed"], true);
    assert_eq!(h.syn(denied, 43_006), XDP_PASS);
    assert_eq!(del("deny", "192.0.2.88/32").json()["changed"], false);
    del("deny", "203.0.113.0/24").assert_problem(409, "configuration");
    assert!(
        h.agent
            .policy()
            .deny
            .contains(&"203.0.113.0/24".parse().unwrap())
    );
    h.send(Method::DELETE, "/v1/allow", Some(TOKEN), None)
        .assert_problem(400, "cidr");
}

#[test]
fn admin_endpoints_are_off_without_a_configured_token() {
    let h = Harness::new(&[]);
    for (method, path, body) in [
        (
            Method::POST,
            "/v1/bans",
            Some(json!({"addr": "192.0.2.5", "ttl": "1m"})),
        ),
        (Method::DELETE, "/v1/bans/192.0.2.5", None),
        (
            Method::POST,
            "/v1/allow",
            Some(json!({"cidr": "10.0.0.0/8"})),
        ),
        (Method::DELETE, "/v1/deny?cidr=10.0.0.0%2F8", None),
    ] {
        h.send(method, path, Some(TOKEN), body)
            .assert_problem(403, "disabled");
    }
    assert!(h.agent.with_maps(|m| m.bans()).unwrap().is_empty());
    assert!(h.agent.policy().allow.is_empty());
}

#[test]
fn health_readiness_unknown_paths_and_graceful_shutdown() {
    let h = Harness::build(&[], None, false);
    assert_eq!(h.get("/healthz").status, 200);
    h.get("/readyz").assert_problem(503, "not attached");
    h.agent.set_ready();
    let answer = h.get("/readyz");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["status"], "ready");
    h.get("/nowhere").assert_problem(404, "no such endpoint");
    assert_eq!(h.send(Method::DELETE, "/metrics", None, None).status, 405);

    let addr = h.addr;
    h.shut_down().expect("the listener stops cleanly");
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err());
}

#[test]
fn the_listener_reports_a_port_in_use() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let agent = limiter_tests::kernel::agent(&["--http", addr.as_str()], limiter_config(), None);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let error = runtime
        .block_on(HttpServer::bind(
            Arc::clone(&agent.enforcer),
            Arc::clone(&agent.limiter),
            agent.settings.clone(),
            &agent.sweep,
        ))
        .err()
        .expect("the port is taken");
    assert!(matches!(error, HttpError::Bind { .. }), "{error}");
    assert!(error.to_string().contains(&addr), "{error}");
}

#[test]
fn operator_commands_talk_to_the_running_agent() {
    let h = Harness::new(&["--admin-token", TOKEN, "--max-conn-per-ip", "1"]);
    assert_eq!(h.syn(v6("2001:db8:0:0:1::9"), 44_001), XDP_PASS);
    assert_eq!(h.syn(v6("2001:db8::1:0:0:5"), 44_002), XDP_TX);
    let pin_dir = PathBuf::from("/nonexistent-limiter-pins");
    let fallback = Fallback {
        pin_dir: pin_dir.clone(),
        json: false,
    };

    let status = ops::StatusArgs {
        connect: h.connect(),
        fallback: fallback.clone(),
    }
    .output()
    .expect("status");
    assert!(
        status.contains(&format!("at {}, ready", h.addr)),
        "{status}"
    );
    assert!(
        status.contains("connections 1 open, from 1 sources"),
        "{status}"
    );
    assert!(status.contains("conn_per_ip 1"), "{status}");

    h.check(json!({"action": "sends", "key": "tenant", "cost": 6}))
        .assert_problem(422, "cost");
    let top = ops::TopArgs {
        connect: h.connect(),
        fallback: fallback.clone(),
        limit: 5,
    }
    .output()
    .expect("top");
    assert!(
        top.contains("sends (quota 5 per 1day, 1 refused in all)\n    tenant "),
        "{top}"
    );
    // Both addresses are in 2001:db8::/64, the default IPv6 source prefix, and the key is
    // shown as the network it stands for, not as one host.
    assert!(top.contains("2001:db8::/64"), "{top}");
    assert!(top.contains("conn_per_ip"), "{top}");

    let unused_pins = PathBuf::from("/sys/fs/bpf/limiter-no-such-pins");
    let text = ops::BanArgs {
        addr: v4(50),
        ttl: Duration::from_secs(90),
        admin: h.admin(Some(TOKEN)),
        pin_dir: unused_pins.clone(),
    }
    .output()
    .expect("ban");
    assert_eq!(text, "banned 192.0.2.50 (source 192.0.2.50) for 1m 30s\n");
    assert_eq!(h.syn(v4(50), 44_003), XDP_DROP);
    let error = ops::BanArgs {
        addr: v4(51),
        ttl: Duration::from_secs(90),
        admin: h.admin(Some("wrong")),
        pin_dir: unused_pins.clone(),
    }
    .output()
    .unwrap_err()
    .to_string();
    assert!(error.contains("401"), "{error}");
    assert_eq!(h.syn(v4(51), 44_004), XDP_PASS);

    let text = ops::UnbanArgs {
        addr: v4(50),
        admin: h.admin(Some(TOKEN)),
        pin_dir: unused_pins,
    }
    .output()
    .expect("unban");
    assert_eq!(text, "lifted the ban on 192.0.2.50 (source 192.0.2.50)\n");

    let entry = |cidr: &str| ops::ListEntry {
        cidr: cidr.to_owned(),
        admin: h.admin(Some(TOKEN)),
    };
    let text = ops::ListArgs {
        change: ops::ListChange::Add(entry("192.0.2.128/25")),
    }
    .output(ListKind::Deny)
    .expect("deny add");
    assert_eq!(text, "added 192.0.2.128/25 to the deny list\n");
    assert_eq!(h.syn(v4(200), 44_005), XDP_DROP);
    let text = ops::ListArgs {
        change: ops::ListChange::Del(entry("192.0.2.128/25")),
    }
    .output(ListKind::Deny)
    .expect("deny del");
    assert_eq!(text, "removed 192.0.2.128/25 from the deny list\n");
    let error = ops::ListArgs {
        change: ops::ListChange::Add(entry("10.0.0.1/8")),
    }
    .output(ListKind::Allow)
    .unwrap_err()
    .to_string();
    assert!(error.contains("400") && error.contains("cidr"), "{error}");
}

/// A loopback address nothing listens on.
fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

#[test]
fn operator_commands_read_pinned_maps_when_no_agent_answers() {
    let pins = PinDir::new();
    // The agent that pinned the maps: it serves nothing, as if it had exited.
    let h = Harness::build(&["--max-conn-per-ip", "1"], Some(pins.0.clone()), true);
    assert_eq!(h.syn(v4(60), 45_001), XDP_PASS);
    assert_eq!(h.syn(v4(60), 45_002), XDP_TX);
    let nobody = Connect {
        http: closed_port(),
        timeout: Duration::from_secs(2),
    };
    let status = ops::StatusArgs {
        connect: nobody.clone(),
        fallback: Fallback {
            pin_dir: pins.0.clone(),
            json: true,
        },
    }
    .output()
    .expect("status from the pinned maps");
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["version"], Value::Null);
    assert_eq!(status["connections"], 1);
    assert_eq!(status["limits"]["max_conn_per_ip"], 1);
    assert_eq!(status["refused"]["conn_per_ip"], 1);

    let top = ops::TopArgs {
        connect: nobody.clone(),
        fallback: Fallback {
            pin_dir: pins.0.clone(),
            json: false,
        },
        limit: 3,
    }
    .output()
    .expect("top from the pinned maps");
    assert!(top.contains("192.0.2.60"), "{top}");

    // Neither an agent nor pinned maps: a clear error naming both.
    let error = ops::StatusArgs {
        connect: nobody.clone(),
        fallback: Fallback {
            pin_dir: PathBuf::from("/sys/fs/bpf/limiter-no-such-pins"),
            json: false,
        },
    }
    .output()
    .unwrap_err()
    .to_string();
    assert!(error.contains("no agent answers"), "{error}");
    assert!(error.contains("limiter-no-such-pins"), "{error}");
    // Bans live in the kernel, so with no agent they go straight into the pinned map.
    let admin = AdminConnect {
        connect: nobody.clone(),
        admin_token: Some(TOKEN.into()),
    };
    let text = ops::BanArgs {
        addr: v4(61),
        ttl: Duration::from_secs(600),
        admin: admin.clone(),
        pin_dir: pins.0.clone(),
    }
    .output()
    .expect("ban in the pinned maps");
    assert_eq!(text, "banned 192.0.2.61 (source 192.0.2.61) for 10m\n");
    assert_eq!(
        h.syn(v4(61), 45_003),
        XDP_DROP,
        "the kernel enforces it at once"
    );
    let text = ops::UnbanArgs {
        addr: v4(61),
        admin: admin.clone(),
        pin_dir: pins.0.clone(),
    }
    .output()
    .expect("unban in the pinned maps");
    assert_eq!(text, "lifted the ban on 192.0.2.61 (source 192.0.2.61)\n");
    assert_eq!(h.syn(v4(61), 45_004), XDP_PASS);
    // List changes belong to the agent (a new one rewrites the lists from its configuration).
    let error = ops::ListArgs {
        change: ops::ListChange::Add(ops::ListEntry {
            cidr: "192.0.2.0/24".into(),
            admin,
        }),
    }
    .output(ListKind::Deny)
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("list changes need a running agent"),
        "{error}"
    );
    drop(h);
}

/// True if the agent closed `stream` within `within` (a read sees the end, or a reset).
fn closed_by_agent(mut stream: &TcpStream, within: Duration) -> bool {
    use std::io::Read;
    stream.set_read_timeout(Some(within)).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn ten_thousand_idle_connections_cannot_blind_health_metrics_or_checks() {
    const MAX: usize = 64;
    // The issue's figure. Loopback SYNs that find the accept queue full wait a second for
    // their retry, so the connections are made from many threads, whose waits overlap.
    const IDLE: usize = 10_000;
    const THREADS: usize = 50;
    let limit = limiter::run::raise_fd_limit().unwrap();
    assert!(
        limit >= IDLE as u64 + 1024,
        "the open-file hard limit ({limit}) is below the {IDLE} connections and some room"
    );
    // Long enough that only the cap, not the timeout, can save the listener.
    let h = Harness::new(&["--max-clients", "64", "--header-timeout", "1h"]);
    let addr = h.addr;
    let attackers: Vec<TcpStream> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                scope.spawn(move || {
                    (0..IDLE / THREADS)
                        .map(|i| {
                            let mut stream =
                                TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
                            if (t + i) % 2 == 1 {
                                // Half trickle: a request line, then nothing (the agent may
                                // have closed the connection already, to make room).
                                use std::io::Write;
                                let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\n");
                            }
                            (i * THREADS + t, stream)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<_> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        // Oldest first, as the agent accepted them (near enough).
        all.sort_by_key(|(n, _)| *n);
        all.into_iter().map(|(_, s)| s).collect()
    });
    let idle = attackers.len();
    let started = std::time::Instant::now();
    assert_eq!(h.get("/healthz").status, 200);
    assert_eq!(h.get("/metrics").status, 200);
    assert_eq!(
        h.check(json!({"action": "export", "key": "dashboard"}))
            .status,
        200
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The agent holds at most MAX of them: every other one has been closed (each eviction
    // completes before the next accept, so the FINs are already here), except those whose
    // last handshake ACK found the accept queue full: complete for the client, they reach
    // the queue only when the kernel resends its SYN-ACK.
    let closed = attackers
        .iter()
        .filter(|s| closed_by_agent(s, Duration::from_millis(20)))
        .count();
    assert!(closed >= idle - MAX - 256, "{closed} of {idle} closed");
    assert_eq!(idle, IDLE);
}

#[test]
fn silent_and_idle_http_connections_are_closed_after_the_header_timeout() {
    let h = Harness::new(&["--header-timeout", "300ms"]);
    let silent = TcpStream::connect(h.addr).unwrap();
    let mut idle = TcpStream::connect(h.addr).unwrap();
    {
        use std::io::{Read, Write};
        idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 12];
        idle.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        idle.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
    }
    assert!(closed_by_agent(&silent, Duration::from_secs(10)));
    // The rest of the first answer, then the end: the keep-alive wait is bounded too.
    let mut idle_closed = false;
    for _ in 0..64 {
        use std::io::Read;
        let mut buf = [0u8; 256];
        match idle.read(&mut buf) {
            Ok(0) | Err(_) => {
                idle_closed = true;
                break;
            }
            Ok(_) => {}
        }
    }
    assert!(idle_closed);
}

/// `auth` with one attempt a minute, so a spent attempt shows as the next one refused.
fn one_auth_a_minute() -> LimiterConfig {
    let mut table = BTreeMap::new();
    table.insert(
        "auth".to_owned(),
        ActionConfig {
            limit: Some(1),
            window: Some(Window(Duration::from_secs(60))),
            ..ActionConfig::default()
        },
    );
    LimiterConfig {
        actions: resolve_actions(&table, &[], false).expect("valid actions"),
        ..limiter_config()
    }
}

/// The attack an optional `check-token` left open: any local user spending a victim's `auth`
/// attempts over the loopback listener, locking the victim out of the broker. Unless the
/// operator opens it, the endpoint answers nobody until a check token is configured.
#[test]
fn by_default_check_refuses_every_caller_and_spends_nothing() {
    let h = Harness::start(&[], one_auth_a_minute(), None, true);
    let victim = json!({"action": "auth", "key": "192.0.2.77"});
    for token in [None, Some("guess"), Some(TOKEN)] {
        let answer = h.send(Method::POST, "/v1/check", token, Some(victim.clone()));
        answer.assert_problem(403, "check-token");
    }
    assert!(h.agent.with_maps(|m| m.bans()).unwrap().is_empty());
    // The broker's own check finds the victim's one attempt unspent.
    let verdict = h.agent.limiter.check("auth", b"192.0.2.77", 1).unwrap();
    assert!(verdict.allowed, "{verdict:?}");
}

#[test]
fn check_open_lets_every_local_caller_spend_as_before() {
    let h = Harness::start(&["--check-open"], one_auth_a_minute(), None, true);
    let victim = json!({"action": "auth", "key": "192.0.2.77"});
    let answer = h.send(Method::POST, "/v1/check", None, Some(victim.clone()));
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = h.send(Method::POST, "/v1/check", None, Some(victim));
    answer.assert_problem(429, "auth");
    assert!(
        !h.agent
            .limiter
            .check("auth", b"192.0.2.77", 1)
            .unwrap()
            .allowed
    );
}

#[test]
fn who_check_answers_changes_with_a_reload() {
    let h = Harness::start(&[], one_auth_a_minute(), None, true);
    let body = json!({"action": "auth", "key": "192.0.2.78"});
    let reload = |check: CheckAccess| {
        h.agent.settings.replace(Settings {
            check,
            ..h.agent.settings()
        });
    };
    reload(CheckAccess::Token(CHECK_TOKEN.into()));
    let answer = h.send(Method::POST, "/v1/check", None, Some(body.clone()));
    answer.assert_problem(401, "check token");
    assert_eq!(h.check(body.clone()).status, 200);
    reload(CheckAccess::Open);
    let answer = h.send(Method::POST, "/v1/check", None, Some(body.clone()));
    answer.assert_problem(429, "auth");
    reload(CheckAccess::Closed);
    h.check(body).assert_problem(403, "check-token");
}

#[test]
fn check_can_require_its_own_token() {
    let h = Harness::new(&["--admin-token", TOKEN]);
    let body = json!({"action": "export", "key": "carol"});
    let answer = h.send(Method::POST, "/v1/check", None, Some(body.clone()));
    answer.assert_problem(401, "check token");
    // The admin token is not the check token.
    let answer = h.send(Method::POST, "/v1/check", Some(TOKEN), Some(body.clone()));
    answer.assert_problem(401, "check token");
    let answer = h.send(Method::POST, "/v1/check", Some(CHECK_TOKEN), Some(body));
    assert_eq!(answer.status, 200, "{}", answer.body);
    // Nor does the check token guard anything else.
    assert_eq!(h.get("/healthz").status, 200);
}

#[test]
fn the_first_scrape_passes_promtool_and_has_every_documented_series_and_no_impossible_one() {
    let h = Harness::new(&[]);
    let answer = h.get("/metrics");
    assert_eq!(answer.status, 200);
    let text = &answer.body;
    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (cargo xtask setup installs it)");
    {
        use std::io::Write;
        promtool
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Every metric the README documents, from the first scrape (the fleet's are checked by
    // the fleet's test: this agent has no fleet).
    let documented = documented_metrics(false);
    assert!(documented.len() > 15, "{documented:?}");
    for name in documented {
        let name = format!("limiter_{name}");
        assert!(
            text.lines()
                .any(|l| !l.starts_with('#') && l.starts_with(name.as_str())),
            "{name} missing from the first scrape"
        );
    }
    let s = samples(text);
    for kind in ["closed", "over_cap", "half_open", "idle", "ban", "app_key"] {
        assert_eq!(value(&s, "limiter_evictions_total", &[("kind", kind)]), 0.0);
    }
    let packets: Vec<&String> = s
        .keys()
        .filter(|k| k.starts_with("limiter_packets_total{"))
        .collect();
    // 11 egress passes, 10 ingress passes (a plain segment is not counted), 15 ingress drops
    // (the refusals, the unreadable, what the host would discard, bad cookies and tunnels),
    // 7 ingress RSTs, 1 SYN answered with a cookie.
    assert_eq!(packets.len(), 44, "{packets:?}");
    for impossible in [
        r#"direction="egress",reason="tracked",verdict="rst""#,
        r#"direction="ingress",reason="admitted",verdict="drop""#,
        r#"direction="egress",reason="conn_per_ip",verdict="pass""#,
        r#"direction="ingress",reason="fragment",verdict="pass""#,
        r#"direction="egress",reason="half_open",verdict="pass""#,
        r#"direction="ingress",reason="segment",verdict="pass""#,
        r#"direction="ingress",reason="checksum",verdict="pass""#,
        r#"direction="egress",reason="martian_source",verdict="pass""#,
    ] {
        assert!(
            !packets.iter().any(|k| k.contains(impossible)),
            "{impossible} is exported"
        );
    }
}

#[test]
fn check_goes_to_the_fleets_redis_for_a_shared_action_and_status_and_metrics_say_so() {
    use limiter_tests::{fleet::FleetAgent, redis::RedisServer};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let redis = RedisServer::start().unwrap();
    // Two agents of one fleet: one checked over the broker socket, one over HTTP.
    let actions = "[actions.export]\nlimit = 3\nwindow = \"60s\"\nkey = \"user\"\n";
    let url = redis.url();
    let (other, fleet) = runtime.block_on(async {
        let start = || FleetAgent::start(&url, actions, Duration::from_secs(2), 2);
        (start().await.unwrap(), start().await.unwrap())
    });
    let agent = limiter_tests::kernel::agent(
        &["--http", "127.0.0.1:0", "--check-open"],
        limiter_config(),
        None,
    );
    agent.set_ready();
    let server = runtime
        .block_on(HttpServer::bind(
            Arc::clone(&agent.enforcer),
            Arc::clone(&fleet.limiter),
            agent.settings.clone(),
            &agent.sweep,
        ))
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = runtime.spawn(server.run(async move {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let post = |body: Value| {
        runtime.block_on(async {
            let response = http
                .post(format!("http://{addr}/v1/check"))
                .json(&body)
                .send()
                .await
                .unwrap();
            (
                response.status().as_u16(),
                response.json::<Value>().await.unwrap(),
            )
        })
    };
    // The other agent spends one of the three; this one gets the other two, then 429.
    let spent = runtime.block_on(async {
        other
            .client()
            .await
            .unwrap()
            .check("export", "alice", 1)
            .await
            .unwrap()
    });
    assert_eq!(spent.remaining, 2);
    for remaining in [1, 0] {
        let (status, body) = post(json!({"action": "export", "key": "alice"}));
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["remaining"], remaining);
    }
    let (status, body) = post(json!({"action": "export", "key": "alice"}));
    assert_eq!(status, 429, "{body}");
    assert!(
        (1..=20_000).contains(&body["retry_after_ms"].as_u64().unwrap()),
        "{body}"
    );
    let exists: i64 = redis
        .query(redis::cmd("EXISTS").arg("limiter:export:{alice}"))
        .unwrap();
    assert_eq!(exists, 1);
    let get = |path: &str| {
        runtime.block_on(async {
            http.get(format!("http://{addr}{path}"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
    };
    let status: Value = serde_json::from_str(&get("/v1/status")).unwrap();
    assert_eq!(status["fleet"]["redis_up"], true, "{status}");
    assert_eq!(status["fleet"]["fallback_checks"], 0, "{status}");
    assert_eq!(status["fleet"]["redis"], redis.url(), "{status}");
    let text = get("/metrics");
    let fleet_metrics = documented_metrics(true);
    assert_eq!(fleet_metrics.len(), 3, "{fleet_metrics:?}");
    for name in fleet_metrics {
        assert!(
            text.contains(&format!("\nlimiter_{name}")),
            "limiter_{name} missing"
        );
    }
    let metrics = samples(&text);
    assert_eq!(value(&metrics, "limiter_fleet_redis_up", &[]), 1.0);
    assert_eq!(value(&metrics, "limiter_fleet_fallback_total", &[]), 0.0);
    stop.send(()).unwrap();
    runtime.block_on(served).unwrap().unwrap();
}
