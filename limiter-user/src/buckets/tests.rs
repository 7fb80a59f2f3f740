//! The limiter core driven through its public surface with a manual clock.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{Arc, Barrier},
    thread,
    time::Duration,
};

use limiter_client::{Escalation, NEVER_MS, Outcome};

use super::{escalation::tests::RecordingBanner, *};

fn limiter_with(
    toml_actions: &str,
    escalation: Option<EscalationConfig>,
) -> (Arc<ManualClock>, Arc<RecordingBanner>, Limiter) {
    let clock = Arc::new(ManualClock::new());
    clock.set_ns(1_000_000_000);
    let banner = Arc::new(RecordingBanner::default());
    let limiter = Limiter::new(
        config_of(toml_actions, escalation),
        clock.clone(),
        banner.clone(),
    );
    (clock, banner, limiter)
}

fn stats_of(limiter: &Limiter, action: &str) -> ActionStats {
    limiter
        .stats()
        .into_iter()
        .find(|s| s.action == action)
        .unwrap()
}

#[test]
fn auth_allows_ten_a_minute_per_address_with_retry_and_reset() {
    let (clock, _, limiter) = limiter_with("", None);
    for remaining in (0..10).rev() {
        let v = limiter.check("auth", b"192.0.2.1", 1).unwrap();
        assert_eq!(
            (v.outcome, v.remaining, v.limit),
            (Outcome::Allowed, remaining, 10)
        );
    }
    let refused = limiter.check("auth", b"192.0.2.1", 1).unwrap();
    assert_eq!(refused.outcome, Outcome::Limited);
    assert_eq!(refused.retry_after_ms, 6_000);
    assert_eq!(refused.reset_after_ms, 60_000);
    // Another address is untouched.
    assert!(limiter.check("auth", b"192.0.2.2", 1).unwrap().allowed);
    clock.advance(Duration::from_millis(5_999));
    assert_eq!(
        limiter
            .check("auth", b"192.0.2.1", 1)
            .unwrap()
            .retry_after_ms,
        1
    );
    clock.advance(Duration::from_millis(1));
    assert!(limiter.check("auth", b"192.0.2.1", 1).unwrap().allowed);
    let stats = stats_of(&limiter, "auth");
    assert_eq!(
        (
            stats.counts.allowed,
            stats.counts.limited,
            stats.counts.blocked
        ),
        (12, 2, 2)
    );
}

/// A bytes budget: each check costs a payload's length, all or nothing, so a payload that
/// no longer fits is refused while a smaller one still passes, and one above the burst is
/// refused for good.
#[test]
fn a_bytes_budget_is_spent_by_each_payloads_length() {
    let (_, _, limiter) = limiter_with(
        "[actions.pub_bytes]\nlimit = 1048576\nwindow = \"1h\"\nkey = \"user\"\n",
        None,
    );
    for _ in 0..10 {
        assert!(
            limiter
                .check("pub_bytes", b"alice", 102_400)
                .unwrap()
                .allowed
        );
    }
    let refused = limiter.check("pub_bytes", b"alice", 102_400).unwrap();
    assert_eq!(
        (refused.outcome, refused.remaining),
        (Outcome::Limited, 24_576)
    );
    assert!(
        limiter
            .check("pub_bytes", b"alice", 20_000)
            .unwrap()
            .allowed
    );
    assert_eq!(
        limiter
            .check("pub_bytes", b"alice", 20_000)
            .unwrap()
            .outcome,
        Outcome::Limited
    );
    let never = limiter.check("pub_bytes", b"bob", 1_048_577).unwrap();
    assert_eq!(never.outcome, Outcome::CostExceedsBurst);
    assert_eq!(never.retry_after_ms, NEVER_MS);
    assert_eq!(
        limiter
            .check("pub_bytes", b"bob", u32::MAX)
            .unwrap()
            .outcome,
        Outcome::CostExceedsBurst
    );
    assert!(matches!(
        limiter.check("pub_bytes", b"bob", 0),
        Err(CheckError::ZeroCost)
    ));
}

/// A user+topic action of 3 keyed by two levels: a user's topics under one subtree share
/// three, another subtree or another user has its own, and a key that is no user and topic
/// is an error, not a bucket.
#[test]
fn a_user_topic_action_holds_per_user_and_subtree() {
    let (_, _, limiter) = limiter_with(
        "[actions.rooms]\nlimit = 3\nwindow = \"1h\"\nkey = \"user+topic\"\ntopic-levels = 2\n",
        None,
    );
    let check = |key: &[u8]| limiter.check("rooms", key, 1).unwrap().allowed;
    assert!(check(b"bob\0room/a/x"));
    assert!(check(b"bob\0room/a/y"));
    assert!(check(b"bob\0room/a"));
    assert!(!check(b"bob\0room/a/z"));
    assert!(check(b"bob\0room/b/x"));
    assert!(check(b"carol\0room/a/x"));
    assert_eq!(stats_of(&limiter, "rooms").counts.tracked_keys, 3);
    for bad in [b"bob".as_slice(), b"bob\0room/+/x", b"\0room/a"] {
        assert!(matches!(
            limiter.check("rooms", bad, 1),
            Err(CheckError::InvalidKey { .. })
        ));
    }
}

/// A reload that changes `topic-levels` changes what a key names, so the action starts with
/// empty buckets; one that keeps them keeps the buckets.
#[test]
fn a_reload_changing_topic_levels_starts_afresh() {
    let rooms = |levels: u8| {
        format!(
            "[actions.rooms]\nlimit = 1\nwindow = \"1h\"\nkey = \"user+topic\"\ntopic-levels = {levels}\n"
        )
    };
    let (_, _, limiter) = limiter_with(&rooms(1), None);
    assert!(limiter.check("rooms", b"bob\0room/a", 1).unwrap().allowed);
    limiter.reconfigure(config_of(&rooms(1), None));
    assert!(!limiter.check("rooms", b"bob\0room/a", 1).unwrap().allowed);
    limiter.reconfigure(config_of(&rooms(2), None));
    assert!(limiter.check("rooms", b"bob\0room/a", 1).unwrap().allowed);
}

