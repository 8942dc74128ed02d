//! The sandbox `bash` runs in: on Linux, Landlock for the file system and a seccomp filter
//! for the network, applied to the command's process between `fork` and `exec`.
//!
//! What a sandboxed command may do:
//! - read and run anything on the machine except Keel's own files ([`Protected`]: the
//!   SQLite database with its journal files, and `keel.toml` unless it sits in the session
//!   directory), and of `/dev` only the harmless devices (`null`, `zero`, `random`,
//!   `tty`, terminals, `shm`);
//! - write, create and delete only in the session directory and in a temporary directory
//!   of its own (`$TMPDIR`, removed when the call ends);
//! - no network unless its agent allows it: sockets other than Unix ones cannot be made
//!   (seccomp), TCP cannot connect or bind (Landlock, ABI 4 and later) and abstract Unix
//!   sockets outside the sandbox cannot be reached (ABI 6 and later);
//! - no signals to processes outside the sandbox (ABI 6 and later: Keel itself cannot be
//!   killed from a command), no privilege gained through set-user-id programs
//!   (`no_new_privs`);
//! - none of Keel's secrets in its environment: `KEEL_*` variables and those the
//!   configuration names as holding keys are removed.
//!
//! Landlock only grants (it has no "deny below"), so a protected file is kept out by
//! granting read access to everything around it instead of to an ancestor ([`read_rules`]).
//! A directory that is writable cannot have a hidden file inside: when the session
//! directory holds the database, the call is refused with [`Error::Sandbox`] saying how to
//! fix it, rather than run with every session's history exposed. A configuration file in
//! the session directory (a project's own `keel.toml`) stays readable and writable there;
//! it holds no keys (they come from the environment, which commands do not inherit), and
//! Keel reads it only at start-up.
//!
//! Where the kernel has no Landlock (or the platform is not Linux) a sandboxed call is
//! refused; an agent with `sandbox = "off"` runs commands with Keel's own rights.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::Error;

/// How an agent's `bash` runs (`sandbox` in `[agent.NAME]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Sandboxed, without network (the default).
    #[default]
    On,
    /// Sandboxed, with network.
    Network,
    /// Not sandboxed: the command has the rights of the user running Keel.
    Off,
}

/// What no sandboxed command may touch or see.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Protected {
    /// The database's files, canonical: the SQLite file and its `-wal`, `-shm` and
    /// `-journal` siblings. Never readable nor writable: a session directory holding them
    /// is refused.
    pub database: Vec<PathBuf>,
    /// The configuration file, canonical. Hidden wherever it is outside the session
    /// directory; inside it, the sandbox cannot keep it from the command (Keel warns at
    /// start-up when it is inside the sessions' root).
    pub config: Option<PathBuf>,
    /// Environment variables never passed to a command, besides every `KEEL_*` one.
    pub env: Vec<String>,
}

impl Protected {
    /// Keel's files and secrets: `database` (a SQLite file, if any) and `config` (the
    /// configuration file, if any), made canonical; `env`, the variables holding keys.
    pub fn new(database: Option<&Path>, config: Option<&Path>, env: Vec<String>) -> Self {
        // A file that does not exist yet (a database about to be created) is where its
        // canonical parent says.
        let canonical = |p: &Path| {
            std::fs::canonicalize(p).unwrap_or_else(|_| {
                let parent = p.parent().filter(|d| !d.as_os_str().is_empty());
                let parent = parent.map_or_else(|| PathBuf::from("."), Path::to_path_buf);
                match (std::fs::canonicalize(parent), p.file_name()) {
                    (Ok(parent), Some(name)) => parent.join(name),
                    _ => p.to_owned(),
                }
            })
        };
        let mut files = Vec::new();
        if let Some(db) = database {
            let db = canonical(db);
            for suffix in ["-wal", "-shm", "-journal"] {
                let mut sibling = db.clone().into_os_string();
                sibling.push(suffix);
                files.push(PathBuf::from(sibling));
            }
            files.push(db);
        }
        Self {
            database: files,
            config: config.map(canonical),
            env,
        }
    }

