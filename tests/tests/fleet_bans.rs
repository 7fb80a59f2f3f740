//! Fleet-wide bans. First the fleet's ban store on a real standalone server and a real
//! 3-master cluster; then real agents (each on a veth of its own in one namespace, with its own
//! pins) sharing one real redis-server in that namespace: a ban or unban on one agent reaches
//! another's kernel ban map within a second, an agent started later has the bans in force
//! before it reports ready, and authentication failures escalate across agents.

use std::{
    net::IpAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use limiter::{
    datapath::kernel_keys::key_address,
    fleet::{BanChange, FleetBans, LogId, Redis, RedisTarget},
};
use limiter_tests::{
    agent::{AgentProcess, PinDir, http_in},
    netns::{Netns, unique_name},
    redis::{RedisCluster, RedisServer},
};

fn bans(url: &str, origin: &str) -> FleetBans {
    let redis = Redis::connect(&RedisTarget::parse(url).unwrap()).unwrap();
    FleetBans::new(redis, "limiter", origin.to_owned())
}

/// Reads `reader`'s log from `after` until it has a change (bounded).
async fn next_changes(reader: &FleetBans, after: LogId) -> (Vec<BanChange>, LogId) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut after = after;
    loop {
        let (changes, next) = reader.read_log(after).await.unwrap();
        if !changes.is_empty() {
            return (changes, next);
        }
        assert!(Instant::now() < deadline, "no change in the log within 5 s");
        after = next;
    }
}

async fn the_log_carries_bans_and_unbans_to_the_other_agents(url: &str) {
    let a = bans(url, "agent-a");
    let b = bans(url, "agent-b");
    let start = b.in_force().await.unwrap();
    assert!(start.bans.is_empty());
    let addr: IpAddr = "192.0.2.7".parse().unwrap();
    a.ban(addr, Duration::from_secs(600)).await.unwrap();
    let (changes, next) = next_changes(&b, start.last).await;
    let [BanChange::Ban(banned, ttl)] = changes[..] else {
        panic!("{changes:?}");
    };
    assert_eq!(banned, addr);
    assert!(
        ttl > Duration::from_secs(595) && ttl <= Duration::from_secs(600),
        "{ttl:?}"
    );
    // The agent that made it skips its own entry: it enforced the ban already.
    let (own, _) = a.read_log(start.last).await.unwrap();
    assert!(own.is_empty(), "{own:?}");
    let in_force = b.in_force().await.unwrap();
    assert_eq!(in_force.bans.len(), 1);
    assert_eq!(in_force.last, next);
    // An IPv4-mapped address is the IPv4 address it maps.
    assert!(a.unban("::ffff:192.0.2.7".parse().unwrap()).await.unwrap());
    let (changes, _) = next_changes(&b, next).await;
    assert_eq!(changes, vec![BanChange::Unban(addr)]);
    assert!(b.in_force().await.unwrap().bans.is_empty());
    assert!(!a.unban(addr).await.unwrap(), "no ban left to lift");

    // Failures counted by two agents add up, and the crossing one is told so once.
    let rule = (Duration::from_secs(60), 3, Duration::from_secs(600));
    let counts = [
        a.count_failure(addr, rule.0, rule.1, rule.2).await.unwrap(),
        b.count_failure(addr, rule.0, rule.1, rule.2).await.unwrap(),
        a.count_failure(addr, rule.0, rule.1, rule.2).await.unwrap(),
        b.count_failure(addr, rule.0, rule.1, rule.2).await.unwrap(),
        b.count_failure(addr, rule.0, rule.1, rule.2).await.unwrap(),
    ];
    assert_eq!(counts, [1, 2, 3, 4, 5]);
    // An unban starts the count afresh.
    a.unban(addr).await.unwrap();
    assert_eq!(
        b.count_failure(addr, rule.0, rule.1, rule.2).await.unwrap(),
        1
    );
}

#[tokio::test]
async fn the_ban_store_on_one_server_and_on_a_cluster() {
    let server = RedisServer::start().unwrap();
    the_log_carries_bans_and_unbans_to_the_other_agents(&server.url()).await;
    let cluster = RedisCluster::start(3).unwrap();
    the_log_carries_bans_and_unbans_to_the_other_agents(&cluster.url()).await;
}

const STARTUP: Duration = Duration::from_secs(20);
const TOKEN: &str = "fleet-admin";

/// One namespace holding the fleet's Redis and its agents, each on a veth of its own (whose
/// peer sits in a namespace of its own), with its own pins, socket and HTTP port.
struct Fleet {
    ns: Netns,
    _peers: Vec<Netns>,
    ifaces: Vec<String>,
    pins: Vec<PinDir>,
    sockets: tempfile::TempDir,
    redis: RedisServer,
}