#[test]
fn peek_consumes_nothing_and_reset_refills() {
    let (_, _, limiter) = limiter_with(
        "[actions.export]\nlimit = 2\nwindow = \"10s\"\nkey = \"user\"\n",
        None,
    );
    for _ in 0..5 {
        let v = limiter.peek("export", b"alice", 2).unwrap();
        assert!(v.allowed);
        assert_eq!(v.remaining, 0, "remaining as if this cost were paid");
    }
    assert_eq!(
        stats_of(&limiter, "export").counts.tracked_keys,
        0,
        "a peek creates nothing"
    );
    assert!(limiter.check("export", b"alice", 2).unwrap().allowed);
    let peek = limiter.peek("export", b"alice", 1).unwrap();
    assert_eq!(
        (peek.outcome, peek.retry_after_ms),
        (Outcome::Limited, 5_000)
    );
    assert!(limiter.reset("export", b"alice").unwrap());
    assert!(!limiter.reset("export", b"alice").unwrap());
    assert!(limiter.check("export", b"alice", 2).unwrap().allowed);
}

#[test]
fn a_cost_above_the_burst_has_its_own_reason_and_spends_nothing() {
    let (_, _, limiter) = limiter_with("[actions.publish]\nlimit = 100\nburst = 50\n", None);
    let v = limiter.check("publish", b"bob", 51).unwrap();
    assert_eq!(v.outcome, Outcome::CostExceedsBurst);
    assert_eq!(v.retry_after_ms, NEVER_MS);
    assert_eq!(v.remaining, 50);
    assert_eq!(limiter.check("publish", b"bob", 50).unwrap().remaining, 0);
}

#[test]
fn off_and_closed() {
    let (_, _, limiter) = limiter_with("[actions.dashboard_auth]\nlimit = 0\n", None);
    for _ in 0..1000 {
        assert_eq!(
            limiter.check("publish", b"bob", 100).unwrap().outcome,
            Outcome::Unlimited
        );
    }
    let closed = limiter.check("dashboard_auth", b"192.0.2.1", 1).unwrap();
    assert_eq!((closed.outcome, closed.allowed), (Outcome::Closed, false));
    assert_eq!(stats_of(&limiter, "publish").counts.tracked_keys, 0);
}

#[test]
fn bad_input_is_an_error() {
    let (_, _, limiter) = limiter_with("", None);
    assert_eq!(
        limiter.check("nope", b"x", 1),
        Err(CheckError::UnknownAction("nope".into()))
    );
    assert!(matches!(
        limiter.check("auth", b"not-an-ip", 1),
        Err(CheckError::InvalidKey { .. })
    ));
    assert_eq!(
        limiter.check("auth", b"192.0.2.1", 0),
        Err(CheckError::ZeroCost)
    );
}

#[test]
fn session_keys_are_digested_in_top_blocked() {
    let (_, _, limiter) = limiter_with("[actions.dashboard_api]\nlimit = 1\n", None);
    for _ in 0..4 {
        limiter.check("dashboard_api", b"tok-secret", 1).unwrap();
    }
    limiter.check("dashboard_api", b"other", 1).unwrap();
    limiter.check("dashboard_api", b"other", 1).unwrap();
    let top = limiter.top_blocked("dashboard_api", 10).unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[0].blocked, 3);
    assert_eq!(top[1].blocked, 1);
    assert!(
        top.iter()
            .all(|k| k.key.starts_with("sha256:") && !k.key.contains("secret"))
    );
}

#[test]
fn sweep_evicts_only_full_buckets() {
    let (clock, _, limiter) = limiter_with("", None);
    limiter.check("auth", b"192.0.2.1", 1).unwrap();
    for _ in 0..10 {
        limiter.check("auth", b"192.0.2.2", 1).unwrap();
    }
    assert_eq!(limiter.sweep(), 0);
    clock.advance(Duration::from_secs(6));
    assert_eq!(limiter.sweep(), 1, "one token refilled: 192.0.2.1 is full");
    assert_eq!(stats_of(&limiter, "auth").counts.tracked_keys, 1);
    clock.advance(Duration::from_secs(54));
    assert_eq!(limiter.sweep(), 1);
    assert_eq!(stats_of(&limiter, "auth").counts.tracked_keys, 0);
}

#[test]
fn a_flood_of_fresh_keys_never_refuses_or_bans_an_innocent_key() {
    // The attack: unescalated checks (as over HTTP) fill auth's key cap with hot buckets.
    let (clock, banner, limiter) = limiter_with(
        "[actions.auth]\nlimit = 10\nwindow = \"60s\"\nmax-keys = 100\n",
        Some(EscalationConfig {
            after: Some(1),
            refused_for: None,
            window: Duration::from_secs(60),
            ban: Duration::from_secs(600),
            increment: BanIncrement::OFF,
            max_addresses: 1000,
        }),
    );
    for i in 0..5_000u32 {
        let key = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
        limiter
            .check_unescalated("auth", key.as_bytes(), 1)
            .unwrap();
    }
    // Every new address's first auth over the broker socket is still allowed, and nobody
    // is banned.
    for i in 0..1_000u32 {
        let key = format!("192.0.{}.{}", i >> 8, i & 255);
        let verdict = limiter.check("auth", key.as_bytes(), 1).unwrap();
        assert!(verdict.allowed, "{key}: {verdict:?}");
    }
    assert!(banner.calls.lock().unwrap().is_empty());
    let stats = stats_of(&limiter, "auth");
    assert_eq!(stats.counts.tracked_keys, 100, "the cap holds");
    assert_eq!(
        stats.counts.overflow_checks,
        5_000 - 100 + 1_000,
        "degraded mode is counted"
    );
    // A key that goes over its own limit is refused as ever.
    let key = b"10.0.0.1";
    let refused = (0..20)
        .filter(|_| !limiter.check("auth", key, 1).unwrap().allowed)
        .count();
    assert!(refused >= 10);
    // Once buckets are full again, new keys make room and are tracked again.
    clock.advance(Duration::from_secs(60));
    for _ in 0..10 {
        assert!(limiter.check("auth", b"198.51.100.1", 1).unwrap().allowed);
    }
    assert!(!limiter.check("auth", b"198.51.100.1", 1).unwrap().allowed);
}

#[test]
fn swept_keys_give_their_memory_back() {
    let (clock, _, limiter) = limiter_with("[actions.export]\nlimit = 5\nwindow = \"1s\"\n", None);
    for i in 0..50_000 {
        limiter
            .check("export", format!("user-{i}").as_bytes(), 1)
            .unwrap();
    }
    const { assert!(BYTES_PER_KEY <= 130, "the documented figure") };
    let full = stats_of(&limiter, "export").key_memory_bytes;
    assert!(full <= 50_000 * BYTES_PER_KEY, "{full} bytes");
    clock.advance(Duration::from_secs(1));
    limiter.sweep();
    let swept = stats_of(&limiter, "export").key_memory_bytes;
    assert!(swept * 10 < full, "{swept} of {full} bytes kept");
}

