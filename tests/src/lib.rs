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
