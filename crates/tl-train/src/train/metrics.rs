//! The run's metrics, one JSON object per line in `metrics.jsonl`.
//!
//! JSON has no NaN or infinity, and a diverging run produces both; a number that is not
//! finite is written as one of the strings `"NaN"`, `"inf"` and `"-inf"` (see [`float`]),
//! so every record reads back as it was written.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// One step's fp8 range counts: values that saturated at the largest finite value after
/// scaling, and nonzero values flushed to zero, over all fp8 casts of the step, and per
/// tensor (`blocks.0.wq.input`, `.weight`, `.grad`) where either is nonzero.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Fp8Counts {
    /// Values saturated, all tensors.
    pub saturated: u64,
    /// Values flushed to zero, all tensors.
    pub flushed: u64,
    /// `[saturated, flushed]` of each tensor with any.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub tensors: std::collections::BTreeMap<String, [u64; 2]>,
}

impl Fp8Counts {
    /// The counts of one update of an fp8 state (`per_layer` in layer order, each input,
    /// weight, grad) under the layers' `names`.
    pub fn from_layers(names: &[String], per_layer: &[[tl_numerics::RangeCounts; 3]]) -> Self {
        let mut counts = Fp8Counts::default();
        for (name, layer) in names.iter().zip(per_layer) {
            for (role, c) in ["input", "weight", "grad"].iter().zip(layer) {
                counts.saturated += c.saturated;
                counts.flushed += c.flushed;
                if c.saturated + c.flushed > 0 {
                    counts
                        .tensors
                        .insert(format!("{name}.{role}"), [c.saturated, c.flushed]);
                }
            }
        }
        counts
    }
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// An optimizer step (steps count from 1: the record of step 1 follows the first update).
    Train {
        /// Optimizer steps taken so far.
        step: u64,
        /// The batch's mean loss, nats per token.
        #[serde(with = "float")]
        loss: f64,
        /// The learning rate the step used.
        #[serde(with = "float")]
        lr: f64,
        /// Gradient norm before clipping, when clipping is on and the step was taken.
        #[serde(with = "float::option")]
        grad_norm: Option<f64>,
        /// The loss scale after the step (fp16).
        #[serde(with = "float::option")]
        scale: Option<f64>,
        /// Whether an overflow skipped the update.
        skipped: bool,
        /// Gradient values the fp16 casts flushed to zero.
        underflows: u64,
        /// Throughput of this step.
        #[serde(with = "float")]
        tokens_per_s: f64,
        /// Wall-clock seconds of this step.
        #[serde(with = "float")]
        step_s: f64,
        /// When the step ended: UTC, RFC 3339 with milliseconds (`2026-12-02T10:15:03.123Z`).
        /// `None` in the records of builds before it was logged.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        time: Option<String>,
        /// Seconds of training since the run began when the step ended, across resumes: the
        /// time the processes of the run spent training, evaluating and checkpointing, not
        /// the time between them (a resumed process starts from the `elapsed_s` of the
        /// checkpoint's step in this log). `None` in older records.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        elapsed_s: Option<f64>,
        /// Tokens trained on so far, over all ranks: `step` × the global batch's tokens per
        /// step. `None` in older records.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokens: Option<u64>,
        /// What the step's fp8 casts pushed out of range (fp8 runs).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fp8: Option<Fp8Counts>,
    },
    /// A validation loss.
    Eval {
        /// Optimizer steps taken so far.
        step: u64,
        /// Mean validation loss, nats per token.
        #[serde(with = "float")]
        val_loss: f64,
        /// The same loss in bits per byte of the windows' text, which does not depend on the
        /// tokenizer: `val_loss · tokens / (ln 2 · bytes)`. `None` in older records.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        val_bpb: Option<f64>,
        /// When the evaluation ended (UTC, RFC 3339); `None` in older records.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        time: Option<String>,
    },
}