fn concurrent_admitted(limiter: Arc<Limiter>, keys: usize, per_key: usize) -> Vec<usize> {
    let threads = keys * per_key;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (limiter, barrier) = (limiter.clone(), barrier.clone());
            thread::spawn(move || {
                let key = format!("user-{}", i % keys);
                barrier.wait();
                (
                    i % keys,
                    limiter.check("export", key.as_bytes(), 1).unwrap().allowed,
                )
            })
        })
        .collect();
    let mut admitted = vec![0; keys];
    for handle in handles {
        let (key, allowed) = handle.join().unwrap();
        admitted[key] += usize::from(allowed);
    }
    admitted
}

const FIFTY: &str = "[actions.export]\nlimit = 50\nwindow = \"1h\"\nkey = \"user\"\n";

#[test]
fn four_hundred_concurrent_checks_on_one_key_admit_exactly_fifty() {
    let (_, _, limiter) = limiter_with(FIFTY, None);
    assert_eq!(concurrent_admitted(Arc::new(limiter), 1, 400), vec![50]);
}

#[test]
fn four_hundred_concurrent_checks_across_four_keys_admit_exactly_fifty_each() {
    let (_, _, limiter) = limiter_with(FIFTY, None);
    assert_eq!(concurrent_admitted(Arc::new(limiter), 4, 100), vec![50; 4]);
}

#[test]
fn auth_refusals_and_reported_failures_escalate_to_one_ban() {
    let escalation = EscalationConfig {
        after: Some(3),
        refused_for: None,
        window: Duration::from_secs(60),
        ban: Duration::from_secs(900),
        increment: BanIncrement::OFF,
        max_addresses: 100,
    };
    let (_, banner, limiter) = limiter_with("[actions.auth]\nlimit = 2\n", Some(escalation));
    let addr: IpAddr = "2001:db8::9".parse().unwrap();
    assert_eq!(
        limiter.report_auth_failure(addr),
        Escalation::Counted { failures: 1 }
    );
    for _ in 0..2 {
        assert!(limiter.check("auth", b"2001:db8::9", 1).unwrap().allowed);
    }
    // Refusals 1 and 2 bring the count to 3; the third refusal is the fourth failure.
    for _ in 0..3 {
        assert!(!limiter.check("auth", b"2001:db8::9", 1).unwrap().allowed);
    }
    assert_eq!(limiter.report_auth_failure(addr), Escalation::AlreadyBanned);
    assert_eq!(
        *banner.calls.lock().unwrap(),
        vec![(addr, Some(Duration::from_secs(900)))]
    );
    assert_eq!(limiter.escalation_stats().unwrap().bans, 1);
    limiter.unban(addr).unwrap();
    assert_eq!(
        limiter.report_auth_failure(addr),
        Escalation::Counted { failures: 1 }
    );
}

#[test]
fn escalation_is_off_unless_configured() {
    let (_, banner, limiter) = limiter_with("[actions.auth]\nlimit = 1\n", None);
    for _ in 0..50 {
        limiter.check("auth", b"192.0.2.1", 1).unwrap();
    }
    assert_eq!(
        limiter.report_auth_failure("192.0.2.1".parse().unwrap()),
        Escalation::Off
    );
    assert!(banner.calls.lock().unwrap().is_empty());
}

fn config_of(toml_actions: &str, escalation: Option<EscalationConfig>) -> LimiterConfig {
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        actions: BTreeMap<String, ActionConfig>,
    }
    let file: File = toml::from_str(toml_actions).unwrap();
    LimiterConfig {
        actions: resolve_actions(&file.actions, &[], false).unwrap(),
        escalation,
        mode: Enforcement::Enforce,
    }
}

#[test]
fn a_reload_names_each_mode_it_changes_once() {
    use crate::events::Event;
    let actions = |publish: &str| {
        format!(
            "[actions.export]\nlimit = 1\nwindow = \"1s\"\n\
             [actions.publish]\nlimit = 1\nwindow = \"1s\"\n{publish}"
        )
    };
    let with = |mode, publish: &str| LimiterConfig {
        mode,
        ..config_of(&actions(publish), None)
    };
    let mode = |action: Option<&str>, from, to| Event::Mode {
        action: action.map(str::to_owned),
        from,
        to,
    };
    let enforce = with(Enforcement::Enforce, "");
    assert!(enforce.mode_changes(&enforce).is_empty());
    // The top level switches every action that follows it: one event.
    assert_eq!(
        enforce.mode_changes(&with(Enforcement::Monitor, "")),
        [mode(None, "enforce", "monitor")]
    );
    // An action of its own mode is named; one that keeps what it runs as is not.
    assert_eq!(
        enforce.mode_changes(&with(Enforcement::Enforce, "mode = \"monitor\"\n")),
        [mode(Some("publish"), "enforce", "monitor")]
    );
    let pinned = with(Enforcement::Enforce, "mode = \"enforce\"\n");
    assert_eq!(
        pinned.mode_changes(&with(Enforcement::Monitor, "mode = \"enforce\"\n")),
        [mode(None, "enforce", "monitor")]
    );
    assert_eq!(
        with(Enforcement::Monitor, "mode = \"enforce\"\n")
            .mode_changes(&with(Enforcement::Monitor, "")),
        [mode(Some("publish"), "enforce", "monitor")]
    );
}

#[test]
fn a_reload_applies_new_limits_to_buckets_that_keep_their_state() {
    let (clock, _, limiter) = limiter_with(
        "[actions.export]\nlimit = 10\nwindow = \"10s\"\nkey = \"user\"\n",
        None,
    );
    let export = limiter.action_id("export").unwrap();
    for _ in 0..4 {
        assert!(limiter.check_id(&export, b"alice", 1).unwrap().allowed);
    }
    let changes = limiter.reconfigure(config_of(
        "[actions.export]\nlimit = 5\nwindow = \"10s\"\nkey = \"user\"\n",
        None,
    ));
    assert_eq!(changes.changed, ["export"]);
    assert!(changes.rekeyed.is_empty() && changes.added.is_empty());
    // Alice spent 4 s of debt; the new bucket holds 10 s at 2 s a token: 3 tokens are left.
    let verdict = limiter.check_id(&export, b"alice", 1).unwrap();
    assert_eq!((verdict.limit, verdict.remaining), (5, 2));
    assert!(limiter.check("export", b"alice", 1).unwrap().allowed);
    assert!(limiter.check("export", b"alice", 1).unwrap().allowed);
    assert!(!limiter.check("export", b"alice", 1).unwrap().allowed);
    clock.advance(Duration::from_secs(2));
    assert!(limiter.check_id(&export, b"alice", 1).unwrap().allowed);
    let stats = stats_of(&limiter, "export");
    assert_eq!(
        (stats.counts.allowed, stats.counts.limited),
        (8, 1),
        "counters carry over"
    );
    assert_eq!(stats.counts.tracked_keys, 1);
}

