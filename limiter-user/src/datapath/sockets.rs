//! The host's TCP socket table, read through `sock_diag` netlink: the truth the sweeper holds
//! the flow table against. A tracked flow whose socket is gone (the host closed it in a way
//! the programs did not see, or the agent was away) is released; one whose socket exists is
//! kept however idle it is; an established connection the flow table lacks is adopted, and
//! closed (`SOCK_DESTROY`) if it got past a cap unjudged.

use std::collections::{HashMap, HashSet};

use limiter_common::FlowKey;
use netlink_packet_sock_diag::{
    SockDiagDestroy, SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP, TCP_ESTABLISHED, TCP_LISTEN},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::protocols::NETLINK_SOCK_DIAG;
use thiserror::Error;

use super::{
    kernel_keys::mapped,
    netlink::{self, NetlinkError},
};

#[derive(Debug, Error)]
pub enum SocketsError {
    #[error("reading the socket table through sock_diag")]
    Netlink(#[from] NetlinkError),
    #[error("SOCK_DESTROY refused; the kernel needs CONFIG_INET_DIAG_DESTROY")]
    Destroy(#[source] NetlinkError),
    #[error("no established socket for that connection")]
    NoSocket,
}

/// The TCP sockets of this network namespace, keyed like the flow table.
#[derive(Debug, Default)]
pub struct SocketTable {
    /// Connections, oriented as flows are (`remote` is the peer, `local` this host), each with
    /// its state and its socket's id (which `SOCK_DESTROY` names).
    connections: HashMap<FlowKey, Entry>,
    /// Local ports something listens on: connections to them end in this namespace, so the
    /// table speaks for their flows. Flows to other ports (a broker in another namespace
    /// behind the protected interface) are not judged by it.
    listening: HashSet<u16>,
}

/// One socket of the table: its TCP state (`TCP_ESTABLISHED`, ...) and its id.
#[derive(Debug)]
struct Entry {
    state: u8,
    id: SocketId,
}

impl SocketTable {
    /// Dumps every IPv4 and IPv6 TCP socket of the caller's network namespace.
    pub fn read() -> Result<Self, SocketsError> {
        let mut table = SocketTable::default();
        for family in [AF_INET, AF_INET6] {
            dump(family, |state, id| {
                if state == TCP_LISTEN {
                    table.listening.insert(id.source_port);
                    return;
                }
                let flow = FlowKey {
                    remote: mapped(id.destination_address).octets(),
                    local: mapped(id.source_address).octets(),
                    remote_port: id.destination_port,
                    local_port: id.source_port,
                    _pad: 0,
                };
                // A 4-tuple has one socket; should a dump ever name one twice (a request
                // socket beside its child), the established one is what adoption and
                // `SOCK_DESTROY` need, as when they were kept apart.
                if state == TCP_ESTABLISHED || !table.connections.contains_key(&flow) {
                    let socket = Entry {
                        state,
                        id: id.clone(),
                    };
                    table.connections.insert(flow, socket);
                }
            })?;
        }
        Ok(table)
    }

    /// Whether the table can say anything about `flow`: its local port is served here.
    pub fn covers(&self, flow: &FlowKey) -> bool {
        self.listening.contains(&flow.local_port)
    }

    /// Whether a socket for `flow` exists.
    pub fn has(&self, flow: &FlowKey) -> bool {
        self.connections.contains_key(flow)
    }

    /// Established connections to local ports served here, oriented as flows: the ones a
    /// flow should exist for.
    pub fn established(&self) -> impl Iterator<Item = &FlowKey> {
        self.connections
            .iter()
            .filter(|(flow, socket)| socket.state == TCP_ESTABLISHED && self.covers(flow))
            .map(|(flow, _)| flow)
    }

    /// Closes an established connection's socket (`SOCK_DESTROY`: the host sends the peer a
    /// RST), as if the programs had refused it.
    pub fn destroy(&self, flow: &FlowKey) -> Result<(), SocketsError> {
        let id = match self.connections.get(flow) {
            Some(socket) if socket.state == TCP_ESTABLISHED => &socket.id,
            _ => return Err(SocketsError::NoSocket),
        };
        let family = if id.source_address.is_ipv4() {
            AF_INET
        } else {
            AF_INET6
        };
        let request = SockDiagDestroy::new(SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::ESTABLISHED,
            socket_id: id.clone(),
        }));
        netlink::acknowledged::<_, SockDiagMessage>(NETLINK_SOCK_DIAG, request).map_err(|e| match e
        {
            NetlinkError::Refused(_) => SocketsError::Destroy(e),
            e => SocketsError::Netlink(e),
        })
    }
}

