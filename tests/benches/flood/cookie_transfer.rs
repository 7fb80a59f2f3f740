//! What a cookie costs the client it lets in (part of `cargo xtask bench flood --spoofed`): a
//! connection the programs' cookie built against a normal one, timed over a bulk transfer.
//! The cookie's connection must scale its windows and select its acknowledgements as a normal
//! one does (the tests check the options agree; this measures that nothing else is lost).
//!
//! The normal connection is one with cookies off (the host's own cookies only for a full
//! queue, the kernel's default): a proven source on a cookie host would reach the host's
//! stack, but that host runs `tcp_syncookies = 2` and would answer it with its own cookie.
//! Both hosts have the same programs, veth and NAPI peer; they take turns over the rounds so
//! the machine's noise hits both alike, and the medians are compared.

use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context, Result, ensure};
use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    kernel::Attached,
    netns::CLIENT_V4,
    report::{AtLeast, Report},
    transfer::{Sink, transfer},
};

use crate::median;

const BYTES: usize = 10 << 20;
const ROUNDS: usize = 7;

fn host(flags: &[&str], sysctls: &'static [&'static str]) -> Result<Attached> {
    Attached::prepared(flags, |pair| {
        for setting in sysctls {
            pair.server.exec(&["sysctl", "-q", "-w", setting])?;
        }
        Ok(())
    })
}

pub fn run() -> Result<()> {
    let cookie = host(
        &["--syn-cookies", "always"],
        &["net.ipv4.tcp_syncookies=2", "net.ipv4.tcp_timestamps=2"],
    )?;
    let normal = host(&["--syn-cookies", "off"], &["net.ipv4.tcp_timestamps=2"])?;
    let cookie_sink = Sink::new(&cookie.pair.server, ROUNDS)?;
    let normal_sink = Sink::new(&normal.pair.server, ROUNDS)?;
    let data = vec![0x5Au8; BYTES];
    let (mut cookie_rates, mut normal_rates) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // Each round's cookie connection comes from a source of its own, new to the
        // programs, so that it gets a cookie: a closed one's source is proven, and keeps its
        // slot until the sweeper's pass, which this bench does not run.
        let fresh = Ipv4Addr::new(10, 77, 0, 10 + round as u8);
        let dev = &cookie.pair.client_if;
        cookie
            .pair
            .client
            .exec(&["ip", "addr", "add", &format!("{fresh}/24"), "dev", dev])?;
        cookie_rates
            .push(transfer(&cookie.pair.client, IpAddr::V4(fresh), &cookie_sink, &data)?.rate);
        normal_rates.push(
            transfer(
                &normal.pair.client,
                IpAddr::V4(CLIENT_V4),
                &normal_sink,
                &data,
            )?
            .rate,
        );
    }
    let cookies = cookie
        .dp
        .maps
        .packets(Direction::Ingress, Verdict::Cookie, Reason::Unproven)
        .context("the cookie counter")?;
    ensure!(
        cookies == ROUNDS as u64,
        "{cookies} of {ROUNDS} connections were answered with the programs' cookie"
    );
    let (cookie_rate, normal_rate) = (median(cookie_rates), median(normal_rates));
    let mut report = Report::new(
        "flood-cookie-transfer",
        "flood --spoofed",
        "A connection a cookie let in: bulk transfer",
        &format!(
            "{} MB sent from the client's end of a veth to a listener on the server's end, \
             {ROUNDS} rounds (median), on two hosts with the same programs and NAPI peer taking \
             turns: one with `--syn-cookies always` (`tcp_syncookies = 2`, each round from a \
             source new to the programs, so the programs' cookie built its connection), one \
             with cookies off (a normal handshake). Both with `tcp_timestamps = 2`. The rate \
             runs from the first write to the listener's last read.",
            BYTES >> 20
        ),
    );
    report.table(
        &["connection", "MB/s", "/ normal", "target"],
        &[
            vec![
                "through the programs' cookie".to_owned(),
                format!("{:.0}", cookie_rate / 1e6),
                format!("{:.2}", cookie_rate / normal_rate),
                AtLeast(0.9).judge(cookie_rate / normal_rate),
            ],
            vec![
                "normal handshake (anchor)".to_owned(),
                format!("{:.0}", normal_rate / 1e6),
                "1.00".to_owned(),
                "—".to_owned(),
            ],
        ],
    );
    report.summary(format!(
        "a cookie connection {:.2} × a normal one's rate ({})",
        cookie_rate / normal_rate,
        AtLeast(0.9).judge(cookie_rate / normal_rate)
    ));
    report.finish()
}
