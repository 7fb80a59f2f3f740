//! Differential test: random and mutated frames through the real programs under
//! BPF_PROG_TEST_RUN (XDP for ingress, the egress TC program for the host's segments) and
//! through the reference model (`limiter_tests::model`); verdicts and every counter must
//! agree, and XDP_ABORTED must never appear.
//!
//! Frames come from a seeded PRNG, so a failure reproduces: it names the seed and the frame.
//! Set `LIMITER_MODEL_SEED` to replay one; `cargo xtask fuzz` sets it and
//! `LIMITER_FUZZ_FRAMES` for long runs.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use etherparse::{EtherType, SingleVlanHeader, VlanId};
use limiter_common::{
    BUCKET_TAG_MASK, Blocked, Direction, Event, FlowKey, PROFILE_SLOTS, ProfileSource, Reason,
    SourceKey, Verdict, stats::stat_slot,
};
use limiter_tests::{
    frames::{self, Flags, Tcp, Vlans},
    kernel::{Kernel, TC_ACT_OK, settings},
    model::{Input, Model, Segment},
};
use nix::{
    sched::{CpuSet, sched_setaffinity},
    time::{ClockId, clock_gettime},
    unistd::Pid,
};

const PORT: u16 = 5672;
/// The port of the profile configuration's profile: half of each client's connections go to
/// it there (elsewhere, every connection goes to `PORT`).
const PROFILE_PORT: u16 = 1883;
/// A port nothing protects.
const OTHER_PORT: u16 = 22;
const V4_CLIENTS: usize = 150;
const V6_CLIENTS: usize = 50;
const PORTS_PER_CLIENT: usize = 4;
/// Full state comparisons (every map) happen this often; verdicts are checked every frame.
const CHECK_EVERY: usize = 100;
const XDP_ABORTED: u32 = 0;

/// Caps that bite: 200 clients with 4 ports each against 3 per source and 150 in all. The
/// flow table's 256 slots size the SYN bucket array too, so that many clients share a bucket
/// slot and take it over from each other, and a slot's `holders` counts several sources.
const CAPS: &[&str] = &[
    "--ports",
    "5672",
    "--flow-table-size",
    "256",
    "--max-conn-per-ip",
    "3",
    "--max-conn-total",
    "150",
    "--rst-xdp-tx",
];

/// No SYN rate: the caps and lists alone decide.
const NO_RATE: &[&str] = &["--syn-rate", "0"];

/// A SYN rate that bites: 200 clients against one handshake a second each after a burst of
/// one (a token is spent only by a completed handshake), so that sources are refused for
/// their rate, get tokens back as the run goes on, and (over the caps' 256 bucket slots) take
/// shared slots over with a fresh bucket.
const RATE: &[&str] = &[
    "--syn-rate",
    "1",
    "--syn-burst",
    "1",
    "--reject-rate",
    "rst",
];

/// A connection rate that bites, over all 200 clients: 50 handshakes a second after a burst
/// of 5, so that the run meets it spent (SYNs refused at once, handshakes refused at their
/// ACK) and refilled.
const CONN_RATE: &[&str] = &["--syn-rate", "0", "--conn-rate", "50", "--conn-burst", "5"];

/// Overrides over part of the clients, nested so that the most specific must win: the first
/// half of the IPv4 clients get a higher cap, a /28 inside it a lower one and a SYN rate of
/// its own (the top level's is off), and a tenth of the IPv6 clients a cap of one.
const OVERRIDES: &[&str] = &[
    "--override",
    "192.0.2.0/25:max-conn-per-ip=6",
    "--override",
    "192.0.2.16/28:max-conn-per-ip=1,syn-rate=1,syn-burst=1",
    "--override",
    "2001:db8::/60:max-conn-per-ip=1",
];

/// A port profile beside the top level, each with caps that bite on its own counts: every
/// client holds two connections at most on each (one per source on each here, so a source's
/// connections to one never spend its allowance on the other), the profile with its own
/// total, SYN rate, connection rate and refusal modes; and overrides whose sources keep each
/// profile's limits where they set none.
const PROFILES: &[&str] = &[
    "--ports",
    "5672",
    "--flow-table-size",
    "256",
    "--max-conn-per-ip",
    "1",
    "--max-conn-total",
    "150",
    "--syn-rate",
    "0",
    "--rst-xdp-tx",
    "--profile",
    "mqtt:ports=1883,max-conn-per-ip=1,max-conn-total=60,syn-rate=1,syn-burst=1,\
     conn-rate=40,conn-burst=4,reject-conn=drop,reject-rate=rst",
    // Overrides that leave fields to each port's profile: a burst of its own at the profile's
    // rate (none at the top level), and a cap of its own at the profile's rate.
    "--override",
    "192.0.2.0/26:syn-burst=2",
    "--override",
    "192.0.2.64/27:max-conn-per-ip=2",
    // Kernel escalation: refusals over a source's own cap or rate wait for the handshake.
    "--escalate-refused-for",
    "30s",
];

