//! What `limiter status` and `limiter top` print: the API's documents as text.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use crate::api::{Connections, KernelLimits, ProfileLimits, RateLimits, Status};

fn limit_text(n: u32) -> String {
    if n == 0 {
        "no limit".to_owned()
    } else {
        n.to_string()
    }
}

fn rate_text(rate: u32, burst: u32) -> String {
    if rate == 0 {
        "no limit".to_owned()
    } else {
        format!("{rate}/s (burst {burst})")
    }
}

/// A group of ports' caps, rates and refusals, and whether it only monitors.
fn caps_text(l: &ProfileLimits) -> String {
    format!(
        "{}per source {} ({}), total {} ({}), SYN rate {} ({}), connection rate {}",
        if l.mode == "monitor" {
            "MONITOR MODE (judged and counted, nothing refused): "
        } else {
            ""
        },
        limit_text(l.max_conn_per_ip),
        l.reject_conn,
        limit_text(l.max_conn_total),
        l.reject_conn,
        rate_text(l.syn_rate, l.syn_burst),
        l.reject_rate,
        rate_text(l.conn_rate, l.conn_burst),
    )
}

fn render_limits(l: &KernelLimits) -> String {
    format!(
        "{}, sources keyed by IPv4 /{} and IPv6 /{}, {} when the flow table is full",
        caps_text(&l.top),
        l.ipv4_prefix,
        l.ipv6_prefix,
        if l.fail_closed { "refuse" } else { "pass" },
    )
}

/// `limiter status` as text.
pub fn render_status(status: &Status, http: SocketAddr) -> String {
    let mut out = String::new();
    let _ = match (&status.version, status.ready) {
        (Some(version), Some(ready)) => writeln!(
            out,
            "agent       limiter {version} at {http}, {}",
            if ready { "ready" } else { "NOT READY" }
        ),
        _ => writeln!(out, "agent       not running (read from the pinned maps)"),
    };
    let _ = writeln!(
        out,
        "connections {} open, from {} sources",
        status.connections, status.tracked_sources
    );
    let _ = writeln!(
        out,
        "flow table  {} of {} entries",
        status.flow_table_entries, status.flow_table_capacity
    );
    let _ = writeln!(out, "bans        {} active", status.bans_active);
    let _ = writeln!(out, "limits      {}", render_limits(&status.limits));
    let by_reason = |counts: &std::collections::BTreeMap<String, u64>| {
        counts
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for p in &status.profiles {
        let ports = if p.ports.is_empty() {
            "every other port".to_owned()
        } else {
            let ports: Vec<_> = p.ports.iter().map(u16::to_string).collect();
            format!("ports {}", ports.join(", "))
        };
        let _ = writeln!(
            out,
            "profile     {} ({ports}): {} open; {}",
            p.name,
            p.connections,
            caps_text(&p.limits),
        );
        let _ = writeln!(out, "            refused: {}", by_reason(&p.refused));
        if p.limits.mode == "monitor" || p.would_refuse.values().any(|n| *n > 0) {
            let _ = writeln!(
                out,
                "            would refuse: {}",
                by_reason(&p.would_refuse)
            );
        }
    }
    let profiles_own = |field: Option<u32>, text: fn(u32) -> String| {
        field.map_or_else(|| "the profile's".to_owned(), text)
    };
    for o in &status.limits.overrides {
        let rate = match (o.syn_rate, o.syn_burst) {
            (Some(rate), burst) => rate_text(rate, burst.unwrap_or(rate.saturating_mul(2))),
            (None, Some(burst)) => format!("the profile's (burst {burst})"),
            (None, None) => "the profile's".to_owned(),
        };
        let _ = writeln!(
            out,
            "override    {}: per source {}, SYN rate {rate}",
            o.cidr,
            profiles_own(o.max_conn_per_ip, limit_text),
        );
    }
    let _ = writeln!(
        out,
        "refused     connections: {}",
        by_reason(&status.refused)
    );
    let _ = writeln!(
        out,
        "            packets: {}",
        by_reason(&status.refused_packets)
    );
    match &status.syn_cookies {
        Some(cookies) => {
            let threshold = cookies
                .threshold
                .map(|t| format!(" above {t} SYNs/s"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "syn cookies {} ({}{threshold}); switched on {} times, off {}",
                if cookies.active { "ON" } else { "off" },
                cookies.mode,
                cookies.switched_on,
                cookies.switched_off,
            );
        }
        None => {
            let _ = writeln!(
                out,
                "syn cookies {}",
                if status.limits.syn_cookies {
                    "ON"
                } else {
                    "off"
                }
            );
        }
    }
    if let Some(fleet) = &status.fleet {
        let _ = writeln!(
            out,
            "fleet       {} {}; {} checks decided locally, {} switches to local, {} back",
            fleet.redis,
            if fleet.redis_up {
                "up".to_owned()
            } else {
                format!(
                    "DOWN (deciding locally at limit / {})",
                    fleet.expected_replicas
                )
            },
            fleet.fallback_checks,
            fleet.switches_to_local,
            fleet.switches_to_redis,
        );
    }
    out
}

pub fn render_top(connections: &Connections, limits: &RateLimits) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Sources by open connections ({} open, {} sources)",
        connections.connections, connections.tracked_sources
    );
    if connections.sources.is_empty() {
        let _ = writeln!(out, "  (none)");
    } else {
        let _ = writeln!(
            out,
            "  {:<40} {:<12} {:>11}",
            "SOURCE", "PROFILE", "CONNECTIONS"
        );
        for s in &connections.sources {
            let _ = writeln!(
                out,
                "  {:<40} {:<12} {:>11}",
                s.source, s.profile, s.connections
            );
        }
    }
    let _ = writeln!(
        out,
        "\nSources refused by the kernel, by reason (connection attempts)"
    );
    let mut any = false;
    for (reason, top) in &limits.kernel.top_blocked {
        if top.is_empty() {
            continue;
        }
        any = true;
        let _ = writeln!(out, "  {reason}");
        for b in top {
            let _ = writeln!(out, "    {:<38} {:>11}", b.source, b.blocked);
        }
    }
    if !any {
        let _ = writeln!(out, "  (none)");
    }
    if !limits.kernel.bans.is_empty() {
        let _ = writeln!(
            out,
            "\nBans ({} active, longest first)",
            limits.kernel.bans_active
        );
        for ban in &limits.kernel.bans {
            let left =
                humantime::format_duration(Duration::from_secs(ban.expires_in_ms.div_ceil(1000)));
            let _ = writeln!(out, "  {:<40} {left} left", ban.source);
        }
    }
    if let Some(broker) = &limits.broker {
        let _ = writeln!(out, "\nBroker keys refused, by action");
        let mut any = false;
        for action in &broker.actions {
            if action.top_blocked.is_empty() {
                continue;
            }
            any = true;
            let _ = writeln!(
                out,
                "  {} ({} {} per {}, {} refused in all)",
                action.name,
                action.kind,
                action.limit,
                humantime::format_duration(Duration::from_millis(action.window_ms)),
                action.counts.blocked
            );
            for b in &action.top_blocked {
                let _ = writeln!(out, "    {:<38} {:>11}", b.key, b.blocked);
            }
        }
        if !any {
            let _ = writeln!(out, "  (none)");
        }
    }
    out
}
