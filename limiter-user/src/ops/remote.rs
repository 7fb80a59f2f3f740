//! Reaching the agent: its HTTP API, or the pinned maps when it does not answer.

use std::{net::SocketAddr, path::Path};

use anyhow::{Context, Result, anyhow};
use reqwest::{Method, StatusCode, Url};
use serde::{Serialize, de::DeserializeOwned};

use super::Connect;
use crate::datapath::Maps;

/// Why a request to the agent got no answer of its own.
pub(super) enum AskError {
    /// Nothing listens, or nothing answered in time: worth falling back to the pinned maps.
    Unreachable(reqwest::Error),
    /// The agent answered, with an error or something unreadable.
    Failed(anyhow::Error),
}

impl From<AskError> for anyhow::Error {
    fn from(error: AskError) -> Self {
        match error {
            AskError::Unreachable(e) => anyhow!(e),
            AskError::Failed(e) => e,
        }
    }
}

/// The running agent, over HTTP.
pub(super) struct Remote {
    base: Url,
    client: reqwest::Client,
    token: Option<String>,
}

impl Remote {
    pub(super) fn new(connect: &Connect, token: Option<String>) -> Result<Self> {
        let base = Url::parse(&format!("http://{}/", connect.http))
            .with_context(|| format!("{} as a URL", connect.http))?;
        let client = reqwest::Client::builder()
            .timeout(connect.timeout)
            .no_proxy()
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            base,
            client,
            token,
        })
    }

    pub(super) fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.clear().extend(segments);
        }
        url
    }

    pub(super) async fn ask<T: DeserializeOwned>(
        &self,
        method: Method,
        url: Url,
        query: &[(&str, String)],
        body: Option<&impl Serialize>,
    ) -> Result<T, AskError> {
        let mut request = self.client.request(method, url.clone()).query(query);
        if let Some(body) = body {
            request = request.json(body);
        }
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(|e| {
            if e.is_connect() || e.is_timeout() {
                AskError::Unreachable(e)
            } else {
                AskError::Failed(anyhow!(e).context(format!("asking {url}")))
            }
        })?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| AskError::Failed(anyhow!(e).context(format!("reading {url}"))))?;
        if !status.is_success() {
            return Err(AskError::Failed(refusal(status, &text)));
        }
        serde_json::from_str(&text)
            .map_err(|e| AskError::Failed(anyhow!(e).context(format!("reading {url}'s answer"))))
    }

    pub(super) async fn get<T: DeserializeOwned>(
        &self,
        path: &[&str],
        query: &[(&str, String)],
    ) -> Result<T, AskError> {
        self.ask(Method::GET, self.url(path), query, None::<&()>)
            .await
    }
}

/// An error answer in words: the problem's detail when there is one.
pub(super) fn refusal(status: StatusCode, body: &str) -> anyhow::Error {
    let detail = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned());
    let hint = match status {
        StatusCode::UNAUTHORIZED => " (pass --admin-token or set LIMITER_ADMIN_TOKEN)",
        _ => "",
    };
    anyhow!("the agent refused ({status}): {detail}{hint}")
}

pub(super) fn open_pinned(pin_dir: &Path, http: SocketAddr, why: &reqwest::Error) -> Result<Maps> {
    let maps = Maps::open_pinned(pin_dir).map_err(|e| {
        anyhow!(
            "no agent answers at {http} ({}) and the pinned maps under {} cannot be read ({})",
            root_cause(why),
            pin_dir.display(),
            crate::errors::error_chain(&e),
        )
    })?;
    eprintln!(
        "no agent answers at {http} ({}); reading the pinned maps under {}",
        root_cause(why),
        pin_dir.display()
    );
    Ok(maps)
}

/// The innermost cause: for a refused connection, "Connection refused" rather than every
/// layer of the HTTP client's wrapping.
pub(super) fn root_cause(error: &dyn std::error::Error) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}
