//! Path confinement: every path a built-in tool touches goes through [`resolve`], and every
//! file it reads, writes or lists is opened through [`Beneath`].
//!
//! Invariants, given a canonical session directory `root`:
//! - a relative path is joined to `root` and normalized lexically (`.` dropped, `..` pops a
//!   component); if the normalized form leaves `root` (`../x`, `a/../../x`) it is refused,
//!   whatever the file system holds;
//! - an absolute path is accepted only when it resolves inside `root`;
//! - the normalized path is then resolved the way the kernel would (every symlink followed,
//!   dangling ones included, a missing tail kept as written) and refused if its real
//!   location is outside `root`;
//! - the tool then opens that real location *beneath* an open handle on `root`, so a
//!   directory swapped for a symlink between the check and the use cannot lead the open
//!   outside: on Linux (5.6 and later) with `openat2(RESOLVE_BENEATH)`, which the kernel
//!   refuses with `EXDEV` when resolution would leave `root`; elsewhere, or where `openat2`
//!   is refused (old kernels, some container seccomp profiles), by opening one component at
//!   a time with `O_NOFOLLOW`, where any symlink met is refused (the resolved path holds
//!   none, so one appearing means the tree changed underneath). Either way an escape found
//!   at open time is [`Error::PathEscape`], and nothing is created outside.
//!
//! The walkers (`list`, `glob`, `grep`) do not follow symlinks while walking; a symlink they
//! meet is reported only when [`real_inside`] says its target is inside `root`, and every
//! file they report or read is checked or opened through [`Beneath`] too.

use std::collections::VecDeque;
use std::ffi::{CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
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

/// The session directory held open, so that files are opened beneath it and nowhere else
/// (see the module's invariants).
#[derive(Debug)]
pub(crate) struct Beneath {
    root: PathBuf,
    dir: OwnedFd,
    /// Whether `openat2` is used; when `false`, paths are walked one component at a time.
    openat2: bool,
}

impl Beneath {
    /// Opens the session directory `root` (canonical).
    pub(crate) fn new(root: &Path) -> Result<Self, Error> {
        let dir = open_plain(None, root.as_os_str().as_bytes(), DIRECTORY)
            .map_err(|e| Error::Io(format!("cannot open the session directory: {e}")))?;
        Ok(Self {
            root: root.to_owned(),
            dir,
            openat2: openat2_works(),
        })
    }

    /// The same, always walking component by component (what platforms without `openat2`
    /// get), so tests cover both ways.
    #[cfg(test)]
    fn walking(root: &Path) -> Self {
        Self {
            openat2: false,
            ..Self::new(root).expect("session directory")
        }
    }

    /// Opens `real` (inside the session directory, from [`resolve`]) with the `open(2)`
    /// `flags` (and `mode`, when creating). An open that would resolve outside fails with
    /// `EXDEV`: see [`failure`].
    pub(crate) fn open(&self, real: &Path, flags: libc::c_int, mode: u32) -> io::Result<File> {
        let relative = self.relative(real)?;
        let fd = if self.openat2 {
            open_beneath(&self.dir, &relative, flags, mode)?
        } else {
            self.open_walking(&relative, flags, mode)?
        };
        Ok(File::from(fd))
    }

    /// Whether `real` is, right now, a regular file beneath the session directory.
    pub(crate) fn is_file(&self, real: &Path) -> bool {
        self.open(real, LOOK, 0)
            .and_then(|file| file.metadata())
            .is_ok_and(|meta| meta.is_file())
    }

    /// Creates the directory `real` and its missing parents, each one beneath the session
    /// directory: a parent swapped for a symlink leading outside fails with `EXDEV`.
    pub(crate) fn create_dir_all(&self, real: &Path) -> io::Result<()> {
        let relative = self.relative(real)?;
        let mut prefix = PathBuf::new();
        let mut parent = self.open(&self.root, DIRECTORY, 0)?;
        for part in relative.components() {
            prefix.push(part);
            let name = c_path(part.as_os_str().as_bytes())?;
            // SAFETY: `parent` is an open directory and `name` a NUL-terminated string.
            let made = unsafe { libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), 0o777) };
            if made != 0 {
                let error = io::Error::last_os_error();
                if error.raw_os_error() != Some(libc::EEXIST) {
                    return Err(error);
                }
            }
            // Opened again from the root, so a name swapped for a symlink leading outside
            // is refused rather than followed.
            parent = self.open(&self.root.join(&prefix), DIRECTORY, 0)?;
        }
        Ok(())
    }

    /// The session directory.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// `real` relative to the session directory.
    fn relative(&self, real: &Path) -> io::Result<PathBuf> {
        let relative = real.strip_prefix(&self.root).map_err(|_| escaped())?;
        if relative
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
        {
            // `resolve` never yields `..` or `.`; anything else is a caller's mistake.
            return Err(escaped());
        }
        Ok(relative.to_owned())
    }

    /// Opens `relative` one component at a time, following no symlink: the directories
    /// with `O_NOFOLLOW | O_DIRECTORY`, the last one with `O_NOFOLLOW` added to `flags`.
    fn open_walking(&self, relative: &Path, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
        let parts: Vec<_> = relative.components().collect();
        let Some((last, parents)) = parts.split_last() else {
            return open_plain(Some(&self.dir), b".", flags);
        };
        let mut dir: Option<OwnedFd> = None;
        for part in parents {
            let at = dir.as_ref().unwrap_or(&self.dir);
            let name = part.as_os_str().as_bytes();
            let next = open_plain(Some(at), name, DIRECTORY | libc::O_NOFOLLOW)
                .map_err(|e| symlink_is_escape(at, name, e))?;
            dir = Some(next);
        }
        let at = dir.as_ref().unwrap_or(&self.dir);
        let bytes = last.as_os_str().as_bytes();
        let name = c_path(bytes)?;
        // SAFETY: `at` is an open directory and `name` a NUL-terminated string.
        let fd = unsafe {
            libc::openat(
                at.as_raw_fd(),
                name.as_ptr(),
                flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        };
        owned(fd).map_err(|e| symlink_is_escape(at, bytes, e))
    }
}

