//! Lists and bans that last: `allow-file` / `deny-file` watched and applied while the agent
//! runs, bans and admin list entries kept in the state file across a restart (and the loss of
//! the pinned maps a reboot means), a corrupt state file that never stops the agent, and a
//! list of 100,000 CIDRs. The real binary on a veth in namespaces the test made.

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use limiter::api::ListKind;
use limiter_tests::{
    agent::{AgentProcess, PinDir, http_in},
    netns::{CLIENT_V4, Pair, SERVER_V4, Server, connect},
};
use nix::sys::signal::Signal;
use reqwest::Method;
use serde_json::json;

const TOKEN: &str = "s3cret";
const HTTP: &str = limiter_tests::agent::TEST_HTTP;

struct Setup {
    _peer: limiter::datapath::Datapath,
    pair: Pair,
    server: Server,
    pins: PinDir,
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Self {
        let pair = Pair::new().expect("namespaces");
        let server = Server::start(&pair.server, IpAddr::V4(SERVER_V4)).unwrap();
        Self {
            _peer: limiter_tests::kernel::peer(&pair).unwrap(),
            pair,
            server,
            pins: PinDir::new(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `limiter run` on the server's veth with this setup's pins and socket, refusing a
    /// denylisted or banned source with an RST so that a refusal shows at once.
    fn agent(&self, args: &[&str]) -> AgentProcess {
        AgentProcess::builder(&self.pair.server, &self.pair.server_if, &self.pins)
            .socket(self.path("limiter.sock"))
            .args([
                "--reject-deny",
                "rst",
                "--reject-ban",
                "rst",
                "--admin-token",
                TOKEN,
            ])
            .args(args)
            .ready()
            .expect("starting the agent")
    }

    /// Whether a new connection from the client is refused at once (the XDP RST).
    fn refused(&self) -> bool {
        match connect(&self.pair.client, IpAddr::V4(CLIENT_V4), self.server.addr).unwrap() {
            Ok(_) => false,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
                true
            }
        }
    }

    fn http(&self, method: Method, path: &str, body: Option<serde_json::Value>) -> (u16, String) {
        let url = format!("http://{HTTP}{path}");
        http_in(&self.pair.server, method, &url, Some(TOKEN), body).expect("the agent answers")
    }
}

/// Polls `check` until it holds, for at most `within`.
fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if check() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Saves `text` as an editor does: a new file renamed over the old one.
fn save_by_rename(path: &Path, text: &str) {
    let new = path.with_extension("new");
    std::fs::write(&new, text).unwrap();
    std::fs::rename(&new, path).unwrap();
}

#[test]
fn a_list_file_edited_while_running_takes_effect() {
    let s = Setup::new();
    let deny = s.path("deny.txt");
    std::fs::write(&deny, "# nobody yet\n").unwrap();
    let agent = s.agent(&["--deny-file", deny.to_str().unwrap()]);
    assert!(!s.refused());
    assert_eq!(s.pins.maps().list_entries(ListKind::Deny).unwrap(), 0);

    // Saved by rename: the watcher sees it, the trie takes it, the client is refused.
    save_by_rename(
        &deny,
        &format!("# the client\n{CLIENT_V4}/32\n198.51.100.0/24\n"),
    );
    agent
        .wait_for("list file applied", Duration::from_secs(10))
        .unwrap();
    assert_eq!(s.pins.maps().list_entries(ListKind::Deny).unwrap(), 2);
    assert_eq!(s.pins.maps().config().unwrap().has_deny, 1);
    assert!(s.refused());

    // A bad line: reported, and the last good entries stay in force.
    save_by_rename(&deny, &format!("{CLIENT_V4}/32\n10.77.0.300\n"));
    let line = agent
        .wait_for("last good entries stay in force", Duration::from_secs(10))
        .unwrap();
    assert!(line.contains("deny-file") && line.contains(":2:"), "{line}");
    assert!(s.refused());
    assert_eq!(s.pins.maps().list_entries(ListKind::Deny).unwrap(), 2);

    // Written in place, emptied: the client is let through again.
    std::fs::write(&deny, "").unwrap();
    assert!(
        eventually(Duration::from_secs(10), || s
            .pins
            .maps()
            .list_entries(ListKind::Deny)
            .unwrap()
            == 0),
        "{}",
        agent.log()
    );
    assert_eq!(s.pins.maps().config().unwrap().has_deny, 0);
    assert!(!s.refused());
}

#[test]
fn bans_and_admin_entries_survive_a_restart_and_the_loss_of_the_pins() {
    let s = Setup::new();
    let state = s.path("state.json");
    let state_arg = state.to_str().unwrap().to_owned();
    let mut agent = s.agent(&["--state-file", &state_arg]);
    let (status, body) = s.http(
        Method::POST,
        "/v1/bans",
        Some(json!({"addr": CLIENT_V4.to_string(), "ttl": "1h"})),
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = s.http(
        Method::POST,
        "/v1/allow",
        Some(json!({"cidr": "10.99.0.0/16"})),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = s.http(
        Method::POST,
        "/v1/deny",
        Some(json!({"cidr": "203.0.113.0/24"})),
    );
    assert_eq!(status, 201, "{body}");
    assert!(s.refused());
    agent.signal(Signal::SIGTERM);
    assert!(agent.wait_exit(Duration::from_secs(10)).unwrap().success());
    let saved = std::fs::read_to_string(&state).expect("the state file is written");
    assert!(saved.contains(&format!("{CLIENT_V4}/32")), "{saved}");

    // What a reboot leaves: no pinned maps, so no ban in the kernel; only the state file.
    limiter::datapath::detach(&s.pins.0, None).unwrap();
    assert!(!s.refused());
    let agent = s.agent(&["--state-file", &state_arg]);
    let log = agent.log();
    let line = log
        .lines()
        .find(|l| l.contains("state restored"))
        .expect("restored");
    assert!(
        line.contains("bans=1") && line.contains("entries=2"),
        "{log}"
    );
    let bans = s.pins.maps().bans().unwrap();
    assert_eq!(bans.len(), 1);
    assert!(bans[0].1 > Duration::from_secs(3500), "{bans:?}");
    assert!(s.refused());
    assert_eq!(s.pins.maps().list_entries(ListKind::Allow).unwrap(), 1);
    // Restored as admin entries: the admin API can remove them.
    let (status, body) = s.http(Method::DELETE, "/v1/allow?cidr=10.99.0.0/16", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"changed\":true"), "{body}");
    // An unban reaches the file too: the next agent does not bring the ban back.
    let (status, _) = s.http(Method::DELETE, &format!("/v1/bans/{CLIENT_V4}"), None);
    assert_eq!(status, 200);
    assert!(!s.refused());
    assert!(
        eventually(Duration::from_secs(5), || !std::fs::read_to_string(&state)
            .unwrap()
            .contains(&CLIENT_V4.to_string())),
        "{}",
        std::fs::read_to_string(&state).unwrap()
    );
}

#[test]
fn a_corrupt_state_file_is_reported_set_aside_and_the_agent_starts() {
    let s = Setup::new();
    let state = s.path("state.json");
    let garbage = "{\"version\":1,\"bans\":[{\"source\":\"10.77.0.2/32\",";
    std::fs::write(&state, garbage).unwrap();
    let agent = s.agent(&["--state-file", state.to_str().unwrap()]);
    assert!(
        agent.log().contains("state file is corrupt"),
        "{}",
        agent.log()
    );
    assert_eq!(
        std::fs::read_to_string(s.path("state.json.corrupt")).unwrap(),
        garbage
    );
    assert!(!s.refused());
    // And the agent keeps a good file from then on.
    let (status, _) = s.http(
        Method::POST,
        "/v1/bans",
        Some(json!({"addr": CLIENT_V4.to_string(), "ttl": "10m"})),
    );
    assert_eq!(status, 200);
    assert!(eventually(Duration::from_secs(5), || {
        std::fs::read_to_string(&state).is_ok_and(|t| t.contains("10.77.0.2/32"))
    }));
}

#[test]
fn a_hundred_thousand_cidrs_load_into_the_trie() {
    let s = Setup::new();
    let deny = s.path("deny.txt");
    // Every other address of 172.16.0.0/14 (nothing merges: 100,000 entries reach the trie)
    // and the client, then 65,536 neighbours that merge into one /16.
    let mut text: String = (0..100_000u32)
        .map(|i| format!("{}\n", Ipv4Addr::from(0xac10_0000 + 2 * i)))
        .collect();
    text.push_str(&format!("{CLIENT_V4} # the client\n"));
    text.extend((0..65_536u32).map(|i| format!("{}/32\n", Ipv4Addr::from(0xc0a8_0000 + i))));
    std::fs::write(&deny, text).unwrap();
    let _agent = s.agent(&["--deny-file", deny.to_str().unwrap()]);
    assert_eq!(s.pins.maps().list_entries(ListKind::Deny).unwrap(), 100_002);
    assert!(s.refused());
}
