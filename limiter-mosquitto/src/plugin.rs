//! The functions mosquitto calls: the three exports of plugin API version 5 and the event
//! callbacks they register.
//!
//! **How a failed password reaches the agent with mosquitto 2.0.** 2.0 has no callback
//! priorities and no "login succeeded" event, and the basic-auth chain stops at the first
//! callback that does not defer. Plugin callbacks are registered when the plugin is loaded,
//! before the broker registers its password-file check, so this plugin's basic-auth callback
//! always runs first: it can refuse on `auth`, but cannot see the password check's result.
//! So it remembers each client it deferred, and listens for `MOSQ_EVT_DISCONNECT`, which
//! the broker fires for every client it drops, including a refused CONNECT. A refused login is
//! recognisable there: when the password check refuses, mosquitto 2.0 clears the client's id
//! before disconnecting it (`handle_connect.c`), while an accepted client keeps its id. A
//! remembered client that disconnects without an id is reported as an auth failure; one this
//! plugin refused itself is not remembered, so it is never counted twice.
//!
//! **Strikes.** With `plugin_opt_strikes ACTION`, every PUBLISH is also checked against that
//! action keyed by the client's id, with the payload's size. A `disconnect` verdict drops the
//! message and marks the client kicked: from then on every ACL check of that client is denied
//! without asking. The kick itself waits for the next `MOSQ_EVT_TICK` (the main loop, between
//! packets): `mosquitto_kick_client_by_clientid` runs the whole disconnect inside the call,
//! which the middle of the client's own PUBLISH, still being handled, must not meet. Its
//! `MOSQ_EVT_DISCONNECT` (every client's) tells the agent the connection is gone.
//!
//! **Bytes and topics.** With `plugin_opt_publish_topic ACTION`, every PUBLISH by a user
//! spends one of that action (keyed by `user+topic`) under the user and the topic
//! (`limiter_client::user_topic_key`); with `plugin_opt_publish_bytes ACTION`, its payload's
//! length of that action under the user. Either refusal drops the message.
//!
//! No panic may unwind into the broker (undefined behaviour across `extern "C"`): every
//! export and callback runs inside [`guard`], which turns a panic into an error code.

use std::{
    collections::{HashMap, HashSet},
    ffi::{CStr, CString, OsStr, c_char, c_int, c_void},
    net::IpAddr,
    os::unix::ffi::OsStrExt,
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    sync::Mutex,
};

use crate::{
    agent_link::{Agent, Strike},
    broker_conf::{self, BrokerConf, ConfError},
    ffi::{self, Client, EvtAclCheck, EvtBasicAuth, EvtDisconnect, Opt, PluginId},
    options::{FailMode, Options},
    passes::{self, AutoError, Pass, Passes},
};

/// The plugin's state, owned by the broker as `userdata` between init and cleanup.
struct Plugin {
    id: *mut PluginId,
    options: Options,
    /// What an allowed login and an allowed ACL check answer.
    passes: Passes,
    agent: Agent,
    /// Clients whose login this plugin deferred, by handle, with their address: those the
    /// password check then refuses are reported on disconnect.
    deferred: Mutex<HashMap<usize, IpAddr>>,
    /// Clients the strikes action closed, by handle: each of their ACL checks is denied until
    /// their disconnect.
    kicked: Mutex<HashSet<usize>>,
    /// Whom to kick at the next tick: the handle (a client already gone is skipped) and id.
    to_kick: Mutex<Vec<(usize, CString)>>,
    /// The user of each client holding a session of `plugin_opt_sessions`, by handle.
    sessions: Mutex<HashMap<usize, String>>,
}

/// Runs `f`, turning a panic into `on_panic` (and a log line) instead of unwinding into C.
fn guard(on_panic: c_int, f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log(
            ffi::MOSQ_LOG_WARNING,
            "limiter: internal error (panic) in the plugin",
        );
        on_panic
    })
}

/// Writes a line to the broker's log.
fn log(level: c_int, message: &str) {
    let Ok(text) = CString::new(message) else {
        return;
    };
    // SAFETY: both are valid NUL-terminated strings and "%s" consumes exactly one of them.
    unsafe { ffi::mosquitto_log_printf(level, c"%s".as_ptr(), text.as_ptr()) };
}

/// A C string the broker owns, copied; `None` for NULL or non-UTF-8.
///
/// # Safety
/// `ptr` is NULL or a valid NUL-terminated string.
unsafe fn string(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-NULL and NUL-terminated, by the caller's contract.
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .ok()
        .map(str::to_owned)
}

