//! Path confinement: every path a built-in tool touches goes through [`resolve`].
//!
//! Invariants, given a canonical session directory `root`:
//! - a relative path is joined to `root` and normalized lexically (`.` dropped, `..` pops a
//!   component); if the normalized form leaves `root` (`../x`, `a/../../x`) it is refused,
//!   whatever the file system holds;
//! - an absolute path is accepted only when it resolves inside `root`;
//! - the normalized path is then resolved the way the kernel would (every symlink followed,
//!   dangling ones included, a missing tail kept as written) and refused if its real
//!   location is outside `root`. The tool then operates on that real location, so what was
//!   checked is what is used.
//!
//! The walkers (`list`, `glob`, `grep`) do not follow symlinks while walking; a symlink they
//! meet is reported only when [`real_inside`] says its target is inside `root`.
//!
//! This keeps the file tools from reaching outside by mistake or by a crafted path. It is
//! not a sandbox against a concurrent process swapping a directory for a symlink between
//! the check and the use; `bash` can do anything the user running Keel can anyway.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::Error;

/// Symlinks followed while resolving one path before it is called a loop (Linux's limit).
const MAX_SYMLINK_HOPS: usize = 40;

/// A path inside the session directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// Where the path really is: symlinks resolved, inside the session directory.
    pub real: PathBuf,
    /// The path as the model should see it: relative to the session directory, `/`
    /// separated, `.` for the directory itself.
    pub shown: String,
}

/// Resolves `input` against the session directory `root` (which must be canonical), or
/// refuses it with [`Error::PathEscape`].
pub(crate) fn resolve(root: &Path, input: &str) -> Result<Resolved, Error> {
    let escape = || Error::PathEscape(input.to_owned());
    let given = Path::new(input);
    let lexical = normalize(&root.join(given));
    let real =
        real_location(&lexical).map_err(|e| Error::Io(format!("cannot resolve `{input}`: {e}")))?;
    if !real.starts_with(root) {
        return Err(escape());
    }
    // A relative path that walks out lexically is refused even if some symlink would bring
    // it back: `..` past the session directory is never meaningful to the model.
    let shown_from = if lexical.starts_with(root) {
        lexical
    } else if given.is_absolute() {
        // E.g. the session directory reached through a symlink to it: inside, really.
        real.clone()
    } else {
        return Err(escape());
    };
    Ok(Resolved {
        shown: shown(root, &shown_from),
        real,
    })
}

/// What permission rules see of `input`: where it really is (symlinks followed), relative
/// to `root`, `/` separated; `input` as written when it cannot be resolved or leaves
/// `root` (the tool then refuses it anyway).
pub(crate) fn permission_path(root: &Path, input: &str) -> String {
    match resolve(root, input) {
        Ok(resolved) => shown(root, &resolved.real),
        Err(_) => input.to_owned(),
    }
}

/// `path` relative to `root` as the model sees it.
pub(crate) fn shown(root: &Path, path: &Path) -> String {
    let relative = path.strip_prefix(root).unwrap_or(path);
    let parts: Vec<_> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.is_empty() {
        ".".to_owned()
    } else {
        parts.join("/")
    }
}

/// The real location of `path` (which may be a symlink), if it is inside `root`. A path
/// that cannot be resolved (a symlink loop, say) is not.
pub(crate) fn real_inside(root: &Path, path: &Path) -> Option<PathBuf> {
    real_location(path)
        .ok()
        .filter(|real| real.starts_with(root))
}

/// Lexical normalization of an absolute path: `.` dropped, `..` pops (never above `/`).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Prefix(_) | Component::RootDir | Component::Normal(_) => {
                out.push(component.as_os_str());
            }
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
        }
    }
    out
}