/// A moment as UTC in RFC 3339 with milliseconds, as the records' `time` holds it:
/// `2026-12-02T10:15:03.123Z`. Moments before 1970 are written as 1970's first.
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use tl_train::train::rfc3339_utc;
/// let moment = UNIX_EPOCH + Duration::from_millis(1_796_206_503_123);
/// assert_eq!(rfc3339_utc(moment), "2026-12-02T10:15:03.123Z");
/// ```
pub fn rfc3339_utc(moment: std::time::SystemTime) -> String {
    let since = moment
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let (secs, millis) = (since.as_secs(), since.subsec_millis());
    let (days, of_day) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    )
}

/// The proleptic Gregorian date `(year, month, day)` of the day `days` after 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

impl Record {
    /// The step the record belongs to.
    pub fn step(&self) -> u64 {
        match self {
            Record::Train { step, .. } | Record::Eval { step, .. } => *step,
        }
    }
}

/// Appends records to `metrics.jsonl`, one flushed line each, so a crash loses at most the
/// line being written.
pub struct MetricsLog {
    path: PathBuf,
    file: fs::File,
    elapsed_s: f64,
}

impl MetricsLog {
    /// Opens the log of a run directory for appending, keeping only the records up to
    /// `keep_through` (those after a resumed checkpoint's step belong to the lost tail).
    ///
    /// # Errors
    /// [`TrainError::Io`] if the file cannot be read or written.
    pub fn open(run_dir: &Path, keep_through: u64) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let kept: Vec<Record> = read_records(&path)?
            .into_iter()
            .filter(|record| record.step() <= keep_through)
            .collect();
        let mut text = String::new();
        for record in &kept {
            text.push_str(&serde_json::to_string(record).expect("records serialize"));
            text.push('\n');
        }
        super::super::store::write_atomic(&path, text.as_bytes())?;
        let file = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|source| TrainError::io(&path, source))?;
        let elapsed_s = kept
            .iter()
            .rev()
            .find_map(|record| match record {
                Record::Train { elapsed_s, .. } => *elapsed_s,
                Record::Eval { .. } => None,
            })
            .unwrap_or(0.0);
        Ok(Self {
            path,
            file,
            elapsed_s,
        })
    }

    /// The `elapsed_s` of the last training record kept when the log was opened (0 for a new
    /// run, or a log of records that do not have it): where a resumed run's clock goes on.
    pub fn elapsed_s_at_open(&self) -> f64 {
        self.elapsed_s
    }

    /// Appends one record.
    ///
    /// # Errors
    /// [`TrainError::Io`] if the line cannot be written.
    pub fn append(&mut self, record: &Record) -> Result<()> {
        let mut line = serde_json::to_string(record).expect("records serialize");
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|source| TrainError::io(&self.path, source))
    }
}

/// Every record of a `metrics.jsonl` (none if the file does not exist).
///
/// A last line without its newline is what a crash in the middle of [`MetricsLog::append`]
/// leaves: it is ignored. Any other line that is not a record is an error, since dropping
/// it would lose a step's figures.
///
/// # Errors
/// [`TrainError::Io`] if the file exists but cannot be read; [`TrainError::Metrics`] naming
/// the first line that is not valid UTF-8 or not a record.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(TrainError::io(path, source)),
    };
    let mut records = Vec::new();
    let mut lines = bytes.split(|&byte| byte == b'\n').enumerate().peekable();
    while let Some((index, line)) = lines.next() {
        let last = lines.peek().is_none();
        if last {
            // After the final newline (empty), or a torn line: nothing was complete there.
            break;
        }
        let damaged = |reason: String| TrainError::Metrics {
            path: path.to_path_buf(),
            line: index + 1,
            reason,
        };
        let text = std::str::from_utf8(line)
            .map_err(|error| damaged(format!("not UTF-8 text ({error})")))?;
        let record = serde_json::from_str(text)
            .map_err(|error| damaged(format!("not a metrics record ({error})")))?;
        records.push(record);
    }
    Ok(records)
}

/// Serde for an `f64` that may be NaN or infinite: finite values as JSON numbers, the others
/// as the strings `"NaN"`, `"inf"` and `"-inf"`.
pub mod float {
    use serde::Serializer;
    use serde::de::{self, Deserializer, Visitor};
    use std::fmt;