    /// What a command run in `directory` cannot read: the database, and the
    /// configuration unless it is inside `directory`.
    fn hidden_from(&self, directory: &Path) -> Vec<PathBuf> {
        let config = self.config.iter().filter(|c| !c.starts_with(directory));
        self.database.iter().chain(config).cloned().collect()
    }

    /// Whether `name` must not reach a command.
    pub fn hides_variable(&self, name: &str) -> bool {
        (name.starts_with("KEEL_") && name != "KEEL_SESSION_ID" && name != "KEEL_CALL_ID")
            || self.env.iter().any(|v| v == name)
    }
}

/// The sandbox one call runs in; `None` in [`Context`](super::Context) means none.
#[derive(Debug, Clone)]
pub struct Sandbox {
    /// Whether the command may use the network.
    pub network: bool,
    pub protected: Arc<Protected>,
}

impl Sandbox {
    /// The sandbox for an agent's `mode`: `None` when it is off.
    pub fn for_mode(mode: Mode, protected: &Arc<Protected>) -> Option<Self> {
        match mode {
            Mode::Off => None,
            Mode::On | Mode::Network => Some(Self {
                network: mode == Mode::Network,
                protected: protected.clone(),
            }),
        }
    }

    /// Refuses a session directory that holds the database: it would be writable.
    fn check_directory(&self, directory: &Path) -> Result<(), Error> {
        match self
            .protected
            .database
            .iter()
            .find(|p| p.starts_with(directory))
        {
            Some(inside) => Err(Error::Sandbox(format!(
                "the session directory {} holds Keel's database {}, which the sandbox \
                 cannot keep from a command that may write there; keep the database \
                 outside session directories (--db), or give this agent sandbox = \"off\"",
                directory.display(),
                inside.display()
            ))),
            None => Ok(()),
        }
    }
}

/// Whether this machine can sandbox commands, for the log at start-up: `Ok` with the
/// Landlock ABI version, or why not.
pub fn status() -> Result<u32, String> {
    imp::status()
}

/// A sandbox made ready for one command: built before the command is spawned, applied in
/// the child by [`Prepared::apply`], its temporary directory removed when dropped.
pub(crate) struct Prepared {
    temp: PathBuf,
    network: bool,
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    inner: imp::Inner,
}

impl Prepared {
    /// Builds the rules for a command run in `directory` (canonical); `name` names its
    /// temporary directory.
    pub(crate) fn new(sandbox: &Sandbox, directory: &Path, name: &str) -> Result<Self, Error> {
        sandbox.check_directory(directory)?;
        let temp = temp_directory(name)?;
        match imp::Inner::new(sandbox, directory, &temp) {
            Ok(inner) => Ok(Self {
                temp,
                network: sandbox.network,
                inner,
            }),
            Err(e) => {
                remove(&temp);
                Err(e)
            }
        }
    }

    /// The command's `$TMPDIR`.
    pub(crate) fn temp(&self) -> &Path {
        &self.temp
    }

    pub(crate) fn network(&self) -> bool {
        self.network
    }

    /// Confines the calling process. Runs in the child between `fork` and `exec`, so it
    /// only makes system calls: no allocation, no lock.
    pub(crate) fn apply(&self) -> std::io::Result<()> {
        self.inner.apply()
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        remove(&self.temp);
    }
}

fn remove(temp: &Path) {
    if let Err(e) = std::fs::remove_dir_all(temp)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %temp.display(), error = %e, "could not remove a sandbox's temporary directory");
    }
}

/// A fresh directory only this user can enter, for one command's temporary files.
fn temp_directory(name: &str) -> Result<PathBuf, Error> {
    use std::os::unix::fs::DirBuilderExt as _;
    let path = std::env::temp_dir().join(format!("keel-{name}-{:016x}", fastrand::u64(..)));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&path)
        .map_err(|e| {
            Error::Io(format!(
                "could not create a temporary directory {}: {e}",
                path.display()
            ))
        })?;
    Ok(path)
}