fn address(client: *const Client) -> Option<IpAddr> {
    // SAFETY: `client` is the live handle the broker passed to this callback.
    let text = unsafe { string(ffi::mosquitto_client_address(client)) }?;
    text.parse().ok()
}

fn username(client: *const Client) -> Option<String> {
    // SAFETY: `client` is the live handle the broker passed to this callback.
    unsafe { string(ffi::mosquitto_client_username(client)) }
}

/// An error and its causes, on one line for the broker's log.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(&format!(": {e}"));
        cause = e.source();
    }
    text
}

/// The file this plugin was loaded from, as the dynamic loader knows it.
fn own_path() -> Option<PathBuf> {
    // SAFETY: Dl_info is plain pointers, for which all zeroes is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let here = own_path as *const c_void;
    // SAFETY: `here` is an address inside this library and `info` a valid place to write.
    if unsafe { libc::dladdr(here, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr filled dli_fname with a NUL-terminated path it keeps alive.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(OsStr::from_bytes(name.to_bytes())))
}

/// The answers for allowed checks: from the explicit options, or from the configuration file
/// of the broker this plugin is loaded into (its own process) where one is `auto`.
fn broker_passes(options: &Options, pairs: &[(String, String)]) -> Result<Passes, AutoError> {
    if !options.needs_broker_conf() {
        return Ok(passes::passes(options, None));
    }
    let unreadable = |path: &str, source| ConfError::Read {
        path: PathBuf::from(path),
        source,
    };
    let cmdline =
        std::fs::read("/proc/self/cmdline").map_err(|e| unreadable("/proc/self/cmdline", e))?;
    let cwd = std::fs::read_link("/proc/self/cwd").map_err(|e| unreadable("/proc/self/cwd", e))?;
    let conf_path = broker_conf::config_path(&cmdline, &cwd).ok_or(AutoError::NoConfigFile)?;
    let conf = BrokerConf::read(&conf_path)?;
    let me = own_path().unwrap_or_default();
    let canonical = |p: &Path| std::fs::canonicalize(cwd.join(p)).ok();
    let me_canonical = canonical(&me);
    passes::resolve(
        options,
        &conf,
        &conf_path,
        &me,
        |line| me_canonical.is_some() && canonical(line) == me_canonical,
        pairs,
    )
}

/// The return code for `pass`; `refuse` is the kind's refusal.
fn code(pass: Pass, refuse: c_int) -> c_int {
    match pass {
        Pass::Defer => ffi::MOSQ_ERR_PLUGIN_DEFER,
        Pass::Allow => ffi::MOSQ_ERR_SUCCESS,
        Pass::Refuse => refuse,
    }
}

/// Chooses plugin API version 5, the only one this plugin implements.
///
/// # Safety
/// Called by the broker with `count` versions at `versions`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mosquitto_plugin_version(count: c_int, versions: *const c_int) -> c_int {
    guard(-1, || {
        let count = usize::try_from(count).unwrap_or(0);
        if versions.is_null() || count == 0 {
            return -1;
        }
        // SAFETY: the broker passes `count` versions at `versions`.
        let offered = unsafe { std::slice::from_raw_parts(versions, count) };
        if offered.contains(&5) { 5 } else { -1 }
    })
}

