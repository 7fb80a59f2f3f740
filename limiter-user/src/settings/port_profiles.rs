//! `[profiles.NAME]` (and `--profile`): groups of protected ports held to limits of their own
//! and counted apart, as EMQX and mosquitto cap each listener: a source's MQTT connections do
//! not spend its dashboard allowance. What a profile leaves out is the top level's.

use std::{collections::BTreeMap, str::FromStr};

use clap::ValueEnum;
use limiter_common::{Limits, MAX_PROFILES, Refusal, profile::PROFILE_NAME_BYTES};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{ConfigError, flags::RefusalArg};
use crate::{
    buckets::Enforcement,
    datapath::{PortProfile, TOP_LEVEL_PROFILE},
};

/// One profile as written: its name, its ports and any of the limits, the rest taken from
/// the top level.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ProfileArg {
    /// The table's name in the file (`[profiles.NAME]`), the text before the colon in the flag.
    #[serde(skip)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u32>,
    pub max_conn_per_ip: Option<u32>,
    pub max_conn_total: Option<u32>,
    pub syn_rate: Option<u32>,
    pub syn_burst: Option<u32>,
    pub conn_rate: Option<u32>,
    pub conn_burst: Option<u32>,
    pub reject_conn: Option<RefusalArg>,
    pub reject_rate: Option<RefusalArg>,
    pub mode: Option<Enforcement>,
}

/// The keys a profile takes, as the flag's error lists them.
const KEYS: &str = "ports, max-conn-per-ip, max-conn-total, syn-rate, syn-burst, conn-rate, \
                    conn-burst, reject-conn, reject-rate, mode";

