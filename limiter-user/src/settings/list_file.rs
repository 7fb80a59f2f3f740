//! The list files (`allow-file`, `deny-file`): one CIDR a line, `#` comments, blank lines
//! ignored. Read at start and on SIGHUP through the resolve (a bad file refuses both), and again
//! whenever the watcher sees the file change.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use ipnet::IpNet;

use super::{ConfigError, parse_cidr};

/// A list file and what it held when last read, merged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListFile {
    pub path: PathBuf,
    /// Shared: the settings are cloned per use, and a file may hold 100,000 entries.
    pub entries: Arc<Vec<IpNet>>,
}

impl ListFile {
    /// Reads and checks `path` for `setting`; the error names the setting, the file and the
    /// line.
    pub fn read(setting: &'static str, path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(setting, format!("reading {}: {e}", path.display())))?;
        Ok(Self {
            path: path.to_owned(),
            entries: Arc::new(parse_list(setting, path, &text)?),
        })
    }
}

/// The lists' files, when set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFiles {
    pub allow: Option<ListFile>,
    pub deny: Option<ListFile>,
}

/// The entries of a list file's `text`, merged (`ipnet`'s aggregate), so a list of 100,000
/// lines reaches the kernel's trie as few entries as cover the same sources.
pub fn parse_list(
    setting: &'static str,
    path: &Path,
    text: &str,
) -> Result<Vec<IpNet>, ConfigError> {
    let mut nets = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let entry = line.split('#').next().unwrap_or_default().trim();
        if entry.is_empty() {
            continue;
        }
        let net = parse_cidr(setting, entry).map_err(|e| {
            ConfigError::new(
                setting,
                format!("{}:{}: {}", path.display(), n + 1, e.message),
            )
        })?;
        nets.push(net);
    }
    Ok(IpNet::aggregate(&nets))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<String>, ConfigError> {
        parse_list("deny-file", Path::new("/etc/deny.txt"), text)
            .map(|nets| nets.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn comments_and_blanks_are_skipped_and_entries_merged() {
        let text = "# scanners\n\n198.51.100.0/25\n198.51.100.128/25  # the other half\n\
                    \t203.0.113.9\n2001:db8::/32\n2001:db8:1::/48\n::ffff:192.0.2.0/120\n";
        assert_eq!(
            parse(text).unwrap(),
            [
                "192.0.2.0/24",
                "198.51.100.0/24",
                "203.0.113.9/32",
                "2001:db8::/32"
            ]
        );
        assert!(parse("# nothing yet\n").unwrap().is_empty());
    }

    #[test]
    fn a_bad_line_is_named_with_its_file_and_number() {
        for (text, needle) in [
            (
                "10.0.0.0/8\n10.0.0.300\n",
                "/etc/deny.txt:2: `10.0.0.300` is not a CIDR",
            ),
            (
                "\n\n10.0.0.1/8\n",
                "/etc/deny.txt:3: `10.0.0.1/8` has host bits set",
            ),
            ("10.0.0.0/33 # typo\n", "/etc/deny.txt:1:"),
        ] {
            let error = parse(text).unwrap_err();
            assert_eq!(error.setting, "deny-file");
            assert!(error.message.contains(needle), "{text:?}: {error}");
        }
    }

    #[test]
    fn a_missing_file_names_the_setting() {
        let error = ListFile::read("allow-file", Path::new("/nonexistent/allow.txt")).unwrap_err();
        assert_eq!(error.setting, "allow-file");
        assert!(error.message.contains("/nonexistent/allow.txt"), "{error}");
    }

    #[test]
    fn a_hundred_thousand_entries_load_and_merge() {
        // Every other address of 10.0.0.0/13: nothing merges, the worst case for the trie...
        let sparse: String = (0..100_000u32)
            .map(|i| format!("{}\n", std::net::Ipv4Addr::from(0x0a00_0000 + 2 * i)))
            .collect();
        assert_eq!(
            parse_list("deny-file", Path::new("x"), &sparse)
                .unwrap()
                .len(),
            100_000
        );
        // ...and 100,000 neighbours, which merge into the few prefixes that cover them.
        let dense: String = (0..100_000u32)
            .map(|i| format!("{}/32\n", std::net::Ipv4Addr::from(0x0a00_0000 + i)))
            .collect();
        let merged = parse_list("deny-file", Path::new("x"), &dense).unwrap();
        let covered: u64 = merged.iter().map(|n| 1u64 << (32 - n.prefix_len())).sum();
        assert_eq!(covered, 100_000);
        assert!(merged.len() <= 17, "{merged:?}");
    }
}
