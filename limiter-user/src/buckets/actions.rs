//! Named actions: what each limits, keyed by what, and how its settings are read and checked.
//!
//! Settings arrive from three places, weakest first: the built-in defaults, the config file's
//! `[actions.NAME]` tables, and command-line flags. Every problem is reported with the name of
//! the setting at fault, so an operator can fix the file without reading code.

use std::{collections::BTreeMap, fmt, time::Duration};

use limiter_client::MAX_ACTION_NAME;
use serde::{Deserialize, Deserializer, Serialize, de};

pub use super::bucket_keys::{DEFAULT_TOPIC_LEVELS, KeyKind, MAX_TOPIC_LEVELS};
use super::{
    calendar_quota::{self, Quota},
    gcra::Rate,
    strikes::StrikeRule,
};

/// How an action counts: a GCRA bucket refilled continuously (`rate`, the default), or a fixed
/// allowance per calendar window (`quota`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    #[default]
    Rate,
    Quota,
    /// At most `limit` sessions held at once per key, acquired and released by the broker.
    Concurrency,
}

impl ActionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Rate => "rate",
            ActionKind::Quota => "quota",
            ActionKind::Concurrency => "concurrency",
        }
    }
}

/// Whether refusals are carried out (`enforce`) or only judged and counted (`monitor`, a dry
/// run: Envoy's shadow mode, nginx's `limit_req_dry_run`): every check is judged and counted as
/// it would be, buckets spent alike, but nothing is refused, and no refusal escalates to a ban.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    #[default]
    Enforce,
    Monitor,
}

impl Enforcement {
    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::Enforce => "enforce",
            Enforcement::Monitor => "monitor",
        }
    }
}

/// Tracked keys per action when the config does not say: at most 130 bytes each
/// (`store::BYTES_PER_KEY`), so a full action costs under 33 MB.
pub const DEFAULT_MAX_KEYS: usize = 250_000;

/// `strike-window` when an action sets `strikes-to-disconnect` alone.
pub const DEFAULT_STRIKE_WINDOW: Duration = Duration::from_secs(10);

/// One `[actions.NAME]` table. Every field is optional so that a table for a built-in action
/// overrides only what it names; a new action must give `limit` and `window`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ActionConfig {
    /// `rate` (default) or `quota`.
    pub kind: Option<ActionKind>,
    /// Requests per window (per period for a quota); 0 switches the action off, except for the security actions
    /// (`auth`, `dashboard_auth`), where 0 refuses everything.
    pub limit: Option<u32>,
    /// `"60s"`, `"1m 30s"`, `"500ms"`, or a whole number of milliseconds.
    pub window: Option<Window>,
    /// A quota's window, aligned to the UNIX epoch; default one day, the UTC day.
    pub period: Option<Window>,
    /// Bucket capacity: how many may arrive at once after a quiet spell. Default: the limit.
    pub burst: Option<u32>,
    pub key: Option<KeyKind>,
    /// How many of a topic's levels name a `user+topic` key's bucket (`a/b/c` with 2: `a/b`);
    /// 1 to [`MAX_TOPIC_LEVELS`], default [`DEFAULT_TOPIC_LEVELS`]. Needs `key = "user+topic"`.
    pub topic_levels: Option<u32>,
    /// Cap on tracked keys; past it a new key evicts full buckets, or is answered untracked as
    /// a fresh bucket (docs/protocol.md, "The key cap").
    pub max_keys: Option<usize>,
    /// Whether refusals count towards a kernel ban of the address (ip-keyed actions only).
    pub escalate: Option<bool>,
    /// Whether the action's buckets live in the fleet's Redis, one limit for every agent.
    /// Default: true when a Redis is configured.
    pub shared: Option<bool>,
    /// Limits of their own for named keys (`"premium" = 5000`), per the action's window or
    /// period; each key's burst is its limit. Replaces the overrides set before it whole.
    pub overrides: Option<BTreeMap<String, u32>>,
    /// `enforce` or `monitor`; default: the top-level `mode`.
    pub mode: Option<Enforcement>,
    /// A check whose payload is larger is refused (`payload_too_large`) without spending.
    pub max_payload_bytes: Option<u32>,
    /// Strikes (refusals; an oversize payload weighs `oversize-strikes`) within
    /// `strike-window` that close the connection; 0 never closes. Needs `key = "connection"`.
    pub strikes_to_disconnect: Option<u32>,
    /// Default 10 s, from a count's first strike.
    pub strike_window: Option<Window>,
    /// What one payload over `max-payload-bytes` weighs; default 1.
    pub oversize_strikes: Option<u32>,
}