/// The same caps with an allow list and a deny list over part of the clients, refused
/// connections dropped rather than answered, and tunnels let through.
const LISTS: &[&str] = &[
    "--tunnels",
    "pass",
    "--ports",
    "5672",
    "--max-conn-per-ip",
    "2",
    "--max-conn-total",
    "40",
    "--allow",
    "192.0.2.0/28",
    "--deny",
    "192.0.2.64/26,2001:db8:bad::/48",
    "--reject-conn",
    "drop",
    "--rst-xdp-tx",
];

#[test]
fn caps_agree_with_the_model() {
    run(&[CAPS, NO_RATE].concat(), seed(0x11A1_7E55), frames());
}

#[test]
fn lists_agree_with_the_model() {
    run(
        &[LISTS, NO_RATE].concat(),
        seed(0xDE1A_7157).wrapping_add(1),
        frames(),
    );
}

#[test]
fn the_syn_rate_agrees_with_the_model() {
    let model = run(
        &[CAPS, RATE].concat(),
        seed(0x5EED_4A7E).wrapping_add(2),
        frames(),
    );
    // The run must have met the rate both ways: refusals, and admissions after them.
    let refused = counted(&model, Verdict::Rst, Reason::SynRate);
    println!(
        "model: the rate refused {refused} SYNs; {} found a token that came back",
        model.refills
    );
    assert!(refused > 100, "the rate refused {refused} SYNs");
    assert!(
        model.refills > 100,
        "only {} SYNs found a token that came back with time",
        model.refills
    );
}

#[test]
fn the_connection_rate_agrees_with_the_model() {
    let model = run(
        &[CAPS, CONN_RATE].concat(),
        seed(0xC044_4A7E).wrapping_add(3),
        frames(),
    );
    let refused = counted(&model, Verdict::Drop, Reason::ConnRate);
    let admitted = counted(&model, Verdict::Pass, Reason::Admitted);
    println!("model: the connection rate refused {refused} SYNs; {admitted} handshakes admitted");
    assert!(refused > 100, "the connection rate refused {refused} SYNs");
    assert!(
        admitted > 5,
        "only {admitted} handshakes: the rate never refilled"
    );
}

/// With cookies on, as `BPF_PROG_TEST_RUN` can run them: no listener answers the lookup, so
/// no cookie is made (an unproven source's SYN goes on to the host as without cookies), and
/// every ACK no half-open handshake expects is checked for a cookie and found to be none; it
/// must then be judged as it would be without cookies (its FIN marking its flow).
#[test]
fn cookies_without_a_listener_change_nothing_the_model_sees() {
    run(
        &[CAPS, RATE, &["--syn-cookies", "always"]].concat(),
        seed(0xC00C_1E5A).wrapping_add(5),
        frames(),
    );
}

#[test]
fn overrides_agree_with_the_model() {
    let model = run(
        &[CAPS, NO_RATE, OVERRIDES].concat(),
        seed(0x0E44_1DE5).wrapping_add(4),
        frames(),
    );
    // The overrides must have bitten: the lower cap and the /28's own rate refused.
    let capped = counted(&model, Verdict::Rst, Reason::ConnPerIp);
    let rated = counted(&model, Verdict::Drop, Reason::SynRate);
    println!("model: with overrides, {capped} SYNs over a cap, {rated} over the /28's rate");
    assert!(capped > 100 && rated > 10, "{capped} capped, {rated} rated");
}

#[test]
fn profiles_agree_with_the_model() {
    let model = run(PROFILES, seed(0x960F_11E5).wrapping_add(7), frames());
    // Both profiles' caps must have bitten, each on its own counts.
    let refused = |profile: u32, reason: Reason| {
        model
            .refusals
            .get(&(profile, false))
            .map_or(0, |r| r[reason.blocked_slot().expect("a refusal")])
    };
    let mqtt = 1;
    println!(
        "model: top level refused {} over the per-source cap; the profile {} over it, {} over \
         its total, {} over its SYN rate, {} over its connection rate",
        refused(0, Reason::ConnPerIp),
        refused(mqtt, Reason::ConnPerIp),
        refused(mqtt, Reason::ConnTotal),
        refused(mqtt, Reason::SynRate),
        refused(mqtt, Reason::ConnRate),
    );
    assert!(refused(0, Reason::ConnPerIp) > 10);
    let offenses: u64 = model.offenders.values().map(|(n, _)| n).sum();
    println!(
        "model: {} sources refused {offenses} times at their handshakes",
        model.offenders.len()
    );
    assert!(offenses > 10);
    assert!(refused(mqtt, Reason::ConnPerIp) > 10);
    assert!(refused(mqtt, Reason::SynRate) + refused(mqtt, Reason::ConnRate) > 10);
    assert!(model.connections(0) > 0 && model.connections(mqtt) > 0);
}