#[test]
fn a_reload_that_changes_the_key_kind_adds_or_removes_actions_starts_them_afresh() {
    let (_, _, limiter) = limiter_with(
        "[actions.export]\nlimit = 1\nwindow = \"1m\"\nkey = \"user\"\n",
        None,
    );
    let export = limiter.action_id("export").unwrap();
    assert!(limiter.check("export", b"10.0.0.1", 1).unwrap().allowed);
    assert!(!limiter.check("export", b"10.0.0.1", 1).unwrap().allowed);
    let changes = limiter.reconfigure(config_of(
        "[actions.export]\nlimit = 1\nwindow = \"1m\"\nkey = \"ip\"\n\
         [actions.upload]\nlimit = 1\nwindow = \"1m\"\n",
        None,
    ));
    assert_eq!(changes.rekeyed, ["export"]);
    assert_eq!(changes.added, ["upload"]);
    assert!(changes.removed.is_empty());
    assert!(
        limiter.check_id(&export, b"10.0.0.1", 1).unwrap().allowed,
        "a new key kind starts with empty buckets"
    );
    assert!(matches!(
        limiter.check("export", b"alice", 1),
        Err(CheckError::InvalidKey { .. })
    ));
    assert!(limiter.check("upload", b"x", 1).unwrap().allowed);

    let changes = limiter.reconfigure(config_of(
        "[actions.upload]\nlimit = 1\nwindow = \"1m\"\n",
        None,
    ));
    assert_eq!(changes.removed, ["export"]);
    assert_eq!(
        limiter.check_id(&export, b"10.0.0.1", 1),
        Err(CheckError::UnknownAction("export".into())),
        "a resolved id follows the action out"
    );
    assert!(limiter.check("export", b"10.0.0.1", 1).is_err());
    assert!(
        !limiter.check("upload", b"x", 1).unwrap().allowed,
        "kept its bucket"
    );
    assert!(
        limiter
            .reconfigure(config_of(
                "[actions.upload]\nlimit = 1\nwindow = \"1m\"\n",
                None
            ))
            .is_empty()
    );
}

#[test]
fn a_reload_turns_escalation_on_changes_it_and_turns_it_off() {
    let (_, banner, limiter) = limiter_with("", None);
    let addr: IpAddr = "192.0.2.5".parse().unwrap();
    assert_eq!(limiter.report_auth_failure(addr), Escalation::Off);
    let escalation = |after| EscalationConfig {
        after: Some(after),
        refused_for: None,
        window: Duration::from_secs(60),
        ban: Duration::from_secs(120),
        increment: BanIncrement::OFF,
        max_addresses: 100,
    };
    limiter.reconfigure(config_of("[actions.auth]\n", Some(escalation(3))));
    for failures in 1..=2 {
        assert_eq!(
            limiter.report_auth_failure(addr),
            Escalation::Counted { failures }
        );
    }
    // Lowered to 2: the third failure is one more than the new threshold.
    limiter.reconfigure(config_of("[actions.auth]\n", Some(escalation(2))));
    assert_eq!(limiter.report_auth_failure(addr), Escalation::Banned);
    assert_eq!(
        *banner.calls.lock().unwrap(),
        vec![(addr, Some(Duration::from_secs(120)))]
    );
    limiter.reconfigure(config_of("[actions.auth]\n", None));
    assert_eq!(limiter.report_auth_failure(addr), Escalation::Off);
    assert_eq!(limiter.escalation_stats(), None);
}

/// 2026-12-01T23:59:50Z, ten seconds before a UTC midnight.
const BEFORE_MIDNIGHT_NS: u64 = (1_796_083_200 + 86_400 - 10) * 1_000_000_000;

const SENDS: &str = "[actions.sends]\nkind = \"quota\"\nlimit = 20\nkey = \"user\"\n";

#[test]
fn a_daily_quota_rolls_over_at_midnight_utc() {
    let (clock, _, limiter) = limiter_with(SENDS, None);
    clock.set_ns(BEFORE_MIDNIGHT_NS);
    let first = limiter.check("sends", b"tenant-1", 15).unwrap();
    assert_eq!(
        (first.outcome, first.limit, first.remaining),
        (Outcome::Allowed, 20, 5)
    );
    assert_eq!((first.retry_after_ms, first.reset_after_ms), (0, 10_000));
    // A batch of 6 does not fit the 5 left: refused whole, nothing spent.
    let batch = limiter.check("sends", b"tenant-1", 6).unwrap();
    assert_eq!(batch.outcome, Outcome::Limited);
    assert_eq!(
        (batch.remaining, batch.retry_after_ms, batch.reset_after_ms),
        (5, 10_000, 10_000)
    );
    assert_eq!(limiter.peek("sends", b"tenant-1", 5).unwrap().remaining, 0);
    assert!(limiter.check("sends", b"tenant-1", 5).unwrap().allowed);
    clock.advance(Duration::from_millis(9_999));
    let late = limiter.check("sends", b"tenant-1", 1).unwrap();
    assert_eq!((late.allowed, late.retry_after_ms), (false, 1));
    // Midnight: the whole allowance is back, and the next reset is a day away.
    clock.advance(Duration::from_millis(1));
    let tomorrow = limiter.check("sends", b"tenant-1", 20).unwrap();
    assert_eq!(
        (
            tomorrow.allowed,
            tomorrow.remaining,
            tomorrow.reset_after_ms
        ),
        (true, 0, 86_400_000)
    );
    let stats = stats_of(&limiter, "sends");
    assert_eq!(
        (
            stats.counts.allowed,
            stats.counts.limited,
            stats.counts.blocked
        ),
        (3, 2, 2)
    );
}

#[test]
fn a_cost_above_the_quota_has_its_own_reason_and_spends_nothing() {
    let (clock, _, limiter) = limiter_with(SENDS, None);
    clock.set_ns(BEFORE_MIDNIGHT_NS);
    let v = limiter.check("sends", b"tenant-1", 21).unwrap();
    assert_eq!(v.outcome, Outcome::CostExceedsLimit);
    assert_eq!(
        (v.remaining, v.retry_after_ms, v.reset_after_ms),
        (20, NEVER_MS, 0)
    );
    assert_eq!(
        limiter.check("sends", b"tenant-1", 20).unwrap().remaining,
        0
    );
    assert_eq!(stats_of(&limiter, "sends").counts.cost_exceeds_limit, 1);
}