/// The Landlock rules that let a command read everything but `protected`: for each
/// directory on the way to a protected path, listing it (not reading its files) and
/// reading every entry that neither is protected nor leads to one; `/dev` is left to the
/// caller. Entries that are symlinks or mount points are granted only when where they
/// really lead is not protected and does not hold a protected path.
fn read_rules(protected: &[PathBuf]) -> Vec<(PathBuf, Reach)> {
    let mut rules = Vec::new();
    carve(Path::new("/"), protected, &mut rules);
    rules
}

/// What a read rule grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Listing the directory and those below it, not reading their files.
    List,
    /// Reading and running everything below.
    Tree,
}

fn carve(directory: &Path, protected: &[PathBuf], rules: &mut Vec<(PathBuf, Reach)>) {
    rules.push((directory.to_owned(), Reach::List));
    let Ok(entries) = std::fs::read_dir(directory) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path == Path::new("/dev") || protected.contains(&path) {
            continue;
        }
        let is_directory = entry.file_type().is_ok_and(|t| t.is_dir());
        let leads_to_protected = |p: &Path| protected.iter().any(|x| x.starts_with(p));
        if is_directory && leads_to_protected(&path) {
            carve(&path, protected, rules);
            continue;
        }
        // A symlink, or a directory mounted from elsewhere, is granted as what it leads to.
        match std::fs::canonicalize(&path) {
            Ok(real) if !leads_to_protected(&real) => rules.push((path, Reach::Tree)),
            _ => {}
        }
    }
}

/// Devices a command may read and write: the ones a shell and its tools open. (`/dev/fd`
/// and `/dev/std*` lead through `/proc`, which is readable, to the command's own pipes.)
const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
    "/dev/shm",
];

#[cfg(target_os = "linux")]
mod imp {
    use std::os::fd::{AsRawFd as _, OwnedFd};
    use std::path::Path;

    use landlock::{
        ABI, Access, AccessFs, AccessNet, BitFlags, PathBeneath, PathFd, Ruleset, RulesetAttr,
        RulesetCreatedAttr, Scope,
    };

    use super::{DEVICES, Error, Reach, Sandbox, read_rules};

    /// The newest Landlock ABI Keel asks for; older kernels get what they support.
    const ABI_WANTED: ABI = ABI::V6;

