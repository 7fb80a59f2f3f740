//! limiter's kernel programs. The entry points stay thin: parse, decide (policy), answer.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod atomics;
mod maps;
mod parsing;
mod policy;
mod reply;

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    helpers::bpf_ktime_get_boot_ns,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use aya_log_ebpf::debug;
use limiter_common::{AdjustRequest, Direction, Event, FlowKey, ReleaseRequest, release};
use parsing::Window;
use policy::Action;

/// `CLOCK_BOOTTIME`: keeps counting through suspend, so bans and timeouts never stretch.
#[inline(always)]
fn now() -> u64 {
    // SAFETY: the helper has no preconditions.
    unsafe { bpf_ktime_get_boot_ns() }
}

/// Ingress: refuses connections over their limits before the socket layer sees them.
#[xdp]
pub fn limiter_xdp(ctx: XdpContext) -> u32 {
    let window = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
    let action = match parsing::parse(&window) {
        Ok(segment) => policy::ingress(&segment, now()),
        Err(reason) => policy::pass(Direction::Ingress, reason),
    };
    match action {
        Action::Pass => xdp_action::XDP_PASS,
        Action::Drop => xdp_action::XDP_DROP,
        Action::Rst(syn) => {
            debug!(&ctx, "refusing SYN from port {} with RST", syn.sport);
            if reply::rst(&ctx, &syn) {
                xdp_action::XDP_TX
            } else {
                xdp_action::XDP_DROP
            }
        }
    }
}

/// Egress: sees the host's FINs and RSTs so that flows close, and keeps them alive.
#[classifier]
pub fn limiter_tc(ctx: TcContext) -> i32 {
    let window = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
    match parsing::parse(&window) {
        Ok(segment) => policy::egress(&segment, now()),
        Err(reason) => policy::pass(Direction::Egress, reason),
    };
    TC_ACT_OK
}

/// Not attached anywhere: the agent runs it through `BPF_PROG_TEST_RUN` with a
/// [`ReleaseRequest`] as the packet, to release a flow with the datapath's own atomics.
#[xdp]
pub fn limiter_release(ctx: XdpContext) -> u32 {
    let window = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
    let Some(request) = window.read::<ReleaseRequest>(0) else {
        return release::INVALID;
    };
    let key: FlowKey = request.flow;
    match maps::FLOWS.get_ptr_mut(key) {
        Some(flow) if policy::close(&key, flow, Event::Released) => release::RELEASED,
        _ => release::ABSENT,
    }
}

/// Not attached anywhere: the agent runs it through `BPF_PROG_TEST_RUN` with an
/// [`AdjustRequest`] as the packet, to repair a drifted counter with an atomic add.
#[xdp]
pub fn limiter_adjust(ctx: XdpContext) -> u32 {
    let window = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
    let Some(request) = window.read::<AdjustRequest>(0) else {
        return release::INVALID;
    };
    let counter = if request.global != 0 {
        maps::GLOBAL_CONNS.get_ptr_mut(0)
    } else {
        maps::get_or_insert(&maps::SOURCE_CONNS, &request.source, &0)
    };
    match counter {
        Some(counter) => {
            atomics::fetch_add(counter, request.delta as u64);
            release::RELEASED
        }
        None => release::ABSENT,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
