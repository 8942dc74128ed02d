//! Walking the session directory for `glob` and `grep`.
//!
//! Invariants: the walk never leaves the session directory. It does not follow symlinks;
//! a symlink to a file is reported only when its real location is inside the session
//! directory (then under the link's own path), and a symlink to a directory is not entered
//! (its target, if inside, is walked on its own). `.gitignore` (and `.ignore`) rules are
//! respected even outside a git repository; the `.git` directory is skipped; other hidden
//! files are included. Entries that cannot be read (permission denied) are skipped, and so
//! is a file that is not, when reached, a regular file beneath the session directory
//! (checked through [`Beneath`], so a directory swapped for a symlink mid-walk reveals
//! nothing outside).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use ignore::WalkBuilder;
use tokio_util::sync::CancellationToken;

use super::Error;
use super::path::{self, Beneath};

/// A regular file found by the walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct File {
    /// Where to read it (a symlink resolved).
    pub real: PathBuf,
    /// Its path relative to the session directory, as the model sees it.
    pub shown: String,
}

/// Calls `each` for every regular file under `start` (itself inside the session directory
/// `beneath` holds), in a stable order (names sorted within each directory). Stops with
/// [`Error::Interrupted`] when `cancel` fires.
pub(crate) fn files(
    beneath: &Beneath,
    start: &Path,
    cancel: &CancellationToken,
    mut each: impl FnMut(File),
) -> Result<(), Error> {
    let walker = WalkBuilder::new(start)
        .follow_links(false)
        .hidden(false)
        .require_git(false)
        .filter_entry(|entry| entry.file_name() != OsStr::new(".git"))
        .sort_by_file_name(|a, b| a.cmp(b))
        .build();
    for entry in walker {
        if cancel.is_cancelled() {
            return Err(Error::Interrupted);
        }
        let Ok(entry) = entry else { continue };
        let Some(kind) = entry.file_type() else {
            continue;
        };
        let root = beneath.root();
        let real = if kind.is_file() {
            entry.path().to_path_buf()
        } else if kind.is_symlink() {
            match path::real_inside(root, entry.path()) {
                Some(real) => real,
                None => continue,
            }
        } else {
            continue;
        };
        if !beneath.is_file(&real) {
            continue;
        }
        each(File {
            shown: path::shown(root, entry.path()),
            real,
        });
    }
    Ok(())
}