/// A window length read from TOML as either a humantime string or milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window(pub Duration);

impl<'de> Deserialize<'de> for Window {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = Window;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration such as \"60s\" or \"500ms\", or milliseconds as a number")
            }
            fn visit_u64<E: de::Error>(self, ms: u64) -> Result<Window, E> {
                Ok(Window(Duration::from_millis(ms)))
            }
            fn visit_i64<E: de::Error>(self, ms: i64) -> Result<Window, E> {
                u64::try_from(ms)
                    .map(|ms| Window(Duration::from_millis(ms)))
                    .map_err(|_| E::custom("a window cannot be negative"))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Window, E> {
                humantime::parse_duration(text)
                    .map(Window)
                    .map_err(|e| E::custom(format!("{text:?} is not a duration: {e}")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// A validated action, as the limiter uses it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ActionSpec {
    pub name: String,
    pub kind: ActionKind,
    pub limit: u32,
    /// A rate's window, or a quota's period.
    #[serde(
        rename = "window_ms",
        serialize_with = "crate::duration_units::serialize_ms"
    )]
    pub window: Duration,
    /// A rate's bucket capacity; a quota's is its limit.
    pub burst: u32,
    pub key: KeyKind,
    pub max_keys: usize,
    pub escalate: bool,
    /// A security control: a limit of 0 refuses every attempt instead of switching it off.
    pub security: bool,
    /// Checked against the fleet's buckets in Redis rather than this agent's.
    pub shared: bool,
    /// Keys with a limit of their own, as the operator wrote them. Not serialized: a session
    /// key is a secret, and the status shows only how many there are.
    #[serde(skip)]
    pub overrides: BTreeMap<String, u32>,
    /// The action's own mode; `None` follows the top-level `mode`.
    pub mode: Option<Enforcement>,
    /// Larger payloads are refused; 0 is no cap.
    pub max_payload_bytes: u32,
    /// When strikes close the connection; `None`: never.
    pub strikes: Option<StrikeRule>,
}

/// How an action behaves, derived once from its settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Limit 0 on an ordinary action: every check passes and nothing is tracked.
    Unlimited,
    /// Limit 0 on a security action: every check is refused.
    Closed,
    Limited(Rate),
    Quota(Quota),
    /// At most this many sessions per key.
    Sessions(u32),
}

impl ActionSpec {
    /// This action as it applies to a key overridden with `limit`: the same kind, window and
    /// key, `limit` as its limit and its burst.
    pub fn overridden(&self, limit: u32) -> ActionSpec {
        ActionSpec {
            limit,
            burst: limit,
            overrides: BTreeMap::new(),
            ..self.clone()
        }
    }

    pub fn mode(&self) -> Mode {
        let limited = match self.kind {
            ActionKind::Rate => Rate::new(self.limit, self.window, self.burst).map(Mode::Limited),
            ActionKind::Quota => Quota::new(self.limit, self.window).map(Mode::Quota),
            ActionKind::Concurrency => (self.limit > 0).then_some(Mode::Sessions(self.limit)),
        };
        match limited {
            Some(mode) => mode,
            None if self.security => Mode::Closed,
            None => Mode::Unlimited,
        }
    }
}

/// The built-in actions with their defaults.
pub fn builtin_actions() -> Vec<ActionSpec> {
    let spec = |name: &str, limit, window_s, key, security| ActionSpec {
        name: name.to_owned(),
        kind: ActionKind::Rate,
        limit,
        window: Duration::from_secs(window_s),
        burst: limit,
        key,
        max_keys: DEFAULT_MAX_KEYS,
        escalate: name == "auth",
        security,
        shared: false,
        overrides: BTreeMap::new(),
        mode: None,
        max_payload_bytes: 0,
        strikes: None,
    };
    vec![
        spec("auth", 10, 60, KeyKind::Ip, true),
        spec("dashboard_auth", 10, 60, KeyKind::Ip, true),
        spec("dashboard_api", 300, 60, KeyKind::Session, false),
        spec("publish", 0, 1, KeyKind::User, false),
        spec("subscribe", 0, 60, KeyKind::User, false),
    ]
}