/// Reads the options, starts the runtime and registers the callbacks.
///
/// # Safety
/// Called by the broker with its plugin id, a place for `userdata`, and `count` options.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mosquitto_plugin_init(
    identifier: *mut PluginId,
    userdata: *mut *mut c_void,
    options: *mut Opt,
    count: c_int,
) -> c_int {
    guard(ffi::MOSQ_ERR_UNKNOWN, || {
        let pairs: Vec<(String, String)> = if options.is_null() || count <= 0 {
            Vec::new()
        } else {
            // SAFETY: the broker passes `count` options at `options`.
            let opts = unsafe { std::slice::from_raw_parts(options, count as usize) };
            opts.iter()
                // SAFETY: the broker's option strings are NUL-terminated (or NULL).
                .filter_map(|o| Some((unsafe { string(o.key) }?, unsafe { string(o.value) }?)))
                .collect()
        };
        let parsed = match Options::parse(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
            Ok(parsed) => parsed,
            Err(e) => {
                log(ffi::MOSQ_LOG_WARNING, &format!("limiter: {e}"));
                return ffi::MOSQ_ERR_INVAL;
            }
        };
        let passes = match broker_passes(&parsed, &pairs) {
            Ok(passes) => passes,
            Err(e) => {
                log(ffi::MOSQ_LOG_WARNING, &format!("limiter: {}", chain(&e)));
                return ffi::MOSQ_ERR_INVAL;
            }
        };
        let agent = match Agent::new(parsed.socket.clone(), parsed.timeout) {
            Ok(agent) => agent,
            Err(e) => {
                log(
                    ffi::MOSQ_LOG_WARNING,
                    &format!("limiter: starting the runtime: {e}"),
                );
                return ffi::MOSQ_ERR_UNKNOWN;
            }
        };
        let plugin = Box::into_raw(Box::new(Plugin {
            id: identifier,
            options: parsed,
            passes,
            agent,
            deferred: Mutex::new(HashMap::new()),
            kicked: Mutex::new(HashSet::new()),
            to_kick: Mutex::new(Vec::new()),
            sessions: Mutex::new(HashMap::new()),
        }));
        // SAFETY: the broker passes a valid place for the userdata pointer.
        unsafe { *userdata = plugin.cast() };
        for (event, callback) in CALLBACKS {
            // SAFETY: a valid id, an `extern "C"` callback of the generic type, and the
            // plugin as userdata, which lives until cleanup unregisters the callbacks.
            let rc = unsafe {
                ffi::mosquitto_callback_register(
                    identifier,
                    event,
                    callback,
                    std::ptr::null(),
                    plugin.cast(),
                )
            };
            if rc != ffi::MOSQ_ERR_SUCCESS {
                log(
                    ffi::MOSQ_LOG_WARNING,
                    &format!("limiter: registering event {event} failed ({rc})"),
                );
                return rc;
            }
        }
        // SAFETY: `plugin` was just made from a Box and is not freed before cleanup.
        let (o, p) = unsafe { (&(*plugin).options, (*plugin).passes) };
        log(
            ffi::MOSQ_LOG_INFO,
            &format!(
                "limiter: asking the agent at {} (auth {}, publish {}, subscribe {}, strikes {}, sessions {}, publish bytes {}, publish topic {}; fail {:?}, timeout {:?}); allowed logins {:?}, allowed ACL checks {:?}",
                o.socket.display(),
                o.actions.auth,
                o.actions.publish,
                o.actions.subscribe,
                o.strikes.as_deref().unwrap_or("off"),
                o.sessions.as_deref().unwrap_or("off"),
                o.publish_bytes.as_deref().unwrap_or("off"),
                o.publish_topic.as_deref().unwrap_or("off"),
                o.fail,
                o.timeout,
                p.login,
                p.acl
            ),
        );
        ffi::MOSQ_ERR_SUCCESS
    })
}

const CALLBACKS: [(c_int, ffi::Callback); 4] = [
    (ffi::MOSQ_EVT_BASIC_AUTH, on_basic_auth),
    (ffi::MOSQ_EVT_ACL_CHECK, on_acl_check),
    (ffi::MOSQ_EVT_DISCONNECT, on_disconnect),
    (ffi::MOSQ_EVT_TICK, on_tick),
];

/// Unregisters the callbacks and frees the plugin.
///
/// # Safety
/// Called once by the broker with the `userdata` init stored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mosquitto_plugin_cleanup(
    userdata: *mut c_void,
    _options: *mut Opt,
    _count: c_int,
) -> c_int {
    guard(ffi::MOSQ_ERR_UNKNOWN, || {
        if userdata.is_null() {
            return ffi::MOSQ_ERR_SUCCESS;
        }
        // SAFETY: `userdata` is the Box init leaked, and the broker frees it only here.
        let plugin = unsafe { Box::from_raw(userdata.cast::<Plugin>()) };
        for (event, callback) in CALLBACKS {
            // SAFETY: the id and callbacks registered in init.
            unsafe {
                ffi::mosquitto_callback_unregister(plugin.id, event, callback, std::ptr::null())
            };
        }
        plugin.agent.shutdown();
        ffi::MOSQ_ERR_SUCCESS
    })
}

/// The verdict the fail mode gives when the agent has none.
fn unanswered(
    plugin: &Plugin,
    what: &str,
    why: &dyn std::fmt::Display,
    refuse: c_int,
    allow: c_int,
) -> c_int {
    let rc = match plugin.options.fail {
        FailMode::Open => allow,
        FailMode::Closed => refuse,
    };
    log(
        ffi::MOSQ_LOG_WARNING,
        &format!(
            "limiter: no verdict for {what} ({why}); failing {:?}",
            plugin.options.fail
        ),
    );
    rc
}