impl Fleet {
    fn new(agents: usize) -> Self {
        let ns = Netns::new("lfb").unwrap();
        let mut peers = Vec::new();
        let mut ifaces = Vec::new();
        for _ in 0..agents {
            let peer = Netns::new("lfp").unwrap();
            let iface = unique_name("lfa");
            let peer_if = unique_name("lfq");
            ns.exec(&[
                "ip",
                "link",
                "add",
                &iface,
                "type",
                "veth",
                "peer",
                "name",
                &peer_if,
                "netns",
                peer.name(),
            ])
            .unwrap();
            ns.exec(&["ip", "link", "set", &iface, "up"]).unwrap();
            peer.exec(&["ip", "link", "set", &peer_if, "up"]).unwrap();
            peers.push(peer);
            ifaces.push(iface);
        }
        let redis = RedisServer::start_in(&ns).unwrap();
        Self {
            pins: (0..agents).map(|_| PinDir::new()).collect(),
            sockets: tempfile::tempdir().unwrap(),
            ns,
            _peers: peers,
            ifaces,
            redis,
        }
    }

    fn socket(&self, i: usize) -> PathBuf {
        self.sockets.path().join(format!("agent-{i}.sock"))
    }

    fn http_port(i: usize) -> u16 {
        9100 + i as u16
    }

    /// Agent `i`, sharing the fleet's Redis; not waited for.
    fn start(&self, i: usize, args: &[&str]) -> AgentProcess {
        AgentProcess::builder(&self.ns, &self.ifaces[i], &self.pins[i])
            .socket(self.socket(i))
            .http(format!("127.0.0.1:{}", Self::http_port(i)))
            .args(["--redis", &self.redis.url(), "--admin-token", TOKEN])
            .args(args)
            .start()
            .expect("starting an agent")
    }

    fn agent(&self, i: usize, args: &[&str]) -> AgentProcess {
        let agent = self.start(i, args);
        agent.wait_for("limiter is ready", STARTUP).unwrap();
        agent
    }

    /// The addresses agent `i`'s kernel ban map holds.
    fn banned(&self, i: usize) -> Vec<IpAddr> {
        self.pins[i]
            .maps()
            .bans()
            .unwrap()
            .iter()
            .map(|(key, _)| key_address(key))
            .collect()
    }