/// Errors name the setting as the operator wrote it (`actions.auth.window`).
pub use crate::errors::ConfigError;

/// Applies the config file's tables, then the flag overrides, over the built-ins.
/// `overrides` is keyed by action name; their errors name the action's flags as a group.
/// With a `fleet` (a Redis configured) actions are shared unless their table says
/// `shared = false`; without one, none can be.
pub fn resolve_actions(
    table: &BTreeMap<String, ActionConfig>,
    overrides: &[(&str, ActionConfig)],
    fleet: bool,
) -> Result<Vec<ActionSpec>, ConfigError> {
    let mut specs = builtin_actions();
    for spec in &mut specs {
        spec.shared = fleet;
    }
    for (name, config) in table {
        let origin = format!("actions.{name}");
        apply(&mut specs, name, config, &origin, fleet)?;
        if let Some(overrides) = &config.overrides {
            let spec = specs.iter_mut().find(|s| s.name == *name);
            apply_overrides(spec.expect("applied above"), overrides, &origin)?;
        }
    }
    for (name, config) in overrides {
        apply(
            &mut specs,
            name,
            config,
            &format!("flags for {name}"),
            fleet,
        )?;
    }
    Ok(specs)
}

fn apply(
    specs: &mut Vec<ActionSpec>,
    name: &str,
    config: &ActionConfig,
    origin: &str,
    fleet: bool,
) -> Result<(), ConfigError> {
    let valid_name = !name.is_empty()
        && name.len() <= MAX_ACTION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !valid_name {
        return Err(ConfigError::new(
            origin,
            format!("an action name is 1 to {MAX_ACTION_NAME} of [A-Za-z0-9_.-]"),
        ));
    }
    let index = match specs.iter().position(|s| s.name == name) {
        Some(index) => index,
        None => {
            let missing = |field: &str| {
                ConfigError::new(format!("{origin}.{field}"), "required for a new action")
            };
            let kind = config.kind.unwrap_or_default();
            specs.push(ActionSpec {
                name: name.to_owned(),
                kind,
                limit: config.limit.ok_or_else(|| missing("limit"))?,
                window: match kind {
                    ActionKind::Rate => config.window.ok_or_else(|| missing("window"))?.0,
                    ActionKind::Quota => calendar_quota::DAY,
                    ActionKind::Concurrency => Duration::ZERO,
                },
                burst: 0,
                key: config.key.unwrap_or(KeyKind::Other),
                max_keys: DEFAULT_MAX_KEYS,
                escalate: false,
                security: false,
                shared: fleet,
                overrides: BTreeMap::new(),
                mode: None,
                max_payload_bytes: 0,
                strikes: None,
            });
            specs.len() - 1
        }
    };
    let spec = &mut specs[index];
    let mut limit_changed = config.limit.is_some_and(|l| l != spec.limit);
    if let Some(kind) = config.kind
        && kind != spec.kind
    {
        // A rate's window is no quota's period, nor the other way round: a changed kind
        // starts from its own defaults.
        spec.kind = kind;
        spec.window = match kind {
            ActionKind::Quota => calendar_quota::DAY,
            ActionKind::Concurrency => Duration::ZERO,
            ActionKind::Rate => {
                config
                    .window
                    .ok_or_else(|| {
                        ConfigError::new(format!("{origin}.window"), "required for a rate")
                    })?
                    .0
            }
        };
        limit_changed = true;
    }
    if let Some(limit) = config.limit {
        spec.limit = limit;
    }
    if spec.kind == ActionKind::Quota {
        return apply_quota(spec, config, origin, fleet);
    }
    if spec.kind == ActionKind::Concurrency {
        return apply_concurrency(spec, config, origin, fleet);
    }
    if config.period.is_some() {
        return Err(ConfigError::new(
            format!("{origin}.period"),
            "only a quota has a period (kind = \"quota\"); a rate has a window",
        ));
    }
    if let Some(window) = config.window {
        spec.window = window.0;
    }
    match config.burst {
        Some(0) => {
            return Err(ConfigError::new(
                format!("{origin}.burst"),
                "must be at least 1 (leave it out to use the limit)",
            ));
        }
        Some(burst) => spec.burst = burst,
        // A burst left unset follows the limit, including a limit changed here.
        None if limit_changed || spec.burst == 0 => spec.burst = spec.limit,
        None => {}
    }
    if spec.window.is_zero() {
        return Err(ConfigError::new(
            format!("{origin}.window"),
            "must be longer than zero",
        ));
    }
    if spec.limit > 0 && Rate::new(spec.limit, spec.window, spec.burst).is_none() {
        return Err(ConfigError::new(
            format!("{origin}.limit"),
            format!(
                "{} per {:?} is finer than one per nanosecond",
                spec.limit, spec.window
            ),
        ));
    }
    apply_common(spec, config, origin, fleet)?;
    // The fleet's buckets count in microseconds (Redis's clock), exactly.
    if spec.shared && spec.limit > 0 && spec.window.as_nanos() / u128::from(spec.limit) < 1_000 {
        return Err(ConfigError::new(
            format!("{origin}.limit"),
            format!(
                "{} per {:?} is finer than one per microsecond, which a shared bucket cannot \
                 express (or set shared = false)",
                spec.limit, spec.window
            ),
        ));
    }
    Ok(())
}

