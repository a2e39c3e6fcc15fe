//! The run's metrics, one JSON object per line in `metrics.jsonl`.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// An optimizer step (steps count from 1: the record of step 1 follows the first update).
    Train {
        /// Optimizer steps taken so far.
        step: u64,
        /// The batch's mean loss, nats per token.
        loss: f64,
        /// The learning rate the step used.
        lr: f64,
        /// Gradient norm before clipping, when clipping is on and the step was taken.
        grad_norm: Option<f64>,
        /// The loss scale after the step (fp16).
        scale: Option<f64>,
        /// Whether an overflow skipped the update.
        skipped: bool,
        /// Gradient values the fp16 casts flushed to zero.
        underflows: u64,
        /// Throughput of this step.
        tokens_per_s: f64,
        /// Wall-clock seconds of this step.
        step_s: f64,
    },
    /// A validation loss.
    Eval {
        /// Optimizer steps taken so far.
        step: u64,
        /// Mean validation loss, nats per token.
        val_loss: f64,
    },
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
        Ok(Self { path, file })
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

/// Every record of a `metrics.jsonl` (none if the file does not exist); a torn last line, as
/// a crash mid-write leaves, is ignored.
///
/// # Errors
/// [`TrainError::Io`] if the file exists but cannot be read.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    let file = match fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(TrainError::io(path, source)),
    };
    let mut records = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line.map_err(|source| TrainError::io(path, source))?;
        if let Ok(record) = serde_json::from_str(&line) {
            records.push(record);
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(step: u64) -> Record {
        Record::Eval {
            step,
            val_loss: 1.5,
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

    #[test]
    fn a_line_is_tagged_with_its_kind() {
        let line = serde_json::to_string(&eval(7)).unwrap();
        assert_eq!(line, r#"{"kind":"eval","step":7,"val_loss":1.5}"#);
    }
}