#[test]
fn a_set_period_is_aligned_to_the_epoch() {
    let (clock, _, limiter) = limiter_with(
        "[actions.exports]\nkind = \"quota\"\nlimit = 2\nperiod = \"1h\"\n",
        None,
    );
    // 23:59:50: the hour started at 23:00.
    clock.set_ns(BEFORE_MIDNIGHT_NS);
    assert!(limiter.check("exports", b"k", 2).unwrap().allowed);
    let refused = limiter.check("exports", b"k", 1).unwrap();
    assert_eq!(refused.retry_after_ms, 10_000);
    clock.advance(Duration::from_secs(10));
    let next = limiter.check("exports", b"k", 1).unwrap();
    assert_eq!((next.allowed, next.reset_after_ms), (true, 3_600_000));
}

#[test]
fn quota_keys_are_swept_a_margin_after_their_window() {
    let (clock, _, limiter) = limiter_with(SENDS, None);
    clock.set_ns(BEFORE_MIDNIGHT_NS);
    limiter.check("sends", b"a", 1).unwrap();
    limiter.check("sends", b"b", 21).unwrap();
    assert_eq!(limiter.sweep(), 1, "a key that spent nothing holds nothing");
    clock.advance(Duration::from_secs(10));
    assert_eq!(
        limiter.sweep(),
        0,
        "yesterday's count is kept for the margin"
    );
    clock.advance(Duration::from_secs(3_599));
    assert_eq!(limiter.sweep(), 0);
    clock.advance(Duration::from_secs(1));
    assert_eq!(limiter.sweep(), 1, "an hour into the next day it goes");
    assert_eq!(stats_of(&limiter, "sends").counts.tracked_keys, 0);
}

#[test]
fn a_full_quota_action_makes_room_from_past_windows() {
    let (clock, _, limiter) = limiter_with(
        "[actions.sends]\nkind = \"quota\"\nlimit = 1\nperiod = \"10s\"\nmax-keys = 10\n",
        None,
    );
    clock.set_ns(BEFORE_MIDNIGHT_NS);
    for i in 0..10 {
        limiter
            .check("sends", format!("k{i}").as_bytes(), 1)
            .unwrap();
    }
    assert!(limiter.check("sends", b"new", 1).unwrap().allowed);
    assert_eq!(stats_of(&limiter, "sends").counts.overflow_checks, 1);
    // The margin of a 10 s period is 1 s: past it, the old keys make room.
    clock.advance(Duration::from_secs(11));
    assert!(limiter.check("sends", b"new", 1).unwrap().allowed);
    assert!(
        !limiter.check("sends", b"new", 1).unwrap().allowed,
        "tracked"
    );
    assert_eq!(stats_of(&limiter, "sends").counts.tracked_keys, 1);
}

#[test]
fn two_hundred_concurrent_checks_of_cost_three_fit_a_quota_of_fifty_exactly() {
    let (clock, _, limiter) = limiter_with(SENDS.replace("20", "50").as_str(), None);
    clock.set_ns(BEFORE_MIDNIGHT_NS);
    let limiter = Arc::new(limiter);
    let barrier = Arc::new(Barrier::new(200));
    let handles: Vec<_> = (0..200)
        .map(|_| {
            let (limiter, barrier) = (limiter.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                limiter.check("sends", b"tenant", 3).unwrap().allowed
            })
        })
        .collect();
    let admitted = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|&allowed| allowed)
        .count();
    assert_eq!(admitted, 16);
    assert_eq!(limiter.peek("sends", b"tenant", 2).unwrap().remaining, 0);
    assert_eq!(
        limiter.peek("sends", b"tenant", 3).unwrap().outcome,
        Outcome::Limited
    );
}

/// Checks of cost 1 on `key` admitted back to back, up to 100.
fn admitted(limiter: &Limiter, action: &str, key: &str) -> usize {
    (0..100)
        .take_while(|_| limiter.check(action, key.as_bytes(), 1).unwrap().allowed)
        .count()
}

const PUBLISH_OVERRIDES: &str = "[actions.publish]\nlimit = 10\nwindow = \"1s\"\n\
    [actions.publish.overrides]\n\"premium\" = 50\n\"scraper\" = 1\n\"muted\" = 0\n\
    [actions.auth.overrides]\n\"10.0.0.1\" = 3\n";

#[test]
fn an_override_raises_one_keys_limit_and_another_lowers_one() {
    let (clock, _, limiter) = limiter_with(PUBLISH_OVERRIDES, None);
    assert_eq!(admitted(&limiter, "publish", "premium"), 50);
    assert_eq!(admitted(&limiter, "publish", "scraper"), 1);
    assert_eq!(admitted(&limiter, "publish", "alice"), 10);
    // 0 on an ordinary action: that key is not limited.
    assert_eq!(admitted(&limiter, "publish", "muted"), 100);
    let verdict = limiter.check("publish", b"premium", 1).unwrap();
    assert_eq!((verdict.allowed, verdict.limit), (false, 50));
    // Refilled at its own rate: 50 per second is one every 20 ms.
    clock.advance(Duration::from_millis(20));
    assert_eq!(admitted(&limiter, "publish", "premium"), 1);
    // An address override is found however the address is written.
    assert_eq!(admitted(&limiter, "auth", "::ffff:10.0.0.1"), 3);
    assert_eq!(admitted(&limiter, "auth", "10.0.0.1"), 0);
    assert_eq!(admitted(&limiter, "auth", "10.0.0.2"), 10);
}

#[test]
fn a_full_override_key_is_swept_by_its_own_rate_and_a_reload_changes_it_live() {
    let (clock, _, limiter) = limiter_with(PUBLISH_OVERRIDES, None);
    assert_eq!(admitted(&limiter, "publish", "premium"), 50);
    // After 100 ms the default rate would be full again, not premium's (2.5 of 50 back).
    clock.advance(Duration::from_millis(100));
    limiter.sweep();
    assert_eq!(stats_of(&limiter, "publish").counts.tracked_keys, 1);
    clock.advance(Duration::from_secs(1));
    limiter.sweep();
    assert_eq!(stats_of(&limiter, "publish").counts.tracked_keys, 0);
    // A reload lowers premium: its next checks meet the new limit.
    let changes = limiter.reconfigure(config_of(
        "[actions.publish]\nlimit = 10\nwindow = \"1s\"\n\
         [actions.publish.overrides]\n\"premium\" = 2\n",
        None,
    ));
    assert!(
        changes.changed.contains(&"publish".to_owned()),
        "{changes:?}"
    );
    assert_eq!(admitted(&limiter, "publish", "premium"), 2);
    assert_eq!(admitted(&limiter, "publish", "scraper"), 10);
}