/// A key's own limits, each checked as the action's own limit would be, and each key as a
/// check's key would be (an `ip` action's keys must be addresses).
fn apply_overrides(
    spec: &mut ActionSpec,
    overrides: &BTreeMap<String, u32>,
    origin: &str,
) -> Result<(), ConfigError> {
    for (key, &limit) in overrides {
        let setting = || format!("{origin}.overrides.{key:?}");
        super::bucket_keys::store(spec.key, key.as_bytes()).map_err(|e| {
            ConfigError::new(setting(), format!("not a {} key: {e}", spec.key.as_str()))
        })?;
        if limit == 0 {
            continue;
        }
        let fine = match spec.kind {
            ActionKind::Rate => spec.window.as_nanos() / u128::from(limit) >= 1,
            ActionKind::Quota | ActionKind::Concurrency => true,
        };
        if !fine {
            return Err(ConfigError::new(
                setting(),
                format!(
                    "{limit} per {:?} is finer than one per nanosecond",
                    spec.window
                ),
            ));
        }
        if spec.shared
            && spec.kind == ActionKind::Rate
            && spec.window.as_nanos() / u128::from(limit) < 1_000
        {
            return Err(ConfigError::new(
                setting(),
                format!(
                    "{limit} per {:?} is finer than one per microsecond, which a shared bucket \
                     cannot express",
                    spec.window
                ),
            ));
        }
    }
    spec.overrides = overrides.clone();
    Ok(())
}

/// The settings both kinds share: the key, the key cap, escalation, sharing.
fn apply_common(
    spec: &mut ActionSpec,
    config: &ActionConfig,
    origin: &str,
    fleet: bool,
) -> Result<(), ConfigError> {
    if let Some(key) = config.key {
        spec.key = key;
    }
    if let Some(levels) = config.topic_levels {
        let KeyKind::UserTopic { levels: kept } = &mut spec.key else {
            return Err(ConfigError::new(
                format!("{origin}.topic-levels"),
                "needs key = \"user+topic\": only a topic has levels",
            ));
        };
        *kept = u8::try_from(levels)
            .ok()
            .filter(|l| (1..=MAX_TOPIC_LEVELS).contains(l))
            .ok_or_else(|| {
                ConfigError::new(
                    format!("{origin}.topic-levels"),
                    format!("must be 1 to {MAX_TOPIC_LEVELS}, not {levels}"),
                )
            })?;
    }
    if let Some(max_keys) = config.max_keys {
        if max_keys == 0 {
            return Err(ConfigError::new(
                format!("{origin}.max-keys"),
                "must be at least 1",
            ));
        }
        spec.max_keys = max_keys;
    }
    if let Some(escalate) = config.escalate {
        spec.escalate = escalate;
    }
    if let Some(mode) = config.mode {
        spec.mode = Some(mode);
    }
    if spec.escalate && spec.key != KeyKind::Ip {
        return Err(ConfigError::new(
            format!("{origin}.escalate"),
            "only an action keyed by ip can escalate to a ban",
        ));
    }
    match config.shared {
        Some(true) if !fleet => {
            return Err(ConfigError::new(
                format!("{origin}.shared"),
                "needs the fleet's Redis (cluster.redis)",
            ));
        }
        Some(true) if spec.key == KeyKind::Connection => {
            return Err(ConfigError::new(
                format!("{origin}.shared"),
                "a connection is one broker's: an action keyed by connection is never shared",
            ));
        }
        Some(shared) => spec.shared = shared,
        None => {}
    }
    if spec.key == KeyKind::Connection {
        spec.shared = false;
    }
    apply_strikes(spec, config, origin)
}

