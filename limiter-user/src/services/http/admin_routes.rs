//! The token-protected admin endpoints: bans and list entries.

use std::net::IpAddr;

use axum::{
    Json,
    extract::{
        Path, Query, Request, State,
        rejection::{JsonRejection, QueryRejection},
    },
    http::StatusCode,
    middleware::Next,
    response::{IntoResponse, Response},
};

use super::{
    AppState,
    auth::require_bearer,
    problem::{Problem, blocking, json_rejection, maps_problem, query_rejection},
};
use crate::{
    api::{BanAnswer, BanRequest, ListAnswer, ListKind, ListRequest, parse_ban_ttl},
    datapath::{
        EnforceError, Enforcer,
        kernel_keys::{key_text, source_key},
    },
    duration_units::duration_ms,
    events::{self, BanCause, Event},
    settings::parse_cidr,
};

/// Off (403) without a configured token; 401 for a missing or wrong one. The token is read per
/// request, so a SIGHUP reload that changes it applies at once.
pub(super) async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, Problem> {
    let Some(expected) = state.settings.get().admin_token else {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "the admin endpoints are disabled: no admin token is configured (--admin-token)",
        ));
    };
    require_bearer(&request, &expected, "admin token")?;
    Ok(next.run(request).await)
}

fn parse_addr(text: &str) -> Result<IpAddr, Problem> {
    text.trim()
        .parse::<IpAddr>()
        // `::ffff:a.b.c.d` is the IPv4 client the kernel keys as such.
        .map(|a| a.to_canonical())
        .map_err(|_| Problem::bad_request("addr", format!("`{text}` is not an IP address")))
}

fn enforce_problem(error: EnforceError) -> Problem {
    match error {
        EnforceError::Configured(net) => Problem::new(
            StatusCode::CONFLICT,
            format!("cidr: {net} comes from the configuration; change it there"),
        )
        .with("field", "cidr"),
        other => Problem::internal("changing the kernel maps", &other),
    }
}

pub(super) async fn ban(
    State(state): State<AppState>,
    body: Result<Json<BanRequest>, JsonRejection>,
) -> Result<Json<BanAnswer>, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    let addr = parse_addr(&request.addr)?;
    let ttl = parse_ban_ttl(&request.ttl).map_err(|e| Problem::bad_request("ttl", e))?;
    let answer = blocking(move || {
        // Through the limiter's banner, as bans from the broker protocol and escalation go,
        // so a fleet's banner shares it with every agent.
        state
            .limiter
            .ban(addr, ttl)
            .map_err(|e| Problem::internal("placing the ban", &e))?;
        events::emit(&Event::Ban {
            addr,
            cause: BanCause::Http,
            ttl,
        });
        let source = ban_source(&state.enforcer, addr)?;
        Ok(BanAnswer {
            addr: addr.to_string(),
            source,
            ttl_ms: Some(duration_ms(ttl)),
            lifted: None,
        })
    })
    .await?;
    Ok(Json(answer))
}

fn ban_source(enforcer: &Enforcer, addr: IpAddr) -> Result<String, Problem> {
    let config = enforcer.with_maps(|m| m.config()).map_err(maps_problem)?;
    Ok(key_text(&source_key(addr, &config), &config))
}

pub(super) async fn unban(
    State(state): State<AppState>,
    Path(addr): Path<String>,
) -> Result<Json<BanAnswer>, Problem> {
    let addr = parse_addr(&addr)?;
    let answer = blocking(move || {
        // Also forgets the address's authentication failures, so escalation starts over.
        let lifted = state
            .limiter
            .unban(addr)
            .map_err(|e| Problem::internal("lifting the ban", &e))?;
        events::emit(&Event::Unban {
            addr,
            cause: BanCause::Http,
            lifted,
        });
        Ok(BanAnswer {
            addr: addr.to_string(),
            source: ban_source(&state.enforcer, addr)?,
            ttl_ms: None,
            lifted: Some(lifted),
        })
    })
    .await?;
    Ok(Json(answer))
}

async fn list_change(
    state: AppState,
    kind: ListKind,
    cidr: &str,
    add: bool,
) -> Result<Response, Problem> {
    let net = parse_cidr("cidr", cidr).map_err(|e| Problem::bad_request("cidr", e.message))?;
    let answer = blocking(move || {
        let changed = if add {
            state.enforcer.list_add(kind, net)
        } else {
            state.enforcer.list_del(kind, net)
        }
        .map_err(enforce_problem)?;
        Ok(ListAnswer {
            list: kind.name().to_owned(),
            cidr: net.trunc().to_string(),
            changed,
        })
    })
    .await?;
    let status = if add && answer.changed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(answer)).into_response())
}

/// Which list a route changes, as a type, so that one handler serves both lists.
pub(super) trait Listed {
    const KIND: ListKind;
}

pub(super) struct Allow;

impl Listed for Allow {
    const KIND: ListKind = ListKind::Allow;
}

pub(super) struct Deny;

impl Listed for Deny {
    const KIND: ListKind = ListKind::Deny;
}

pub(super) async fn list_add<L: Listed>(
    State(state): State<AppState>,
    body: Result<Json<ListRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    list_change(state, L::KIND, &request.cidr, true).await
}

pub(super) async fn list_del<L: Listed>(
    State(state): State<AppState>,
    query: Result<Query<ListRequest>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(request) = query.map_err(query_rejection)?;
    list_change(state, L::KIND, &request.cidr, false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_canonical_and_errors_name_the_field() {
        assert_eq!(
            parse_addr("::ffff:10.0.0.1").unwrap(),
            "10.0.0.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_addr("2001:0db8:0:0::1").unwrap().to_string(),
            "2001:db8::1"
        );
        let problem = parse_addr("10.0.0.0/8").unwrap_err();
        assert_eq!(problem.0.status, StatusCode::BAD_REQUEST);
        assert!(
            problem.0.detail.starts_with("addr: "),
            "{}",
            problem.0.detail
        );
    }
}
