//! The broker's own mosquitto.conf, read for the few settings that decide what the broker
//! would answer without this plugin: `allow_anonymous`, `password_file`, `acl_file`, the other
//! `plugin` / `auth_plugin` lines, and `per_listener_settings`, per listener.
//!
//! Read because a plugin cannot ask mosquitto 2.0 for them, and mosquitto 2.0 answers a login
//! or an ACL check that every callback deferred differently from one no callback saw (see
//! [`crate::passes`]). Only the reading is here; the decision is `passes`.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
};

/// Why the broker's configuration could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    #[error("reading {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: `{key}` needs a value", path.display())]
    MissingValue {
        path: PathBuf,
        line: usize,
        key: String,
    },
    #[error("{}:{line}: `{key} {value}` is not true or false", path.display())]
    NotBool {
        path: PathBuf,
        line: usize,
        key: String,
        value: String,
    },
}

/// A `plugin` (or `auth_plugin`) line and the `plugin_opt_*` / `auth_opt_*` lines after it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginLine {
    pub path: PathBuf,
    /// Keys without the `plugin_opt_` / `auth_opt_` prefix, as the broker passes them.
    pub options: Vec<(String, String)>,
}

/// The security settings of one scope: the whole broker, or one listener under
/// `per_listener_settings true`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Security {
    /// `None` while the file does not say (mosquitto's default then applies).
    pub allow_anonymous: Option<bool>,
    pub password_file: bool,
    pub acl_file: bool,
    pub plugins: Vec<PluginLine>,
}

/// What was read, with every `include_dir` followed in place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BrokerConf {
    pub per_listener_settings: bool,
    /// Whether any `listener` or `port` line exists: without one mosquitto 2.0 runs "local
    /// only", where `allow_anonymous` defaults to true.
    pub has_listeners: bool,
    /// The settings outside any listener section (all of them when `per_listener_settings`
    /// is false).
    pub global: Security,
    /// Each `listener` section's settings, in file order (empty unless
    /// `per_listener_settings` is true).
    pub listeners: Vec<Listener>,
}

/// One `listener PORT [ADDRESS]` section.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listener {
    /// The `listener` line's arguments, to name the listener in messages.
    pub name: String,
    pub security: Security,
}

impl BrokerConf {
    /// What mosquitto 2.0 takes for an `allow_anonymous` the file does not set: false, except
    /// in local-only mode (no listener at all), where it is true.
    pub fn allow_anonymous_default(&self) -> bool {
        !self.has_listeners
    }

    /// Reads `path` and every file its `include_dir` lines name (the `.conf` files of the
    /// directory, in byte order of their names, as mosquitto does).
    pub fn read(path: &Path) -> Result<Self, ConfError> {
        let mut lines = Vec::new();
        collect(path, &mut lines, 0)?;
        Self::from_lines(lines)
    }

    /// Parses one file's text with no `include_dir` (it would be read from disk).
    #[cfg(test)]
    pub fn parse(text: &str) -> Result<Self, ConfError> {
        let path = PathBuf::from("mosquitto.conf");
        Self::from_lines(
            text.lines()
                .enumerate()
                .map(|(n, l)| Line {
                    path: path.clone(),
                    number: n + 1,
                    text: l.to_owned(),
                })
                .collect(),
        )
    }

    fn from_lines(lines: Vec<Line>) -> Result<Self, ConfError> {
        let mut conf = Self::default();
        // `per_listener_settings` decides where every other line goes, wherever it stands.
        for line in &lines {
            if let Some(("per_listener_settings", value)) = line.key_value() {
                conf.per_listener_settings = line.bool("per_listener_settings", value)?;
            }
        }
        for line in &lines {
            let Some((key, value)) = line.key_value() else {
                continue;
            };
            let scope = match conf.listeners.last_mut() {
                Some(listener) => &mut listener.security,
                None => &mut conf.global,
            };
            match key {
                "listener" => {
                    conf.has_listeners = true;
                    if conf.per_listener_settings {
                        conf.listeners.push(Listener {
                            name: value.to_owned(),
                            security: Security::default(),
                        });
                    }
                }
                "port" => conf.has_listeners = true,
                "allow_anonymous" => scope.allow_anonymous = Some(line.bool(key, value)?),
                "password_file" => scope.password_file = !line.value(key, value)?.is_empty(),
                "acl_file" => scope.acl_file = !line.value(key, value)?.is_empty(),
                "plugin" | "auth_plugin" => scope.plugins.push(PluginLine {
                    path: PathBuf::from(line.value(key, value)?),
                    options: Vec::new(),
                }),
                _ => {
                    let option = key
                        .strip_prefix("plugin_opt_")
                        .or_else(|| key.strip_prefix("auth_opt_"));
                    // mosquitto gives an option to the plugin line above it.
                    if let (Some(option), Some(plugin)) = (option, scope.plugins.last_mut()) {
                        plugin.options.push((option.to_owned(), value.to_owned()));
                    }
                }
            }
        }
        Ok(conf)
    }
}