/// The entries of the directory `dir` (opened through [`Beneath`]): the directory that was
/// opened, whatever its path leads to by now.
pub(crate) fn read_dir(dir: &File) -> io::Result<std::fs::ReadDir> {
    // The kernel's name for the open descriptor reaches exactly that directory.
    #[cfg(target_os = "linux")]
    let name = format!("/proc/self/fd/{}", dir.as_raw_fd());
    #[cfg(not(target_os = "linux"))]
    let name = format!("/dev/fd/{}", dir.as_raw_fd());
    std::fs::read_dir(name)
}

/// The tool error for a failed open of `shown`: an escape found at open time is
/// [`Error::PathEscape`], anything else what [`Error::from_io`] makes of it.
pub(crate) fn failure(shown: &str, error: &io::Error) -> Error {
    if error.raw_os_error() == Some(libc::EXDEV) {
        Error::PathEscape(shown.to_owned())
    } else {
        Error::from_io(shown, error)
    }
}

/// Flags for opening a file to read it: never blocking on a FIFO, never becoming the
/// controlling terminal.
pub(crate) const READ: libc::c_int = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY;

/// Flags for opening a file only to look at what it is: `O_PATH` on Linux (no read
/// permission needed, nothing read), a non-blocking read elsewhere.
#[cfg(target_os = "linux")]
const LOOK: libc::c_int = libc::O_PATH;
#[cfg(not(target_os = "linux"))]
const LOOK: libc::c_int = READ;

/// Flags for opening a directory to walk through or list it.
pub(crate) const DIRECTORY: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY;

fn escaped() -> io::Error {
    io::Error::from_raw_os_error(libc::EXDEV)
}