/// # Safety
/// Called by the broker with a `mosquitto_evt_basic_auth` and the plugin as userdata.
unsafe extern "C" fn on_basic_auth(
    _event: c_int,
    data: *mut c_void,
    userdata: *mut c_void,
) -> c_int {
    guard(ffi::MOSQ_ERR_AUTH, || {
        // SAFETY: userdata is the plugin registered with this callback, alive until cleanup.
        let plugin = unsafe { &*userdata.cast::<Plugin>() };
        // SAFETY: the broker passes its basic-auth event for this callback.
        let event = unsafe { &*data.cast::<EvtBasicAuth>() };
        // Whatever `auth` does not refuse gets the answer the broker needs to decide as it would
        // without the plugin.
        let pass = code(plugin.passes.login, ffi::MOSQ_ERR_AUTH);
        let addr = address(event.client).filter(|_| plugin.options.actions.auth);
        if let Some(addr) = addr
            && let Err(rc) = check_auth(plugin, addr, pass)
        {
            return rc;
        }
        if let Some(action) = &plugin.options.sessions
            && let Err(rc) = acquire_session(plugin, action, event.client)
        {
            return rc;
        }
        // Only a deferred login meets a password check after this one, whose refusal to report.
        if let Some(addr) = addr
            && plugin.passes.login == Pass::Defer
            && let Ok(mut deferred) = plugin.deferred.lock()
        {
            deferred.insert(event.client as usize, addr);
        }
        pass
    })
}

/// `auth` for the client's address: `Err` with the code to answer when the login is refused.
fn check_auth(plugin: &Plugin, addr: IpAddr, pass: c_int) -> Result<(), c_int> {
    match plugin.agent.check("auth", addr.to_string()) {
        Ok(true) => {}
        Ok(false) => {
            log(
                ffi::MOSQ_LOG_NOTICE,
                &format!("limiter: auth refused for {addr}"),
            );
            return Err(ffi::MOSQ_ERR_AUTH);
        }
        Err(why) => {
            let rc = unanswered(
                plugin,
                &format!("auth of {addr}"),
                &why,
                ffi::MOSQ_ERR_AUTH,
                pass,
            );
            if rc == ffi::MOSQ_ERR_AUTH {
                return Err(rc);
            }
        }
    }
    Ok(())
}

/// The session a login with a username takes in the `sessions` action, named by the client's
/// handle (unique among live clients, unlike a client id a takeover reuses): `Err` with the
/// code to answer when the user has all its sessions. Released at the client's disconnect.
fn acquire_session(plugin: &Plugin, action: &str, client: *mut Client) -> Result<(), c_int> {
    let Some(user) = username(client) else {
        return Ok(());
    };
    let handle = client as usize;
    let session = format!("{handle:#x}");
    match plugin
        .agent
        .acquire(action.to_owned(), user.clone(), session)
    {
        Ok(true) => {
            if let Ok(mut sessions) = plugin.sessions.lock() {
                sessions.insert(handle, user);
            }
            Ok(())
        }
        Ok(false) => {
            log(
                ffi::MOSQ_LOG_NOTICE,
                &format!("limiter: {action}: user {user} has all its sessions; login refused"),
            );
            Err(ffi::MOSQ_ERR_AUTH)
        }
        Err(why) => {
            let rc = unanswered(
                plugin,
                &format!("{action} of user {user}"),
                &why,
                ffi::MOSQ_ERR_AUTH,
                ffi::MOSQ_ERR_SUCCESS,
            );
            if rc == ffi::MOSQ_ERR_SUCCESS {
                Ok(())
            } else {
                Err(rc)
            }
        }
    }
}

