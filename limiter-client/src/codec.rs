//! Length-prefixed framing for both ends of the connection.
//!
//! A frame is a big-endian `u32` length followed by that many bytes: an opcode, a `u32`
//! correlation id and the payload. A frame whose body cannot be parsed still has a known
//! length, so it is consumed whole and turned into an error reply while the connection goes
//! on; only a length above the maximum is fatal, because skipping it would mean reading up to
//! 4 GiB from a client that is already misbehaving.

use std::io;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::frame::{
    self, ErrorCode, HEADER_LEN, ParseError, Request, Response, parse_request, parse_response,
};

/// Largest frame body accepted by default: a check with the longest name and key is 1,095.
pub const DEFAULT_MAX_FRAME: usize = 4096;

/// Why a connection cannot go on. A frame that is merely unreadable is not one of these: it
/// arrives as a [`Received`] whose message is an error.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// A frame announced a body longer than the codec's maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The length the frame announced.
        len: usize,
        /// The codec's maximum.
        max: usize,
    },
    /// Reading or writing the stream failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// One frame as received: its correlation id (0 when the frame was too short to hold one)
/// and the message, or why the message could not be read.
#[derive(Debug)]
pub struct Received<T> {
    /// The correlation id, echoed in the reply so a pipelining peer can match them up.
    pub id: u32,
    /// The message, or why it could not be read; either way the frame was consumed whole.
    pub message: Result<T, ParseError>,
}

/// Splits off one whole frame body if the buffer holds one.
fn next_frame(src: &mut BytesMut, max: usize) -> Result<Option<Bytes>, CodecError> {
    if src.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
    if len > max {
        return Err(CodecError::TooLarge { len, max });
    }
    if src.len() < 4 + len {
        src.reserve(4 + len - src.len());
        return Ok(None);
    }
    src.advance(4);
    Ok(Some(src.split_to(len).freeze()))
}

fn split_header<T>(
    mut body: Bytes,
    parse: impl FnOnce(u8, Bytes) -> Result<T, ParseError>,
) -> Received<T> {
    if body.len() < HEADER_LEN {
        return Received {
            id: 0,
            message: Err(ParseError {
                code: ErrorCode::Malformed,
                message: format!(
                    "a frame body is at least {HEADER_LEN} bytes (opcode and correlation id), \
                     this one is {}",
                    body.len()
                ),
            }),
        };
    }
    let opcode = body.get_u8();
    let id = body.get_u32();
    Received {
        id,
        message: parse(opcode, body),
    }
}

fn put_frame(dst: &mut BytesMut, id: u32, body: impl FnOnce(&mut BytesMut) -> u8) {
    let start = dst.len();
    dst.put_u32(0);
    dst.put_u8(0);
    dst.put_u32(id);
    let opcode = body(dst);
    let len = (dst.len() - start - 4) as u32;
    dst[start..start + 4].copy_from_slice(&len.to_be_bytes());
    dst[start + 4] = opcode;
}

/// The agent's side: decodes requests, encodes responses.
#[derive(Clone, Copy, Debug)]
pub struct ServerCodec {
    max_frame: usize,
}

impl ServerCodec {
    /// A codec refusing frames whose body is longer than `max_frame` bytes
    /// ([`DEFAULT_MAX_FRAME`] unless the agent is configured otherwise).
    pub fn new(max_frame: usize) -> Self {
        Self { max_frame }
    }
}

impl Decoder for ServerCodec {
    type Item = Received<Request>;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Self::Item>, CodecError> {
        Ok(next_frame(src, self.max_frame)?.map(|body| split_header(body, parse_request)))
    }
}

impl Encoder<(u32, Response)> for ServerCodec {
    type Error = CodecError;

    fn encode(
        &mut self,
        (id, response): (u32, Response),
        dst: &mut BytesMut,
    ) -> Result<(), CodecError> {
        put_frame(dst, id, |dst| frame::put_response(dst, &response));
        Ok(())
    }
}

/// The broker's side: encodes requests, decodes responses.
#[derive(Clone, Copy, Debug)]
pub struct ClientCodec {
    max_frame: usize,
}

impl ClientCodec {
    /// A codec refusing replies whose body is longer than `max_frame` bytes; replies are
    /// small, so [`DEFAULT_MAX_FRAME`] is always enough.
    pub fn new(max_frame: usize) -> Self {
        Self { max_frame }
    }
}

impl Decoder for ClientCodec {
    type Item = Received<Response>;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Self::Item>, CodecError> {
        Ok(next_frame(src, self.max_frame)?.map(|body| split_header(body, parse_response)))
    }
}

