//! The key of an action keyed by `user+topic` (protocol 1.4): the user, a NUL byte, and the
//! topic the message was published to. The agent keeps the topic's first `topic-levels`
//! levels and names the bucket by them, so the broker sends the whole topic and need not
//! know the action's setting.
//!
//! NUL separates the two because MQTT allows U+0000 in neither a username nor a topic: no
//! user's name can end where another's topic begins.

use crate::MAX_KEY_LEN;

/// The byte between the user and the topic.
pub const USER_TOPIC_SEPARATOR: u8 = 0;

/// Why no `user+topic` key can be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UserTopicError {
    /// The user is empty.
    #[error("the user is empty")]
    EmptyUser,
    /// The topic is empty.
    #[error("the topic is empty")]
    EmptyTopic,
    /// The user or the topic holds a NUL byte, the key's separator.
    #[error("the user or the topic holds a NUL byte")]
    Nul,
    /// The topic holds `+` or `#`: a filter, not the concrete topic of a message.
    #[error("the topic {0:?} holds a wildcard (+ or #)")]
    Wildcard(String),
    /// Not even the topic's first level fits beside the user in [`MAX_KEY_LEN`] bytes.
    #[error(
        "the user ({user} bytes) and the topic's first level ({first_level} bytes) do not fit \
         in a key of {MAX_KEY_LEN} bytes"
    )]
    TooLong {
        /// The user's length in bytes.
        user: usize,
        /// The length of the topic's first level in bytes.
        first_level: usize,
    },
}

/// The key for `user` publishing to `topic`. A topic too long for the key is cut after its
/// last whole level that fits: the agent keys by the first levels only, so the bucket is
/// the same as for the whole topic whenever those levels fit, and otherwise one of fewer
/// levels, shared by more topics (stricter, never looser). A key whose first level does not
/// fit beside the user is refused rather than cut inside a level.
pub fn user_topic_key(user: &str, topic: &str) -> Result<Vec<u8>, UserTopicError> {
    if user.is_empty() {
        return Err(UserTopicError::EmptyUser);
    }
    if topic.is_empty() {
        return Err(UserTopicError::EmptyTopic);
    }
    if user.contains('\0') || topic.contains('\0') {
        return Err(UserTopicError::Nul);
    }
    if topic.contains(['+', '#']) {
        return Err(UserTopicError::Wildcard(topic.to_owned()));
    }
    let budget = MAX_KEY_LEN.saturating_sub(user.len() + 1);
    let kept = if topic.len() <= budget {
        topic
    } else {
        // The longest run of whole levels that fits: up to a '/' at or before the budget.
        match topic.as_bytes()[..=budget.min(topic.len() - 1)]
            .iter()
            .rposition(|b| *b == b'/')
        {
            Some(cut) if cut > 0 => &topic[..cut],
            _ => {
                return Err(UserTopicError::TooLong {
                    user: user.len(),
                    first_level: topic.split('/').next().map_or(0, str::len),
                });
            }
        }
    };
    let mut key = Vec::with_capacity(user.len() + 1 + kept.len());
    key.extend_from_slice(user.as_bytes());
    key.push(USER_TOPIC_SEPARATOR);
    key.extend_from_slice(kept.as_bytes());
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_the_user_a_nul_and_the_topic() {
        assert_eq!(user_topic_key("alice", "a/b/c").unwrap(), b"alice\0a/b/c");
        assert_eq!(user_topic_key("alice", "/").unwrap(), b"alice\0/");
    }

    #[test]
    fn what_cannot_be_a_publishes_key_is_refused() {
        assert_eq!(user_topic_key("", "a"), Err(UserTopicError::EmptyUser));
        assert_eq!(user_topic_key("alice", ""), Err(UserTopicError::EmptyTopic));
        assert_eq!(user_topic_key("al\0ice", "a"), Err(UserTopicError::Nul));
        assert_eq!(user_topic_key("alice", "a\0b"), Err(UserTopicError::Nul));
        for filter in ["a/+/c", "a/#", "#"] {
            assert!(matches!(
                user_topic_key("alice", filter),
                Err(UserTopicError::Wildcard(_))
            ));
        }
    }

    #[test]
    fn a_long_topic_is_cut_after_its_last_whole_level_that_fits() {
        let user = "u";
        // Exactly the key's length: kept whole.
        let exact = "x".repeat(MAX_KEY_LEN - 2);
        assert_eq!(user_topic_key(user, &exact).unwrap().len(), MAX_KEY_LEN);
        // A first level, then a level that runs past the end: the first level stays.
        let first = "a".repeat(100);
        let topic = format!("{first}/{}", "b".repeat(2000));
        assert_eq!(
            user_topic_key(user, &topic).unwrap(),
            format!("u\0{first}").into_bytes()
        );
        // A '/' right at the budget's edge still keeps everything before it.
        let edge = format!("{}/{}", "c".repeat(MAX_KEY_LEN - 2), "d".repeat(10));
        assert_eq!(user_topic_key(user, &edge).unwrap().len(), MAX_KEY_LEN);
        // Many short levels: the cut is on a boundary and the key within the bound.
        let levels = vec!["lvl"; 600].join("/");
        let key = user_topic_key(user, &levels).unwrap();
        assert!(key.len() <= MAX_KEY_LEN);
        assert!(levels.as_bytes().starts_with(&key[2..]));
        assert_eq!(levels.as_bytes()[key.len() - 2], b'/');
    }

    #[test]
    fn a_first_level_that_cannot_fit_is_refused_not_cut() {
        let topic = format!("{}/b", "a".repeat(MAX_KEY_LEN));
        assert_eq!(
            user_topic_key("alice", &topic),
            Err(UserTopicError::TooLong {
                user: 5,
                first_level: MAX_KEY_LEN
            })
        );
        let long_user = "u".repeat(MAX_KEY_LEN);
        assert!(matches!(
            user_topic_key(&long_user, "a"),
            Err(UserTopicError::TooLong { .. })
        ));
        // An empty first level alone is no cut to make: refused as well.
        let slash_first = format!("/{}", "a".repeat(MAX_KEY_LEN));
        assert!(matches!(
            user_topic_key("u", &slash_first),
            Err(UserTopicError::TooLong { .. })
        ));
    }
}