/// The payload cap and the strikes that close a connection.
fn apply_strikes(
    spec: &mut ActionSpec,
    config: &ActionConfig,
    origin: &str,
) -> Result<(), ConfigError> {
    let error = |field: &str, why: &str| ConfigError::new(format!("{origin}.{field}"), why);
    if let Some(max) = config.max_payload_bytes {
        if max == 0 {
            return Err(error(
                "max-payload-bytes",
                "must be at least 1 (leave it out for no cap)",
            ));
        }
        spec.max_payload_bytes = max;
    }
    let mut rule = spec.strikes;
    match config.strikes_to_disconnect {
        Some(0) => rule = None,
        Some(to_disconnect) => {
            rule = Some(StrikeRule {
                to_disconnect,
                ..rule.unwrap_or(StrikeRule {
                    to_disconnect,
                    window: DEFAULT_STRIKE_WINDOW,
                    oversize: 1,
                })
            });
        }
        None => {}
    }
    if let Some(window) = config.strike_window {
        let Some(rule) = rule.as_mut() else {
            return Err(error(
                "strike-window",
                "needs strikes-to-disconnect (at least 1)",
            ));
        };
        if window.0.is_zero() {
            return Err(error("strike-window", "must be longer than zero"));
        }
        rule.window = window.0;
    }
    if let Some(oversize) = config.oversize_strikes {
        let Some(rule) = rule.as_mut() else {
            return Err(error(
                "oversize-strikes",
                "needs strikes-to-disconnect (at least 1)",
            ));
        };
        if oversize == 0 {
            return Err(error("oversize-strikes", "must be at least 1"));
        }
        if spec.max_payload_bytes == 0 {
            return Err(error(
                "oversize-strikes",
                "needs max-payload-bytes: only a payload over it is oversize",
            ));
        }
        rule.oversize = oversize;
    }
    if rule.is_some() && spec.key != KeyKind::Connection {
        return Err(error(
            "strikes-to-disconnect",
            "needs key = \"connection\": strikes close the connection the key names",
        ));
    }
    spec.strikes = rule;
    Ok(())
}

/// Sessions per key: a limit, and no window, period or burst; shared in a fleet as the other
/// kinds are (the fleet's leases in Redis).
fn apply_concurrency(
    spec: &mut ActionSpec,
    config: &ActionConfig,
    origin: &str,
    fleet: bool,
) -> Result<(), ConfigError> {
    for (field, set) in [
        ("window", config.window.is_some()),
        ("period", config.period.is_some()),
        ("burst", config.burst.is_some()),
    ] {
        if set {
            return Err(ConfigError::new(
                format!("{origin}.{field}"),
                "a concurrency action has only a limit: sessions held at once per key",
            ));
        }
    }
    spec.burst = spec.limit;
    apply_common(spec, config, origin, fleet)
}

