//! What a login or an ACL check that the agent allows answers, so that the broker decides
//! exactly as it would without the plugin.
//!
//! Mosquitto 2.0 (`src/security.c`, `mosquitto_unpwd_check` and `mosquitto_acl_check`) runs
//! the callbacks in order and stops at the first that does not defer; then:
//! - a login no callback saw is decided on `allow_anonymous` alone; one every callback
//!   deferred is accepted only without a username and with `allow_anonymous true`;
//! - an ACL check no callback saw is allowed; one every callback deferred is denied.
//!
//! A `password_file` or `acl_file` registers its own callback after the plugins (so this
//! plugin's always runs first), and the password file's defers for a login without a
//! username. So deferring is exact where the broker has a check of its own, and where it has
//! none the plugin must answer what "no callback" would have: a deferral there would refuse
//! every login with a username, or deny every publish and subscribe; a SUCCESS where it has
//! one would skip it (a password bypass, an ACL bypass). Another plugin (`plugin`,
//! `auth_plugin`) is taken for a check of its own of both kinds: what it registers cannot be
//! seen from its line, and deferring to a plugin that checks nothing errs on refusing,
//! never on letting in.

use std::path::{Path, PathBuf};

use crate::{
    broker_conf::{BrokerConf, ConfError, PluginLine, Security},
    options::{AclDefault, LoginCheck, Options},
};

/// A callback's answer for what the agent allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// `MOSQ_ERR_PLUGIN_DEFER`: the broker's own check decides.
    Defer,
    /// `MOSQ_ERR_SUCCESS`.
    Allow,
    /// `MOSQ_ERR_AUTH` / `MOSQ_ERR_ACL_DENIED`: what the broker answers with no check of its
    /// own and anonymous logins refused.
    Refuse,
}

/// The answers for an allowed login and an allowed ACL check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Passes {
    pub login: Pass,
    pub acl: Pass,
}

/// What the broker decides by itself in one scope (the broker, or one listener).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scope {
    pub allow_anonymous: bool,
    /// A password file or another plugin checks logins.
    pub login_check: bool,
    /// An ACL file or another plugin checks publishes and subscribes.
    pub acl: bool,
}

/// The answer to an allowed login in `scope`.
pub fn login_pass(scope: Scope) -> Pass {
    match (scope.login_check, scope.allow_anonymous) {
        (true, _) => Pass::Defer,
        (false, true) => Pass::Allow,
        (false, false) => Pass::Refuse,
    }
}

/// The answer to an allowed ACL check in `scope`.
pub fn acl_pass(scope: Scope) -> Pass {
    if scope.acl { Pass::Defer } else { Pass::Allow }
}

/// The answers, with explicit options winning over what `scope` says.
pub fn passes(options: &Options, scope: Option<Scope>) -> Passes {
    let login = match (options.login_check, scope) {
        (LoginCheck::Broker, _) => Pass::Defer,
        (LoginCheck::None, _) => Pass::Allow,
        (LoginCheck::Auto, Some(scope)) => login_pass(scope),
        // Unreachable through `resolve`, which reads a scope whenever one is auto; deferring
        // is what the plugin did before it could read one.
        (LoginCheck::Auto, None) => Pass::Defer,
    };
    let acl = match (options.acl_default, scope) {
        (AclDefault::Defer, _) => Pass::Defer,
        (AclDefault::Allow, _) => Pass::Allow,
        (AclDefault::Auto, Some(scope)) => acl_pass(scope),
        (AclDefault::Auto, None) => Pass::Defer,
    };
    Passes { login, acl }
}

/// Why `auto` could not be worked out; the plugin then refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum AutoError {
    #[error(
        "cannot find the broker's configuration file (no `-c FILE` on its command line); \
         set plugin_opt_login_check and plugin_opt_acl_default"
    )]
    NoConfigFile,
    #[error(
        "reading the broker's configuration; set plugin_opt_login_check and plugin_opt_acl_default to skip it"
    )]
    Conf(#[from] ConfError),
    #[error(
        "no `plugin` line of {} loads this plugin ({}); set plugin_opt_login_check and \
         plugin_opt_acl_default",
        conf.display(),
        me.display()
    )]
    NotFound { conf: PathBuf, me: PathBuf },
    #[error(
        "per_listener_settings: the listeners loading this plugin need different answers \
         ({listeners}); set {option} explicitly"
    )]
    ListenersDisagree { listeners: String, option: String },
}