impl Encoder<(u32, &Request)> for ClientCodec {
    type Error = CodecError;

    fn encode(
        &mut self,
        (id, request): (u32, &Request),
        dst: &mut BytesMut,
    ) -> Result<(), CodecError> {
        put_frame(dst, id, |dst| frame::put_request(dst, request));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::{net::IpAddr, time::Duration};

    use super::*;
    use crate::{Checked, Escalation, Outcome, Verdict};

    fn round_trip_request(request: Request) {
        let mut buf = BytesMut::new();
        ClientCodec::new(DEFAULT_MAX_FRAME)
            .encode((42, &request), &mut buf)
            .unwrap();
        let received = ServerCodec::new(DEFAULT_MAX_FRAME)
            .decode(&mut buf)
            .unwrap()
            .unwrap();
        assert_eq!(received.id, 42);
        assert_eq!(received.message.unwrap(), request);
        assert!(buf.is_empty());
    }

    #[test]
    fn every_request_round_trips() {
        let addr: IpAddr = "2001:db8::1".parse().unwrap();
        round_trip_request(Request::Check {
            action: "auth".into(),
            key: Bytes::from_static(b"192.0.2.1"),
            cost: 3,
        });
        round_trip_request(Request::Peek {
            action: "publish".into(),
            key: Bytes::from_static(b"alice"),
            cost: 100,
        });
        round_trip_request(Request::Reset {
            action: "auth".into(),
            key: Bytes::from_static(b"192.0.2.1"),
        });
        round_trip_request(Request::AuthFailure {
            addr: "192.0.2.1".parse().unwrap(),
        });
        round_trip_request(Request::Ban {
            addr,
            ttl: Duration::from_secs(600),
        });
        round_trip_request(Request::Unban { addr });
        round_trip_request(Request::Authenticate {
            token: Bytes::from_static(b"s3cret"),
        });
        round_trip_request(Request::CheckPayload {
            action: "publish".into(),
            key: Bytes::from_static(b"client-7"),
            cost: 1,
            payload_bytes: 70_000,
        });
        round_trip_request(Request::ConnectionGone {
            key: Bytes::from_static(b"client-7"),
        });
        round_trip_request(Request::Acquire {
            action: "sessions".into(),
            key: Bytes::from_static(b"alice"),
            session: Bytes::from_static(b"0x7f00aa"),
        });
        round_trip_request(Request::Release {
            action: "sessions".into(),
            key: Bytes::from_static(b"alice"),
            session: Bytes::from_static(b"0x7f00aa"),
        });
    }

    #[test]
    fn a_check_payload_is_a_check_with_the_size_behind_its_cost() {
        let mut buf = BytesMut::new();
        let request = Request::CheckPayload {
            action: "pub".into(),
            key: Bytes::from_static(b"c1"),
            cost: 1,
            payload_bytes: 0x0001_0000,
        };
        ClientCodec::new(DEFAULT_MAX_FRAME)
            .encode((5, &request), &mut buf)
            .unwrap();
        assert_eq!(
            hex(&buf),
            "00000015080000000503707562000263310000000100010000"
        );
        // The monitor flag byte: 0 is none, an allowance is never a refusal to report.
        let mut reply = BytesMut::new();
        reply.extend_from_slice(&hex_bytes(
            "0000001f8400000005000000000a000000090000000000000000000000000000177001",
        ));
        assert!(
            ClientCodec::new(DEFAULT_MAX_FRAME)
                .decode(&mut reply)
                .unwrap()
                .unwrap()
                .message
                .is_err()
        );
    }

    #[test]
    fn every_response_round_trips() {
        let responses = [
            Response::Verdict(Verdict::new(Outcome::Limited, 10, 0, 6000, 60000)),
            Response::Done { changed: true },
            Response::Escalation(Escalation::Counted { failures: 3 }),
            Response::Escalation(Escalation::Banned),
            Response::Verdict(Verdict::new(Outcome::Disconnect, 10, 0, 6000, 60000)),
            Response::Checked(Checked {
                verdict: Verdict::new(Outcome::Allowed, 10, 0, 0, 60000),
                would_refuse: Some(Outcome::Limited),
            }),
            Response::Checked(Checked {
                verdict: Verdict::new(Outcome::PayloadTooLarge, 10, 3, 0, 600),
                would_refuse: None,
            }),
            Response::Error {
                code: ErrorCode::UnknownAction,
                message: "unknown action \"x\"".into(),
            },
        ];
        for response in responses {
            let mut buf = BytesMut::new();
            ServerCodec::new(DEFAULT_MAX_FRAME)
                .encode((7, response.clone()), &mut buf)
                .unwrap();
            let received = ClientCodec::new(DEFAULT_MAX_FRAME)
                .decode(&mut buf)
                .unwrap()
                .unwrap();
            assert_eq!((received.id, received.message.unwrap()), (7, response));
        }
    }

    #[test]
    fn the_documented_example_encodes_byte_for_byte() {
        // docs/protocol.md, "Worked example".
        let mut buf = BytesMut::new();
        let request = Request::Check {
            action: "auth".into(),
            key: Bytes::from_static(b"192.0.2.1"),
            cost: 1,
        };
        ClientCodec::new(DEFAULT_MAX_FRAME)
            .encode((1, &request), &mut buf)
            .unwrap();
        assert_eq!(
            hex(&buf),
            "00000019 01 00000001 04 61757468 0009 3139322e302e322e31 00000001".replace(' ', "")
        );
        let mut buf = BytesMut::new();
        ServerCodec::new(DEFAULT_MAX_FRAME)
            .encode(
                (
                    1,
                    Response::Verdict(Verdict::new(Outcome::Allowed, 10, 9, 0, 6000)),
                ),
                &mut buf,
            )
            .unwrap();
        assert_eq!(
            hex(&buf),
            "0000001e 81 00000001 00 0000000a 00000009 0000000000000000 0000000000001770"
                .replace(' ', "")
        );
    }

    fn hex_bytes(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn decode_one(bytes: &[u8]) -> Result<Option<Received<Request>>, CodecError> {
        ServerCodec::new(64).decode(&mut BytesMut::from(bytes))
    }

    fn parse_error(bytes: &[u8]) -> (u32, ParseError) {
        let received = decode_one(bytes).unwrap().unwrap();
        (received.id, received.message.unwrap_err())
    }

    #[test]
    fn partial_frames_wait_for_more() {
        assert!(decode_one(&[0, 0]).unwrap().is_none());
        assert!(decode_one(&[0, 0, 0, 9, 1, 0]).unwrap().is_none());
    }

    #[test]
    fn malformed_frames_are_named_and_keep_their_id() {
        let (id, e) = parse_error(&[0, 0, 0, 2, 1, 0]);
        assert_eq!((id, e.code), (0, ErrorCode::Malformed));
        assert!(e.message.contains("at least 5 bytes"), "{}", e.message);

        let (id, e) = parse_error(&[0, 0, 0, 5, 0x7e, 0, 0, 0, 9]);
        assert_eq!((id, e.code), (9, ErrorCode::UnknownOpcode));

        // A check whose key length runs past the end.
        let (id, e) = parse_error(&[0, 0, 0, 10, 1, 0, 0, 0, 3, 1, b'a', 0, 5, b'k']);
        assert_eq!((id, e.code), (3, ErrorCode::Malformed));
        assert!(e.message.contains("inside the key"), "{}", e.message);

        // Zero cost.
        let (_, e) = parse_error(&[0, 0, 0, 14, 1, 0, 0, 0, 3, 1, b'a', 0, 1, b'k', 0, 0, 0, 0]);
        assert_eq!(e.code, ErrorCode::InvalidCost);

        // Trailing bytes.
        let (_, e) = parse_error(&[0, 0, 0, 8, 6, 0, 0, 0, 3, 4, 1, 2]);
        assert_eq!(e.code, ErrorCode::Malformed);
        let (_, e) = parse_error(&[0, 0, 0, 11, 6, 0, 0, 0, 3, 4, 1, 2, 3, 4, 9]);
        assert!(e.message.contains("trailing"), "{}", e.message);

        // Bad address family, empty action, non-UTF-8 action, empty key.
        let (_, e) = parse_error(&[0, 0, 0, 6, 4, 0, 0, 0, 3, 5]);
        assert!(e.message.contains("family 5"), "{}", e.message);
        let (_, e) = parse_error(&[0, 0, 0, 6, 1, 0, 0, 0, 3, 0]);
        assert!(e.message.contains("action name"), "{}", e.message);
        let (_, e) = parse_error(&[0, 0, 0, 14, 1, 0, 0, 0, 3, 1, 0xff, 0, 1, b'k', 0, 0, 0, 1]);
        assert!(e.message.contains("UTF-8"), "{}", e.message);
        let (_, e) = parse_error(&[0, 0, 0, 13, 1, 0, 0, 0, 3, 1, b'a', 0, 0, 0, 0, 0, 1]);
        assert_eq!(e.code, ErrorCode::InvalidKey);
    }

    #[test]
    fn an_oversized_length_is_fatal() {
        match decode_one(&[0, 0, 1, 0]) {
            Err(CodecError::TooLarge { len: 256, max: 64 }) => {}
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
}