/// # Safety
/// Called by the broker with a `mosquitto_evt_acl_check` and the plugin as userdata.
unsafe extern "C" fn on_acl_check(
    _event: c_int,
    data: *mut c_void,
    userdata: *mut c_void,
) -> c_int {
    guard(ffi::MOSQ_ERR_ACL_DENIED, || {
        // SAFETY: userdata is the plugin registered with this callback, alive until cleanup.
        let plugin = unsafe { &*userdata.cast::<Plugin>() };
        // SAFETY: the broker passes its ACL-check event for this callback.
        let event = unsafe { &*data.cast::<EvtAclCheck>() };
        let pass = code(plugin.passes.acl, ffi::MOSQ_ERR_ACL_DENIED);
        let handle = event.client as usize;
        if plugin.kicked.lock().is_ok_and(|k| k.contains(&handle)) {
            return ffi::MOSQ_ERR_ACL_DENIED;
        }
        if event.access == ffi::MOSQ_ACL_WRITE
            && let Some(action) = &plugin.options.strikes
            && let Err(rc) = strike(plugin, action, event)
        {
            return rc;
        }
        let publish = event.access == ffi::MOSQ_ACL_WRITE;
        let action = match event.access {
            ffi::MOSQ_ACL_WRITE if plugin.options.actions.publish => Some("publish"),
            ffi::MOSQ_ACL_SUBSCRIBE if plugin.options.actions.subscribe => Some("subscribe"),
            ffi::MOSQ_ACL_WRITE => None,
            _ => return pass,
        };
        // Anonymous clients have no per-user bucket; their connections are the kernel's job.
        let Some(user) = username(event.client) else {
            return pass;
        };
        if let Some(action) = action
            && let Err(rc) = spend(plugin, action, &user, user.as_bytes().to_vec(), 1)
        {
            return rc;
        }
        if !publish {
            return pass;
        }
        // Each action spends on its own: a message a later one drops has spent the earlier
        // ones' tokens. The topic's count goes before the bytes, the larger spend.
        if let Some(action) = &plugin.options.publish_topic
            && let Err(rc) = spend_topic(plugin, action, &user, event)
        {
            return rc;
        }
        // An empty payload costs no bytes (and a cost of 0 is no request).
        if let Some(action) = &plugin.options.publish_bytes
            && event.payloadlen > 0
            && let Err(rc) = spend(
                plugin,
                action,
                &user,
                user.as_bytes().to_vec(),
                event.payloadlen,
            )
        {
            return rc;
        }
        pass
    })
}

/// `cost` of `action` for `user` under `key`: `Err` with the code to answer when the agent
/// refuses, or gives no answer and the fail mode is closed.
fn spend(plugin: &Plugin, action: &str, user: &str, key: Vec<u8>, cost: u32) -> Result<(), c_int> {
    match plugin.agent.spend(action.to_owned(), key, cost) {
        Ok(true) => Ok(()),
        Ok(false) => {
            log(
                ffi::MOSQ_LOG_NOTICE,
                &format!("limiter: {action} refused for user {user}"),
            );
            Err(ffi::MOSQ_ERR_ACL_DENIED)
        }
        Err(why) => {
            let rc = unanswered(
                plugin,
                &format!("{action} by {user}"),
                &why,
                ffi::MOSQ_ERR_ACL_DENIED,
                ffi::MOSQ_ERR_SUCCESS,
            );
            if rc == ffi::MOSQ_ERR_SUCCESS {
                Ok(())
            } else {
                Err(rc)
            }
        }
    }
}

/// One of the `user+topic` `action` for the PUBLISH's user and topic. A topic whose first
/// level does not fit in a key beside the user is dropped: no bucket can name it.
fn spend_topic(
    plugin: &Plugin,
    action: &str,
    user: &str,
    event: &EvtAclCheck,
) -> Result<(), c_int> {
    // SAFETY: NULL or the broker's NUL-terminated topic, alive for this callback.
    let Some(topic) = (unsafe { string(event.topic) }) else {
        return Ok(());
    };
    match limiter_client::user_topic_key(user, &topic) {
        Ok(key) => spend(plugin, action, user, key, 1),
        Err(why) => {
            log(
                ffi::MOSQ_LOG_NOTICE,
                &format!("limiter: {action}: a publish by user {user} dropped: {why}"),
            );
            Err(ffi::MOSQ_ERR_ACL_DENIED)
        }
    }
}