/// Monitor mode on the lists, caps and rate: nothing the policy would refuse is, each SYN it
/// would is counted `would_refuse`, and the handshakes it lets past a cap are tracked; with
/// kernel escalation, their sources' streaks are marked as only judged.
#[test]
fn monitor_mode_agrees_with_the_model() {
    let model = run(
        &[
            LISTS,
            RATE,
            &["--mode", "monitor", "--escalate-refused-for", "30s"],
        ]
        .concat(),
        seed(0x3041_7042).wrapping_add(6),
        frames(),
    );
    let refusals = &Reason::ALL[..Reason::REFUSAL_COUNT];
    let refused: u64 = refusals
        .iter()
        .map(|&r| counted(&model, Verdict::Drop, r) + counted(&model, Verdict::Rst, r))
        .sum();
    assert_eq!(refused, 0, "monitor mode refused");
    let would: Vec<u64> = refusals
        .iter()
        .map(|&r| counted(&model, Verdict::WouldRefuse, r))
        .collect();
    println!("model: monitor mode would have refused {would:?} (by refusal reason)");
    for reason in [Reason::ConnPerIp, Reason::SynRate, Reason::Denylisted] {
        assert!(
            counted(&model, Verdict::WouldRefuse, reason) > 10,
            "{reason:?}: {would:?}"
        );
    }
    assert!(model.offenders.len() > 10);
    assert!(model.offenders.values().all(|(_, monitored)| *monitored));
}

/// The ingress packets the model counted under `verdict` and `reason`.
fn counted(model: &Model, verdict: Verdict, reason: Reason) -> u64 {
    model
        .stats
        .get(&stat_slot(Direction::Ingress, verdict, reason))
        .copied()
        .unwrap_or(0)
}

/// The least time a rated run takes: enough for the floors below at 25,000 frames.
const RATED_SPAN: Duration = Duration::from_secs(8);

/// Frames per test: an eighth of `LIMITER_FUZZ_FRAMES` (`cargo xtask fuzz`), else 25,000.
fn frames() -> usize {
    env_u64("LIMITER_FUZZ_FRAMES").map_or(25_000, |n| (n / 8).max(1) as usize)
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}: not a number")),
    )
}

/// `LIMITER_MODEL_SEED` if set (`cargo xtask fuzz --seed`), else the test's own fixed seed.
fn seed(default: u64) -> u64 {
    env_u64("LIMITER_MODEL_SEED").unwrap_or(default)
}