    /// Polls agent `i`'s ban map until `addr` is (or is not) in it; the time it took, or
    /// `None` if not within `within`.
    fn wait_banned(
        &self,
        i: usize,
        addr: IpAddr,
        banned: bool,
        within: Duration,
    ) -> Option<Duration> {
        let start = Instant::now();
        loop {
            if self.banned(i).contains(&addr) == banned {
                return Some(start.elapsed());
            }
            if start.elapsed() > within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// One HTTP request to agent `i`, from a thread in the fleet's namespace; status 0 when
    /// nothing answers (yet).
    fn http(
        &self,
        i: usize,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, String) {
        let url = format!("http://127.0.0.1:{}{path}", Self::http_port(i));
        http_in(&self.ns, method, &url, Some(TOKEN), body).unwrap_or_default()
    }
}

const ONE_SECOND: Duration = Duration::from_secs(1);

#[test]
fn a_ban_on_one_agent_reaches_the_others_and_a_later_agent_before_it_is_ready() {
    let fleet = Fleet::new(3);
    let a = fleet.agent(0, &[]);
    let b = fleet.agent(1, &[]);
    let addr: IpAddr = "198.51.100.23".parse().unwrap();
    assert!(fleet.banned(1).is_empty());

    let (status, body) = fleet.http(
        0,
        reqwest::Method::POST,
        "/v1/bans",
        Some(serde_json::json!({"addr": addr.to_string(), "ttl": "10m"})),
    );
    assert_eq!(status, 200, "{body}");
    assert!(fleet.banned(0).contains(&addr), "enforced on A at once");
    let took = fleet.wait_banned(1, addr, true, ONE_SECOND);
    assert!(took.is_some(), "not on B within 1 s; B's log:\n{}", b.log());
    let left = fleet.pins[1].maps().bans().unwrap()[0].1;
    assert!(
        left > Duration::from_secs(590),
        "B keeps the ban's expiry: {left:?}"
    );

    // Agent C starts later: the ban is in its kernel map before /readyz first says 200.
    let c = fleet.start(2, &[]);
    let deadline = Instant::now() + STARTUP;
    loop {
        let (status, _) = fleet.http(2, reqwest::Method::GET, "/readyz", None);
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "C not ready; its log:\n{}",
            c.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        fleet.banned(2).contains(&addr),
        "C ready without the fleet's ban; its log:\n{}",
        c.log()
    );

    // An unban on B lifts it on A and C within a second.
    let (status, body) = fleet.http(
        1,
        reqwest::Method::DELETE,
        &format!("/v1/bans/{addr}"),
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert!(fleet.banned(1).is_empty());
    for i in [0, 2] {
        assert!(
            fleet.wait_banned(i, addr, false, ONE_SECOND).is_some(),
            "agent {i} still bans {addr} after 1 s"
        );
    }
    let (_, metrics) = fleet.http(0, reqwest::Method::GET, "/metrics", None);
    assert!(
        metrics.contains("limiter_fleet_ban_changes_total{change=\"sent\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("limiter_fleet_ban_changes_total{change=\"received\"} 1"),
        "{metrics}"
    );
    drop((a, b, c));
}

#[test]
fn authentication_failures_escalate_across_agents() {
    let fleet = Fleet::new(2);
    // Each agent alone sees at most 3 refusals, not more than its threshold of 3; the fleet
    // sees at least 4.
    let args = [
        "--auth-limit",
        "1",
        "--escalate-after",
        "3",
        "--escalate-ban",
        "10m",
    ];
    let agents: Vec<AgentProcess> = (0..2).map(|i| fleet.agent(i, &args)).collect();
    let addr: IpAddr = "203.0.113.77".parse().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let key = addr.to_string();
    runtime.block_on(async {
        for i in 0..2 {
            let client = limiter_client::Client::connect_unix(fleet.socket(i))
                .await
                .unwrap();
            let verdicts: Vec<bool> =
                futures::future::join_all((0..3).map(|_| client.check("auth", key.as_bytes(), 1)))
                    .await
                    .into_iter()
                    .map(|v| v.unwrap().allowed)
                    .collect();
            // At least 2 refused here (more when `auth` is shared across the fleet), and at
            // most 3: never more than this agent's own threshold.
            let refused = verdicts.iter().filter(|&&allowed| !allowed).count();
            assert!((2..=3).contains(&refused), "{verdicts:?}");
        }
    });
    for (i, agent) in agents.iter().enumerate() {
        assert!(
            fleet.wait_banned(i, addr, true, ONE_SECOND).is_some(),
            "agent {i} did not ban after the fleet's failures; its log:\n{}",
            agent.log()
        );
    }
}

#[test]
fn while_redis_is_down_bans_stay_local_and_are_counted_then_sharing_resumes() {
    let mut fleet = Fleet::new(2);
    let a = fleet.agent(0, &[]);
    let b = fleet.agent(1, &[]);
    fleet.redis.kill().unwrap();
    let lonely: IpAddr = "192.0.2.61".parse().unwrap();
    let (status, body) = fleet.http(
        0,
        reqwest::Method::POST,
        "/v1/bans",
        Some(serde_json::json!({"addr": lonely.to_string(), "ttl": "10m"})),
    );
    assert_eq!(status, 200, "a ban needs no Redis: {body}");
    assert!(fleet.banned(0).contains(&lonely), "enforced on A");
    a.wait_for("bans are enforced on this agent only", STARTUP)
        .unwrap();
    let deadline = Instant::now() + STARTUP;
    loop {
        let (_, metrics) = fleet.http(0, reqwest::Method::GET, "/metrics", None);
        if metrics.contains("limiter_fleet_ban_changes_total{change=\"send_failed\"} 1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lost change is not counted:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!fleet.banned(1).contains(&lonely), "B never heard of it");

    // Redis is back (empty: nothing persisted): both agents share again.
    fleet.redis.restart().unwrap();
    let shared: IpAddr = "192.0.2.62".parse().unwrap();
    let deadline = Instant::now() + STARTUP;
    loop {
        // A's writer may still be finding Redis again: ban until the change is sent.
        fleet.http(
            0,
            reqwest::Method::POST,
            "/v1/bans",
            Some(serde_json::json!({"addr": shared.to_string(), "ttl": "10m"})),
        );
        if fleet.wait_banned(1, shared, true, ONE_SECOND).is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B never got the ban after Redis came back; B's log:\n{}\nA's log:\n{}",
            b.log(),
            a.log()
        );
    }
    // A logged the way back once (B may not have noticed the outage at all: its reader
    // reconnects by itself and reads the new log from where it stood).
    a.wait_for("bans are shared again", STARTUP).unwrap();
}
