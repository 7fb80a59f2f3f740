//! What the kernel enforces, as one checked value the agent hands to the maps.

use ipnet::IpNet;
use limiter_common::{Config, Limits, SourceLimits};

use super::Lists;

/// The policy in force: limits and refusal modes, protected ports and their profiles, and
/// source lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The top level's limits, prefixes and refusal modes. Its fields that follow from the
    /// ports, profiles and lists (`all_ports`, `has_allow`, `has_deny`, `has_overrides`,
    /// `has_profiles`) or from the rates (their GCRA terms) are ignored here and derived by
    /// [`Policy::config`], so they can never disagree with what the maps hold; `has_bans`
    /// follows the ban table, which [`super::Maps`] keeps.
    pub base: Config,
    /// When the programs answer SYNs with cookies.
    pub cookies: CookieMode,
    /// Ports protected at the top level; empty means every port no profile names.
    pub ports: Vec<u16>,
    /// Port groups with limits and counts of their own (`[profiles.NAME]`), in the order the
    /// configuration gives them; the maps keep each in a slot of its own by name.
    pub profiles: Vec<PortProfile>,
    pub allow: Vec<IpNet>,
    pub deny: Vec<IpNet>,
    /// Source prefixes with limits of their own, in the override tries.
    pub overrides: Vec<SourceOverride>,
}

/// A group of ports and what connections to them are held to, counted apart from every other
/// port's (`[profiles.NAME]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortProfile {
    pub name: String,
    pub ports: Vec<u16>,
    /// Every field resolved (what the profile leaves out is the top level's), the GCRA terms
    /// derived.
    pub limits: Limits,
}

/// The name the top level's counts and limits go by where profiles are named (the metrics'
/// `profile` label, the status documents).
pub const TOP_LEVEL_PROFILE: &str = "default";

/// A source prefix and the per-source limits its sources get (`[[overrides]]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceOverride {
    pub net: IpNet,
    pub limits: SourceLimits,
}

/// When the programs answer an unproven source's SYN with a cookie (`syn-cookies`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CookieMode {
    Off,
    /// While the SYNs a second reaching the host (or answered with cookies) pass `threshold`
    /// (see `services::syn_cookies`).
    Auto {
        threshold: u32,
    },
    Always,
}

impl Policy {
    /// The config map's value for this policy.
    pub fn config(&self) -> Config {
        let mut config = Config {
            all_ports: self.ports.is_empty().into(),
            has_allow: (!self.allow.is_empty()).into(),
            has_deny: (!self.deny.is_empty()).into(),
            has_overrides: (!self.overrides.is_empty()).into(),
            has_profiles: (!self.profiles.is_empty()).into(),
            ..self.base
        };
        config.limits.derive_rate_terms();
        config
    }

    /// The profile a local port belongs to: `Some(None)` for the top level, `None` if the
    /// port is not protected.
    pub fn profile_of(&self, port: u16) -> Option<Option<&PortProfile>> {
        if let Some(profile) = self.profiles.iter().find(|p| p.ports.contains(&port)) {
            return Some(Some(profile));
        }
        (self.ports.is_empty() || self.ports.contains(&port)).then_some(None)
    }

    /// Whether connections to a local port are limited.
    pub fn protects(&self, port: u16) -> bool {
        self.profile_of(port).is_some()
    }

    /// The limits of a protected port's profile (the top level's for one in no profile).
    pub fn limits_of(&self, port: u16) -> Option<Limits> {
        self.profile_of(port)
            .map(|profile| profile.map_or_else(|| self.config().limits, |p| p.limits))
    }

    /// This policy with the entries of `layers` (the list files', the admin API's) added, each
    /// list merged (`ipnet`'s aggregate: duplicates, covered prefixes and adjacent halves
    /// joined), so the tries hold as few entries as match the same sources.
    pub fn merged(&self, layers: &[&Lists]) -> Policy {
        let mut out = self.clone();
        for (list, extra) in [
            (
                &mut out.allow,
                layers.iter().map(|l| &l.allow).collect::<Vec<_>>(),
            ),
            (&mut out.deny, layers.iter().map(|l| &l.deny).collect()),
        ] {
            let all: Vec<IpNet> = list
                .iter()
                .chain(extra.into_iter().flatten())
                .copied()
                .collect();
            *list = IpNet::aggregate(&all);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_fields_follow_the_lists_and_ports() {
        let mut policy = Policy {
            base: Config {
                has_allow: 1,
                all_ports: 0,
                ..Config::UNCONFIGURED
            },
            cookies: CookieMode::Off,
            ports: Vec::new(),
            profiles: Vec::new(),
            allow: Vec::new(),
            deny: Vec::new(),
            overrides: Vec::new(),
        };
        let config = policy.config();
        assert_eq!(
            (config.all_ports, config.has_allow, config.has_deny),
            (1, 0, 0)
        );
        policy.ports.push(5672);
        let with = policy.merged(&[&Lists {
            allow: Vec::new(),
            deny: vec!["10.0.0.0/8".parse().unwrap()],
        }]);
        let config = with.config();
        assert_eq!(
            (config.all_ports, config.has_allow, config.has_deny),
            (0, 0, 1)
        );
    }

    #[test]
    fn lists_are_merged_before_they_reach_the_tries() {
        let nets = |list: &[&str]| {
            list.iter()
                .map(|n| n.parse().unwrap())
                .collect::<Vec<IpNet>>()
        };
        let policy = Policy {
            base: Config::UNCONFIGURED,
            cookies: CookieMode::Off,
            ports: Vec::new(),
            profiles: Vec::new(),
            allow: nets(&["10.0.0.0/25"]),
            deny: nets(&["192.0.2.1/32"]),
            overrides: Vec::new(),
        };
        let files = Lists {
            allow: nets(&[
                "10.0.0.128/25",
                "10.0.0.7/32",
                "2001:db8::/33",
                "2001:db8:8000::/33",
            ]),
            deny: nets(&["192.0.2.1/32", "198.51.100.0/24"]),
        };
        let admin = Lists {
            allow: Vec::new(),
            deny: nets(&["198.51.100.9/32", "203.0.113.5/32"]),
        };
        let merged = policy.merged(&[&files, &admin]);
        assert_eq!(merged.allow, nets(&["10.0.0.0/24", "2001:db8::/32"]));
        assert_eq!(
            merged.deny,
            nets(&["192.0.2.1/32", "198.51.100.0/24", "203.0.113.5/32"])
        );
    }

    #[test]
    fn the_syn_rate_reaches_the_programs_as_gcra_terms() {
        let policy = |syn_rate, syn_burst| Policy {
            base: Config {
                limits: Limits {
                    syn_rate,
                    syn_burst,
                    syn_interval_ns: 7,
                    syn_tolerance_ns: 7,
                    ..Limits::UNLIMITED
                },
                ..Config::UNCONFIGURED
            },
            cookies: CookieMode::Off,
            ports: Vec::new(),
            profiles: Vec::new(),
            allow: Vec::new(),
            deny: Vec::new(),
            overrides: Vec::new(),
        };
        let terms = |c: Config| (c.limits.syn_interval_ns, c.limits.syn_tolerance_ns);
        assert_eq!(terms(policy(50, 10).config()), (20_000_000, 200_000_000));
        assert_eq!(terms(policy(3, 1).config()), (333_333_333, 333_333_333));
        assert_eq!(terms(policy(1_000_000_000, 0).config()), (1, 1));
        assert_eq!(
            terms(policy(0, 40).config()),
            (0, 0),
            "no rate, no metering"
        );
    }
}