    /// Writes `value` as a number, or as its name when it is not finite.
    ///
    /// # Errors
    /// Those of the serializer.
    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            serializer.serialize_f64(*value)
        } else if value.is_nan() {
            serializer.serialize_str("NaN")
        } else if *value > 0.0 {
            serializer.serialize_str("inf")
        } else {
            serializer.serialize_str("-inf")
        }
    }

    /// Reads a number, or one of the names [`serialize`] writes.
    ///
    /// # Errors
    /// Anything else.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        deserializer.deserialize_any(FloatVisitor)
    }

    struct FloatVisitor;

    impl Visitor<'_> for FloatVisitor {
        type Value = f64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a number, \"NaN\", \"inf\" or \"-inf\"")
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
            Ok(v)
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
            Ok(v as f64)
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
            Ok(v as f64)
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
            match v {
                "NaN" => Ok(f64::NAN),
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
            }
        }
    }

    /// The same for an `Option<f64>`: `null` for `None`.
    pub mod option {
        use super::FloatVisitor;
        use serde::{Deserialize, Deserializer, Serializer};

        /// Writes `None` as `null`, a value as [`super::serialize`] does.
        ///
        /// # Errors
        /// Those of the serializer.
        pub fn serialize<S: Serializer>(
            value: &Option<f64>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            match value {
                Some(value) => super::serialize(value, serializer),
                None => serializer.serialize_none(),
            }
        }

        /// Reads `null` as `None`, anything else as [`super::deserialize`] does.
        ///
        /// # Errors
        /// Anything that is neither.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Option<f64>, D::Error> {
            #[derive(Deserialize)]
            struct Wrapped(#[serde(deserialize_with = "deserialize_float")] f64);
            fn deserialize_float<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
                d.deserialize_any(FloatVisitor)
            }
            Ok(Option::<Wrapped>::deserialize(deserializer)?.map(|Wrapped(v)| v))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(step: u64) -> Record {
        Record::Eval {
            step,
            val_loss: 1.5,
            val_bpb: None,
            time: None,
        }
    }

    #[test]
    fn reopening_drops_records_after_the_resumed_step_and_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), 0).unwrap();
        for step in 1..=4 {
            log.append(&eval(step)).unwrap();
        }
        drop(log);
        let path = dir.path().join("metrics.jsonl");
        let mut text = fs::read_to_string(&path).unwrap();
        text.push_str("{\"kind\":\"eval\",\"st"); // a crash mid-line
        fs::write(&path, text).unwrap();
        let mut log = MetricsLog::open(dir.path(), 2).unwrap();
        log.append(&eval(3)).unwrap();
        let steps: Vec<u64> = read_records(&path)
            .unwrap()
            .iter()
            .map(Record::step)
            .collect();
        assert_eq!(steps, [1, 2, 3]);
    }

    /// The record of an fp16 step whose gradients overflowed: the loss is not finite.
    fn skipped(step: u64, loss: f64) -> Record {
        Record::Train {
            step,
            loss,
            lr: 1e-3,
            grad_norm: None,
            scale: Some(f64::INFINITY),
            skipped: true,
            underflows: 0,
            tokens_per_s: 10.0,
            step_s: f64::NEG_INFINITY,
            time: None,
            elapsed_s: None,
            tokens: None,
            fp8: None,
        }
    }

    #[test]
    fn records_with_nan_and_infinities_round_trip_and_survive_a_resume() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(dir.path(), 0).unwrap();
        let records = [skipped(1, f64::NAN), skipped(2, f64::INFINITY), eval(2)];
        for record in &records {
            log.append(record).unwrap();
        }
        drop(log);
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains(r#""loss":"NaN""#), "{text}");
        assert!(text.contains(r#""step_s":"-inf""#), "{text}");
        // Reopened as a resume from step 2 does: nothing before the step is lost.
        drop(MetricsLog::open(dir.path(), 2).unwrap());
        let back = read_records(&path).unwrap();
        assert_eq!(back.len(), 3);
        // NaN != NaN: compare the bits of the loss.
        match (&back[0], &back[1]) {
            (Record::Train { loss: a, .. }, Record::Train { loss: b, scale, .. }) => {
                assert!(a.is_nan());
                assert_eq!(*b, f64::INFINITY);
                assert_eq!(*scale, Some(f64::INFINITY));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(back[2], eval(2));
        let summary = super::super::RunSummary::from_records(&back, None, 0, None);
        assert_eq!(summary.skipped_steps, 2);
    }

    #[test]
    fn a_damaged_line_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let good = serde_json::to_string(&eval(1)).unwrap();
        for (damage, what) in [
            (
                b"{\"kind\":\"eval\",\"step\":2}".to_vec(),
                "not a metrics record",
            ),
            (vec![b'{', 0xff, b'}'], "not UTF-8"),
            (b"\"loss\": null".to_vec(), "not a metrics record"),
        ] {
            let mut bytes = format!("{good}\n").into_bytes();
            bytes.extend_from_slice(&damage);
            bytes.extend_from_slice(format!("\n{good}\n").as_bytes());
            fs::write(&path, &bytes).unwrap();
            let error = read_records(&path).unwrap_err();
            match &error {
                TrainError::Metrics { line, reason, .. } => {
                    assert_eq!(*line, 2);
                    assert!(reason.contains(what), "{reason}");
                }
                other => panic!("{other:?}"),
            }
            assert!(
                error.to_string().contains("metrics.jsonl, line 2"),
                "{error}"
            );
            // And a resume refuses to rewrite the log without that line.
            assert!(MetricsLog::open(dir.path(), 10).is_err());
            assert_eq!(fs::read(&path).unwrap(), bytes, "the log is left as it was");
        }
    }

    #[test]
    fn a_line_is_tagged_with_its_kind() {
        let line = serde_json::to_string(&eval(7)).unwrap();
        assert_eq!(line, r#"{"kind":"eval","step":7,"val_loss":1.5}"#);
    }

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        use std::time::{Duration, UNIX_EPOCH};
        let at = |millis: u64| rfc3339_utc(UNIX_EPOCH + Duration::from_millis(millis));
        assert_eq!(at(0), "1970-01-01T00:00:00.000Z");
        // A leap day, and the last millisecond of a leap year.
        assert_eq!(at(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(at(1_735_689_599_999), "2024-12-31T23:59:59.999Z");
        assert_eq!(at(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
    }

    #[test]
    fn records_of_older_builds_still_read_and_write_back_unchanged() {
        let old = r#"{"kind":"train","step":3,"loss":2.5,"lr":0.001,"grad_norm":1.25,"scale":null,"skipped":false,"underflows":0,"tokens_per_s":900.0,"step_s":0.25}"#;
        let record: Record = serde_json::from_str(old).unwrap();
        match &record {
            Record::Train {
                time,
                elapsed_s,
                tokens,
                ..
            } => assert_eq!((time, elapsed_s, tokens), (&None, &None, &None)),
            other => panic!("{other:?}"),
        }
        assert_eq!(serde_json::to_string(&record).unwrap(), old);
        let old_eval = r#"{"kind":"eval","step":3,"val_loss":2.0}"#;
        let record: Record = serde_json::from_str(old_eval).unwrap();
        assert_eq!(serde_json::to_string(&record).unwrap(), old_eval);
    }

    #[test]
    fn a_reopened_log_goes_on_from_the_elapsed_time_of_its_last_kept_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), 0).unwrap();
        assert_eq!(log.elapsed_s_at_open(), 0.0);
        for step in 1..=3 {
            let mut record = skipped(step, 1.0);
            if let Record::Train { elapsed_s, .. } = &mut record {
                *elapsed_s = Some(step as f64 * 10.0);
            }
            log.append(&record).unwrap();
            log.append(&eval(step)).unwrap();
        }
        drop(log);
        assert_eq!(
            MetricsLog::open(dir.path(), 2).unwrap().elapsed_s_at_open(),
            20.0
        );
    }
}