#[test]
fn a_quota_off_by_default_holds_an_overridden_key_to_its_own_quota() {
    let (clock, _, limiter) = limiter_with(
        "[actions.sends]\nkind = \"quota\"\nlimit = 0\nkey = \"user\"\n\
         [actions.sends.overrides]\n\"trial\" = 3\n",
        None,
    );
    clock.set_ns(10 * 86_400 * 1_000_000_000 + 1);
    assert_eq!(admitted(&limiter, "sends", "trial"), 3);
    assert_eq!(admitted(&limiter, "sends", "anyone"), 100);
    clock.set_ns(11 * 86_400 * 1_000_000_000);
    assert_eq!(admitted(&limiter, "sends", "trial"), 3);
}

fn with_mode(toml_actions: &str, mode: Enforcement) -> (Arc<ManualClock>, Limiter) {
    let clock = Arc::new(ManualClock::new());
    clock.set_ns(1_000_000_000);
    let config = LimiterConfig {
        mode,
        ..config_of(
            toml_actions,
            Some(EscalationConfig {
                after: Some(2),
                refused_for: None,
                window: Duration::from_secs(60),
                ban: Duration::from_secs(600),
                increment: BanIncrement::OFF,
                max_addresses: 100,
            }),
        )
    };
    let banner = Arc::new(RecordingBanner::default());
    (clock.clone(), Limiter::new(config, clock, banner))
}

/// The same traffic through `limiter`: three keys over a minute and a half, some batches too
/// big for the burst; returns how many checks were refused.
fn traffic(clock: &ManualClock, limiter: &Limiter) -> usize {
    let mut refused = 0;
    for step in 0..90 {
        for (key, cost) in [("alice", 1), ("bob", 2), ("carol", 7)] {
            refused += usize::from(
                !limiter
                    .check("publish", key.as_bytes(), cost)
                    .unwrap()
                    .allowed,
            );
        }
        clock.advance(Duration::from_millis(if step % 3 == 0 {
            1_000
        } else {
            100
        }));
    }
    refused
}

const PUBLISH_5: &str = "[actions.publish]\nlimit = 5\nwindow = \"1s\"\n";

#[test]
fn monitor_mode_refuses_nothing_and_counts_exactly_what_enforce_refuses() {
    let (clock, enforcing) = with_mode(PUBLISH_5, Enforcement::Enforce);
    let refused = traffic(&clock, &enforcing);
    assert!(refused > 50, "{refused}");
    let (clock, monitoring) = with_mode(PUBLISH_5, Enforcement::Monitor);
    assert_eq!(
        traffic(&clock, &monitoring),
        0,
        "monitor mode refuses nothing"
    );
    let (enforced, monitored) = (
        stats_of(&enforcing, "publish"),
        stats_of(&monitoring, "publish"),
    );
    // Judged alike: the same outcomes, the same buckets spent...
    assert_eq!(monitored.counts.limited, enforced.counts.limited);
    assert_eq!(monitored.counts.allowed, enforced.counts.allowed);
    assert_eq!(monitored.counts.blocked, refused as u64);
    // ...and every refusal enforcement made counted as one monitor mode did not.
    assert_eq!(monitored.counts.would_refuse, refused as u64);
    assert_eq!(enforced.counts.would_refuse, 0);
    let by_reason: u64 = monitored.would_refuse.iter().map(|(_, n)| n).sum();
    assert_eq!(by_reason, refused as u64);
    assert!(
        monitored
            .would_refuse
            .iter()
            .any(|&(o, n)| o == Outcome::CostExceedsBurst && n == 90)
    );
}

#[test]
fn monitor_mode_bans_nobody_and_counts_the_bans_it_did_not_place() {
    let auth = "[actions.auth]\nlimit = 1\nwindow = \"60s\"\n";
    let addr: IpAddr = "192.0.2.9".parse().unwrap();
    let (_, limiter) = with_mode(auth, Enforcement::Monitor);
    for _ in 0..10 {
        assert!(limiter.check("auth", b"192.0.2.9", 1).unwrap().allowed);
        assert!(!matches!(
            limiter.report_auth_failure(addr),
            Escalation::Banned
        ));
    }
    let stats = limiter.escalation_stats().unwrap();
    assert_eq!(stats.bans, 0);
    assert!(stats.would_ban >= 1, "{stats:?}");
    // In enforce mode the same failures ban.
    let (_, limiter) = with_mode(auth, Enforcement::Enforce);
    let results: Vec<_> = (0..3).map(|_| limiter.report_auth_failure(addr)).collect();
    assert_eq!(results[2], Escalation::Banned);
}

#[test]
fn the_mode_switches_live_and_an_actions_own_mode_wins() {
    let (clock, limiter) = with_mode(PUBLISH_5, Enforcement::Enforce);
    let refused = |limiter: &Limiter| {
        (0..10)
            .filter(|_| !limiter.check("publish", b"dave", 1).unwrap().allowed)
            .count()
    };
    assert_eq!(refused(&limiter), 5);
    let mut config = config_of(PUBLISH_5, None);
    config.mode = Enforcement::Monitor;
    limiter.reconfigure(config);
    assert_eq!(refused(&limiter), 0, "monitor from the next check on");
    assert_eq!(stats_of(&limiter, "publish").counts.would_refuse, 10);
    // An action's own mode wins over the top level's, either way.
    let mut config = config_of(
        "[actions.publish]\nlimit = 5\nwindow = \"1s\"\nmode = \"enforce\"\n",
        None,
    );
    config.mode = Enforcement::Monitor;
    limiter.reconfigure(config);
    clock.advance(Duration::from_secs(1));
    assert_eq!(refused(&limiter), 5);
    limiter.reconfigure(config_of(
        "[actions.publish]\nlimit = 5\nwindow = \"1s\"\nmode = \"monitor\"\n",
        None,
    ));
    assert_eq!(refused(&limiter), 0);
}

