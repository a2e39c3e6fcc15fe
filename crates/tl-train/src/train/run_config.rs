//! A run's `config.json`: its [`TrainConfig`] with the key `tinyllm` added, naming the build
//! that wrote it (`{"version": "0.1.0", "commit": "<40 hex digits>" or null}`).
//!
//! The key is a record for people, not part of the config: every reader of a config file
//! ([`read_config_json`], [`TrainConfig::from_file`]) drops it before reading the config, so
//! a run resumed or restarted by another build compares equal, and a run's `config.json`
//! fed back to `tinyllm train --config` starts the same run.

use serde::Serialize;

use super::config::TrainConfig;
use crate::build_info::BuildInfo;

/// The key of `config.json` that names the build.
pub const BUILD_KEY: &str = "tinyllm";

/// The config as `config.json` holds it: the build first, then the config's own keys.
#[derive(Serialize)]
struct Stamped<'a> {
    tinyllm: BuildInfo,
    #[serde(flatten)]
    config: &'a TrainConfig,
}

/// The bytes of `config.json` for `config`, written by this build (pretty JSON).
pub fn config_json(config: &TrainConfig) -> Vec<u8> {
    serde_json::to_vec_pretty(&Stamped {
        tinyllm: BuildInfo::current(),
        config,
    })
    .expect("the config serializes")
}

/// Drops the build's key from a config file's top level (JSON), if there.
pub(crate) fn strip_build_key(value: &mut serde_json::Value) {
    if let Some(object) = value.as_object_mut() {
        object.remove(BUILD_KEY);
    }
}

/// The config of a `config.json`'s bytes, whichever build wrote them (or none: a file
/// without the `tinyllm` key reads the same).
///
/// # Errors
/// The JSON error when the bytes are not such a config.
pub fn read_config_json(bytes: &[u8]) -> serde_json::Result<TrainConfig> {
    let mut value = parse_json(bytes)?;
    strip_build_key(&mut value);
    serde_json::from_value(value)
}

/// A config file's JSON as a value, refusing an object that repeats a key as reading it
/// straight into a [`TrainConfig`] does (serde_json's own `Value` silently keeps the last).
///
/// # Errors
/// The JSON error: bad syntax, trailing characters, or a repeated key.
pub(crate) fn parse_json(bytes: &[u8]) -> serde_json::Result<serde_json::Value> {
    serde_json::from_slice::<Strict>(bytes).map(|Strict(value)| value)
}

/// A JSON value read by [`StrictVisitor`].
struct Strict(serde_json::Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

/// Builds a `serde_json::Value`, refusing a key repeated in one object.
struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        serde_json::Number::from_f64(v)
            .map(serde_json::Value::Number)
            .ok_or_else(|| E::custom(format!("{v} is not a JSON number")))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format!("duplicate field `{key}`")));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(serde_json::Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn the_build_key_comes_first_and_reads_back_to_the_same_config() {
        let config = TrainConfig::for_preset(Preset::Tiny);
        let bytes = config_json(&config);
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with("{\n  \"tinyllm\": {"), "{text}");
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value[BUILD_KEY]["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(read_config_json(&bytes).unwrap(), config);
        // Another build's stamp, or none, reads the same.
        let mut other = value.clone();
        other[BUILD_KEY] = serde_json::json!({"version": "9.9.9", "commit": "f".repeat(40)});
        let other = serde_json::to_vec(&other).unwrap();
        assert_eq!(read_config_json(&other).unwrap(), config);
        let plain = serde_json::to_vec(&config).unwrap();
        assert_eq!(read_config_json(&plain).unwrap(), config);
    }

    #[test]
    fn a_repeated_key_is_refused_at_any_depth() {
        let config = TrainConfig::for_preset(Preset::Tiny);
        let text = String::from_utf8(config_json(&config)).unwrap();
        for (from, to) in [
            ("\"steps\":", "\"steps\": 1,\n  \"steps\":"),
            ("\"d_model\":", "\"d_model\": 1,\n    \"d_model\":"),
        ] {
            let twice = text.replacen(from, to, 1);
            let error = read_config_json(twice.as_bytes()).unwrap_err();
            assert!(error.to_string().contains("duplicate field"), "{error}");
        }
        assert_eq!(
            parse_json(text.as_bytes()).unwrap(),
            serde_json::from_str::<serde_json::Value>(&text).unwrap()
        );
    }

    #[test]
    fn other_unknown_keys_are_still_refused() {
        let mut value = serde_json::to_value(TrainConfig::for_preset(Preset::Tiny)).unwrap();
        value["tinyllm_extra"] = 1.into();
        let error = read_config_json(&serde_json::to_vec(&value).unwrap()).unwrap_err();
        assert!(error.to_string().contains("unknown field"), "{error}");
    }
}