/// The flag's form: `NAME:KEY=VALUE,KEY=VALUE`, the keys those of the file's table, the ports
/// joined by `+` (`mqtt:ports=1883+8883,max-conn-per-ip=10`).
impl FromStr for ProfileArg {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (name, settings) = text
            .split_once(':')
            .ok_or_else(|| format!("`{text}` is not NAME:KEY=VALUE,..."))?;
        let mut arg = ProfileArg {
            name: name.trim().to_owned(),
            ..Default::default()
        };
        for pair in settings.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}` is not KEY=VALUE"))?;
            let (key, value) = (key.trim(), value.trim());
            let number = || {
                value
                    .parse::<u32>()
                    .map_err(|_| format!("{key}: `{value}` is not a whole number"))
            };
            let refusal =
                || RefusalArg::from_str(value, true).map_err(|_| format!("{key}: rst or drop"));
            match key {
                "ports" => {
                    arg.ports = value
                        .split('+')
                        .map(|p| {
                            p.trim()
                                .parse::<u32>()
                                .map_err(|_| format!("ports: `{p}` is not a port"))
                        })
                        .collect::<Result<_, _>>()?;
                }
                "max-conn-per-ip" => arg.max_conn_per_ip = Some(number()?),
                "max-conn-total" => arg.max_conn_total = Some(number()?),
                "syn-rate" => arg.syn_rate = Some(number()?),
                "syn-burst" => arg.syn_burst = Some(number()?),
                "conn-rate" => arg.conn_rate = Some(number()?),
                "conn-burst" => arg.conn_burst = Some(number()?),
                "reject-conn" => arg.reject_conn = Some(refusal()?),
                "reject-rate" => arg.reject_rate = Some(refusal()?),
                "mode" => {
                    arg.mode = Some(
                        Enforcement::from_str(value, true)
                            .map_err(|_| "mode: enforce or monitor".to_owned())?,
                    );
                }
                other => return Err(format!("unknown key `{other}` ({KEYS})")),
            }
        }
        Ok(arg)
    }
}

/// The file's form: a table of profiles by name, which the flags' profiles are laid over
/// name by name, key by key (the settings' one merge rule).
pub mod by_name {
    use super::*;

    pub fn serialize<S: Serializer>(profiles: &[ProfileArg], out: S) -> Result<S::Ok, S::Error> {
        let table: BTreeMap<&str, &ProfileArg> =
            profiles.iter().map(|p| (p.name.as_str(), p)).collect();
        table.serialize(out)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(input: D) -> Result<Vec<ProfileArg>, D::Error> {
        let table = BTreeMap::<String, ProfileArg>::deserialize(input)?;
        Ok(table
            .into_iter()
            .map(|(name, arg)| ProfileArg { name, ..arg })
            .collect())
    }
}

/// Checks the profiles against the top level (its `limits`, resolved, and its `ports`, checked)
/// and resolves each to the limits the programs hold its ports to. Every problem names
/// `profiles.NAME.KEY`.
pub fn resolve(
    args: &[ProfileArg],
    top: &Limits,
    top_ports: &[u16],
) -> Result<Vec<PortProfile>, ConfigError> {
    if args.len() > MAX_PROFILES {
        return Err(ConfigError::new(
            "profiles",
            format!("{} profiles; at most {MAX_PROFILES}", args.len()),
        ));
    }
    let mut out: Vec<PortProfile> = Vec::with_capacity(args.len());
    for arg in args {
        let name = &arg.name;
        let fail = |key: &str, message: String| {
            ConfigError::new(format!("profiles.{name}.{key}"), message)
        };
        let valid = !name.is_empty()
            && name.len() < PROFILE_NAME_BYTES
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid {
            return Err(ConfigError::new(
                format!("profiles.{name}"),
                format!(
                    "a name is 1 to {} letters, digits, `-` or `_`",
                    PROFILE_NAME_BYTES - 1
                ),
            ));
        }
        if name == TOP_LEVEL_PROFILE {
            return Err(ConfigError::new(
                format!("profiles.{name}"),
                format!("`{TOP_LEVEL_PROFILE}` names the top level's ports; choose another"),
            ));
        }
        if arg.ports.is_empty() {
            return Err(fail("ports", "names no port".into()));
        }
        let mut ports = Vec::with_capacity(arg.ports.len());
        for port in &arg.ports {
            let port = match *port {
                port @ 1..=65_535 => port as u16,
                other => {
                    return Err(fail(
                        "ports",
                        format!("{other} is not a TCP port (1-65535)"),
                    ));
                }
            };
            if top_ports.contains(&port) {
                return Err(fail(
                    "ports",
                    format!("{port} is in the top-level ports too; a port has one profile"),
                ));
            }
            if let Some(other) = out.iter().find(|p| p.ports.contains(&port)) {
                return Err(fail(
                    "ports",
                    format!(
                        "{port} is in profiles.{} too; a port has one profile",
                        other.name
                    ),
                ));
            }
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        let syn_rate = arg.syn_rate.unwrap_or(top.syn_rate);
        if syn_rate > 1_000_000_000 {
            return Err(fail(
                "syn-rate",
                "more than one SYN per nanosecond cannot be metered".into(),
            ));
        }
        // As at the top level: a rate of its own brings its default burst.
        let syn_burst = match (arg.syn_burst, arg.syn_rate) {
            (Some(burst), _) => burst,
            (None, Some(rate)) => rate.saturating_mul(2),
            (None, None) => top.syn_burst,
        };
        if syn_rate != 0 && syn_burst == 0 {
            return Err(fail(
                "syn-burst",
                "must be at least 1 when a SYN rate is set".into(),
            ));
        }
        let conn_rate = arg.conn_rate.unwrap_or(top.conn_rate);
        if conn_rate > 1_000_000_000 {
            return Err(fail(
                "conn-rate",
                "more than one connection per nanosecond cannot be metered".into(),
            ));
        }
        let conn_burst = match (arg.conn_burst, arg.conn_rate) {
            (Some(burst), _) => burst,
            (None, Some(rate)) => rate,
            (None, None) => top.conn_burst,
        };
        if conn_rate != 0 && conn_burst == 0 {
            return Err(fail(
                "conn-burst",
                "must be at least 1 when a connection rate is set".into(),
            ));
        }
        let refusal =
            |arg: Option<RefusalArg>, top: u8| arg.map_or(top, |r| Refusal::from(r) as u8);
        let mut limits = Limits {
            max_conn_per_ip: arg.max_conn_per_ip.unwrap_or(top.max_conn_per_ip),
            max_conn_total: arg.max_conn_total.unwrap_or(top.max_conn_total),
            syn_rate,
            syn_burst,
            conn_rate,
            conn_burst,
            reject_conn: refusal(arg.reject_conn, top.reject_conn),
            reject_rate: refusal(arg.reject_rate, top.reject_rate),
            monitor: arg
                .mode
                .map_or(top.monitor, |mode| (mode == Enforcement::Monitor).into()),
            ..Limits::UNLIMITED
        };
        limits.derive_rate_terms();
        out.push(PortProfile {
            name: name.clone(),
            ports,
            limits,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top() -> Limits {
        Limits {
            max_conn_per_ip: 10,
            max_conn_total: 1000,
            syn_rate: 20,
            syn_burst: 40,
            ..Limits::UNLIMITED
        }
    }

    fn arg(text: &str) -> ProfileArg {
        text.parse().unwrap()
    }

    #[test]
    fn the_flag_form_reads_every_key() {
        assert_eq!(
            arg(
                "mqtt:ports=1883+8883,max-conn-per-ip=5,max-conn-total=900,syn-rate=3,\
                 syn-burst=4,conn-rate=50,conn-burst=60,reject-conn=drop,reject-rate=rst,\
                 mode=monitor"
            ),
            ProfileArg {
                name: "mqtt".into(),
                ports: vec![1883, 8883],
                max_conn_per_ip: Some(5),
                max_conn_total: Some(900),
                syn_rate: Some(3),
                syn_burst: Some(4),
                conn_rate: Some(50),
                conn_burst: Some(60),
                reject_conn: Some(RefusalArg::Drop),
                reject_rate: Some(RefusalArg::Rst),
                mode: Some(Enforcement::Monitor),
            }
        );
        for (bad, needle) in [
            ("mqtt", "NAME:KEY=VALUE"),
            ("mqtt:ports=1883+x", "ports: `x`"),
            ("mqtt:max-conns=3", "unknown key `max-conns`"),
            ("mqtt:mode=dry", "mode: enforce or monitor"),
            ("mqtt:reject-conn=maybe", "reject-conn: rst or drop"),
        ] {
            let err = bad.parse::<ProfileArg>().unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn the_file_form_is_a_table_per_profile_and_a_typo_names_its_key() {
        let file = crate::settings::FileConfig::parse(
            "[profiles.mqtt]\nports = [1883, 8883]\nmax-conn-per-ip = 5\n\n\
             [profiles.dashboard]\nports = [8080]\nmode = \"monitor\"\n",
        )
        .unwrap();
        let names: Vec<_> = file
            .layer
            .profiles
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names, ["dashboard", "mqtt"]);
        assert_eq!(
            file.layer.profiles[1],
            arg("mqtt:ports=1883+8883,max-conn-per-ip=5")
        );
        let err =
            crate::settings::FileConfig::parse("[profiles.mqtt]\nports = [1]\nmax-conns = 1\n")
                .unwrap_err();
        assert!(err.message.contains("max-conns"), "{err:?}");
    }

    #[test]
    fn what_a_profile_leaves_out_comes_from_the_top_level() {
        let resolved = resolve(
            &[
                arg("mqtt:ports=1883+8883+1883,max-conn-per-ip=5"),
                arg("dash:ports=8080,syn-rate=1,conn-rate=7,mode=monitor,reject-conn=drop"),
            ],
            &top(),
            &[5672],
        )
        .unwrap();
        let mqtt = &resolved[0];
        assert_eq!(mqtt.ports, [1883, 8883]);
        let l = mqtt.limits;
        assert_eq!(
            (
                l.max_conn_per_ip,
                l.max_conn_total,
                l.syn_rate,
                l.syn_burst,
                l.monitor
            ),
            (5, 1000, 20, 40, 0)
        );
        assert_eq!(l.syn_interval_ns, 50_000_000, "terms derived");
        let l = resolved[1].limits;
        assert_eq!(
            (
                l.max_conn_per_ip,
                l.syn_rate,
                l.syn_burst,
                l.conn_rate,
                l.conn_burst
            ),
            (10, 1, 2, 7, 7)
        );
        assert_eq!((l.monitor, l.reject_conn), (1, Refusal::Drop as u8));
    }

    #[test]
    fn a_bad_profile_is_refused_naming_its_key() {
        let too_many: Vec<_> = (0..=MAX_PROFILES)
            .map(|i| arg(&format!("p{i}:ports={}", 1000 + i)))
            .collect();
        for (args, setting, needle) in [
            (
                vec![arg("mqtt:max-conn-per-ip=1")],
                "profiles.mqtt.ports",
                "names no port",
            ),
            (
                vec![arg("mqtt:ports=0")],
                "profiles.mqtt.ports",
                "not a TCP port",
            ),
            (
                vec![arg("mqtt:ports=5672")],
                "profiles.mqtt.ports",
                "top-level ports",
            ),
            (
                vec![arg("a:ports=1883"), arg("b:ports=8883+1883")],
                "profiles.b.ports",
                "profiles.a too",
            ),
            (
                vec![arg("default:ports=1")],
                "profiles.default",
                "top level",
            ),
            (
                vec![arg("my profile:ports=1")],
                "profiles.my profile",
                "letters",
            ),
            (
                vec![arg("m:ports=1,syn-rate=5,syn-burst=0")],
                "profiles.m.syn-burst",
                "at least 1",
            ),
            (
                vec![arg("m:ports=1,conn-rate=5,conn-burst=0")],
                "profiles.m.conn-burst",
                "at least 1",
            ),
            (
                vec![arg("m:ports=1,syn-rate=2000000000")],
                "profiles.m.syn-rate",
                "nanosecond",
            ),
            (too_many, "profiles", "at most 15"),
        ] {
            let err = resolve(&args, &top(), &[5672]).unwrap_err();
            assert_eq!(err.setting, setting);
            assert!(err.message.contains(needle), "{err:?}");
        }
    }
}