/// Runs `count` frames of seed `seed` through a kernel loaded with `flags` and the model;
/// returns the model as the run left it.
fn run(flags: &[&str], seed: u64, count: usize) -> Model {
    let mut k = Kernel::new(flags);
    let live = k.dp.maps.config().expect("the live config");
    let held = k.dp.maps.profile_labels().expect("the profiles' slots");
    let mut policy = settings(flags).policy;
    if policy.base.offense_gap_ns != 0 {
        // Kernel escalation's streaks, whose times the model does not keep: a pause that
        // would start one again (10 s) must never come, however slow the run.
        policy.base.offense_gap_ns = u64::MAX;
        k.dp.maps
            .apply(&policy)
            .expect("the policy without streak gaps");
    }
    let mut model = Model::new(&policy, &live, &held);
    let ports = if policy.profiles.is_empty() {
        vec![PORT]
    } else {
        vec![PORT, PROFILE_PORT]
    };
    let mut generator = Generator::new(seed, ports);
    let started = std::time::Instant::now();
    // A rate's tokens come back only with time, which the kernel's clock measures: spread a
    // rated run's frames over at least this long, so that a fast machine meets refills as a
    // slow one does (a run of 2 s saw too few to compare).
    let span = if model.rated() {
        RATED_SPAN
    } else {
        Duration::ZERO
    };
    // Frames whose run straddled a tick of the rate clock, and of those, the ones the kernel
    // judged at the later instant.
    let (mut straddled, mut late) = (0, 0);
    println!("model: seed {seed} ({count} frames, flags {flags:?})");
    for index in 0..count {
        let due = started + span.mul_f64(index as f64 / count as f64);
        if let Some(early) = due.checked_duration_since(std::time::Instant::now()) {
            std::thread::sleep(early);
        }
        on_cpu(index % 2);
        if let Some(change) = generator.ban_change() {
            change_bans(&mut k, &mut model, &change);
        }
        let frame = generator.next();
        let fail =
            |what: String| -> ! { panic!("seed {seed}, frame {index} ({}): {what}", frame.label) };
        match frame.path {
            Path::Xdp => {
                let before = rate_clock();
                let got = k.xdp(&frame.bytes).action;
                let after = rate_clock();
                if got == XDP_ABORTED {
                    fail("XDP_ABORTED".into());
                }
                match judge(&k, &mut model, &frame.input, got, before, after) {
                    Ok(Judged::Late) => late += 1,
                    Ok(Judged::Early) => straddled += 1,
                    Ok(Judged::Exactly) => {}
                    Err(what) => fail(what),
                }
            }
            Path::Tc => {
                let got = k.tc(&frame.bytes);
                model.tc(&frame.input);
                if got != TC_ACT_OK {
                    fail(format!("TC action {got}; {:?}", frame.input));
                }
            }
        }
        let checkpoint = index % CHECK_EVERY == CHECK_EVERY - 1 || index + 1 == count;
        if checkpoint && let Err(what) = compare(&k, &model, &generator.clients) {
            fail(format!(
                "{what} (state last matched after frame {})",
                (index / CHECK_EVERY * CHECK_EVERY).saturating_sub(1)
            ));
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let refused: u64 = model.refused_conns.iter().sum();
    println!(
        "model: {count} frames in {elapsed:.1} s ({:.0} frames/s), {} opened, {} connection \
         attempts refused, {} refused SYNs repeated one refused before",
        count as f64 / elapsed,
        model.events[Event::Opened as usize],
        refused,
        model.repeats
    );
    // Every configuration refuses, bans included: the counts must have met new attempts and
    // repeated ones. (Monitor mode refuses nothing: its test checks what it counted.)
    let banned = Reason::Banned
        .blocked_slot()
        .map(|slot| model.refused_conns[slot]);
    let monitoring = flags.windows(2).any(|w| w == ["--mode", "monitor"]);
    assert!(
        monitoring || refused > 100 && model.repeats > 10 && banned.is_some_and(|n| n > 10),
        "too few refused attempts to compare: {:?}, {} repeats",
        model.refused_conns,
        model.repeats
    );
    if model.rated() {
        println!(
            "model: {} frames straddled a tick of the rate clock, {late} judged at its end",
            straddled + late
        );
    }
    model
}

/// Sets or lifts a ban in the kernel, as the agent does, and in the model.
fn change_bans(k: &mut Kernel, model: &mut Model, change: &BanChange) {
    let maps = &mut k.dp.maps;
    match *change {
        BanChange::Ban(addr, in_force) => {
            let ttl = if in_force {
                Duration::from_secs(3600)
            } else {
                Duration::ZERO
            };
            maps.ban(addr, ttl).expect("ban");
            model.ban(addr, in_force);
        }
        BanChange::Unban(addr) => {
            maps.unban(addr).expect("unban");
            model.unban(addr);
        }
    }
}

/// At which instant of the rate clock the kernel judged a frame, as far as the model can tell.
enum Judged {
    /// No tick fell between the reads around the frame.
    Exactly,
    /// A tick did; the earlier instant agrees (as does the later one, perhaps).
    Early,
    /// A tick did; only the later instant agrees.
    Late,
}

/// The SYN rate's clock, as the program reads it (`bpf_ktime_get_coarse_ns`).
fn rate_clock() -> u64 {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC_COARSE).expect("the coarse clock");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// Holds the kernel's action `got` on a frame against the model's. The program read the rate
/// clock somewhere between `before` and `after`; when a tick fell between them, either
/// instant is right, so the model judges the frame at both and goes on as the one that agrees
/// with the kernel, in the action and in every SYN bucket.
fn judge(
    k: &Kernel,
    model: &mut Model,
    input: &Input,
    got: u32,
    before: u64,
    after: u64,
) -> Result<Judged, String> {
    let mut late = (before != after && model.rated()).then(|| model.clone());
    model.rate_now = before;
    let want = model.xdp(input);
    let Some(late) = late.as_mut() else {
        return (got == want)
            .then_some(Judged::Exactly)
            .ok_or_else(|| format!("XDP action {got}, model {want}; {input:?}"));
    };
    late.rate_now = after;
    let late_want = late.xdp(input);
    let early = if got == want {
        compare_rates(k, model)
    } else {
        Err(format!("XDP action {got}, model {want}"))
    };
    let Err(early) = early else {
        return Ok(Judged::Early);
    };
    if got == late_want {
        compare_rates(k, late)?;
        *model = late.clone();
        return Ok(Judged::Late);
    }
    Err(format!(
        "at {before}: {early}; at {after}: XDP action {got}, model {late_want}; {input:?}"
    ))
}

/// The rate state of the kernel against the model's: the connection rate's TAT and every SYN
/// bucket slot. A frame whose run straddled a tick of the rate clock is told apart by it.
fn compare_rates(k: &Kernel, model: &Model) -> Result<(), String> {
    for profile in 0..PROFILE_SLOTS {
        let tat =
            k.dp.maps
                .connection_rate_tat(profile)
                .expect("the connection rate");
        let want = model.conn_tat.get(&profile).copied().unwrap_or(0);
        if tat != want {
            return Err(format!(
                "connection rate TAT of profile {profile}: kernel {tat}, model {want}"
            ));
        }
    }
    let kernel = k.dp.maps.syn_buckets().expect("SYN buckets");
    let in_use = model
        .buckets
        .values()
        .filter(|b| b.tag != 0 || b.holders != 0)
        .count();
    if kernel.len() != in_use {
        return Err(format!(
            "SYN buckets in use: kernel {}, model {in_use}",
            kernel.len()
        ));
    }
    let rated = model.rated();
    for (slot, bucket) in kernel {
        let want = model.buckets.get(&slot).copied().unwrap_or_default();
        let tag = bucket.tat_tag & BUCKET_TAG_MASK;
        let got = (
            tag,
            (tag != 0).then_some(bucket.source),
            bucket.holders,
            rated.then_some(bucket.tat_tag & !BUCKET_TAG_MASK),
            bucket.refused,
            bucket.seen,
        );
        let expected = (
            want.tag,
            want.source,
            want.holders,
            rated.then_some(want.tat),
            want.refused,
            want.seen,
        );
        if got != expected {
            return Err(format!(
                "SYN bucket {slot} (tag, source, admitted, holders, TAT, refused, seen): kernel \
                 {got:?}, model {expected:?}"
            ));
        }
    }
    Ok(())
}

/// Pins the calling thread to `cpu`: BPF_PROG_TEST_RUN runs the program there, so per-CPU
/// counters are written on both CPUs and must still add up.
fn on_cpu(cpu: usize) {
    let mut set = CpuSet::new();
    set.set(cpu).expect("a CPU index");
    sched_setaffinity(Pid::from_raw(0), &set).expect("sched_setaffinity");
}

/// Every counter and table of the kernel against the model's.
fn compare(k: &Kernel, model: &Model, clients: &[IpAddr]) -> Result<(), String> {
    let maps = &k.dp.maps;
    for count in maps.packet_counts().expect("packet counts") {
        let slot = stat_slot(count.direction, count.verdict, count.reason);
        let want = model.stats.get(&slot).copied().unwrap_or(0);
        if count.packets != want {
            return Err(format!(
                "{:?}/{:?}/{:?}: kernel {}, model {want}",
                count.direction, count.verdict, count.reason, count.packets
            ));
        }
    }
    for event in Event::ALL {
        let got = maps.events(event).expect("events");
        let want = model.events[event as usize];
        if got != want {
            return Err(format!("event {event:?}: kernel {got}, model {want}"));
        }
    }
    let global = maps.profile_connections().expect("global counts");
    for profile in 0..PROFILE_SLOTS {
        let (got, want) = (global[profile as usize], model.connections(profile));
        if got != want {
            return Err(format!(
                "global of profile {profile}: kernel {got}, model {want}"
            ));
        }
        for addr in clients {
            let got = maps
                .source_connections_in(*addr, profile)
                .expect("source count");
            let want = model.source_connections(*addr, profile);
            if got != want {
                return Err(format!(
                    "connections of {addr} in profile {profile}: kernel {got}, model {want}"
                ));
            }
        }
        for would in [false, true] {
            for reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
                let got = maps.refusals_in(profile, would, *reason).expect("refusals");
                let want = model
                    .refusals
                    .get(&(profile, would))
                    .map_or(0, |r| r[reason.blocked_slot().expect("a refusal")]);
                if got != want {
                    return Err(format!(
                        "profile {profile}, {reason:?} (would: {would}): kernel {got}, model {want}"
                    ));
                }
            }
        }
    }
    let flows: HashMap<FlowKey, (ProfileSource, u32)> = maps
        .flows()
        .expect("flows")
        .into_iter()
        .map(|(key, flow)| (key, (flow.counted, flow.state)))
        .collect();
    let want: HashMap<FlowKey, (ProfileSource, u32)> = model
        .flows
        .iter()
        .map(|(key, flow)| (*key, (flow.counted, flow.state)))
        .collect();
    if flows != want {
        return Err(format!("flows: kernel {flows:?}, model {want:?}"));
    }
    let half_open: HashMap<FlowKey, (ProfileSource, u32)> = maps
        .half_open()
        .expect("half-open")
        .into_iter()
        .map(|(key, h)| (key, (h.counted, h.server_isn)))
        .collect();
    let want: HashMap<FlowKey, (ProfileSource, u32)> = model
        .half_open
        .iter()
        .map(|(key, h)| (*key, (h.counted, h.isn)))
        .collect();
    if half_open != want {
        return Err(format!("half-open: kernel {half_open:?}, model {want:?}"));
    }
    for reason in Reason::ALL {
        let got = maps
            .refused_connections(reason)
            .expect("refused connections");
        let want = reason
            .blocked_slot()
            .map_or(0, |slot| model.refused_conns[slot]);
        if got != want {
            return Err(format!(
                "refused attempts, {reason:?}: kernel {got}, model {want}"
            ));
        }
    }
    let offenders: HashMap<SourceKey, (u64, bool)> = maps
        .offenders()
        .expect("offenders")
        .into_iter()
        .map(|(source, offense)| (source, (offense.refusals, offense.monitored != 0)))
        .collect();
    if offenders != model.offenders {
        return Err(format!(
            "offenders: kernel {offenders:?}, model {:?}",
            model.offenders
        ));
    }
    let blocked: HashMap<SourceKey, Blocked> =
        maps.blocked().expect("top-blocked").into_iter().collect();
    let want = model.top_blocked();
    let mut sources = blocked.keys().chain(want.keys());
    if let Some(source) = sources.find(|s| blocked.get(s) != want.get(s)) {
        return Err(format!(
            "top-blocked, {source:?}: kernel {:?}, model {:?}",
            blocked.get(source),
            want.get(source)
        ));
    }
    compare_rates(k, model)
}

/// A splitmix64 PRNG: small, seedable, good enough to pick frames.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn u32(&mut self) -> u32 {
        self.next() as u32
    }

    /// True with probability `percent`/100.
    fn percent(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

enum Path {
    Xdp,
    Tc,
}

/// What the agent does to the bans between frames.
#[derive(Debug)]
enum BanChange {
    /// A ban in force for longer than any run, or (`false`) one expired when set.
    Ban(IpAddr, bool),
    Unban(IpAddr),
}

/// One generated frame: its bytes, where it goes, what the parser must make of it.
struct Frame {
    bytes: Vec<u8>,
    path: Path,
    input: Input,
    /// What kind of frame, for failure messages.
    label: &'static str,
}

/// Where a client's connection on one port is, as the generator sees it. The generator only
/// aims at plausible sequences; what is right is the model's to say.
#[derive(Clone, Copy, Default)]
struct Conn {
    stage: Stage,
    seq: u32,
    isn: u32,
    fin_in: bool,
    fin_out: bool,
}

#[derive(Clone, Copy, Default, PartialEq)]
enum Stage {
    #[default]
    Idle,
    SynSent,
    SynAcked,
    Open,
}

struct Generator {
    rng: Rng,
    clients: Vec<IpAddr>,
    /// The protected ports a client's connections go to, in turn.
    ports: Vec<u16>,
    conns: Vec<Conn>,
    /// The next flag byte: flag-byte frames take them in turn, so all 256 come up.
    next_flags: u8,
    /// Truncated frames made so far: each cuts one byte further on (modulo the frame), so the
    /// cuts sweep the offsets rather than sample them.
    cuts: usize,
}

fn server(client: IpAddr) -> IpAddr {
    match client {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1)),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1)),
    }
}

