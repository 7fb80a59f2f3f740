//! The plugin's connection to the limiter agent: a one-thread tokio runtime owned by the
//! plugin, and blocking calls with a deadline for the broker's callbacks.
//!
//! The broker runs every callback on its one event loop, so a callback must never wait on
//! the agent longer than the configured timeout: it hands the question to the runtime and
//! waits on a channel with that timeout. A late answer is dropped. The connection is made
//! lazily and remade after it breaks, so the broker may start before the agent, and survives
//! the agent's restarts.

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, mpsc},
    time::Duration,
};

use limiter_client::{Client, ClientError, Outcome};
use tokio::{runtime::Runtime, sync::Mutex};

/// Why there is no verdict; the caller applies its fail mode either way, and logs this.
#[derive(Debug)]
pub enum NoAnswer {
    /// No reply within the timeout.
    Timeout,
    /// The agent is unreachable or answered with an error.
    Failed(ClientError),
}

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoAnswer::Timeout => f.write_str("no answer within the timeout"),
            NoAnswer::Failed(e) => write!(f, "{e}"),
        }
    }
}

/// What a connection's strikes action says about one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strike {
    /// Let it through (in monitor mode, with what enforcement would have answered).
    Pass { would_refuse: Option<Outcome> },
    /// Drop the message.
    Drop,
    /// Drop it and close the connection.
    Disconnect,
}

impl Strike {
    /// The plugin's decision for a verdict; an outcome this plugin does not know is a refusal,
    /// as the protocol says.
    pub fn of(outcome: Outcome, would_refuse: Option<Outcome>) -> Self {
        match outcome {
            Outcome::Disconnect => Strike::Disconnect,
            o if o.allowed() => Strike::Pass { would_refuse },
            _ => Strike::Drop,
        }
    }
}

/// A handle to the agent, shared by every callback.
pub struct Agent {
    runtime: Runtime,
    socket: PathBuf,
    timeout: Duration,
    client: Arc<Mutex<Option<Client>>>,
}

impl Agent {
    /// Starts the runtime; connects on first use.
    pub fn new(socket: PathBuf, timeout: Duration) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("limiter-plugin")
            .enable_all()
            .build()?;
        Ok(Self {
            runtime,
            socket,
            timeout,
            client: Arc::new(Mutex::new(None)),
        })
    }

    /// Runs `request` on the shared connection within the timeout and waits for its answer
    /// as long: what every blocking call is made of.
    fn ask<T, F, Fut>(&self, request: F) -> Result<T, NoAnswer>
    where
        T: Send + Sync + 'static,
        F: FnOnce(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, ClientError>> + Send,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        let client = Arc::clone(&self.client);
        let socket = self.socket.clone();
        let timeout = self.timeout;
        self.runtime.spawn(async move {
            let answer = tokio::time::timeout(timeout, async {
                let answer = request(connected(&client, &socket).await?).await;
                forget_if_broken(&client, &answer).await;
                answer
            })
            .await;
            // The callback may have stopped waiting; then nobody needs the answer.
            let _ = tx.send(match answer {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(NoAnswer::Failed(e)),
                Err(_) => Err(NoAnswer::Timeout),
            });
        });
        rx.recv_timeout(self.timeout)
            .unwrap_or(Err(NoAnswer::Timeout))
    }

    /// Runs `request` on the shared connection within the timeout, without waiting: for
    /// reports nothing of the broker's depends on.
    fn tell<T, F, Fut>(&self, request: F)
    where
        T: Send + Sync + 'static,
        F: FnOnce(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, ClientError>> + Send,
    {
        let client = Arc::clone(&self.client);
        let socket = self.socket.clone();
        let timeout = self.timeout;
        self.runtime.spawn(async move {
            let _ = tokio::time::timeout(timeout, async {
                let answer = request(connected(&client, &socket).await?).await;
                forget_if_broken(&client, &answer).await;
                answer.map(drop)
            })
            .await;
        });
    }

    /// Spends one token of `action` for `key`: `Ok(true)` allowed, `Ok(false)` refused.
    pub fn check(&self, action: &'static str, key: String) -> Result<bool, NoAnswer> {
        self.spend(action.to_owned(), key.into_bytes(), 1)
    }

    /// Spends `cost` tokens of `action` for `key` (a payload's bytes, a `user+topic` key's
    /// one): `Ok(true)` allowed, `Ok(false)` refused, a cost above the bucket's burst too.
    pub fn spend(&self, action: String, key: Vec<u8>, cost: u32) -> Result<bool, NoAnswer> {
        self.ask(move |c| async move { c.check(&action, key, cost).await.map(|v| v.allowed) })
    }

    /// Spends one token of the strikes `action` for the connection `client_id`, giving the
    /// payload's size: whether to pass, drop, or drop and disconnect.
    pub fn check_connection(
        &self,
        action: String,
        client_id: String,
        payload_bytes: u32,
    ) -> Result<Strike, NoAnswer> {
        self.ask(move |c| async move {
            let checked = c
                .check_payload(&action, client_id, 1, payload_bytes)
                .await?;
            Ok(Strike::of(checked.verdict.outcome, checked.would_refuse))
        })
    }

    /// Takes a session of `user` in the concurrency `action`: `Ok(true)` taken, `Ok(false)`
    /// the user has all its sessions. The plugin's one connection holds it, so a broker that
    /// dies frees them all.
    pub fn acquire(&self, action: String, user: String, session: String) -> Result<bool, NoAnswer> {
        self.ask(move |c| async move { c.acquire(&action, user, session).await.map(|v| v.allowed) })
    }

    /// Gives a session back, without waiting: the client is gone already.
    pub fn release(&self, action: String, user: String, session: String) {
        self.tell(move |c| async move { c.release(&action, user, session).await });
    }

    /// Tells the agent a client's connection is gone, without waiting: its strikes are
    /// released, and nothing of the broker's depends on the answer.
    pub fn connection_gone(&self, client_id: String) {
        self.tell(move |c| async move { c.connection_gone(client_id).await });
    }

    /// Reports a failed password by `addr` without waiting: the broker has already refused
    /// the login, and only the escalation count depends on it.
    pub fn report_auth_failure(&self, addr: IpAddr) {
        self.tell(move |c| async move { c.report_auth_failure(addr).await });
    }

    /// Stops the runtime, giving in-flight requests a moment.
    pub fn shutdown(self) {
        self.runtime.shutdown_timeout(Duration::from_millis(100));
    }
}

