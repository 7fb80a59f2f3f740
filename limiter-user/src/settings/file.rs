//! The TOML file and the one rule by which layers meet: a key set above wins, tables merge key
//! by key. Written once over serde, so no setting is merged by hand.

use std::{collections::BTreeMap, path::Path};

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use super::{BrokerLayer, ClusterLayer, ConfigError, Layer};
use crate::buckets::ActionConfig;

/// What a configuration file holds: the settings layer at the top level, the broker
/// protocol's settings under `[broker]`, the broker limiter's actions under `[actions]`, and
/// the fleet's Redis under `[cluster]`.
#[derive(Clone, Debug, Default)]
pub struct FileConfig {
    pub layer: Layer,
    pub broker: BrokerLayer,
    pub cluster: ClusterLayer,
    pub actions: BTreeMap<String, ActionConfig>,
}

impl FileConfig {
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("config", format!("reading {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| ConfigError {
            setting: e.setting,
            message: format!("{}: {}", path.display(), e.message),
        })
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::new("config", e.message()))?;
        let actions = match table.remove("actions") {
            None => BTreeMap::new(),
            Some(value) => value
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::new("actions", e.message()))?,
        };
        let broker = match table.remove("broker") {
            None => Default::default(),
            Some(value) => value
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::new("broker", e.message()))?,
        };
        let cluster = match table.remove("cluster") {
            None => Default::default(),
            Some(value) => value
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::new("cluster", e.message()))?,
        };
        let layer = Layer::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
            // serde names an unknown key in its message ("unknown field `x`"), but not the
            // key of a value it refuses ("unknown variant `x`"): the first key refused on its
            // own is the one.
            let refused = table.iter().find(|(key, value)| {
                let alone = toml::Table::from_iter([((*key).clone(), (*value).clone())]);
                Layer::deserialize(toml::Value::Table(alone)).is_err()
            });
            ConfigError::new(
                refused.map_or("config", |(key, _)| key.as_str()),
                e.message(),
            )
        })?;
        Ok(Self {
            layer,
            broker,
            cluster,
            actions,
        })
    }
}

/// `upper` over `lower`: every key `upper` sets wins, tables merge key by key.
pub fn merge<T: Serialize + DeserializeOwned>(upper: &T, lower: &T) -> Result<T, ConfigError> {
    let mut merged = table(lower)?;
    overlay(&mut merged, table(upper)?);
    T::deserialize(toml::Value::Table(merged)).map_err(|e| ConfigError::new("config", e.message()))
}

/// The keys a layer sets.
pub fn keys<T: Serialize>(layer: &T) -> Result<Vec<String>, ConfigError> {
    Ok(table(layer)?.keys().cloned().collect())
}

fn table<T: Serialize>(layer: &T) -> Result<toml::Table, ConfigError> {
    toml::Table::try_from(layer).map_err(|e| ConfigError::new("config", e))
}

fn overlay(lower: &mut toml::Table, upper: toml::Table) {
    for (key, value) in upper {
        match (lower.get_mut(&key), value) {
            (Some(toml::Value::Table(below)), toml::Value::Table(above)) => overlay(below, above),
            (_, value) => {
                lower.insert(key, value);
            }
        }
    }
}