/// A connection-keyed action: 2 per 10 s, closed at 3 strikes within 10 s; payloads over 100
/// bytes refused, weighing 2 strikes.
const STRIKING: &str = "[actions.pub]\nlimit = 2\nwindow = \"10s\"\nkey = \"connection\"\n\
    strikes-to-disconnect = 3\nstrike-window = \"10s\"\nmax-payload-bytes = 100\n\
    oversize-strikes = 2\n";

fn weighed(limiter: &Arc<Limiter>, key: &str, payload: u32) -> Judged {
    let id = limiter.action_id("pub").unwrap();
    let Ok(judged) = limiter
        .submit(&id, key.as_bytes(), (1, payload), Submit::Check)
        .unwrap()
        .now()
    else {
        panic!("a local action answers at once");
    };
    judged
}

#[test]
fn refusals_strike_a_connection_until_it_is_disconnected_and_stays_so_until_gone() {
    let (clock, _, limiter) = limiter_with(STRIKING, None);
    let outcome = |key: &str| limiter.check("pub", key.as_bytes(), 1).unwrap().outcome;
    assert_eq!(outcome("c1"), Outcome::Allowed);
    assert_eq!(outcome("c1"), Outcome::Allowed);
    assert_eq!(outcome("c1"), Outcome::Limited, "strike 1");
    clock.advance(Duration::from_secs(1));
    assert_eq!(outcome("c1"), Outcome::Limited, "strike 2");
    let closing = limiter.check("pub", b"c1", 1).unwrap();
    assert_eq!(closing.outcome, Outcome::Disconnect, "strike 3 closes");
    assert_eq!(
        (closing.retry_after_ms, closing.reset_after_ms),
        (NEVER_MS, NEVER_MS)
    );
    // Whatever it sends until the broker reports it gone is refused, buckets full or not.
    clock.advance(Duration::from_secs(9));
    assert_eq!(outcome("c1"), Outcome::Disconnect);
    assert_eq!(
        limiter.peek("pub", b"c1", 1).unwrap().outcome,
        Outcome::Disconnect
    );
    // Another connection of the same client is judged by its own bucket and strikes.
    assert_eq!(outcome("c2"), Outcome::Allowed);
    let stats = stats_of(&limiter, "pub");
    assert_eq!(
        (stats.counts.limited, stats.counts.disconnect),
        (2, 2),
        "the closing check and the one after it; a peek counts nothing"
    );
    assert_eq!(stats.counts.struck_connections, 1);
    assert_eq!(
        stats.counts.strike_disconnects, 1,
        "one connection closed, however often it was answered so"
    );
    assert!(limiter.connection_gone(b"c1"));
    assert!(!limiter.connection_gone(b"c1"), "nothing left to forget");
    assert_eq!(
        outcome("c1"),
        Outcome::Allowed,
        "a new connection of that name"
    );
}

#[test]
fn strikes_spread_wider_than_their_window_never_disconnect() {
    let (clock, _, limiter) = limiter_with(STRIKING, None);
    for _ in 0..10 {
        // Two allowed, then one refusal: one strike per 11 s.
        let refused: Vec<Outcome> = (0..3)
            .map(|_| limiter.check("pub", b"c1", 1).unwrap().outcome)
            .collect();
        assert_eq!(
            refused,
            [Outcome::Allowed, Outcome::Allowed, Outcome::Limited]
        );
        clock.advance(Duration::from_secs(11));
    }
}

#[test]
fn an_oversize_payload_is_refused_unspent_and_weighs_its_strikes() {
    let (_, _, limiter) = limiter_with(STRIKING, None);
    let limiter = Arc::new(limiter);
    let fits = weighed(&limiter, "c1", 100);
    assert_eq!(
        (fits.verdict.outcome, fits.verdict.remaining),
        (Outcome::Allowed, 1)
    );
    let over = weighed(&limiter, "c1", 101);
    assert_eq!(over.verdict.outcome, Outcome::PayloadTooLarge);
    // Nothing spent: the bucket still pays the next check.
    assert_eq!(weighed(&limiter, "c1", 0).verdict.outcome, Outcome::Allowed);
    // 2 + 2 strikes reach 3.
    assert_eq!(
        weighed(&limiter, "c1", 5_000).verdict.outcome,
        Outcome::Disconnect
    );
    // A check that does not give a size is never oversize.
    let plain = Limiter::new(
        config_of(STRIKING, None),
        Arc::new(ManualClock::new()),
        Arc::new(RecordingBanner::default()),
    );
    assert_eq!(
        plain.check("pub", b"c9", 1).unwrap().outcome,
        Outcome::Allowed
    );
}

#[test]
fn a_disconnected_connection_silent_for_a_window_is_swept() {
    let (clock, _, limiter) = limiter_with(STRIKING, None);
    for _ in 0..5 {
        limiter.check("pub", b"c1", 1).unwrap();
    }
    assert_eq!(
        limiter.check("pub", b"c1", 1).unwrap().outcome,
        Outcome::Disconnect
    );
    clock.advance(Duration::from_secs(9));
    limiter.sweep();
    assert_eq!(stats_of(&limiter, "pub").counts.struck_connections, 1);
    clock.advance(Duration::from_secs(10));
    limiter.sweep();
    assert_eq!(stats_of(&limiter, "pub").counts.struck_connections, 0);
    assert_eq!(
        limiter.check("pub", b"c1", 1).unwrap().outcome,
        Outcome::Allowed
    );
}

#[test]
fn monitor_mode_judges_strikes_and_says_it_would_disconnect() {
    let (_, limiter) = with_mode(STRIKING, Enforcement::Monitor);
    let limiter = Arc::new(limiter);
    let judged: Vec<Judged> = (0..6).map(|_| weighed(&limiter, "c1", 1)).collect();
    assert!(
        judged.iter().all(|j| j.enforced().allowed),
        "nothing refused"
    );
    let would: Vec<Option<Outcome>> = judged.iter().map(Judged::would_refuse).collect();
    assert_eq!(
        would,
        [
            None,
            None,
            Some(Outcome::Limited),
            Some(Outcome::Limited),
            Some(Outcome::Disconnect),
            Some(Outcome::Disconnect)
        ]
    );
    assert_eq!(
        stats_of(&limiter, "pub").counts.strike_disconnects,
        0,
        "monitor mode closes nothing"
    );
}

