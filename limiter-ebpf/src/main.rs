//! limiter's kernel programs. The entry points stay thin: parse, decide (policy), answer.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod atomics;
mod cookie;
mod decide;
mod headers;
mod map_access;
mod overrides;
mod parsing;
mod reply;
mod source_counts;

use aya_ebpf::cty::c_void;
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    helpers::bpf_redirect,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use aya_log_ebpf::debug;
use decide::Action;
use headers::Window;
use limiter_common::{
    AdjustRequest, COOKIE_MARK, Direction, Event, FlowKey, FlowRequest, REPLY_MARK, RST_MARK,
    helper,
};
use parsing::Segment;

/// Ingress: refuses connections over their limits before the socket layer sees them.
#[xdp]
pub fn limiter_xdp(ctx: XdpContext) -> u32 {
    let window = Window::of_xdp(&ctx);
    let segment = match parsing::parse_common(&window) {
        Some(frame) => {
            if decide::established(&frame) {
                return xdp_action::XDP_PASS;
            }
            if let Some(reason) = frame.discarded() {
                return unparsed(reason);
            }
            frame.segment()
        }
        None => match parsing::parse(&window, Direction::Ingress) {
            Ok(segment) => segment,
            Err(reason) => return unparsed(reason),
        },
    };
    let action = match decide::ingress(&segment) {
        Action::Handshake => decide::handshake(&segment),
        action => action,
    };
    let action = match action {
        Action::CheckCookie => {
            match cookie::check(ctx.ctx as *mut c_void, &Window::of_xdp(&ctx), &segment) {
                cookie::Check::Valid => decide::cookie_ack(&segment),
                cookie::Check::Invalid => decide::bad_cookie(),
                cookie::Check::NotACookie => decide::not_a_cookie(&segment),
            }
        }
        action => action,
    };
    respond(&ctx, action, &segment)
}

/// Carries out the policy's action on an ingress frame.
#[inline(always)]
fn respond(ctx: &XdpContext, action: Action, segment: &Segment) -> u32 {
    match action {
        Action::Pass | Action::CheckCookie | Action::Handshake => xdp_action::XDP_PASS,
        Action::Drop => xdp_action::XDP_DROP,
        Action::Rst { xdp_tx } => {
            debug!(
                ctx,
                "refusing a segment from port {} with RST", segment.sport
            );
            if !xdp_tx && reply::xdp_mark(ctx, segment, RST_MARK) {
                // `limiter_tc_ingress` answers it.
                xdp_action::XDP_PASS
            } else if reply::xdp_answer(ctx, segment) {
                xdp_action::XDP_TX
            } else {
                xdp_action::XDP_DROP
            }
        }
        Action::ResetHost => {
            if reply::xdp_replace(ctx, segment) {
                xdp_action::XDP_PASS
            } else {
                xdp_action::XDP_DROP
            }
        }
        Action::Cookie { xdp_tx } => xdp_cookie(ctx, segment, xdp_tx),
    }
}

/// Makes the cookie for a SYN here, where a SYN that gets none can still go on to the host,
/// and answers with its SYN-ACK: by `XDP_TX`, or by `limiter_tc_ingress`, the SYN marked and
/// the cookie left in it. Passes the SYN to the host if no cookie can be made or the frame
/// cannot hold the answer.
#[inline(never)]
fn xdp_cookie(ctx: &XdpContext, syn: &Segment, xdp_tx: bool) -> u32 {
    let window = Window::of_xdp(ctx);
    let value = cookie::make(ctx.ctx as *mut c_void, &window, syn);
    let answered = value >= 0
        && if xdp_tx {
            let cookie = cookie::Cookie {
                isn: value as u32,
                offered: cookie::offered(&window, syn),
            };
            reply::xdp_syn_ack(ctx, syn, &cookie)
        } else {
            cookie::stash(&window, syn, value as u32) && reply::xdp_mark(ctx, syn, COOKIE_MARK)
        };
    decide::cookie_sent(answered, value as u32);
    if answered && xdp_tx {
        xdp_action::XDP_TX
    } else {
        // Marked for `limiter_tc_ingress`, or on to the host.
        xdp_action::XDP_PASS
    }
}