/// The model's view of a segment built from `tcp`.
fn segment(tcp: &Tcp) -> Input {
    Input::Segment(Segment {
        src: tcp.src,
        dst: tcp.dst,
        sport: tcp.sport,
        dport: tcp.dport,
        seq: tcp.seq,
        ack: tcp.ack,
        flags: tcp.flag_byte(),
        fragment: false,
    })
}

const ACK: u8 = 0x10;
const SYN: u8 = 0x02;
const FIN: u8 = 0x01;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;

impl Generator {
    fn new(seed: u64, ports: Vec<u16>) -> Self {
        let v4 = (0..V4_CLIENTS).map(|i| IpAddr::V4(Ipv4Addr::new(192, 0, 2, i as u8 + 1)));
        // Every tenth in the denied /48; each in its own /64 (the default IPv6 source prefix).
        let v6 = (0..V6_CLIENTS).map(|i| {
            let third = if i % 10 == 0 { 0xbad } else { 0 };
            IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, third, i as u16, 0, 0, 0, 1))
        });
        let clients: Vec<IpAddr> = v4.chain(v6).collect();
        let conns = vec![Conn::default(); clients.len() * PORTS_PER_CLIENT];
        Self {
            rng: Rng(seed),
            clients,
            ports,
            conns,
            next_flags: 0,
            cuts: 0,
        }
    }

    /// The client's segment of connection `c` with flag byte `flags`.
    fn client(&self, c: usize, flags: u8) -> Tcp {
        let src = self.clients[c / PORTS_PER_CLIENT];
        let sport = 40_000 + (c % PORTS_PER_CLIENT) as u16;
        let conn = self.conns[c];
        let port = self.ports[c % PORTS_PER_CLIENT % self.ports.len()];
        let mut tcp = Tcp::syn(src, sport, server(src), port).with_flag_byte(flags);
        tcp.seq = conn.seq;
        tcp.ack = conn.isn.wrapping_add(1);
        tcp.tcp_options = flags & SYN != 0;
        tcp
    }

    /// The host's segment of connection `c` with flag byte `flags`.
    fn host(&self, c: usize, flags: u8) -> Tcp {
        let conn = self.conns[c];
        let mut tcp = self.client(c, 0).reply(Flags::default());
        tcp = tcp.with_flag_byte(flags);
        tcp.seq = conn.isn.wrapping_add(u32::from(flags & SYN == 0));
        tcp.ack = conn.seq.wrapping_add(1);
        tcp.tcp_options = flags & SYN != 0;
        tcp
    }

    /// Random VLAN tags and IP options or extension headers: none of them changes a verdict.
    fn dress(&mut self, mut tcp: Tcp) -> Tcp {
        tcp.vlans = match self.rng.below(6) {
            0 => Vlans::One(self.rng.below(4094) as u16 + 1),
            1 => Vlans::Two(100, self.rng.below(4094) as u16 + 1),
            _ => Vlans::None,
        };
        if self.rng.percent(15) {
            match tcp.src {
                IpAddr::V4(_) => tcp.ipv4_options = vec![1; 4 * (self.rng.below(10) + 1)],
                IpAddr::V6(_) => tcp.ipv6_extensions = true,
            }
        }
        tcp
    }

    fn xdp(&mut self, tcp: Tcp, label: &'static str) -> Frame {
        let tcp = self.dress(tcp);
        Frame {
            bytes: tcp.build(),
            path: Path::Xdp,
            input: segment(&tcp),
            label,
        }
    }

    fn tc(&mut self, tcp: Tcp, label: &'static str) -> Frame {
        let tcp = self.dress(tcp);
        Frame {
            bytes: tcp.build(),
            path: Path::Tc,
            input: segment(&tcp),
            label,
        }
    }

    fn next(&mut self) -> Frame {
        let c = self.rng.below(self.conns.len());
        match self.rng.below(100) {
            0..55 => self.step(c),
            55..65 => {
                let byte = self.next_flags;
                self.next_flags = byte.wrapping_add(1);
                if self.rng.percent(50) {
                    self.conns[c].seq = self.rng.u32();
                }
                let tcp = self.client(c, byte);
                self.xdp(tcp, "flag byte")
            }
            65..70 => self.truncated(c),
            70..76 => self.fragment(c),
            76..80 => self.chain(c),
            80..82 => self.too_many_vlans(c),
            82..85 => {
                let src = self.clients[c / PORTS_PER_CLIENT];
                let (bytes, reason) = match self.rng.below(3) {
                    0 => (frames::non_ip(), Reason::NonIp),
                    1 => (frames::udp(src, server(src)), Reason::NonTcp),
                    _ => {
                        // A SYN of the connection, tunnelled to the host.
                        let inner = self.client(c, SYN).build();
                        let protocol =
                            [frames::IPIP, frames::IPV6_IN_IP, frames::GRE][self.rng.below(3)];
                        let frame = frames::tunnel(src, server(src), protocol, &inner);
                        (frame, Reason::Tunnel)
                    }
                };
                Frame {
                    bytes,
                    path: Path::Xdp,
                    input: Input::Unparsed(reason),
                    label: "not TCP",
                }
            }
            85..88 => {
                let mut tcp = self.client(c, SYN);
                tcp.dport = OTHER_PORT;
                self.xdp(tcp, "unprotected port")
            }
            88..91 => self.host_discarded(c),
            _ => {
                let flags = [SYN | ACK, ACK, FIN | ACK, RST, RST | ACK, SYN | ACK | PSH];
                let byte = flags[self.rng.below(flags.len())];
                let tcp = self.host(c, byte);
                self.tc(tcp, "host segment")
            }
        }
    }

    /// Now and then, a ban set or lifted on a random client, as the agent's escalation or an
    /// operator would: before one frame in 200, a ban in force, a ban expired when set, or a
    /// ban lifted, one, one and two times in four, so that about a quarter of the clients are
    /// banned once a run is long.
    fn ban_change(&mut self) -> Option<BanChange> {
        if self.rng.below(200) != 0 {
            return None;
        }
        let addr = self.clients[self.rng.below(self.clients.len())];
        Some(match self.rng.below(4) {
            0 => BanChange::Ban(addr, true),
            1 => BanChange::Ban(addr, false),
            _ => BanChange::Unban(addr),
        })
    }

    /// The next segment of a plausible connection on `c`.
    fn step(&mut self, c: usize) -> Frame {
        let conn = self.conns[c];
        match conn.stage {
            Stage::Idle => {
                self.conns[c] = Conn {
                    stage: Stage::SynSent,
                    seq: self.rng.u32(),
                    ..Conn::default()
                };
                let tcp = self.client(c, SYN);
                self.xdp(tcp, "SYN")
            }
            Stage::SynSent if self.rng.percent(10) => {
                let tcp = self.client(c, SYN);
                self.xdp(tcp, "SYN again")
            }
            Stage::SynSent => {
                self.conns[c].isn = self.rng.u32();
                self.conns[c].stage = Stage::SynAcked;
                let tcp = self.host(c, SYN | ACK);
                self.tc(tcp, "SYN-ACK")
            }
            Stage::SynAcked => {
                self.conns[c].stage = Stage::Open;
                let mut tcp = self.client(c, ACK);
                tcp.seq = conn.seq.wrapping_add(1);
                if self.rng.percent(10) {
                    tcp.ack = self.rng.u32();
                }
                if self.rng.percent(20) {
                    tcp.payload = b"CONNECT".to_vec();
                }
                self.xdp(tcp, "handshake ACK")
            }
            Stage::Open => self.open_step(c),
        }
    }

    fn open_step(&mut self, c: usize) -> Frame {
        match self.rng.below(10) {
            0..4 => {
                let mut tcp = self.client(c, ACK | PSH);
                tcp.payload = b"PUBLISH".to_vec();
                self.xdp(tcp, "data")
            }
            4..6 => {
                self.conns[c].fin_in = true;
                self.close_if_both(c);
                let tcp = self.client(c, FIN | ACK);
                self.xdp(tcp, "client FIN")
            }
            6..8 => {
                self.conns[c].fin_out = true;
                self.close_if_both(c);
                let tcp = self.host(c, FIN | ACK);
                self.tc(tcp, "host FIN")
            }
            8 => {
                self.conns[c].stage = Stage::Idle;
                let tcp = self.client(c, RST);
                self.xdp(tcp, "client RST")
            }
            _ => {
                self.conns[c].stage = Stage::Idle;
                let tcp = self.host(c, RST | ACK);
                self.tc(tcp, "host RST")
            }
        }
    }

    fn close_if_both(&mut self, c: usize) {
        if self.conns[c].fin_in && self.conns[c].fin_out {
            self.conns[c].stage = Stage::Idle;
        }
    }

    /// A segment of a client's connection that the host would discard: a wrong IPv4 header
    /// checksum, or an IPv6 source that is an IPv4 client's address mapped (which the
    /// programs would key as that client). Any state it changed would be a hole.
    fn host_discarded(&mut self, c: usize) -> Frame {
        let flags = [SYN, RST, ACK, FIN | ACK, RST | ACK];
        let mut flag = flags[self.rng.below(flags.len())];
        // A plain ACK takes the established fast path unless its ack number's hint is fresh,
        // and passes there uncounted and unjudged (it changes nothing, so the host's discard
        // is all that happens to it): only the ACK that would complete a half-open handshake
        // reaches the discard check, which is the one that matters.
        if flag == ACK && self.conns[c].stage != Stage::SynAcked {
            flag = RST | ACK;
        }
        let mut tcp = self.client(c, flag);
        tcp.ack = self.conns[c].isn.wrapping_add(1);
        let (bytes, reason, label) = match tcp.src {
            IpAddr::V4(_) => {
                let mut bytes = tcp.build();
                // The IPv4 header checksum, after an untagged Ethernet header.
                bytes[14 + 10] ^= 0x5A;
                (bytes, Reason::Checksum, "bad IPv4 checksum")
            }
            IpAddr::V6(_) => {
                let v4 = self
                    .clients
                    .iter()
                    .find_map(|ip| match ip {
                        IpAddr::V4(v4) => Some(*v4),
                        IpAddr::V6(_) => None,
                    })
                    .unwrap_or(Ipv4Addr::new(192, 0, 2, 1));
                tcp.src = IpAddr::V6(v4.to_ipv6_mapped());
                (tcp.build(), Reason::Martian, "IPv4-mapped IPv6 source")
            }
        };
        Frame {
            bytes,
            path: Path::Xdp,
            input: Input::Unparsed(reason),
            label,
        }
    }

    /// A SYN cut short at the next offset: every cut leaves a header or the datagram short.
    fn truncated(&mut self, c: usize) -> Frame {
        let tcp = self.client(c, SYN);
        let mut bytes = self.dress(tcp).build();
        // BPF_PROG_TEST_RUN takes no XDP frame shorter than an Ethernet header.
        let cut = 14 + self.cuts % (bytes.len() - 14);
        self.cuts += 1;
        bytes.truncate(cut);
        Frame {
            bytes,
            path: Path::Xdp,
            input: Input::Unparsed(Reason::Truncated),
            label: "truncated SYN",
        }
    }

    /// A fragment of a SYN: the first (with a whole or a tiny TCP header) or a later one.
    fn fragment(&mut self, c: usize) -> Frame {
        let mut tcp = self.client(c, SYN);
        if self.rng.percent(20) {
            tcp.dport = OTHER_PORT;
        }
        let header = 32;
        tcp.payload = vec![0; 16];
        let (bytes, input, label) = match self.rng.below(3) {
            0 => {
                let first = 8 * (self.rng.below(5) + 1);
                let bytes = tcp.fragments(first).swap_remove(0);
                let input = if first >= header {
                    let Input::Segment(seg) = segment(&tcp) else {
                        unreachable!("segment() gives a segment");
                    };
                    Input::Segment(Segment {
                        fragment: true,
                        ..seg
                    })
                } else {
                    Input::Unparsed(Reason::Fragment)
                };
                (bytes, input, "first fragment")
            }
            1 => {
                let first = 8 * (self.rng.below(5) + 1);
                let bytes = tcp.fragments(first).swap_remove(1);
                (bytes, Input::Unparsed(Reason::Fragment), "last fragment")
            }
            _ => {
                tcp.fragment_offset = self.rng.below(100) as u16 + 1;
                let bytes = self.dress(tcp).build();
                (bytes, Input::Unparsed(Reason::Fragment), "middle fragment")
            }
        };
        Frame {
            bytes,
            path: Path::Xdp,
            input,
            label,
        }
    }

    /// IPv6: a SYN behind 1 to 8 extension headers (the parser follows 5 before TCP). IPv4:
    /// a SYN with options.
    fn chain(&mut self, c: usize) -> Frame {
        let mut tcp = self.client(c, SYN);
        if tcp.src.is_ipv4() {
            tcp.ipv4_options = vec![1; 4 * (self.rng.below(10) + 1)];
            return Frame {
                bytes: tcp.build(),
                path: Path::Xdp,
                input: segment(&tcp),
                label: "IPv4 options",
            };
        }
        let count = self.rng.below(8) + 1;
        let input = if count <= 5 {
            segment(&tcp)
        } else {
            Input::Unparsed(Reason::HeaderChain)
        };
        Frame {
            bytes: tcp.behind_ipv6_chain(count),
            path: Path::Xdp,
            input,
            label: "IPv6 header chain",
        }
    }

    /// Three VLAN tags: one more than the parser follows.
    fn too_many_vlans(&mut self, c: usize) -> Frame {
        let mut tcp = self.client(c, SYN);
        tcp.vlans = Vlans::Two(100, 200);
        let mut bytes = tcp.build();
        let extra = SingleVlanHeader {
            pcp: Default::default(),
            drop_eligible_indicator: false,
            vlan_id: VlanId::try_new(300).expect("vlan"),
            ether_type: EtherType::VLAN_TAGGED_FRAME,
        };
        bytes.splice(14..14, extra.to_bytes());
        Frame {
            bytes,
            path: Path::Xdp,
            input: Input::Unparsed(Reason::Malformed),
            label: "three VLAN tags",
        }
    }
}