/// The configuration file mosquitto was started with (`-c FILE` or `--config-file FILE`),
/// from its NUL-separated command line; relative to its working directory `cwd`.
pub fn config_path(cmdline: &[u8], cwd: &Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut args = cmdline.split(|b| *b == 0);
    while let Some(arg) = args.next() {
        if arg == b"-c" || arg == b"--config-file" {
            let file = args.next().filter(|a| !a.is_empty())?;
            return Some(cwd.join(Path::new(OsStr::from_bytes(file))));
        }
    }
    None
}

/// One line of a file, with where it came from for messages.
struct Line {
    path: PathBuf,
    number: usize,
    text: String,
}

impl Line {
    /// The key and the rest of the line, trimmed; `None` for blanks and comments (mosquitto
    /// takes `#` as a comment only at the start of a line).
    fn key_value(&self) -> Option<(&str, &str)> {
        let text = self.text.trim();
        if text.is_empty() || text.starts_with('#') {
            return None;
        }
        Some(match text.split_once(char::is_whitespace) {
            Some((key, value)) => (key, value.trim()),
            None => (text, ""),
        })
    }

    fn value<'a>(&self, key: &str, value: &'a str) -> Result<&'a str, ConfError> {
        if value.is_empty() {
            return Err(ConfError::MissingValue {
                path: self.path.clone(),
                line: self.number,
                key: key.to_owned(),
            });
        }
        Ok(value)
    }

    fn bool(&self, key: &str, value: &str) -> Result<bool, ConfError> {
        match self.value(key, value)? {
            "true" => Ok(true),
            "false" => Ok(false),
            other => Err(ConfError::NotBool {
                path: self.path.clone(),
                line: self.number,
                key: key.to_owned(),
                value: other.to_owned(),
            }),
        }
    }
}

/// How deep `include_dir` may nest: a directory that includes itself stops here instead of
/// recursing forever (mosquitto refuses nested include_dir altogether).
const MAX_INCLUDE_DEPTH: usize = 8;

