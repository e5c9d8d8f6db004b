//! Persistence under `--data-dir`: the durable catalog (the checkpoint `manifest.json` and the
//! `journal` of changes since it) and the segment files it names, laid out as `layout` draws.
//!
//! What it guarantees:
//! - **Names never become paths.** Segments are immutable and named by a counter, never by a
//!   dataset name: names are arbitrary client strings (`/`, `..`, NUL, megabytes) and live only
//!   inside the catalog, and a name the catalog records is trusted only if it is one we write.
//! - **Atomic commits.** A segment is written under a temporary name, fsync'd, renamed into
//!   place and its directory fsync'd before any record names it. A commit appends one record
//!   (a dataset set, appended to, removed, or some of its segments merged) to the journal and
//!   fsyncs it, so that it costs what it changes. Once the journal outgrows the checkpoint, a
//!   commit writes a new checkpoint instead (temporary file, fsync, rename, directory fsync)
//!   and empties the journal.
//! - **Crash safety.** A crash at any instant leaves the catalog as it was before a commit or
//!   after it, and the catalog only ever names complete segments. What a crash can leave behind
//!   (temporary files, segments nothing names, a torn last record) is removed by the next
//!   [`DataDir::open`], and only after the catalog was read: an unreadable checkpoint or journal
//!   is an error, never an empty catalog that would let the sweep delete data. Tests inject a
//!   fault at every file-system step of every kind of commit (`fs::Fs`) and check this.
//! - **Quarantine.** A dataset whose files fail the checks at open (missing, of another size,
//!   not ours, named twice) is damaged: listed, its files kept, not served, while every other
//!   dataset is. A segment's checksum is checked whenever it is read.
//!
//! The layer is blocking `std::fs` on purpose: the store calls it from one writer task through
//! `spawn_blocking`, and writes merged segments beside it ([`SegmentWriter`]).
//!
//! Its files, each using only those listed before it:
//!
//! ```text
//! layout    file names, segment names, the manifest format number
//! error     FilesError, and a commit's Failed (may it be in force?)
//! fs        Fs: the faultable file-system steps, and plain helpers
//! manifest  the catalog's documents and the checkpoint file
//! change    Change: what a commit does to the catalog and its files
//! journal   the journal: records, replay at open, appends
//! check     segments checked against the catalog at open; Damage
//! segment   reading segments back, and the pins that keep them
//! writer    SegmentWriter: writing segments, and merging runs of them
//! lock      creating and locking the directory
//! dir       DataDir: open, the commits, and which files may be deleted
//! ```

mod change;
mod check;
mod dir;
mod error;
mod fs;
mod journal;
mod layout;
mod lock;
mod manifest;
mod segment;
mod writer;

pub(crate) use change::Change;
pub(crate) use dir::DataDir;
pub(crate) use error::FilesError;
pub(crate) use manifest::{DatasetEntry, Manifest, Segment};
pub(crate) use segment::{PinnedSegment, SegmentFiles};
pub(crate) use writer::SegmentWriter;

#[cfg(test)]
mod tests;
