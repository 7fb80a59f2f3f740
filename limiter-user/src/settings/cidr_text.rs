//! A CIDR as an operator writes it (in a setting, a list file, an admin request or the state
//! file), checked into the one form the tries hold, with an error naming the setting.

use std::net::IpAddr;

use ipnet::IpNet;

use super::ConfigError;

/// Parses CIDRs (a bare address is a host route); host bits set below the prefix are refused,
/// since they usually mean a typo in the prefix.
pub fn parse_cidrs(setting: &'static str, texts: &[String]) -> Result<Vec<IpNet>, ConfigError> {
    texts
        .iter()
        .filter(|t| !t.trim().is_empty())
        .map(|text| parse_cidr(setting, text))
        .collect()
}

pub fn parse_cidr(setting: &'static str, text: &str) -> Result<IpNet, ConfigError> {
    let text = text.trim();
    let net = match text.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => match text.parse::<IpAddr>() {
            Ok(addr) => IpNet::from(addr),
            Err(_) => return Err(ConfigError::new(setting, format!("`{text}` is not a CIDR"))),
        },
    };
    // An IPv4-mapped network is the IPv4 network it maps: IPv4 packets consult the IPv4 tries.
    let net = match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => IpNet::new(IpAddr::V4(v4), v6.prefix_len() - 96).unwrap_or(net),
            None => net,
        },
        _ => net,
    };
    if net.trunc() != net {
        return Err(ConfigError::new(
            setting,
            format!(
                "`{text}` has host bits set below its prefix (did you mean {}?)",
                net.trunc()
            ),
        ));
    }
    Ok(net)
}