/// The answers for this plugin instance in the broker configuration `conf` read from
/// `conf_path`. The instance is the `plugin` line that `is_me` accepts (the same file as the
/// loaded library), narrowed by `my_options` (what the broker passed to init) when several
/// lines load it; under `per_listener_settings` each listener loading it may need other
/// answers, and then the instance cannot tell which listener it serves.
pub fn resolve(
    options: &Options,
    conf: &BrokerConf,
    conf_path: &Path,
    me: &Path,
    is_me: impl Fn(&Path) -> bool,
    my_options: &[(String, String)],
) -> Result<Passes, AutoError> {
    let sections: Vec<(String, &Security)> = if conf.per_listener_settings {
        std::iter::once(("outside any listener".to_owned(), &conf.global))
            .chain(
                conf.listeners
                    .iter()
                    .map(|l| (format!("listener {}", l.name), &l.security)),
            )
            .collect()
    } else {
        vec![("the broker".to_owned(), &conf.global)]
    };
    // (section, the index of a line loading this plugin in it)
    let mut mine: Vec<(&str, &Security, usize)> = Vec::new();
    for (name, security) in &sections {
        for (i, line) in security.plugins.iter().enumerate() {
            if is_me(&line.path) {
                mine.push((name, security, i));
            }
        }
    }
    let same_options = |line: &PluginLine| {
        line.options.len() == my_options.len()
            && line
                .options
                .iter()
                .zip(my_options)
                .all(|((k, v), (mk, mv))| k == mk && v.trim() == mv.trim())
    };
    if mine.len() > 1 && mine.iter().any(|(_, s, i)| same_options(&s.plugins[*i])) {
        mine.retain(|(_, s, i)| same_options(&s.plugins[*i]));
    }
    if mine.is_empty() {
        return Err(AutoError::NotFound {
            conf: conf_path.to_owned(),
            me: me.to_owned(),
        });
    }
    let answers: Vec<(&str, Passes)> = mine
        .iter()
        .map(|(name, security, _)| {
            // Any other line of the scope, another plugin or this one again.
            let others = security.plugins.len() > 1;
            let scope = Scope {
                allow_anonymous: security
                    .allow_anonymous
                    .unwrap_or(conf.allow_anonymous_default()),
                login_check: security.password_file || others,
                acl: security.acl_file || others,
            };
            (*name, passes(options, Some(scope)))
        })
        .collect();
    let first = answers[0].1;
    let mut differ = Vec::new();
    if answers.iter().any(|(_, p)| p.login != first.login) {
        differ.push("plugin_opt_login_check");
    }
    if answers.iter().any(|(_, p)| p.acl != first.acl) {
        differ.push("plugin_opt_acl_default");
    }
    if !differ.is_empty() {
        let listeners = answers
            .iter()
            .map(|(name, p)| format!("{name}: login {:?}, acl {:?}", p.login, p.acl))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(AutoError::ListenersDisagree {
            listeners,
            option: differ.join(" and "),
        });
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "/usr/lib/limiter/liblimiter_mosquitto.so";

    fn auto() -> Options {
        Options::default()
    }

    fn resolve_text(options: &Options, text: &str) -> Result<Passes, AutoError> {
        let conf = BrokerConf::parse(text).unwrap();
        resolve(
            options,
            &conf,
            Path::new("mosquitto.conf"),
            Path::new(ME),
            |p| p == Path::new(ME),
            &[],
        )
    }

    #[test]
    fn every_scope_gets_the_answer_that_keeps_the_brokers_own_decision() {
        for allow_anonymous in [false, true] {
            for login_check in [false, true] {
                for acl in [false, true] {
                    let scope = Scope {
                        allow_anonymous,
                        login_check,
                        acl,
                    };
                    let login = match (login_check, allow_anonymous) {
                        (true, _) => Pass::Defer,
                        (false, true) => Pass::Allow,
                        (false, false) => Pass::Refuse,
                    };
                    let acl_answer = if acl { Pass::Defer } else { Pass::Allow };
                    assert_eq!(login_pass(scope), login, "{scope:?}");
                    assert_eq!(acl_pass(scope), acl_answer, "{scope:?}");
                    assert_eq!(
                        passes(&auto(), Some(scope)),
                        Passes {
                            login,
                            acl: acl_answer
                        }
                    );
                }
            }
        }
    }

    #[test]
    fn explicit_values_override_whatever_the_scope_says() {
        let scope = Scope {
            allow_anonymous: false,
            login_check: false,
            acl: true,
        };
        for (login_check, acl_default, want) in [
            (
                LoginCheck::Broker,
                AclDefault::Allow,
                (Pass::Defer, Pass::Allow),
            ),
            (
                LoginCheck::None,
                AclDefault::Defer,
                (Pass::Allow, Pass::Defer),
            ),
            (
                LoginCheck::Auto,
                AclDefault::Allow,
                (Pass::Refuse, Pass::Allow),
            ),
            (
                LoginCheck::None,
                AclDefault::Auto,
                (Pass::Allow, Pass::Defer),
            ),
        ] {
            let options = Options {
                login_check,
                acl_default,
                ..Options::default()
            };
            let got = passes(&options, Some(scope));
            assert_eq!(
                (got.login, got.acl),
                want,
                "{login_check:?} {acl_default:?}"
            );
        }
    }

    #[test]
    fn the_config_file_decides_auto() {
        let plugin = format!("plugin {ME}\n");
        for (text, login, acl) in [
            // The bug's broker: anonymous allowed, nothing else.
            (
                "listener 1883\nallow_anonymous true\n",
                Pass::Allow,
                Pass::Allow,
            ),
            (
                "listener 1883\nallow_anonymous false\n",
                Pass::Refuse,
                Pass::Allow,
            ),
            // allow_anonymous unset: false with a listener, true in local-only mode.
            ("listener 1883\n", Pass::Refuse, Pass::Allow),
            ("", Pass::Allow, Pass::Allow),
            (
                "listener 1883\npassword_file /pw\n",
                Pass::Defer,
                Pass::Allow,
            ),
            (
                "listener 1883\nallow_anonymous true\nacl_file /acl\n",
                Pass::Allow,
                Pass::Defer,
            ),
            (
                "listener 1883\nplugin /usr/lib/x/dynamic-security.so\n",
                Pass::Defer,
                Pass::Defer,
            ),
        ] {
            let got = resolve_text(&auto(), &format!("{text}{plugin}")).unwrap();
            assert_eq!((got.login, got.acl), (login, acl), "{text}");
        }
    }

    #[test]
    fn per_listener_settings_uses_the_listeners_that_load_this_plugin() {
        let text = format!(
            "per_listener_settings true\n\
             listener 1883\nallow_anonymous true\nplugin {ME}\n\
             listener 1884\npassword_file /pw\nacl_file /acl\n"
        );
        let got = resolve_text(&auto(), &text).unwrap();
        assert_eq!((got.login, got.acl), (Pass::Allow, Pass::Allow));
    }

    #[test]
    fn listeners_that_disagree_stop_the_plugin_naming_the_option() {
        let text = format!(
            "per_listener_settings true\n\
             listener 1883\nallow_anonymous true\nplugin {ME}\n\
             listener 1884\npassword_file /pw\nplugin {ME}\n"
        );
        let err = resolve_text(&auto(), &text).unwrap_err().to_string();
        assert!(err.contains("plugin_opt_login_check"), "{err}");
        assert!(!err.contains("plugin_opt_acl_default"), "{err}");
        assert!(err.contains("listener 1884"), "{err}");
        // The explicit option settles it.
        let options = Options {
            login_check: LoginCheck::Broker,
            ..Options::default()
        };
        assert_eq!(resolve_text(&options, &text).unwrap().login, Pass::Defer);
    }

    #[test]
    fn the_options_tell_two_lines_of_this_plugin_apart() {
        let text = format!(
            "per_listener_settings true\n\
             listener 1883\nallow_anonymous true\nplugin {ME}\nplugin_opt_actions auth\n\
             listener 1884\npassword_file /pw\nplugin {ME}\nplugin_opt_actions publish\n"
        );
        let conf = BrokerConf::parse(&text).unwrap();
        let mine = [("actions".to_owned(), "publish".to_owned())];
        let got = resolve(
            &auto(),
            &conf,
            Path::new("mosquitto.conf"),
            Path::new(ME),
            |p| p == Path::new(ME),
            &mine,
        )
        .unwrap();
        assert_eq!(got.login, Pass::Defer);
    }

    #[test]
    fn a_config_without_this_plugin_is_an_error() {
        let err = resolve_text(&auto(), "plugin /other.so\n").unwrap_err();
        assert!(matches!(err, AutoError::NotFound { .. }), "{err}");
        assert!(err.to_string().contains("plugin_opt_login_check"));
    }
}