/// The shared connection, made if there is none.
async fn connected(
    client: &Mutex<Option<Client>>,
    socket: &PathBuf,
) -> Result<Client, ClientError> {
    let mut slot = client.lock().await;
    if let Some(c) = slot.as_ref() {
        return Ok(c.clone());
    }
    let c = Client::connect_unix(socket).await?;
    *slot = Some(c.clone());
    Ok(c)
}

/// Drops a connection that has ended, so the next call makes a new one.
async fn forget_if_broken<T>(client: &Mutex<Option<Client>>, result: &Result<T, ClientError>) {
    if matches!(
        result,
        Err(ClientError::Closed | ClientError::Protocol(_) | ClientError::Connect { .. })
    ) {
        *client.lock().await = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_disconnect_kicks_and_every_other_refusal_drops() {
        assert_eq!(Strike::of(Outcome::Disconnect, None), Strike::Disconnect);
        for refusal in [
            Outcome::Limited,
            Outcome::PayloadTooLarge,
            Outcome::Closed,
            Outcome::CostExceedsBurst,
        ] {
            assert_eq!(Strike::of(refusal, None), Strike::Drop, "{refusal:?}");
        }
        let monitored = Strike::of(Outcome::Allowed, Some(Outcome::Disconnect));
        assert_eq!(
            monitored,
            Strike::Pass {
                would_refuse: Some(Outcome::Disconnect)
            }
        );
    }

    #[test]
    fn an_unreachable_agent_is_a_failure_not_a_hang() {
        let dir = std::env::temp_dir().join(format!("no-agent-{}.sock", std::process::id()));
        let agent = Agent::new(dir, Duration::from_millis(200)).unwrap();
        let started = std::time::Instant::now();
        assert!(matches!(
            agent.check("auth", "192.0.2.1".into()),
            Err(NoAnswer::Failed(ClientError::Connect { .. }))
        ));
        assert!(started.elapsed() < Duration::from_secs(1));
        agent.shutdown();
    }

    #[test]
    fn a_silent_agent_costs_at_most_the_timeout() {
        let dir = tempfile_dir();
        let path = dir.join("silent.sock");
        // Accepts and never answers.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let agent = Agent::new(path, Duration::from_millis(100)).unwrap();
        let started = std::time::Instant::now();
        assert!(matches!(
            agent.check("auth", "192.0.2.1".into()),
            Err(NoAnswer::Timeout)
        ));
        assert!(started.elapsed() < Duration::from_millis(500));
        agent.shutdown();
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("limiter-mosq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
