//! The kernel programs' debug log: compiled out unless asked for, and forwarded when it is.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Mutex,
};

use limiter::datapath::{Datapath, LoadOptions};
use limiter_tests::{
    frames::Tcp,
    kernel::{Kernel, XDP_TX, settings},
};

/// Collects every record the `log` facade receives (aya-log writes through it).
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        self.0.lock().unwrap().push(record.args().to_string());
    }

    fn flush(&self) {}
}

static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

#[test]
fn kernel_debug_log_is_forwarded_only_when_asked_for() {
    log::set_logger(&CAPTURE).unwrap();
    log::set_max_level(log::LevelFilter::Trace);
    let load = |kernel_debug| {
        let mut dp = Datapath::load(LoadOptions {
            kernel_debug,
            ..LoadOptions::default()
        })
        .expect("the verifier accepts the programs with and without logging");
        dp.maps
            .apply(&settings(&["--max-conn-per-ip", "1", "--rst-xdp-tx"]).policy)
            .unwrap();
        Kernel { dp }
    };
    let syn = |port| {
        let src = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9));
        Tcp::syn(src, port, IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1)), 5672)
    };

    let mut quiet = load(false);
    assert!(
        quiet.dp.take_logger().is_none(),
        "no log reader without --kernel-debug"
    );

    let mut chatty = load(true);
    chatty.connect(&syn(1));
    assert_eq!(chatty.xdp(&syn(2).build()).action, XDP_TX);
    let mut logger = chatty.dp.take_logger().expect("a log reader");
    logger.flush();
    let lines = CAPTURE.0.lock().unwrap().clone();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("refusing a segment from port 2")),
        "{lines:?}"
    );
}