/// The states worth reading: everything but the ends of a connection (TIME_WAIT, CLOSE),
/// whose flows are over, and outgoing attempts (SYN_SENT), which the programs never track.
fn wanted_states() -> StateFlags {
    StateFlags::all() - StateFlags::TIME_WAIT - StateFlags::CLOSE - StateFlags::SYN_SENT
}

fn dump(family: u8, mut each: impl FnMut(u8, &SocketId)) -> Result<(), SocketsError> {
    let request = SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: wanted_states(),
        socket_id: if family == AF_INET {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        },
    });
    netlink::dump(NETLINK_SOCK_DIAG, request, |message| {
        if let SockDiagMessage::InetResponse(response) = message {
            each(response.header.state, &response.header.socket_id);
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};

    use super::*;

    fn key(remote: IpAddr, remote_port: u16, local: IpAddr, local_port: u16) -> FlowKey {
        FlowKey {
            remote: mapped(remote).octets(),
            local: mapped(local).octets(),
            remote_port,
            local_port,
            _pad: 0,
        }
    }

    /// A loopback connection, both ends open, and its flow as the server's end sees it.
    struct Loopback {
        _listener: TcpListener,
        client: TcpStream,
        _accepted: TcpStream,
        flow: FlowKey,
    }

    fn connect() -> Loopback {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let server = listener.local_addr().unwrap();
        let client = TcpStream::connect(server).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let from = client.local_addr().unwrap();
        Loopback {
            _listener: listener,
            client,
            _accepted: accepted,
            flow: key(from.ip(), from.port(), server.ip(), server.port()),
        }
    }

    #[test]
    fn a_live_loopback_connection_is_in_the_table_and_a_made_up_one_is_not() {
        let connection = connect();
        let table = SocketTable::read().unwrap();
        let live = connection.flow;
        assert!(table.covers(&live));
        assert!(table.has(&live));
        let gone = FlowKey {
            remote_port: live.remote_port.wrapping_add(1),
            ..live
        };
        assert!(table.covers(&gone));
        assert!(!table.has(&gone));
        let established: Vec<_> = table.established().collect();
        assert!(established.contains(&&live));
        assert!(!established.contains(&&gone));
        // The listener's own socket is no connection.
        let listening = FlowKey {
            remote: mapped(Ipv4Addr::UNSPECIFIED.into()).octets(),
            remote_port: 0,
            ..live
        };
        assert!(!table.has(&listening));
    }

    #[test]
    fn a_connection_its_peer_closed_exists_but_is_not_established() {
        let connection = connect();
        let flow = connection.flow;
        drop(connection.client);
        // Only the client's end closes: the server's is in CLOSE_WAIT once the FIN arrived,
        // over loopback at once, but not synchronously with `drop`.
        let closing = (0..1_000)
            .map(|_| SocketTable::read().unwrap())
            .find(|table| !table.established().any(|f| *f == flow))
            .expect("the server's end left ESTABLISHED");
        assert!(closing.has(&flow));
        assert!(matches!(
            closing.destroy(&flow),
            Err(SocketsError::NoSocket)
        ));
    }
}