#[test]
fn strike_settings_are_checked_naming_the_key() {
    let new = "[actions.x]\nlimit = 1\nwindow = \"1s\"\n";
    for (extra, setting) in [
        (
            "strikes-to-disconnect = 3\n",
            "actions.x.strikes-to-disconnect",
        ),
        (
            "key = \"connection\"\nstrike-window = \"5s\"\n",
            "actions.x.strike-window",
        ),
        (
            "key = \"connection\"\nstrikes-to-disconnect = 3\nstrike-window = 0\n",
            "actions.x.strike-window",
        ),
        (
            "key = \"connection\"\nstrikes-to-disconnect = 3\noversize-strikes = 2\n",
            "actions.x.oversize-strikes",
        ),
        (
            "key = \"connection\"\nstrikes-to-disconnect = 3\nmax-payload-bytes = 9\n\
             oversize-strikes = 0\n",
            "actions.x.oversize-strikes",
        ),
        ("max-payload-bytes = 0\n", "actions.x.max-payload-bytes"),
    ] {
        let text = format!("{new}{extra}");
        let table = toml::from_str::<toml::Table>(&text).unwrap();
        let actions: BTreeMap<String, ActionConfig> = table["actions"].clone().try_into().unwrap();
        let error = resolve_actions(&actions, &[], false).unwrap_err();
        assert_eq!(error.setting, setting, "{text}: {error}");
    }
    let specs = resolve_actions(
        &toml::from_str::<toml::Table>(&format!(
            "{new}key = \"connection\"\nstrikes-to-disconnect = 4\n"
        ))
        .unwrap()["actions"]
            .clone()
            .try_into()
            .unwrap(),
        &[],
        true,
    )
    .unwrap();
    let x = specs.iter().find(|s| s.name == "x").unwrap();
    assert_eq!(
        x.strikes,
        Some(StrikeRule {
            to_disconnect: 4,
            window: Duration::from_secs(10),
            oversize: 1
        })
    );
    assert!(!x.shared, "a connection is never shared, even in a fleet");
}

const SESSIONS: &str = "[actions.logins]\nkind = \"concurrency\"\nlimit = 2\nkey = \"user\"\n\
    [actions.logins.overrides]\n\"service\" = 3\n";

/// An acquire of a local action, answered at once.
fn acquire_now(
    limiter: &Arc<Limiter>,
    owner: &SessionOwner,
    (action, key, session): (&str, &str, &str),
) -> Result<Judged, CheckError> {
    limiter
        .acquire(owner, action, key.as_bytes(), session.as_bytes())
        .map(|pending| {
            pending
                .now()
                .ok()
                .expect("a local acquire is answered at once")
        })
}

#[test]
fn sessions_are_held_per_key_up_to_the_limit_and_given_back_by_their_owner() {
    let (_, _, limiter) = limiter_with(SESSIONS, None);
    let limiter = Arc::new(limiter);
    let broker = SessionOwner::default();
    let take = |owner: &SessionOwner, key: &str, session: &str| {
        acquire_now(&limiter, owner, ("logins", key, session))
            .unwrap()
            .enforced()
            .outcome
    };
    assert_eq!(take(&broker, "alice", "1"), Outcome::Allowed);
    assert_eq!(take(&broker, "alice", "2"), Outcome::Allowed);
    assert_eq!(
        take(&broker, "alice", "2"),
        Outcome::Allowed,
        "held already"
    );
    assert_eq!(take(&broker, "alice", "3"), Outcome::Limited);
    for session in ["1", "2", "3"] {
        assert_eq!(
            take(&broker, "service", session),
            Outcome::Allowed,
            "its own limit"
        );
    }
    assert_eq!(take(&broker, "service", "4"), Outcome::Limited);
    assert_eq!(stats_of(&limiter, "logins").counts.sessions_held, 5);
    let release = |session: &[u8]| {
        let pending = limiter.release(&broker, "logins", b"alice", session);
        pending
            .unwrap()
            .now()
            .ok()
            .expect("a local release is answered at once")
    };
    assert!(release(b"1"));
    assert!(!release(b"1"));
    assert_eq!(take(&broker, "alice", "3"), Outcome::Allowed);
    assert_eq!(stats_of(&limiter, "logins").counts.session_keys, 2);
    drop(broker);
    let counts = stats_of(&limiter, "logins").counts;
    assert_eq!((counts.session_keys, counts.sessions_held), (0, 0));
    assert_eq!(
        acquire_now(
            &limiter,
            &SessionOwner::default(),
            ("auth", "10.0.0.1", "1")
        ),
        Err(CheckError::NotConcurrency("auth".into()))
    );
}

#[test]
fn monitored_sessions_are_all_taken_and_the_refusal_judged() {
    let (_, limiter) = with_mode(SESSIONS, Enforcement::Monitor);
    let limiter = Arc::new(limiter);
    let broker = SessionOwner::default();
    let judged: Vec<Judged> = (0..3)
        .map(|n| acquire_now(&limiter, &broker, ("logins", "alice", &n.to_string())).unwrap())
        .collect();
    assert!(judged.iter().all(|j| j.enforced().allowed));
    assert_eq!(judged[2].would_refuse(), Some(Outcome::Limited));
    assert_eq!(broker.len(), 3);
}

#[test]
fn in_a_fleet_a_concurrency_action_is_shared_unless_keyed_by_connection() {
    let text = "[actions.logins]\nkind = \"concurrency\"\nlimit = 2\nkey = \"user\"\n\
                [actions.conns]\nkind = \"concurrency\"\nlimit = 2\nkey = \"connection\"\n";
    let table = toml::from_str::<toml::Table>(text).unwrap();
    let actions: BTreeMap<String, ActionConfig> = table["actions"].clone().try_into().unwrap();
    let specs = resolve_actions(&actions, &[], true).unwrap();
    let shared = |name: &str| specs.iter().find(|s| s.name == name).unwrap().shared;
    assert!(shared("logins"));
    assert!(!shared("conns"), "a connection is one broker's");
    assert!(
        resolve_actions(&actions, &[], false)
            .unwrap()
            .iter()
            .all(|s| !s.shared)
    );
}

#[test]
fn a_concurrency_action_has_only_a_limit() {
    for (extra, setting) in [
        ("window = \"1s\"\n", "actions.logins.window"),
        ("burst = 3\n", "actions.logins.burst"),
        ("period = \"1d\"\n", "actions.logins.period"),
    ] {
        let text = format!("[actions.logins]\nkind = \"concurrency\"\nlimit = 2\n{extra}");
        let table = toml::from_str::<toml::Table>(&text).unwrap();
        let actions: BTreeMap<String, ActionConfig> = table["actions"].clone().try_into().unwrap();
        let error = resolve_actions(&actions, &[], false).unwrap_err();
        assert_eq!(error.setting, setting, "{text}: {error}");
    }
}
