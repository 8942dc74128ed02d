//! keel-tests: end-to-end tests of Keel as users run it: the real `keel` binary, the
//! real client, real files. Helpers shared by the tests live here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace root.
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("keel-tests lives one directory below the workspace root")
}

/// The `keel` binary of this checkout, built (once per test process) with the same cargo
/// that runs the tests, so a test never runs a stale binary.
pub fn keel_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let output = Command::new(cargo)
            .current_dir(workspace_root())
            .args([
                "build",
                "--quiet",
                "--package",
                "keel-core",
                "--bin",
                "keel",
                "--message-format=json",
            ])
            .output()
            .expect("cargo runs");
        assert!(
            output.status.success(),
            "building keel failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|message| message["target"]["name"] == "keel")
            .find_map(|message| message["executable"].as_str().map(PathBuf::from))
            .expect("cargo reports the keel executable it built")
    })
}

/// A `keel serve` process on a free loopback port with its own SQLite database, killed
/// when dropped.
pub struct Server {
    pub base_url: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts `keel serve` with `args` added, and waits until it listens.
    pub fn start(args: &[&str]) -> Self {
        use std::io::{BufRead, BufReader};
        let dir = tempfile::tempdir().expect("a temporary directory");
        let db = format!("sqlite://{}", dir.path().join("keel.db").display());
        let mut child = Command::new(keel_binary())
            .args(["serve", "--listen", "127.0.0.1:0", "--db", &db])
            .args(args)
            .current_dir(dir.path())
            .env_remove("KEEL_TOKEN")
            .env_remove("KEEL_CONFIG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("keel starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("keel prints where it listens");
        let base_url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_owned();
        Self {
            base_url,
            child,
            _dir: dir,
        }
    }

    /// The directory the server runs in (the default session directory).
    pub fn directory(&self) -> &Path {
        self._dir.path()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The process may already be gone; either way it must not outlive the test.
        drop(self.child.kill());
        drop(self.child.wait());
    }
}