/// The XDP action for an ingress frame the parser could not judge (see `decide::unparsed`).
#[inline(always)]
fn unparsed(reason: limiter_common::Reason) -> u32 {
    match decide::unparsed(Direction::Ingress, reason) {
        Action::Drop => xdp_action::XDP_DROP,
        _ => xdp_action::XDP_PASS,
    }
}

/// Ingress, after XDP: answers the SYNs `limiter_xdp` refused or met with a cookie and marked,
/// by turning each into its RST|ACK or SYN-ACK and redirecting it out of the interface it came
/// in on. Everything else passes at the cost of one look at the skb's protocol.
#[classifier]
pub fn limiter_tc_ingress(ctx: TcContext) -> i32 {
    let Some(mark) = reply::tc_take_mark(&ctx) else {
        return TC_ACT_OK;
    };
    // A marked frame goes no further than this program: the host's stack, which took its
    // protocol from the mark, would drop it anyway.
    let Ok(segment) = parsing::parse(&Window::of_tc(&ctx), Direction::Ingress) else {
        return TC_ACT_SHOT;
    };
    let answered = if mark == COOKIE_MARK {
        tc_cookie(&ctx, &segment)
    } else {
        reply::tc_answer(&ctx, &segment)
    };
    if !answered {
        return TC_ACT_SHOT;
    }
    // Its way out passes `limiter_tc`, which must not take it for the host's own segment.
    ctx.set_mark(REPLY_MARK);
    // SAFETY: reading the context's field; the helper has no other preconditions.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, 0) as i32 }
}

/// Rewrites a marked SYN into the SYN-ACK of the cookie XDP left in it.
#[inline(never)]
fn tc_cookie(ctx: &TcContext, syn: &Segment) -> bool {
    let window = Window::of_tc(ctx);
    let Some(isn) = cookie::stashed(&window, syn) else {
        return false;
    };
    let cookie = cookie::Cookie {
        isn,
        offered: cookie::offered(&window, syn),
    };
    reply::tc_syn_ack(ctx, syn, &cookie)
}

/// Egress: sees the host's SYN-ACKs (the ISN a handshake must acknowledge) and its FINs and
/// RSTs, so that connections complete and close.
#[classifier]
pub fn limiter_tc(ctx: TcContext) -> i32 {
    // SAFETY: reading a field of the context the program was given.
    if unsafe { (*ctx.skb.skb).mark } == REPLY_MARK {
        // The limiter's own answer to a refused SYN (see `limiter_tc_ingress`).
        return TC_ACT_OK;
    }
    match parsing::parse(&Window::of_tc(&ctx), Direction::Egress) {
        Ok(segment) => decide::egress(&segment),
        Err(reason) => decide::unparsed(Direction::Egress, reason),
    };
    TC_ACT_OK
}

/// Not attached anywhere: the agent runs it through `BPF_PROG_TEST_RUN` with a
/// [`FlowRequest`] as the packet, to release a flow with the datapath's own atomics.
#[xdp]
pub fn limiter_release(ctx: XdpContext) -> u32 {
    let Some(request) = Window::of_xdp(&ctx).read::<FlowRequest>(0) else {
        return helper::INVALID;
    };
    let key: FlowKey = request.flow;
    match map_access::FLOWS.get_ptr_mut(key) {
        Some(flow) if decide::close(&key, flow, Event::Released) => helper::DONE,
        _ => helper::ABSENT,
    }
}

/// Not attached anywhere: the agent runs it through `BPF_PROG_TEST_RUN` with an
/// [`AdjustRequest`] as the packet, to repair a drifted counter with an atomic add.
#[xdp]
pub fn limiter_adjust(ctx: XdpContext) -> u32 {
    let Some(request) = Window::of_xdp(&ctx).read::<AdjustRequest>(0) else {
        return helper::INVALID;
    };
    let counted = limiter_common::ProfileSource::new(request.source, u32::from(request.profile));
    decide::adjust(&counted, request.global != 0, request.delta as u64)
}

/// Not attached anywhere: the agent runs it through `BPF_PROG_TEST_RUN` with a
/// [`FlowRequest`] as the packet, to enter an established connection the flow table lacks and
/// take its slots with the datapath's own atomics (see `decide::adopt`).
#[xdp]
pub fn limiter_adopt(ctx: XdpContext) -> u32 {
    match Window::of_xdp(&ctx).read::<FlowRequest>(0) {
        Some(request) => decide::adopt(&request.flow),
        None => helper::INVALID,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
