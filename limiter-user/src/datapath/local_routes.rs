//! The host's own addresses and its way back to a peer, read from the kernel's routing tables
//! through rtnetlink. An address is the host's own when the LOCAL table (255) routes it as
//! `RTN_LOCAL`, the kernel's own test for delivering a packet here: that is every interface
//! address and alias whatever its label, and whole local prefixes such as 127.0.0.0/8, which
//! no interface lists address by address. Which interface a peer is reached through is the
//! kernel's answer to `RTM_GETROUTE` for it, given by ifindex, so labels and aliases never
//! enter into it.

use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv6Net};
use netlink_packet_core::{NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteType},
};
use netlink_sys::{Socket, protocols::NETLINK_ROUTE};
use thiserror::Error;

use super::netlink::{self, NetlinkError};

/// `RT_TABLE_LOCAL`: where the kernel keeps the routes of the addresses it delivers to itself.
const LOCAL_TABLE: u32 = 255;

#[derive(Debug, Error)]
pub enum RoutesError {
    #[error("asking the kernel for routes")]
    Netlink(#[from] NetlinkError),
    /// An answer that is neither a route nor an error.
    #[error("unexpected rtnetlink answer to a route lookup")]
    Unexpected,
}

/// The host's own addresses, as prefixes keyed as flows key addresses (IPv4 as IPv4-mapped
/// IPv6), so a flow's address is looked up as it stands.
#[derive(Debug, Default)]
pub struct LocalAddresses {
    prefixes: Vec<Ipv6Net>,
}

impl LocalAddresses {
    pub fn new(prefixes: impl IntoIterator<Item = IpNet>) -> Self {
        let prefixes = prefixes
            .into_iter()
            .map(|net| match net {
                IpNet::V4(v4) => Ipv6Net::new(v4.network().to_ipv6_mapped(), 96 + v4.prefix_len())
                    .expect("an IPv4 prefix fits in the mapped range"),
                IpNet::V6(v6) => v6.trunc(),
            })
            .collect();
        Self { prefixes }
    }

    /// The `RTN_LOCAL` routes of the LOCAL table, both families.
    pub fn read() -> Result<Self, RoutesError> {
        let mut prefixes = Vec::new();
        // AF_UNSPEC: one dump of every family's routes.
        netlink::dump(
            NETLINK_ROUTE,
            RouteNetlinkMessage::GetRoute(RouteMessage::default()),
            |message| {
                if let RouteNetlinkMessage::NewRoute(route) = message {
                    prefixes.extend(local_prefix(&route));
                }
            },
        )?;
        Ok(Self::new(prefixes))
    }

    /// Whether `addr` (as flows key it) is one of the host's own.
    pub fn contains(&self, addr: &[u8; 16]) -> bool {
        let addr = Ipv6Addr::from(*addr);
        self.prefixes.iter().any(|net| net.contains(&addr))
    }
}

/// The prefix a route of the LOCAL table makes local, if it is one.
fn local_prefix(route: &RouteMessage) -> Option<IpNet> {
    // The header holds the table's id only below 256; the attribute holds any.
    let table = route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table));
    if table != LOCAL_TABLE || route.header.kind != RouteType::Local {
        return None;
    }
    let address = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })?;
    IpNet::new(address, route.header.destination_prefix_length).ok()
}

/// One rtnetlink socket for a pass's route lookups.
pub struct RouteQueries {
    socket: Socket,
}

impl RouteQueries {
    pub fn open() -> Result<Self, RoutesError> {
        Ok(Self {
            socket: netlink::connected(NETLINK_ROUTE).map_err(NetlinkError::from)?,
        })
    }

    /// The ifindex of the interface the host sends to `addr` (as flows key it) through, as
    /// `ip route get` answers; `None` where the kernel has no route for it (unreachable,
    /// blackhole, prohibited), as nothing goes back to such a peer.
    pub fn out_interface(&self, addr: &[u8; 16]) -> Result<Option<u32>, RoutesError> {
        let addr = Ipv6Addr::from(*addr).to_canonical();
        let mut route = RouteMessage::default();
        (
            route.header.address_family,
            route.header.destination_prefix_length,
        ) = match addr {
            IpAddr::V4(_) => (AddressFamily::Inet, 32),
            IpAddr::V6(_) => (AddressFamily::Inet6, 128),
        };
        route
            .attributes
            .push(RouteAttribute::Destination(RouteAddress::from(addr)));
        netlink::send(
            &self.socket,
            NLM_F_REQUEST,
            RouteNetlinkMessage::GetRoute(route),
        )
        .map_err(NetlinkError::from)?;
        let mut buffer = vec![0; 8 * 1024];
        let mut answer = Err(RoutesError::Unexpected);
        netlink::receive::<RouteNetlinkMessage>(&self.socket, &mut buffer, |message| {
            answer = match message.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(route)) => {
                    Ok(route.attributes.iter().find_map(|a| match a {
                        RouteAttribute::Oif(index) => Some(*index),
                        _ => None,
                    }))
                }
                NetlinkPayload::Error(error) if error.code.is_some() => Ok(None),
                _ => Err(RoutesError::Unexpected),
            };
            Ok(())
        })?;
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::kernel_keys::mapped;

    /// An address as flows key it.
    fn key(addr: &str) -> [u8; 16] {
        mapped(addr.parse().unwrap()).octets()
    }

    fn local(prefixes: &[&str]) -> LocalAddresses {
        LocalAddresses::new(prefixes.iter().map(|p| p.parse().unwrap()))
    }

    #[test]
    fn a_local_prefix_holds_every_address_in_it_of_its_family_only() {
        let host = local(&["127.0.0.0/8", "10.77.0.1/32", "::1/128"]);
        assert!(host.contains(&key("127.0.0.2")));
        assert!(host.contains(&key("127.255.255.254")));
        assert!(host.contains(&key("10.77.0.1")));
        assert!(host.contains(&key("::1")));
        assert!(!host.contains(&key("10.77.0.2")));
        assert!(!host.contains(&key("128.0.0.1")));
        // 127.0.0.0/8 mapped is ::ffff:127.0.0.0/104, not the IPv6 addresses that share bits.
        assert!(!host.contains(&key("7f00::1")));
        assert!(!host.contains(&key("::2")));
    }

    #[test]
    fn nothing_is_local_to_an_empty_table() {
        assert!(!LocalAddresses::default().contains(&key("127.0.0.1")));
    }

    #[test]
    fn the_kernels_local_table_holds_all_of_loopback() {
        let host = LocalAddresses::read().unwrap();
        assert!(host.contains(&key("127.0.0.1")));
        assert!(host.contains(&key("127.0.0.2")), "all of 127.0.0.0/8");
        assert!(!host.contains(&key("192.0.2.1")));
    }

    #[test]
    fn the_route_to_a_loopback_address_goes_out_through_lo() {
        let lo = nix::net::if_::if_nametoindex("lo").unwrap();
        let routes = RouteQueries::open().unwrap();
        assert_eq!(routes.out_interface(&key("127.0.0.2")).unwrap(), Some(lo));
    }
}