/// While walking without following symlinks, meeting one means the tree changed under the
/// tool (a resolved path holds none): treated as an escape. `O_NOFOLLOW` reports a symlink
/// as `ELOOP`, or `ENOTDIR` when `O_DIRECTORY` was asked for, so those errors are checked
/// against what `name` in `at` is.
fn symlink_is_escape(at: &OwnedFd, name: &[u8], error: io::Error) -> io::Error {
    if !matches!(error.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
        return error;
    }
    let Ok(name) = c_path(name) else {
        return error;
    };
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `at` is an open directory, `name` NUL-terminated, `stat` writable.
    let found = unsafe {
        libc::fstatat(
            at.as_raw_fd(),
            name.as_ptr(),
            &raw mut stat,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if found == 0 && stat.st_mode & libc::S_IFMT == libc::S_IFLNK {
        escaped()
    } else {
        error
    }
}

fn c_path(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
}

fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: the kernel just returned this descriptor, and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// `openat(at or the working directory, path, flags)`, close-on-exec.
fn open_plain(at: Option<&OwnedFd>, path: &[u8], flags: libc::c_int) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let at = at.map_or(libc::AT_FDCWD, AsRawFd::as_raw_fd);
    // SAFETY: `path` is NUL-terminated; `at` is an open directory or AT_FDCWD.
    owned(unsafe { libc::openat(at, path.as_ptr(), flags | libc::O_CLOEXEC) })
}

/// `openat2`'s `struct open_how` (linux/openat2.h); libc's is not constructible.
#[cfg(target_os = "linux")]
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `openat2(dir, relative, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: the kernel refuses,
/// with `EXDEV`, any resolution that would leave `dir`, however the tree changes meanwhile.
#[cfg(target_os = "linux")]
fn open_beneath(
    dir: &OwnedFd,
    relative: &Path,
    flags: libc::c_int,
    mode: u32,
) -> io::Result<OwnedFd> {
    let bytes = relative.as_os_str().as_bytes();
    let path = c_path(if bytes.is_empty() { b"." } else { bytes })?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: if flags & libc::O_CREAT != 0 {
            u64::from(mode)
        } else {
            0
        },
        resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    };
    // The kernel answers EAGAIN when a concurrent rename might have let `..` escape; a
    // resolved path holds no `..`, but retrying a few times is what the man page advises.
    let mut attempts = 0;
    loop {
        // SAFETY: `how` is a valid `open_how` of the size passed, `path` NUL-terminated.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                path.as_ptr(),
                &raw const how,
                std::mem::size_of::<OpenHow>(),
            )
        };
        match owned(fd as libc::c_int) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && attempts < 8 => attempts += 1,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            other => return other,
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn open_beneath(_: &OwnedFd, _: &Path, _: libc::c_int, _: u32) -> io::Result<OwnedFd> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
}

/// Whether this kernel has `openat2` and lets Keel call it: asked once, by opening `/`
/// beneath itself.
fn openat2_works() -> bool {
    static WORKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WORKS.get_or_init(|| {
        let Ok(slash) = open_plain(None, b"/", DIRECTORY) else {
            return false;
        };
        let works = open_beneath(&slash, Path::new(""), DIRECTORY, 0).is_ok();
        if !works {
            tracing::warn!(
                "openat2 is not available: the file tools open paths one component at a time, \
                 refusing any symlink met on the way"
            );
        }
        works
    })
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

    /// Both ways of opening beneath: `openat2` (when this kernel has it) and the walk.
    fn both_ways(root: &Path) -> Vec<Beneath> {
        let mut ways = vec![Beneath::walking(root)];
        if openat2_works() {
            ways.push(Beneath::new(root).expect("session directory"));
        }
        ways
    }

    fn errno(result: io::Result<impl std::fmt::Debug>) -> Option<i32> {
        result.expect_err("refused").raw_os_error()
    }

    #[test]
    fn a_directory_swapped_for_a_symlink_after_resolving_is_not_followed() {
        let (_dir, root) = root();
        let outside = tempfile::tempdir().expect("temp dir");
        std::fs::write(outside.path().join("f.txt"), "secret").expect("secret");
        for beneath in both_ways(&root) {
            std::fs::create_dir_all(root.join("a")).expect("dir");
            std::fs::write(root.join("a/f.txt"), "inside").expect("file");
            let file = resolve(&root, "a/f.txt").expect("inside");
            let new = resolve(&root, "a/new.txt").expect("inside");
            let deep = resolve(&root, "a/deeper/dir").expect("inside");
            let dir = resolve(&root, "a").expect("inside");
            assert!(beneath.open(&file.real, READ, 0).is_ok());

            // Between the check and the use, `a` becomes a symlink to a directory outside.
            std::fs::rename(root.join("a"), root.join("was-a")).expect("move");
            std::os::unix::fs::symlink(outside.path(), root.join("a")).expect("symlink");
            let create = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
            assert_eq!(errno(beneath.open(&file.real, READ, 0)), Some(libc::EXDEV));
            assert_eq!(
                errno(beneath.open(&new.real, create, 0o600)),
                Some(libc::EXDEV)
            );
            assert_eq!(errno(beneath.create_dir_all(&deep.real)), Some(libc::EXDEV));
            assert!(!beneath.is_file(&file.real));
            let listing = beneath.open(&dir.real, READ | libc::O_DIRECTORY, 0);
            assert_eq!(errno(listing), Some(libc::EXDEV));
            assert_eq!(
                std::fs::read_dir(outside.path()).expect("outside").count(),
                1,
                "nothing was created outside"
            );
            std::fs::remove_file(root.join("a")).expect("unlink");
            std::fs::remove_dir_all(root.join("was-a")).expect("clean up");
        }
    }

    #[test]
    fn a_file_swapped_for_a_symlink_leading_outside_is_not_opened() {
        let (_dir, root) = root();
        let outside = tempfile::tempdir().expect("temp dir");
        let secret = outside.path().join("secret.txt");
        std::fs::write(&secret, "secret").expect("secret");
        for beneath in both_ways(&root) {
            std::fs::write(root.join("f.txt"), "inside").expect("file");
            let file = resolve(&root, "f.txt").expect("inside");
            std::fs::remove_file(root.join("f.txt")).expect("unlink");
            std::os::unix::fs::symlink(&secret, root.join("f.txt")).expect("symlink");
            assert_eq!(errno(beneath.open(&file.real, READ, 0)), Some(libc::EXDEV));
            assert_eq!(
                errno(beneath.open(&file.real, libc::O_WRONLY | libc::O_TRUNC, 0)),
                Some(libc::EXDEV)
            );
            assert_eq!(std::fs::read_to_string(&secret).expect("secret"), "secret");
            std::fs::remove_file(root.join("f.txt")).expect("unlink");
        }
    }

    #[test]
    fn ordinary_paths_open_and_ordinary_errors_stay_what_they_are() {
        let (_dir, root) = root();
        std::fs::create_dir_all(root.join("a/b")).expect("dirs");
        std::fs::write(root.join("a/b/f.txt"), "inside").expect("file");
        for beneath in both_ways(&root) {
            let file = resolve(&root, "a/b/f.txt").expect("inside");
            let mut text = String::new();
            io::Read::read_to_string(
                &mut beneath.open(&file.real, READ, 0).expect("open"),
                &mut text,
            )
            .expect("read");
            assert_eq!(text, "inside");
            assert!(beneath.open(&root, READ | libc::O_DIRECTORY, 0).is_ok());
            beneath
                .create_dir_all(&root.join("x/y/z"))
                .expect("directories created");
            assert!(root.join("x/y/z").is_dir());
            let missing = beneath.open(&root.join("a/nope"), READ, 0);
            assert_eq!(errno(missing), Some(libc::ENOENT));
            let through_a_file = beneath.open(&root.join("a/b/f.txt/x"), READ, 0);
            assert_eq!(errno(through_a_file), Some(libc::ENOTDIR));
            std::fs::remove_dir_all(root.join("x")).expect("clean up");
        }
    }

    #[test]
    fn paths_outside_the_root_are_refused_before_any_open() {
        let (_dir, root) = root();
        let beneath = Beneath::new(&root).expect("session directory");
        assert_eq!(
            errno(beneath.open(Path::new("/etc/passwd"), READ, 0)),
            Some(libc::EXDEV)
        );
        assert_eq!(
            errno(beneath.open(&root.join("a/../b"), READ, 0)),
            Some(libc::EXDEV)
        );
    }
}
