//! The part of mosquitto 2.0's plugin API this plugin uses, declared by hand from Debian's
//! `mosquitto-dev` headers (`mosquitto_broker.h`, `mosquitto_plugin.h`) and `mosquitto.h`.
//!
//! Hand-declared rather than generated with bindgen: it is seven functions, three event structs
//! and a few constants, and a bindgen build dependency (clang-sys, libclang at build time)
//! would cost every build more than these lines cost to check against the headers. The
//! functions are exported by the broker binary itself and resolved when it loads the plugin,
//! which is why the crate links without a mosquitto library.

use std::ffi::{c_char, c_int, c_void};

/// The broker's client handle; only ever passed back to the broker.
#[repr(C)]
pub struct Client {
    _opaque: [u8; 0],
}

/// `mosquitto_plugin_id_t`: the plugin's identity, given to `mosquitto_plugin_init`.
#[repr(C)]
pub struct PluginId {
    _opaque: [u8; 0],
}

/// `struct mosquitto_opt`: one `plugin_opt_KEY VALUE` line of mosquitto.conf.
#[repr(C)]
pub struct Opt {
    pub key: *mut c_char,
    pub value: *mut c_char,
}

/// `struct mosquitto_evt_basic_auth`.
#[repr(C)]
pub struct EvtBasicAuth {
    pub future: *mut c_void,
    pub client: *mut Client,
    pub username: *mut c_char,
    pub password: *mut c_char,
    pub future2: [*mut c_void; 4],
}

/// `struct mosquitto_evt_acl_check`.
#[repr(C)]
pub struct EvtAclCheck {
    pub future: *mut c_void,
    pub client: *mut Client,
    pub topic: *const c_char,
    pub payload: *const c_void,
    pub properties: *mut c_void,
    pub access: c_int,
    pub payloadlen: u32,
    pub qos: u8,
    pub retain: bool,
    pub future2: [*mut c_void; 4],
}

/// `struct mosquitto_evt_disconnect`.
#[repr(C)]
pub struct EvtDisconnect {
    pub future: *mut c_void,
    pub client: *mut Client,
    pub reason: c_int,
    pub future2: [*mut c_void; 4],
}

/// `MOSQ_FUNC_generic_callback`.
pub type Callback =
    unsafe extern "C" fn(event: c_int, event_data: *mut c_void, userdata: *mut c_void) -> c_int;

// enum mosquitto_plugin_event
pub const MOSQ_EVT_ACL_CHECK: c_int = 2;
pub const MOSQ_EVT_BASIC_AUTH: c_int = 3;
pub const MOSQ_EVT_TICK: c_int = 9;
pub const MOSQ_EVT_DISCONNECT: c_int = 10;

// enum mosq_err_t
pub const MOSQ_ERR_SUCCESS: c_int = 0;
pub const MOSQ_ERR_INVAL: c_int = 3;
pub const MOSQ_ERR_AUTH: c_int = 11;
pub const MOSQ_ERR_ACL_DENIED: c_int = 12;
pub const MOSQ_ERR_UNKNOWN: c_int = 13;
pub const MOSQ_ERR_PLUGIN_DEFER: c_int = 17;

// The `access` of an ACL check.
pub const MOSQ_ACL_WRITE: c_int = 0x02;
pub const MOSQ_ACL_SUBSCRIBE: c_int = 0x04;

// Log levels for mosquitto_log_printf.
pub const MOSQ_LOG_INFO: c_int = 0x01;
pub const MOSQ_LOG_NOTICE: c_int = 0x02;
pub const MOSQ_LOG_WARNING: c_int = 0x04;

unsafe extern "C" {
    pub fn mosquitto_callback_register(
        identifier: *mut PluginId,
        event: c_int,
        cb_func: Callback,
        event_data: *const c_void,
        userdata: *mut c_void,
    ) -> c_int;
    pub fn mosquitto_callback_unregister(
        identifier: *mut PluginId,
        event: c_int,
        cb_func: Callback,
        event_data: *const c_void,
    ) -> c_int;
    pub fn mosquitto_log_printf(level: c_int, fmt: *const c_char, ...);
    pub fn mosquitto_client_address(client: *const Client) -> *const c_char;
    pub fn mosquitto_client_id(client: *const Client) -> *const c_char;
    pub fn mosquitto_client_username(client: *const Client) -> *const c_char;
    /// Disconnects the client with this id at once (its DISCONNECT event fires inside the
    /// call); `with_will` false sends no last will.
    pub fn mosquitto_kick_client_by_clientid(clientid: *const c_char, with_will: bool) -> c_int;
}