/// A quota: a limit per period, with neither a window nor a burst (its capacity is the limit).
fn apply_quota(
    spec: &mut ActionSpec,
    config: &ActionConfig,
    origin: &str,
    fleet: bool,
) -> Result<(), ConfigError> {
    if config.window.is_some() {
        return Err(ConfigError::new(
            format!("{origin}.window"),
            "a quota has a `period` (default one UTC day), not a window",
        ));
    }
    if config.burst.is_some() {
        return Err(ConfigError::new(
            format!("{origin}.burst"),
            "a quota has no burst: its whole limit may be spent at once",
        ));
    }
    if let Some(period) = config.period {
        if !(calendar_quota::MIN_PERIOD..=calendar_quota::MAX_PERIOD).contains(&period.0) {
            return Err(ConfigError::new(
                format!("{origin}.period"),
                "must be from 1s to 366 days",
            ));
        }
        if period.0.subsec_nanos() % 1_000_000 != 0 {
            // Redis counts a shared quota's windows in milliseconds: both must cut the same.
            return Err(ConfigError::new(
                format!("{origin}.period"),
                "must be a whole number of milliseconds",
            ));
        }
        spec.window = period.0;
    }
    spec.burst = spec.limit;
    apply_common(spec, config, origin, fleet)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> BTreeMap<String, ActionConfig> {
        #[derive(Deserialize)]
        struct File {
            actions: BTreeMap<String, ActionConfig>,
        }
        toml::from_str::<File>(text).unwrap().actions
    }

    fn find<'a>(specs: &'a [ActionSpec], name: &str) -> &'a ActionSpec {
        specs.iter().find(|s| s.name == name).unwrap()
    }

    #[test]
    fn a_user_topic_key_takes_its_levels_from_topic_levels() {
        let specs = resolve_actions(
            &table(
                "[actions.rooms]\nlimit = 100\nwindow = \"1s\"\nkey = \"user+topic\"\n\
                 topic-levels = 2\n\
                 [actions.feeds]\nlimit = 5\nwindow = \"1s\"\nkey = \"user+topic\"\n\
                 [actions.feeds.overrides]\n\"bob\\u0000news/sport\" = 50\n",
            ),
            &[],
            false,
        )
        .unwrap();
        assert_eq!(find(&specs, "rooms").key, KeyKind::UserTopic { levels: 2 });
        let feeds = find(&specs, "feeds");
        assert_eq!(feeds.key, KeyKind::UserTopic { levels: 1 });
        assert_eq!(feeds.key.as_str(), "user+topic");
        assert_eq!(feeds.overrides.len(), 1);
        let shown = serde_json::to_value(feeds).unwrap();
        assert_eq!(shown["key"], "user+topic");
    }

    #[test]
    fn topic_levels_out_of_range_or_without_a_topic_key_are_errors_naming_it() {
        for (extra, needle) in [
            (
                "key = \"user+topic\"\ntopic-levels = 0\n",
                "must be 1 to 32, not 0",
            ),
            (
                "key = \"user+topic\"\ntopic-levels = 33\n",
                "must be 1 to 32, not 33",
            ),
            (
                "key = \"user+topic\"\ntopic-levels = 300\n",
                "must be 1 to 32, not 300",
            ),
            (
                "key = \"user\"\ntopic-levels = 2\n",
                "needs key = \"user+topic\"",
            ),
            ("topic-levels = 2\n", "needs key = \"user+topic\""),
        ] {
            let text = format!("[actions.rooms]\nlimit = 10\nwindow = \"1s\"\n{extra}");
            let err = resolve_actions(&table(&text), &[], false).unwrap_err();
            assert_eq!(err.setting, "actions.rooms.topic-levels", "{extra}");
            assert!(err.message.contains(needle), "{extra}: {err}");
        }
        // An override's key is checked as a user+topic key is.
        let text = "[actions.rooms]\nlimit = 10\nwindow = \"1s\"\nkey = \"user+topic\"\n\
                    [actions.rooms.overrides]\n\"no-topic\" = 5\n";
        let err = resolve_actions(&table(text), &[], false).unwrap_err();
        assert!(err.message.contains("not a user+topic key"), "{err}");
        // An unknown kind names the kinds there are.
        let err = toml::from_str::<ActionConfig>("key = \"topic\"\n").unwrap_err();
        assert!(err.to_string().contains("user+topic"), "{err}");
    }

    #[test]
    fn overrides_are_checked_as_the_action_checks_its_keys_and_limits() {
        let specs = resolve_actions(
            &table(
                "[actions.publish]\nlimit = 100\nwindow = \"1s\"\n\
                 [actions.publish.overrides]\n\"premium\" = 5000\n\"muted\" = 0\n\
                 [actions.auth.overrides]\n\"10.0.0.1\" = 1\n\"::ffff:10.0.0.2\" = 50\n",
            ),
            &[],
            false,
        )
        .unwrap();
        let publish = find(&specs, "publish");
        assert_eq!(publish.overrides.len(), 2);
        let premium = publish.overridden(publish.overrides["premium"]);
        assert_eq!((premium.limit, premium.burst), (5000, 5000));
        assert_eq!(premium.window, publish.window);
        assert_eq!(publish.overridden(0).mode(), Mode::Unlimited);
        // A security action's key overridden to 0 is closed, as the action would be.
        assert_eq!(find(&specs, "auth").overridden(0).mode(), Mode::Closed);
        for (text, setting) in [
            (
                "[actions.auth.overrides]\n\"premium\" = 5\n",
                "actions.auth.overrides.\"premium\"",
            ),
            (
                "[actions.publish]\nlimit = 1\nwindow = \"1ms\"\n\
                 [actions.publish.overrides]\n\"fast\" = 2000000\n",
                "actions.publish.overrides.\"fast\"",
            ),
        ] {
            let error = resolve_actions(&table(text), &[], false).unwrap_err();
            assert_eq!(error.setting, setting, "{text}: {error}");
        }
        let shared = resolve_actions(
            &table("[actions.publish]\nlimit = 1\nwindow = \"1s\"\n[actions.publish.overrides]\n\"a\" = 2000000\n"),
            &[],
            true,
        )
        .unwrap_err();
        assert!(shared.message.contains("microsecond"), "{shared}");
    }

    #[test]
    fn builtins_have_the_documented_defaults() {
        let specs = resolve_actions(&BTreeMap::new(), &[], false).unwrap();
        let auth = find(&specs, "auth");
        assert_eq!(
            (auth.limit, auth.burst, auth.window),
            (10, 10, Duration::from_secs(60))
        );
        assert_eq!(auth.key, KeyKind::Ip);
        assert_eq!(find(&specs, "dashboard_api").key, KeyKind::Session);
        assert_eq!(find(&specs, "dashboard_api").limit, 300);
        assert_eq!(find(&specs, "publish").mode(), Mode::Unlimited);
        assert_eq!(find(&specs, "subscribe").mode(), Mode::Unlimited);
    }

    #[test]
    fn a_zero_limit_switches_off_ordinary_actions_but_closes_security_ones() {
        let specs = resolve_actions(
            &table("[actions.auth]\nlimit = 0\n[actions.dashboard_api]\nlimit = 0\n"),
            &[],
            false,
        )
        .unwrap();
        assert_eq!(find(&specs, "auth").mode(), Mode::Closed);
        assert_eq!(find(&specs, "dashboard_api").mode(), Mode::Unlimited);
    }

    #[test]
    fn tables_override_builtins_and_define_new_actions() {
        let specs = resolve_actions(
            &table(
                "[actions.auth]\nwindow = \"2m\"\n\
                 [actions.export]\nlimit = 5\nwindow = 1500\nburst = 2\nkey = \"user\"\n",
            ),
            &[(
                "auth",
                ActionConfig {
                    limit: Some(4),
                    ..Default::default()
                },
            )],
            true,
        )
        .unwrap();
        let auth = find(&specs, "auth");
        assert_eq!(
            (auth.limit, auth.burst),
            (4, 4),
            "burst follows a changed limit"
        );
        assert_eq!(auth.window, Duration::from_secs(120));
        let export = find(&specs, "export");
        assert_eq!(export.window, Duration::from_millis(1500));
        assert_eq!(
            (export.limit, export.burst, export.key),
            (5, 2, KeyKind::User)
        );
        assert!(
            auth.shared && export.shared,
            "a fleet shares every action by default"
        );
    }

    #[test]
    fn only_a_fleet_shares_and_an_action_may_stay_local() {
        let local = table("[actions.publish]\nlimit = 5\nshared = false\n");
        let specs = resolve_actions(&local, &[], true).unwrap();
        assert!(!find(&specs, "publish").shared);
        assert!(find(&specs, "auth").shared);
        let shared = table("[actions.publish]\nshared = true\n");
        let error = resolve_actions(&shared, &[], false).unwrap_err();
        assert_eq!(error.setting, "actions.publish.shared");
        assert!(
            resolve_actions(&BTreeMap::new(), &[], false)
                .unwrap()
                .iter()
                .all(|s| !s.shared)
        );
    }

    #[test]
    fn errors_name_the_setting() {
        let error =
            resolve_actions(&table("[actions.export]\nlimit = 5\n"), &[], false).unwrap_err();
        assert_eq!(error.setting, "actions.export.window");
        let error = resolve_actions(&table("[actions.auth]\nburst = 0\n"), &[], false).unwrap_err();
        assert_eq!(error.setting, "actions.auth.burst");
        let error = resolve_actions(
            &table("[actions.publish]\nlimit = 5\nescalate = true\n"),
            &[],
            false,
        )
        .unwrap_err();
        assert_eq!(error.setting, "actions.publish.escalate");
        let error =
            resolve_actions(&table("[actions.auth]\nwindow = 0\n"), &[], false).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid setting `actions.auth.window`: must be longer than zero"
        );
    }

    #[test]
    fn quotas_default_to_the_utc_day_and_take_a_period() {
        let specs = resolve_actions(
            &table(
                "[actions.sends]\nkind = \"quota\"\nlimit = 500\nkey = \"user\"\n\
                 [actions.exports]\nkind = \"quota\"\nlimit = 3\nperiod = \"7d\"\n\
                 [actions.publish]\nkind = \"quota\"\nlimit = 10000\n",
            ),
            &[],
            false,
        )
        .unwrap();
        let sends = find(&specs, "sends");
        assert_eq!(sends.kind, ActionKind::Quota);
        assert_eq!((sends.window, sends.burst), (calendar_quota::DAY, 500));
        assert!(matches!(sends.mode(), Mode::Quota(_)));
        assert_eq!(find(&specs, "exports").window, 7 * calendar_quota::DAY);
        // A built-in turned into a quota leaves its rate window behind.
        let publish = find(&specs, "publish");
        assert_eq!(
            (publish.window, publish.burst),
            (calendar_quota::DAY, 10_000)
        );
        assert_eq!(find(&specs, "auth").kind, ActionKind::Rate);
    }

    #[test]
    fn quota_errors_name_the_field() {
        let error = |text: &str| {
            resolve_actions(&table(text), &[], false)
                .unwrap_err()
                .setting
        };
        assert_eq!(
            error("[actions.q]\nkind = \"quota\"\nlimit = 5\nwindow = \"1h\"\n"),
            "actions.q.window"
        );
        assert_eq!(
            error("[actions.q]\nkind = \"quota\"\nlimit = 5\nburst = 2\n"),
            "actions.q.burst"
        );
        assert_eq!(
            error("[actions.q]\nkind = \"quota\"\nlimit = 5\nperiod = \"500ms\"\n"),
            "actions.q.period"
        );
        assert_eq!(
            error("[actions.q]\nkind = \"quota\"\nlimit = 5\nperiod = \"400d\"\n"),
            "actions.q.period"
        );
        assert_eq!(
            error("[actions.q]\nkind = \"quota\"\nlimit = 5\nperiod = \"1s 1us\"\n"),
            "actions.q.period"
        );
        assert_eq!(
            error("[actions.q]\nlimit = 5\nwindow = \"1h\"\nperiod = \"1d\"\n"),
            "actions.q.period"
        );
        assert_eq!(error("[actions.q]\nkind = \"quota\"\n"), "actions.q.limit");
        // A quota's window cannot come from a flag either.
        let error = resolve_actions(
            &table("[actions.auth]\nkind = \"quota\"\n"),
            &[(
                "auth",
                ActionConfig {
                    window: Some(Window(Duration::from_secs(5))),
                    ..Default::default()
                },
            )],
            false,
        )
        .unwrap_err();
        assert_eq!(error.setting, "flags for auth.window");
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct File {
            actions: BTreeMap<String, ActionConfig>,
        }
        let error = toml::from_str::<File>("[actions.q]\nkind = \"daily\"\n").unwrap_err();
        assert!(error.to_string().contains("quota"), "{error}");
    }

    #[test]
    fn unknown_fields_and_bad_windows_are_rejected_by_the_parser() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct File {
            actions: BTreeMap<String, ActionConfig>,
        }
        let error = toml::from_str::<File>("[actions.auth]\nlimt = 5\n").unwrap_err();
        assert!(error.to_string().contains("limt"), "{error}");
        let error = toml::from_str::<File>("[actions.auth]\nwindow = \"soon\"\n").unwrap_err();
        assert!(error.to_string().contains("not a duration"), "{error}");
    }
}
