//! Real agents of one fleet: four `limiter run` processes, each enforcing an interface of a
//! namespace the test made (the veth to the client, the namespace's loopback, and the two ends
//! of a second veth inside it), all sharing one `redis-server` on that namespace's loopback.
//! Their brokers' checks go over each agent's own Unix socket, as a broker's do.

use std::time::Duration;

use limiter_client::{Client, Verdict};
use limiter_tests::{
    agent::{AgentProcess, PinDir},
    fleet::{assert_exactly, two_workers},
    netns::{Pair, unique_name},
    redis::RedisServer,
};

const STARTUP: Duration = Duration::from_secs(20);
const FAILED: &str = "Redis failed: shared checks are decided locally";
const ANSWERS: &str = "Redis answers: shared checks go to it again";

struct Agent {
    process: AgentProcess,
    socket: std::path::PathBuf,
    _pins: PinDir,
}

struct Fleet {
    agents: Vec<Agent>,
    redis: RedisServer,
    _sockets: tempfile::TempDir,
    _pair: Pair,
}

impl Fleet {
    /// Four agents on `auth` at 50 per minute, expecting four replicas: alone, each allows
    /// 12 of a key.
    fn start() -> Self {
        let pair = Pair::new().expect("namespaces");
        let (a, b) = (unique_name("fa"), unique_name("fb"));
        pair.server
            .exec(&["ip", "link", "add", &a, "type", "veth", "peer", "name", &b])
            .unwrap();
        for end in [&a, &b] {
            pair.server.exec(&["ip", "link", "set", end, "up"]).unwrap();
        }
        let redis = RedisServer::start_in(&pair.server).unwrap();
        let sockets = tempfile::tempdir().unwrap();
        let url = redis.url();
        let agents = [pair.server_if.as_str(), "lo", a.as_str(), b.as_str()]
            .into_iter()
            .enumerate()
            .map(|(i, iface)| {
                let pins = PinDir::new();
                let socket = sockets.path().join(format!("agent{i}.sock"));
                let http = format!("127.0.0.1:{}", 9_100 + i);
                let process = AgentProcess::builder(&pair.server, iface, &pins)
                    .socket(&socket)
                    .http(http)
                    .args([
                        "--xdp-mode",
                        "skb",
                        "--redis",
                        &url,
                        "--check-timeout",
                        "2s",
                    ])
                    .args(["--expected-replicas", "4", "--auth-limit", "50"])
                    .args(["--auth-window", "60s"])
                    .start()
                    .expect("starting the agent");
                process.wait_for("limiter is ready", STARTUP).unwrap();
                Agent {
                    process,
                    socket,
                    _pins: pins,
                }
            })
            .collect();
        Self {
            agents,
            redis,
            _sockets: sockets,
            _pair: pair,
        }
    }

    /// `per_agent` checks of `key` through each agent at once, each agent's pipelined on one
    /// connection.
    fn at_once(&self, key: &str, per_agent: usize) -> Vec<Vec<Verdict>> {
        two_workers().block_on(async {
            let mut clients = Vec::new();
            for agent in &self.agents {
                clients.push(Client::connect_unix(&agent.socket).await.unwrap());
            }
            let per_client = clients.iter().map(|client| async move {
                let checks = (0..per_agent).map(|_| client.check("auth", key, 1));
                futures::future::join_all(checks)
                    .await
                    .into_iter()
                    .map(Result::unwrap)
                    .collect::<Vec<_>>()
            });
            futures::future::join_all(per_client).await
        })
    }

    fn log_count(&self, agent: usize, needle: &str) -> usize {
        self.agents[agent]
            .process
            .log()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}

#[test]
fn four_real_agents_share_one_exact_limit_and_fall_back_to_their_shares_when_redis_dies() {
    let mut fleet = Fleet::start();
    // 200 checks at once through four agents at a limit of 50: exactly 50.
    let verdicts: Vec<Verdict> = fleet.at_once("192.0.2.1", 50).concat();
    assert_eq!(verdicts.len(), 200);
    assert_exactly(&verdicts, 50);
    let keys: Vec<String> = fleet.redis.query(redis::cmd("KEYS").arg("*")).unwrap();
    assert_eq!(keys, ["limiter:auth:{192.0.2.1}"]);

    // Redis dies: each agent says so once, and alone allows its share, 50 / 4 = 12.
    fleet.redis.kill().unwrap();
    for per_agent in fleet.at_once("192.0.2.2", 20) {
        assert_eq!(per_agent.iter().filter(|v| v.allowed).count(), 12);
        assert!(per_agent.iter().all(|v| v.limit == 12), "{per_agent:?}");
    }
    for agent in &fleet.agents {
        agent.process.wait_for(FAILED, STARTUP).unwrap();
    }

    // Redis comes back (empty): each agent says so once and shares the limit again.
    fleet.redis.restart().unwrap();
    for agent in &fleet.agents {
        agent.process.wait_for(ANSWERS, STARTUP).unwrap();
    }
    assert_exactly(&fleet.at_once("192.0.2.3", 50).concat(), 50);
    for i in 0..fleet.agents.len() {
        assert_eq!(fleet.log_count(i, FAILED), 1, "agent {i}");
        // At the start, and after the restart.
        assert_eq!(fleet.log_count(i, ANSWERS), 2, "agent {i}");
    }
}

#[test]
fn a_bad_redis_setting_exits_2_naming_it() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let mut agent = AgentProcess::builder(&pair.server, &pair.server_if, &pins)
        .args(["--redis", "redis+cluster://"])
        .start()
        .unwrap();
    let status = agent.wait_exit(STARTUP).unwrap();
    assert_eq!(status.code(), Some(2));
    assert!(agent.log().contains("cluster.redis"), "{}", agent.log());
}