/// A PUBLISH through the strikes action: `Err` with the code to answer when it is dropped.
fn strike(plugin: &Plugin, action: &str, event: &EvtAclCheck) -> Result<(), c_int> {
    // SAFETY: the live client handle of this event.
    let id_ptr = unsafe { ffi::mosquitto_client_id(event.client) };
    // SAFETY: NULL or the broker's NUL-terminated id, alive for this callback.
    let Some(id) = (unsafe { string(id_ptr) }) else {
        return Ok(());
    };
    match plugin
        .agent
        .check_connection(action.to_owned(), id.clone(), event.payloadlen)
    {
        Ok(Strike::Pass { would_refuse: None }) => Ok(()),
        Ok(Strike::Pass {
            would_refuse: Some(outcome),
        }) => {
            log(
                ffi::MOSQ_LOG_NOTICE,
                &format!(
                    "limiter: monitor mode: {action} would have answered {} for client {id}",
                    outcome.as_str()
                ),
            );
            Ok(())
        }
        Ok(Strike::Drop) => Err(ffi::MOSQ_ERR_ACL_DENIED),
        Ok(Strike::Disconnect) => {
            let handle = event.client as usize;
            let first = plugin.kicked.lock().is_ok_and(|mut k| k.insert(handle));
            if first
                && let Ok(cid) = CString::new(id.as_bytes())
                && let Ok(mut queue) = plugin.to_kick.lock()
            {
                log(
                    ffi::MOSQ_LOG_NOTICE,
                    &format!("limiter: {action}: disconnecting client {id} for its strikes"),
                );
                queue.push((handle, cid));
            }
            Err(ffi::MOSQ_ERR_ACL_DENIED)
        }
        Err(why) => {
            let rc = unanswered(
                plugin,
                &format!("{action} of client {id}"),
                &why,
                ffi::MOSQ_ERR_ACL_DENIED,
                ffi::MOSQ_ERR_SUCCESS,
            );
            if rc == ffi::MOSQ_ERR_SUCCESS {
                Ok(())
            } else {
                Err(rc)
            }
        }
    }
}

/// Kicks the clients the strikes action closed, between packets.
///
/// # Safety
/// Called by the broker with a `mosquitto_evt_tick` and the plugin as userdata.
unsafe extern "C" fn on_tick(_event: c_int, _data: *mut c_void, userdata: *mut c_void) -> c_int {
    guard(ffi::MOSQ_ERR_SUCCESS, || {
        // SAFETY: userdata is the plugin registered with this callback, alive until cleanup.
        let plugin = unsafe { &*userdata.cast::<Plugin>() };
        let due = match plugin.to_kick.lock() {
            Ok(mut queue) if !queue.is_empty() => std::mem::take(&mut *queue),
            _ => return ffi::MOSQ_ERR_SUCCESS,
        };
        for (handle, id) in due {
            // A client that left meanwhile is no longer kicked, and its id may be another's.
            if !plugin.kicked.lock().is_ok_and(|k| k.contains(&handle)) {
                continue;
            }
            // No lock is held: the kick runs this plugin's disconnect callback inside it.
            // SAFETY: a NUL-terminated id; the broker looks it up and copies nothing.
            unsafe { ffi::mosquitto_kick_client_by_clientid(id.as_ptr(), false) };
        }
        ffi::MOSQ_ERR_SUCCESS
    })
}

/// # Safety
/// Called by the broker with a `mosquitto_evt_disconnect` and the plugin as userdata.
unsafe extern "C" fn on_disconnect(
    _event: c_int,
    data: *mut c_void,
    userdata: *mut c_void,
) -> c_int {
    guard(ffi::MOSQ_ERR_SUCCESS, || {
        // SAFETY: userdata is the plugin registered with this callback, alive until cleanup.
        let plugin = unsafe { &*userdata.cast::<Plugin>() };
        // SAFETY: the broker passes its disconnect event for this callback.
        let event = unsafe { &*data.cast::<EvtDisconnect>() };
        let handle = event.client as usize;
        if let Ok(mut kicked) = plugin.kicked.lock() {
            kicked.remove(&handle);
        }
        if let Some(action) = &plugin.options.sessions
            && let Some(user) = plugin
                .sessions
                .lock()
                .ok()
                .and_then(|mut s| s.remove(&handle))
        {
            plugin
                .agent
                .release(action.clone(), user, format!("{handle:#x}"));
        }
        if plugin.options.strikes.is_some() {
            // SAFETY: the live client handle of this event; NULL or its NUL-terminated id.
            if let Some(id) = unsafe { string(ffi::mosquitto_client_id(event.client)) } {
                plugin.agent.connection_gone(id);
            }
        }
        let Some(addr) = plugin
            .deferred
            .lock()
            .ok()
            .and_then(|mut d| d.remove(&(event.client as usize)))
        else {
            return ffi::MOSQ_ERR_SUCCESS;
        };
        // SAFETY: the live client handle of this event.
        let id = unsafe { ffi::mosquitto_client_id(event.client) };
        if id.is_null() {
            log(
                ffi::MOSQ_LOG_NOTICE,
                &format!("limiter: reporting a failed login from {addr}"),
            );
            plugin.agent.report_auth_failure(addr);
        }
        ffi::MOSQ_ERR_SUCCESS
    })
}
