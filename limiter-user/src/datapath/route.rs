//! The interface the agent protects when none is configured: the default route's.

use super::LoadError;

/// The interface of the IPv4 default route, read from `/proc/net/route`.
pub fn default_route_interface() -> Result<String, LoadError> {
    let table = std::fs::read_to_string("/proc/net/route")
        .map_err(|e| LoadError::DefaultRoute(e.to_string()))?;
    parse_default_route(&table)
        .ok_or_else(|| LoadError::DefaultRoute("no default route in /proc/net/route".into()))
}

fn parse_default_route(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let mut fields = line.split_whitespace();
        let iface = fields.next()?;
        (fields.next()? == "00000000").then(|| iface.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_route_is_the_zero_destination() {
        let table = "Iface\tDestination\tGateway\n\
                     eth1\t0000A8C0\t00000000\n\
                     eth0\t00000000\t0100A8C0\n";
        assert_eq!(parse_default_route(table).as_deref(), Some("eth0"));
        assert_eq!(parse_default_route("Iface\tDestination\n"), None);
    }
}
