//! The catalog's changes ([`Change`]): what one commit makes durable, as one journal record,
//! and what one does to the catalog and its files. A commit checks a change with [`effect`]
//! before writing anything, and replaying the journal checks every record the same way, so a
//! change that does not apply is refused rather than half made.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use super::manifest::{DatasetEntry, Segment};

/// One change to the catalog: what a commit makes durable, as one journal record. Entries
/// are recorded whole, so that every field of one comes back as it was committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Change {
    /// `name` is `entry` now, whether it existed or not.
    Set { name: String, entry: DatasetEntry },
    /// `name`, which exists, is `entry` now, with `entry.segments` after the segments it had.
    Append { name: String, entry: DatasetEntry },
    /// `name` is gone.
    Remove { name: String },
    /// `name`'s segments from index `at`, which must be `run`, are `merged` now: the same
    /// rows, in the same order, in one file. Its entry is otherwise unchanged.
    Merge {
        name: String,
        at: usize,
        run: Vec<Segment>,
        merged: Segment,
    },
}

impl Change {
    pub(super) fn name(&self) -> &str {
        match self {
            Change::Set { name, .. }
            | Change::Append { name, .. }
            | Change::Remove { name }
            | Change::Merge { name, .. } => name,
        }
    }
}

/// The segment files a change names that the catalog did not, and those the catalog named
/// that it does not any more.
#[derive(Debug, Default)]
pub(super) struct Effect {
    pub(super) added: Vec<Segment>,
    pub(super) removed: Vec<Segment>,
}

/// What `change` does to `datasets`' files, or why it does not apply to them. Costs what the
/// change and the entry it changes hold.
pub(super) fn effect(
    datasets: &BTreeMap<String, DatasetEntry>,
    change: &Change,
) -> Result<Effect, String> {
    let name = change.name();
    let current = datasets.get(name);
    let existing = || current.ok_or_else(|| format!("there is no dataset {name:?} to change"));
    let distinct = |segments: &[Segment]| {
        let mut seen = HashSet::new();
        match segments.iter().find(|s| !seen.insert(&s.file)) {
            Some(twice) => Err(format!("it names segment {:?} twice", twice.file)),
            None => Ok(()),
        }
    };
    match change {
        Change::Set { entry, .. } => {
            distinct(&entry.segments)?;
            let old: HashSet<&str> = current
                .iter()
                .flat_map(|e| &e.segments)
                .map(|s| s.file.as_str())
                .collect();
            let new: HashSet<&str> = entry.segments.iter().map(|s| s.file.as_str()).collect();
            Ok(Effect {
                added: (entry.segments.iter())
                    .filter(|s| !old.contains(s.file.as_str()))
                    .cloned()
                    .collect(),
                removed: (current.iter().flat_map(|e| &e.segments))
                    .filter(|s| !new.contains(s.file.as_str()))
                    .cloned()
                    .collect(),
            })
        }
        Change::Append { entry, .. } => {
            let old = existing()?;
            distinct(&entry.segments)?;
            if let Some(again) = (entry.segments.iter()).find(|s| old.segments.contains(s)) {
                return Err(format!("{name:?} names segment {:?} already", again.file));
            }
            Ok(Effect {
                added: entry.segments.clone(),
                removed: Vec::new(),
            })
        }
        Change::Remove { .. } => Ok(Effect {
            added: Vec::new(),
            removed: existing()?.segments.clone(),
        }),
        Change::Merge {
            at, run, merged, ..
        } => {
            let old = existing()?;
            let held = at
                .checked_add(run.len())
                .and_then(|end| old.segments.get(*at..end));
            if run.is_empty() || held != Some(run.as_slice()) {
                return Err(format!(
                    "{name:?} does not hold the {} segments merged at {at}",
                    run.len()
                ));
            }
            let rows = run.iter().fold(0u64, |sum, s| sum.saturating_add(s.rows));
            if merged.rows != rows || run.iter().any(|s| s.file == merged.file) {
                return Err(format!(
                    "the merge of {name:?}'s segments at {at} holds other rows"
                ));
            }
            Ok(Effect {
                added: vec![merged.clone()],
                removed: run.clone(),
            })
        }
    }
}

/// Makes `change`, for which [`effect`] held, in `datasets`.
pub(super) fn apply(datasets: &mut BTreeMap<String, DatasetEntry>, change: Change) {
    match change {
        Change::Set { name, entry } => {
            datasets.insert(name, entry);
        }
        Change::Append { name, entry } => {
            if let Some(current) = datasets.get_mut(&name) {
                let mut segments = std::mem::take(&mut current.segments);
                segments.extend(entry.segments.iter().cloned());
                *current = DatasetEntry { segments, ..entry };
            }
        }
        Change::Remove { name } => {
            datasets.remove(&name);
        }
        Change::Merge {
            name,
            at,
            run,
            merged,
        } => {
            if let Some(current) = datasets.get_mut(&name) {
                current.segments.splice(at..at + run.len(), [merged]);
            }
        }
    }
}