fn collect(path: &Path, lines: &mut Vec<Line>, depth: usize) -> Result<(), ConfError> {
    let read_error = |source| ConfError::Read {
        path: path.to_owned(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(read_error)?;
    for (n, text) in text.lines().enumerate() {
        let line = Line {
            path: path.to_owned(),
            number: n + 1,
            text: text.to_owned(),
        };
        match line.key_value() {
            Some(("include_dir", dir)) if depth < MAX_INCLUDE_DEPTH => {
                let dir = PathBuf::from(dir);
                let entries = std::fs::read_dir(&dir).map_err(|source| ConfError::Read {
                    path: dir.clone(),
                    source,
                })?;
                let mut files = Vec::new();
                for entry in entries {
                    let entry = entry.map_err(|source| ConfError::Read {
                        path: dir.clone(),
                        source,
                    })?;
                    let file = entry.path();
                    if file.extension() == Some(OsStr::new("conf")) {
                        files.push(file);
                    }
                }
                files.sort();
                for file in files {
                    collect(&file, lines, depth + 1)?;
                }
            }
            _ => lines.push(line),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_settings_are_read_wherever_they_stand() {
        let conf = BrokerConf::parse(
            "# a comment\n\
             listener 1883 10.0.0.1\n\
             allow_anonymous true\n\
             password_file /etc/mosquitto/passwd\n\
             \n\
             acl_file /etc/mosquitto/acl\n\
             plugin /usr/lib/limiter/liblimiter_mosquitto.so\n\
             plugin_opt_socket /run/limiter/limiter.sock\n\
             plugin_opt_fail  closed \n\
             auth_plugin /usr/lib/other.so\n\
             auth_opt_x y z\n",
        )
        .unwrap();
        assert!(!conf.per_listener_settings);
        assert!(conf.has_listeners);
        assert!(conf.listeners.is_empty());
        let g = &conf.global;
        assert_eq!(g.allow_anonymous, Some(true));
        assert!(g.password_file && g.acl_file);
        assert_eq!(
            g.plugins,
            vec![
                PluginLine {
                    path: "/usr/lib/limiter/liblimiter_mosquitto.so".into(),
                    options: vec![
                        ("socket".into(), "/run/limiter/limiter.sock".into()),
                        ("fail".into(), "closed".into())
                    ],
                },
                PluginLine {
                    path: "/usr/lib/other.so".into(),
                    options: vec![("x".into(), "y z".into())],
                },
            ]
        );
    }

    #[test]
    fn nothing_set_is_nothing_read_and_no_listener_is_local_only() {
        let conf = BrokerConf::parse("log_dest stderr\n#allow_anonymous true\n").unwrap();
        assert_eq!(conf.global, Security::default());
        assert!(!conf.has_listeners);
        assert!(conf.allow_anonymous_default());
        let conf = BrokerConf::parse("port 1883\n").unwrap();
        assert!(!conf.allow_anonymous_default());
    }

    #[test]
    fn per_listener_settings_gives_each_listener_its_own_section() {
        let conf = BrokerConf::parse(
            "allow_anonymous false\n\
             listener 1883\n\
             allow_anonymous true\n\
             plugin /p.so\n\
             listener 8883 10.0.0.1\n\
             password_file /pw\n\
             acl_file /acl\n\
             plugin /p.so\n\
             plugin_opt_actions auth\n\
             per_listener_settings true\n",
        )
        .unwrap();
        assert!(conf.per_listener_settings);
        assert_eq!(conf.global.allow_anonymous, Some(false));
        assert_eq!(conf.listeners.len(), 2);
        let (a, b) = (&conf.listeners[0], &conf.listeners[1]);
        assert_eq!(a.name, "1883");
        assert_eq!(a.security.allow_anonymous, Some(true));
        assert!(!a.security.password_file && !a.security.acl_file);
        assert_eq!(b.name, "8883 10.0.0.1");
        assert_eq!(b.security.allow_anonymous, None);
        assert!(b.security.password_file && b.security.acl_file);
        assert_eq!(
            b.security.plugins[0].options,
            vec![("actions".into(), "auth".into())]
        );
    }

    #[test]
    fn bad_lines_are_errors_naming_file_line_and_key() {
        for (text, needle) in [
            (
                "allow_anonymous yes\n",
                "mosquitto.conf:1: `allow_anonymous yes`",
            ),
            (
                "\nper_listener_settings\n",
                "mosquitto.conf:2: `per_listener_settings`",
            ),
            ("plugin\n", "`plugin` needs a value"),
        ] {
            let err = BrokerConf::parse(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn the_config_file_is_found_on_the_command_line() {
        let cwd = Path::new("/srv");
        for (cmdline, want) in [
            (
                &b"mosquitto\0-c\0/etc/mosquitto/mosquitto.conf\0"[..],
                Some("/etc/mosquitto/mosquitto.conf"),
            ),
            (
                b"/usr/sbin/mosquitto\0-v\0--config-file\0m.conf\0",
                Some("/srv/m.conf"),
            ),
            (b"mosquitto\0-p\x001883\0", None),
            (b"mosquitto\0-c\0", None),
        ] {
            assert_eq!(config_path(cmdline, cwd), want.map(PathBuf::from));
        }
    }

    #[test]
    fn include_dir_is_followed_in_place_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let conf_d = dir.path().join("conf.d");
        std::fs::create_dir(&conf_d).unwrap();
        std::fs::write(conf_d.join("b.conf"), "allow_anonymous true\n").unwrap();
        std::fs::write(
            conf_d.join("a.conf"),
            "allow_anonymous false\nacl_file /a\n",
        )
        .unwrap();
        std::fs::write(conf_d.join("c.txt"), "password_file /ignored\n").unwrap();
        let main = dir.path().join("mosquitto.conf");
        std::fs::write(
            &main,
            format!("listener 1883\ninclude_dir {}\n", conf_d.display()),
        )
        .unwrap();
        let conf = BrokerConf::read(&main).unwrap();
        assert_eq!(conf.global.allow_anonymous, Some(true), "b.conf comes last");
        assert!(conf.global.acl_file);
        assert!(!conf.global.password_file, "only .conf files are read");

        let missing = dir.path().join("missing.conf");
        let err = BrokerConf::read(&missing).unwrap_err();
        assert!(err.to_string().contains("missing.conf"), "{err}");
    }
}