/// Where `path` (absolute) really is: like `realpath`, but a missing tail is kept as
/// written and a dangling symlink resolves to where its target would be, because that is
/// where a write through it would land.
fn real_location(path: &Path) -> io::Result<PathBuf> {
    let mut pending: VecDeque<OsString> = path
        .components()
        .map(|c| c.as_os_str().to_owned())
        .collect();
    let mut real = PathBuf::new();
    let mut hops = 0;
    while let Some(part) = pending.pop_front() {
        match Path::new(&part).components().next() {
            None | Some(Component::CurDir) => {}
            Some(Component::ParentDir) => {
                // `real` holds no symlinks, so popping is what the kernel does.
                real.pop();
            }
            Some(Component::Prefix(_) | Component::RootDir) => real = PathBuf::from(&part),
            Some(Component::Normal(name)) => {
                let candidate = real.join(name);
                match std::fs::symlink_metadata(&candidate) {
                    Ok(meta) if meta.file_type().is_symlink() => {
                        hops += 1;
                        if hops > MAX_SYMLINK_HOPS {
                            return Err(io::Error::other("too many levels of symbolic links"));
                        }
                        let target = std::fs::read_link(&candidate)?;
                        // The target's parts come next, then what followed the link. An
                        // absolute target starts with `/`, which resets `real`.
                        for c in target.components().rev() {
                            pending.push_front(c.as_os_str().to_owned());
                        }
                    }
                    // Exists and is not a symlink, or does not exist (nor does anything
                    // below it, so the rest is taken as written), or is unreachable (the
                    // tool's own operation will report that).
                    _ => real = candidate,
                }
            }
        }
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().canonicalize().expect("canonical temp dir");
        (dir, root)
    }

    #[test]
    fn normalization_drops_dots_and_pops_parents() {
        assert_eq!(normalize(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
        assert_eq!(normalize(Path::new("/a/../../b")), PathBuf::from("/b"));
        assert_eq!(normalize(Path::new("/")), PathBuf::from("/"));
    }

    #[test]
    fn relative_paths_resolve_inside_and_are_shown_relative() {
        let (_dir, root) = root();
        let r = resolve(&root, "src/./main.rs").expect("inside");
        assert_eq!(r.real, root.join("src/main.rs"));
        assert_eq!(r.shown, "src/main.rs");
        assert_eq!(resolve(&root, "").expect("root").shown, ".");
        assert_eq!(resolve(&root, "a/..").expect("root").shown, ".");
    }

    #[test]
    fn parent_components_that_leave_the_directory_are_refused() {
        let (_dir, root) = root();
        for bad in ["..", "../x", "a/../../x", "./../x"] {
            assert_eq!(
                resolve(&root, bad),
                Err(Error::PathEscape(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn absolute_paths_are_accepted_only_inside() {
        let (_dir, root) = root();
        let inside = root.join("x/y");
        let r = resolve(&root, inside.to_str().expect("utf-8 temp path")).expect("inside");
        assert_eq!(r.shown, "x/y");
        assert_eq!(
            resolve(&root, "/etc/passwd"),
            Err(Error::PathEscape("/etc/passwd".into()))
        );
    }

    #[test]
    fn dangling_symlinks_resolve_to_their_target() {
        let (_dir, root) = root();
        let outside = tempfile::tempdir().expect("temp dir");
        let target = outside.path().join("not-yet");
        std::os::unix::fs::symlink(&target, root.join("link")).expect("symlink");
        assert_eq!(
            resolve(&root, "link"),
            Err(Error::PathEscape("link".into()))
        );
        std::os::unix::fs::symlink("later", root.join("inner")).expect("symlink");
        assert_eq!(
            resolve(&root, "inner").expect("inside").real,
            root.join("later")
        );
    }

    #[test]
    fn relative_symlinks_are_followed_through_parents() {
        let (_dir, root) = root();
        std::fs::create_dir_all(root.join("a/b")).expect("dirs");
        std::os::unix::fs::symlink("../..", root.join("a/b/up")).expect("symlink");
        assert_eq!(
            resolve(&root, "a/b/up/x").expect("inside").real,
            root.join("x")
        );
        std::os::unix::fs::symlink("../../..", root.join("a/b/out")).expect("symlink");
        assert_eq!(
            resolve(&root, "a/b/out/x"),
            Err(Error::PathEscape("a/b/out/x".into()))
        );
    }

    #[test]
    fn symlink_loops_are_an_error_not_a_hang() {
        let (_dir, root) = root();
        std::os::unix::fs::symlink("b", root.join("a")).expect("symlink");
        std::os::unix::fs::symlink("a", root.join("b")).expect("symlink");
        assert!(matches!(resolve(&root, "a"), Err(Error::Io(_))));
        assert_eq!(real_inside(&root, &root.join("a")), None);
    }
}