    pub(super) fn status() -> Result<u32, String> {
        // SAFETY: with a null attribute and LANDLOCK_CREATE_RULESET_VERSION the call only
        // returns the ABI version (or an error); nothing is created.
        let version = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<libc::c_void>(),
                0usize,
                1u32, // LANDLOCK_CREATE_RULESET_VERSION
            )
        };
        if version > 0 {
            return u32::try_from(version).map_err(|_| "bad Landlock version".into());
        }
        let error = std::io::Error::last_os_error();
        Err(match error.raw_os_error() {
            Some(libc::EOPNOTSUPP) => "Landlock is built into this kernel but not enabled \
                                       (add `landlock` to the `lsm=` boot parameter)"
                .into(),
            _ => format!("this kernel has no Landlock (Linux 5.13 or later is needed): {error}"),
        })
    }

    pub(super) struct Inner {
        ruleset: OwnedFd,
        filter: Option<Vec<libc::sock_filter>>,
    }

    impl Inner {
        pub(super) fn new(sandbox: &Sandbox, directory: &Path, temp: &Path) -> Result<Self, Error> {
            let ruleset = ruleset(sandbox, directory, temp).map_err(|e| {
                Error::Sandbox(format!("could not build the sandbox's Landlock rules: {e}"))
            })?;
            let filter = if sandbox.network {
                None
            } else {
                Some(super::seccomp::no_network().map_err(Error::Sandbox)?)
            };
            Ok(Self { ruleset, filter })
        }

        pub(super) fn apply(&self) -> std::io::Result<()> {
            let check = |result: libc::c_long| {
                if result < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(())
                }
            };
            // SAFETY: plain system calls on this process, with arguments that outlive them;
            // nothing here allocates.
            unsafe {
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into())?;
                check(libc::syscall(
                    libc::SYS_landlock_restrict_self,
                    self.ruleset.as_raw_fd(),
                    0u32,
                ))?;
                if let Some(filter) = &self.filter {
                    let program = libc::sock_fprog {
                        len: filter.len() as u16,
                        filter: filter.as_ptr().cast_mut(),
                    };
                    check(libc::syscall(
                        libc::SYS_seccomp,
                        libc::SECCOMP_SET_MODE_FILTER,
                        0u32,
                        &raw const program,
                    ))?;
                }
            }
            Ok(())
        }
    }

    fn ruleset(sandbox: &Sandbox, directory: &Path, temp: &Path) -> Result<OwnedFd, String> {
        let all = AccessFs::from_all(ABI_WANTED);
        let read = AccessFs::from_read(ABI_WANTED);
        let mut attr = Ruleset::default()
            .handle_access(all)
            .map_err(|e| e.to_string())?
            .scope(Scope::Signal)
            .map_err(|e| e.to_string())?;
        if !sandbox.network {
            attr = attr
                .handle_access(AccessNet::from_all(ABI_WANTED))
                .map_err(|e| e.to_string())?
                .scope(Scope::AbstractUnixSocket)
                .map_err(|e| e.to_string())?;
        }
        let mut created = attr.create().map_err(|e| e.to_string())?;
        let mut grant = |path: &Path, access: BitFlags<AccessFs>| -> Result<(), String> {
            let fd = match PathFd::new(path) {
                Ok(fd) => fd,
                // Gone since it was listed, or never there (a device this system lacks).
                Err(_) => return Ok(()),
            };
            created
                .as_mut()
                .add_rule(PathBeneath::new(fd, access))
                .map(|_| ())
                .map_err(|e| format!("{}: {e}", path.display()))
        };
        for (path, reach) in read_rules(&sandbox.protected.hidden_from(directory)) {
            let access = match reach {
                Reach::List => BitFlags::from(AccessFs::ReadDir),
                Reach::Tree => read,
            };
            grant(&path, access)?;
        }
        for device in DEVICES {
            grant(
                Path::new(device),
                read | AccessFs::WriteFile | AccessFs::IoctlDev,
            )?;
        }
        grant(directory, all)?;
        grant(temp, all)?;
        Option::<OwnedFd>::from(created).ok_or_else(|| match status() {
            Err(reason) => reason,
            Ok(_) => "Landlock refused the rules".into(),
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::path::Path;

    use super::{Error, Sandbox};

    pub(super) fn status() -> Result<u32, String> {
        Err("commands can only be sandboxed on Linux (Landlock)".into())
    }

    pub(super) struct Inner;

    impl Inner {
        pub(super) fn new(_: &Sandbox, _: &Path, _: &Path) -> Result<Self, Error> {
            Err(Error::Sandbox(status().unwrap_err()))
        }

        pub(super) fn apply(&self) -> std::io::Result<()> {
            Ok(())
        }
    }
}

/// A seccomp filter that refuses every socket but Unix ones, and `io_uring` (which could
/// open sockets without the `socket` system call).
#[cfg(target_os = "linux")]
mod seccomp {
    use libc::sock_filter;

    #[cfg(target_arch = "x86_64")]
    const ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
    #[cfg(target_arch = "aarch64")]
    const ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64

    // Offsets in struct seccomp_data: nr, arch, then args[0] at 16 (its low half on these
    // little-endian architectures).
    const NR: u32 = 0;
    const ARCH_OFFSET: u32 = 4;
    const ARG0: u32 = 16;

    const LOAD: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

    fn op(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
        sock_filter { code, jt, jf, k }
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    pub(super) fn no_network() -> Result<Vec<sock_filter>, String> {
        let deny = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let allow = libc::SECCOMP_RET_ALLOW;
        let nr = |n: libc::c_long| n as u32;
        // Jumps count the instructions skipped: `jt`/`jf` are relative to the next one.
        Ok(vec![
            op(LOAD, ARCH_OFFSET, 0, 0),
            // Another architecture's system calls (a 32-bit program) are not understood
            // here, so none is allowed.
            op(JEQ, ARCH, 1, 0),
            op(RET, deny, 0, 0),
            op(LOAD, NR, 0, 0),
            // x32 system calls on x86_64 carry this bit; they would bypass the numbers below.
            op(JGE, 0x4000_0000, 6, 0),
            op(JEQ, nr(libc::SYS_io_uring_setup), 5, 0),
            op(JEQ, nr(libc::SYS_socket), 0, 2),
            op(LOAD, ARG0, 0, 0),
            op(JEQ, libc::AF_UNIX as u32, 1, 2),
            op(RET, allow, 0, 0), // not socket()
            op(RET, allow, 0, 0), // socket(AF_UNIX, …)
            op(RET, deny, 0, 0),
        ])
    }

    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub(super) fn no_network() -> Result<Vec<sock_filter>, String> {
        let _ = (op, LOAD, JEQ, JGE, RET);
        Err(
            "turning the network off is not supported on this architecture; give the \
             agent sandbox = \"network\" or \"off\""
                .into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_rules_leave_out_protected_files_and_what_leads_to_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().canonicalize().expect("canonical");
        std::fs::create_dir_all(root.join("data/inner")).expect("dirs");
        std::fs::write(root.join("data/keel.db"), "").expect("db");
        std::fs::write(root.join("data/notes.txt"), "").expect("notes");
        std::os::unix::fs::symlink(root.join("data"), root.join("alias")).expect("symlink");
        std::os::unix::fs::symlink(root.join("data/keel.db"), root.join("db-link"))
            .expect("symlink");
        std::fs::create_dir(root.join("work")).expect("work");
        let protected = Protected::new(Some(&root.join("data/keel.db")), None, Vec::new());
        let rules = read_rules(&protected.hidden_from(&root.join("work")));
        let reach = |p: &Path| rules.iter().find(|(r, _)| r == p).map(|(_, reach)| *reach);
        assert_eq!(reach(Path::new("/")), Some(Reach::List));
        assert_eq!(reach(&root), Some(Reach::List));
        assert_eq!(reach(&root.join("data")), Some(Reach::List));
        assert_eq!(reach(&root.join("data/notes.txt")), Some(Reach::Tree));
        assert_eq!(reach(&root.join("data/inner")), Some(Reach::Tree));
        assert_eq!(reach(&root.join("work")), Some(Reach::Tree));
        assert_eq!(reach(&root.join("data/keel.db")), None);
        assert_eq!(
            reach(&root.join("alias")),
            None,
            "a symlink to a protected directory"
        );
        assert_eq!(
            reach(&root.join("db-link")),
            None,
            "a symlink to a protected file"
        );
        assert_eq!(reach(Path::new("/dev")), None);
        assert!(
            rules.iter().all(|(p, _)| !p.starts_with("/dev")),
            "devices are granted one by one"
        );
    }

    #[test]
    fn a_session_directory_holding_a_protected_file_is_refused() {
        let protected = Arc::new(Protected::new(
            Some(Path::new("/srv/project/keel.db")),
            None,
            Vec::new(),
        ));
        let sandbox = Sandbox::for_mode(Mode::On, &protected).expect("on");
        assert!(matches!(
            sandbox.check_directory(Path::new("/srv/project")),
            Err(Error::Sandbox(_))
        ));
        assert!(
            sandbox
                .check_directory(Path::new("/srv/project/app"))
                .is_ok()
        );
        assert!(Sandbox::for_mode(Mode::Off, &protected).is_none());
    }

    #[test]
    fn keel_variables_and_named_keys_are_hidden() {
        let protected = Protected::new(None, None, vec!["OPENAI_API_KEY".into()]);
        assert!(protected.hides_variable("KEEL_TOKEN"));
        assert!(protected.hides_variable("KEEL_DB"));
        assert!(protected.hides_variable("OPENAI_API_KEY"));
        assert!(!protected.hides_variable("KEEL_CALL_ID"));
        assert!(!protected.hides_variable("PATH"));
    }
}
