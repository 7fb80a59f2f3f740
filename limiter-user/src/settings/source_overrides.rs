//! `[[overrides]]` (and `--override`): source prefixes held to limits of their own, Kafka's
//! `max.connections.per.ip.overrides`. A NAT gateway's prefix gets more connections, a known
//! scanner's fewer; the most specific prefix wins, in the kernel's longest-prefix lookup.

use std::str::FromStr;

use ipnet::IpNet;
use limiter_common::{Config, SourceLimits};
use serde::{Deserialize, Serialize};

use super::{ConfigError, cidr_text::parse_cidr};
use crate::datapath::SourceOverride;

/// The setting every problem here is reported under.
const SETTING: &str = "overrides";

/// One override as written: a prefix and any of the per-source limits, the rest taken from the
/// top level.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct OverrideArg {
    pub cidr: String,
    pub max_conn_per_ip: Option<u32>,
    pub syn_rate: Option<u32>,
    pub syn_burst: Option<u32>,
}

/// The flag's form: `CIDR:KEY=VALUE,KEY=VALUE`, the keys those of the file's table.
impl FromStr for OverrideArg {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        // The limits start after the last colon before the first `=`: an IPv6 prefix has
        // colons of its own.
        let (cidr, limits) = text
            .find('=')
            .and_then(|first| text[..first].rsplit_once(':'))
            .map(|(cidr, _)| (cidr, &text[cidr.len() + 1..]))
            .ok_or_else(|| format!("`{text}` is not CIDR:KEY=VALUE,..."))?;
        let mut arg = OverrideArg {
            cidr: cidr.trim().to_owned(),
            ..Default::default()
        };
        for pair in limits.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}` is not KEY=VALUE"))?;
            let value: u32 = value
                .trim()
                .parse()
                .map_err(|_| format!("{key}: `{value}` is not a whole number"))?;
            let field = match key.trim() {
                "max-conn-per-ip" => &mut arg.max_conn_per_ip,
                "syn-rate" => &mut arg.syn_rate,
                "syn-burst" => &mut arg.syn_burst,
                other => {
                    return Err(format!(
                        "unknown key `{other}` (max-conn-per-ip, syn-rate, syn-burst)"
                    ));
                }
            };
            *field = Some(value);
        }
        Ok(arg)
    }
}

/// Checks the overrides against the top-level config (already checked: its prefixes) and
/// resolves each to the limits the programs hold its sources to; a field an override leaves
/// out stays its port profile's ([`SourceLimits::INHERIT`]).
pub fn resolve(args: &[OverrideArg], top: &Config) -> Result<Vec<SourceOverride>, ConfigError> {
    let mut out: Vec<SourceOverride> = Vec::with_capacity(args.len());
    for arg in args {
        let net = parse_cidr(SETTING, &arg.cidr)?;
        let fail = |message: String| ConfigError::new(SETTING, format!("{net}: {message}"));
        let key_prefix = match net {
            IpNet::V4(_) => top.ipv4_prefix,
            IpNet::V6(_) => top.ipv6_prefix,
        };
        if net.prefix_len() > key_prefix {
            let which = if net.addr().is_ipv4() { "ipv4" } else { "ipv6" };
            return Err(fail(format!(
                "narrower than {which}-prefix /{key_prefix}: one source key covers the whole \
                 /{key_prefix}, so its addresses cannot be held to different limits"
            )));
        }
        if arg.max_conn_per_ip.is_none() && arg.syn_rate.is_none() && arg.syn_burst.is_none() {
            return Err(fail(
                "sets no limit (max-conn-per-ip, syn-rate or syn-burst)".into(),
            ));
        }
        if out.iter().any(|o| o.net == net) {
            return Err(fail("given twice".into()));
        }
        if arg.syn_rate.is_some_and(|rate| rate > 1_000_000_000) {
            return Err(fail(
                "syn-rate: more than one SYN per nanosecond cannot be metered".into(),
            ));
        }
        let limits = SourceLimits::new(arg.max_conn_per_ip, arg.syn_rate, arg.syn_burst);
        if limits.syn_burst == 0 && arg.syn_rate != Some(0) {
            return Err(fail(
                "syn-burst: must be at least 1 when a SYN rate is set".into(),
            ));
        }
        out.push(SourceOverride { net, limits });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top() -> Config {
        Config {
            ipv4_prefix: 32,
            ipv6_prefix: 64,
            ..Config::UNCONFIGURED
        }
    }

    fn arg(text: &str) -> OverrideArg {
        text.parse().unwrap()
    }

    #[test]
    fn the_flag_form_reads_every_key_and_ipv6_prefixes() {
        assert_eq!(
            arg("203.0.113.0/24:max-conn-per-ip=5000, syn-rate=50,syn-burst=7"),
            OverrideArg {
                cidr: "203.0.113.0/24".into(),
                max_conn_per_ip: Some(5000),
                syn_rate: Some(50),
                syn_burst: Some(7),
            }
        );
        assert_eq!(arg("2001:db8::/48:max-conn-per-ip=1").cidr, "2001:db8::/48");
        for (bad, needle) in [
            ("10.0.0.0/8", "CIDR:KEY=VALUE"),
            ("10.0.0.0/8:max-conns=3", "unknown key `max-conns`"),
            ("10.0.0.0/8:syn-rate=fast", "syn-rate"),
            ("10.0.0.0/8:syn-rate", "CIDR:KEY=VALUE"),
            (
                "10.0.0.0/8:syn-rate=1,syn-burst",
                "`syn-burst` is not KEY=VALUE",
            ),
        ] {
            let err = bad.parse::<OverrideArg>().unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn the_file_form_is_a_table_per_override_and_a_typo_names_its_key() {
        let file = crate::settings::FileConfig::parse(
            "[[overrides]]\ncidr = \"203.0.113.0/24\"\nmax-conn-per-ip = 5000\n\n\
             [[overrides]]\ncidr = \"198.51.100.7\"\nsyn-rate = 1\n",
        )
        .unwrap();
        assert_eq!(
            file.layer.overrides,
            [
                arg("203.0.113.0/24:max-conn-per-ip=5000"),
                arg("198.51.100.7:syn-rate=1")
            ]
        );
        let err = crate::settings::FileConfig::parse(
            "[[overrides]]\ncidr = \"10.0.0.0/8\"\nmax-conns = 1\n",
        )
        .unwrap_err();
        assert!(err.message.contains("max-conns"), "{err:?}");
    }

    #[test]
    fn what_an_override_leaves_out_is_its_profiles() {
        let resolved = resolve(
            &[
                arg("203.0.113.0/24:max-conn-per-ip=5000"),
                arg("198.51.100.7:syn-rate=1"),
                arg("2001:db8::/48:syn-burst=3"),
            ],
            &top(),
        )
        .unwrap();
        let own = SourceLimits::own;
        let limits: Vec<_> = resolved
            .iter()
            .map(|o| {
                let l = o.limits;
                (
                    o.net.to_string(),
                    own(l.max_conn_per_ip),
                    own(l.syn_rate),
                    own(l.syn_burst),
                )
            })
            .collect();
        assert_eq!(
            limits,
            [
                ("203.0.113.0/24".to_owned(), Some(5000), None, None),
                ("198.51.100.7/32".to_owned(), None, Some(1), Some(2)),
                ("2001:db8::/48".to_owned(), None, None, Some(3)),
            ]
        );
        assert_eq!(resolved[1].limits.syn_interval_ns, 1_000_000_000);
        assert_eq!(resolved[1].limits.syn_tolerance_ns, 2_000_000_000);
    }

    #[test]
    fn a_bad_override_is_refused_naming_it() {
        for (args, needle) in [
            (vec![arg("10.0.0.0/8:max-conn-per-ip=1")], None),
            (vec![arg("10.0.0.1/8:max-conn-per-ip=1")], Some("host bits")),
            (
                vec![arg("2001:db8::1/128:max-conn-per-ip=1")],
                Some("ipv6-prefix /64"),
            ),
            (
                vec![OverrideArg {
                    cidr: "10.0.0.0/8".into(),
                    ..Default::default()
                }],
                Some("sets no limit"),
            ),
            (
                vec![arg("10.0.0.0/8:syn-rate=1"), arg("10.0.0.0/8:syn-burst=1")],
                Some("given twice"),
            ),
            (
                vec![arg("10.0.0.0/8:syn-rate=5,syn-burst=0")],
                Some("syn-burst"),
            ),
            (vec![arg("10.0.0.0/8:syn-burst=0")], Some("syn-burst")),
            (vec![arg("10.0.0.0/8:syn-rate=0")], None),
        ] {
            match (resolve(&args, &top()), needle) {
                (Ok(_), None) => {}
                (Err(e), Some(needle)) => {
                    assert_eq!(e.setting, SETTING);
                    assert!(e.message.contains(needle), "{e:?}");
                }
                (got, _) => panic!("{args:?}: {got:?}"),
            }
        }
    }
}
