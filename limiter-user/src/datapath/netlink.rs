//! Every netlink conversation the agent has: a `netlink-sys` socket connected to the kernel,
//! requests built and replies read by the netlink-packet crates (routes and qdiscs by
//! `netlink-packet-route`, sockets by `netlink-packet-sock-diag`), so no message is laid out by
//! hand. The callers (`local_routes`, `sockets`, `tc_legacy`) say what to ask; this module how.

use std::{fmt::Debug, io};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkDeserializable, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, NetlinkSerializable,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcHandle, TcMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NetlinkError {
    #[error("netlink socket")]
    Io(#[from] io::Error),
    #[error("decoding a netlink reply")]
    Decode(#[from] netlink_packet_core::DecodeError),
    #[error("the kernel refused the request")]
    Refused(#[source] io::Error),
    #[error("an unexpected netlink reply: {0}")]
    Unexpected(String),
}

impl NetlinkError {
    /// The errno behind the error, where there is one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            NetlinkError::Io(e) | NetlinkError::Refused(e) => e.raw_os_error(),
            _ => None,
        }
    }
}

/// A netlink socket of `protocol`, bound and connected to the kernel.
pub fn connected(protocol: isize) -> io::Result<Socket> {
    let mut socket = Socket::new(protocol)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// Sends `message` with the header `flags`.
pub fn send<M: NetlinkSerializable + Debug>(
    socket: &Socket,
    flags: u16,
    message: M,
) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut request = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
    request.finalize();
    let mut out = vec![0; request.buffer_len()];
    request.serialize(&mut out);
    socket.send(&out, 0)?;
    Ok(())
}

/// Reads the messages of one datagram into `buffer`, handing each to `each`.
pub fn receive<M: NetlinkDeserializable + Debug>(
    socket: &Socket,
    buffer: &mut [u8],
    mut each: impl FnMut(NetlinkMessage<M>) -> Result<(), NetlinkError>,
) -> Result<(), NetlinkError> {
    let size = socket.recv(&mut &mut buffer[..], 0)?;
    let mut offset = 0;
    while offset < size {
        let message = NetlinkMessage::<M>::deserialize(&buffer[offset..size])?;
        let length = message.header.length as usize;
        each(message)?;
        if length == 0 {
            break;
        }
        offset += length;
    }
    Ok(())
}

/// Sends the dump request `message` on a socket of its own and hands every reply message of
/// type `R` to `each`, until the kernel says it is done.
pub fn dump<M: NetlinkSerializable + Debug, R: NetlinkDeserializable + Debug>(
    protocol: isize,
    message: M,
    mut each: impl FnMut(R),
) -> Result<(), NetlinkError> {
    let socket = connected(protocol)?;
    send(&socket, NLM_F_REQUEST | NLM_F_DUMP, message)?;
    let mut buffer = vec![0; 64 * 1024];
    let mut done = false;
    while !done {
        receive::<R>(&socket, &mut buffer, |answer| {
            match answer.payload {
                NetlinkPayload::InnerMessage(inner) => each(inner),
                NetlinkPayload::Done(_) => done = true,
                NetlinkPayload::Error(error) => return Err(NetlinkError::Refused(error.to_io())),
                _ => {}
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Sends `message` asking for an acknowledgement (the kernel answers in messages of type `R`),
/// and reads it: `Ok` if the kernel did it.
pub fn acknowledged<M: NetlinkSerializable + Debug, R: NetlinkDeserializable + Debug>(
    protocol: isize,
    message: M,
) -> Result<(), NetlinkError> {
    let socket = connected(protocol)?;
    send(&socket, NLM_F_REQUEST | NLM_F_ACK, message)?;
    let mut buffer = vec![0; 4096];
    let mut outcome = Err(NetlinkError::Unexpected("no reply".into()));
    receive::<R>(&socket, &mut buffer, |answer| {
        outcome = match answer.payload {
            NetlinkPayload::Error(error) => match error.code {
                None => Ok(()),
                Some(code) => Err(NetlinkError::Refused(io::Error::from_raw_os_error(
                    -code.get(),
                ))),
            },
            other => Err(NetlinkError::Unexpected(format!("{other:?}"))),
        };
        Ok(())
    })?;
    outcome
}

/// Deletes the clsact qdisc of the interface `index` (`tc qdisc del dev X clsact`), the one
/// tc request aya lacks.
pub fn delete_clsact(index: u32) -> Result<(), NetlinkError> {
    let mut qdisc = TcMessage::with_index(index as i32);
    qdisc.header.parent = TcHandle::CLSACT;
    qdisc.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    acknowledged::<_, RouteNetlinkMessage>(
        NETLINK_ROUTE,
        RouteNetlinkMessage::DelQueueDiscipline(qdisc),
    )
}
