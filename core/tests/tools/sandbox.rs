//! `bash` in its sandbox: writes only in the session directory and its `$TMPDIR`, Keel's
//! own files unreadable, no network unless allowed, no signals out, no keys in the
//! environment, while ordinary work (listing, reading, git, a build) goes on.

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_core::tool::sandbox::{Mode, Protected, Sandbox};
use keel_core::tool::{Error, Output};
use serde_json::json;

use super::support::*;

/// A session whose commands run sandboxed, with a database and a configuration of Keel's
/// next to the session directory (`outside/keel.db`, `outside/keel.toml`).
fn sandboxed(mode: Mode) -> (Session, PathBuf) {
    let mut s = Session::new();
    let db = s.outside.join("keel.db");
    std::fs::write(&db, "SQLite format 3\0 the sessions").expect("db");
    std::fs::write(s.outside.join("keel.db-wal"), "wal").expect("wal");
    std::fs::write(s.outside.join("keel.toml"), "default_model = \"x/y\"").expect("config");
    let protected = Arc::new(Protected::new(
        Some(&db),
        Some(&s.outside.join("keel.toml")),
        vec!["HOME".into()],
    ));
    s.context.sandbox = Sandbox::for_mode(mode, &protected);
    assert!(s.context.sandbox.is_some());
    (s, db)
}

async fn run(s: &Session, command: &str) -> Output {
    s.call("bash", json!({ "command": command }))
        .await
        .expect("bash runs")
}

fn exit_code(output: &Output) -> i64 {
    output.structured["exit_code"]
        .as_i64()
        .expect("an exit code")
}

#[tokio::test]
async fn sandboxed_bash_cannot_write_outside_the_session_directory() {
    let (s, _) = sandboxed(Mode::On);
    let target = s.outside.join("planted.txt");
    let ran = run(&s, &format!("echo x > {}", target.display())).await;
    assert_ne!(exit_code(&ran), 0, "{}", text(&ran));
    assert!(!target.exists(), "nothing was written outside");
    assert!(text(&ran).contains("Permission denied"), "{}", text(&ran));
    assert!(
        text(&ran).contains("blocked by sandbox:"),
        "the model is told the sandbox refused: {}",
        text(&ran)
    );
    assert_eq!(ran.structured["sandbox"]["blocked"], true);

    // Nor by moving or deleting what is there.
    let secret = s.outside.join("secret.txt");
    let ran = run(
        &s,
        &format!("rm -f {0}; mv {0} moved.txt", secret.display()),
    )
    .await;
    assert_ne!(exit_code(&ran), 0);
    assert!(secret.exists(), "the file outside is untouched");
}

#[tokio::test]
async fn sandboxed_bash_cannot_read_keels_database_or_configuration() {
    let (s, db) = sandboxed(Mode::On);
    for file in [
        db.clone(),
        s.outside.join("keel.db-wal"),
        s.outside.join("keel.toml"),
    ] {
        let ran = run(&s, &format!("cat {}", file.display())).await;
        assert_ne!(exit_code(&ran), 0, "{}: {}", file.display(), text(&ran));
        assert!(!text(&ran).contains("the sessions"), "{}", text(&ran));
        assert!(text(&ran).contains("blocked by sandbox:"), "{}", text(&ran));
    }
    // Not through a symlink made in the session directory either.
    let ran = run(&s, &format!("ln -s {} db && cat db", db.display())).await;
    assert_ne!(exit_code(&ran), 0, "{}", text(&ran));
    assert!(!text(&ran).contains("the sessions"), "{}", text(&ran));
    // What is next to them still reads, and listing shows the database is there.
    let ran = run(
        &s,
        &format!(
            "cat {}; ls {}",
            s.outside.join("secret.txt").display(),
            s.outside.display()
        ),
    )
    .await;
    assert_eq!(exit_code(&ran), 0, "{}", text(&ran));
    assert!(text(&ran).contains("secret needle"), "{}", text(&ran));
    assert!(text(&ran).contains("keel.db"), "{}", text(&ran));
}

#[tokio::test]
async fn sandboxed_bash_does_ordinary_work_in_the_session_directory() {
    let (s, _) = sandboxed(Mode::On);
    s.file("notes.txt", "hello\n");
    let ran = run(
        &s,
        "set -e; ls; cat notes.txt; mkdir -p src/deep; echo new > src/deep/new.txt; \
         mv src/deep/new.txt moved.txt; rm notes.txt; \
         t=$(mktemp); echo scratch > \"$t\"; cat \"$t\"; \
         case \"$t\" in \"$TMPDIR\"/*) echo temp-is-private;; esac; \
         git init -q . && git add moved.txt && git status --short",
    )
    .await;
    assert_eq!(exit_code(&ran), 0, "{}", text(&ran));
    for expected in [
        "notes.txt",
        "hello",
        "scratch",
        "temp-is-private",
        "A  moved.txt",
    ] {
        assert!(text(&ran).contains(expected), "{expected}: {}", text(&ran));
    }
    assert_eq!(ran.structured["sandbox"]["blocked"], false);
    assert!(s.root.join("moved.txt").exists());
    assert!(!s.root.join("notes.txt").exists());
}

#[tokio::test]
async fn sandboxed_bash_can_build_a_program_in_the_session_directory() {
    let (s, _) = sandboxed(Mode::On);
    s.file(
        "Cargo.toml",
        "[package]\nname = \"hello\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    );
    s.file(
        "src/main.rs",
        "fn main() { println!(\"built in the sandbox\"); }\n",
    );
    let ran = s
        .call(
            "bash",
            json!({ "command": "cargo run --offline --quiet", "timeout_ms": 300_000 }),
        )
        .await
        .expect("bash runs");
    assert_eq!(exit_code(&ran), 0, "{}", text(&ran));
    assert!(
        text(&ran).contains("built in the sandbox"),
        "{}",
        text(&ran)
    );
    assert!(s.root.join("target").is_dir());
}

#[tokio::test]
async fn sandboxed_bash_has_no_network_unless_the_agent_allows_it() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let port = listener.local_addr().expect("address").port();
    let send = format!("echo hello > /dev/tcp/127.0.0.1/{port}");

    let (s, _) = sandboxed(Mode::On);
    let ran = run(&s, &send).await;
    assert_ne!(exit_code(&ran), 0, "{}", text(&ran));
    assert!(text(&ran).contains("blocked by sandbox:"), "{}", text(&ran));
    assert!(text(&ran).contains("no network"), "{}", text(&ran));
    let udp = run(&s, &format!("echo hello > /dev/udp/127.0.0.1/{port}")).await;
    assert_ne!(exit_code(&udp), 0, "UDP is refused too: {}", text(&udp));

    let (s, _) = sandboxed(Mode::Network);
    let ran = run(&s, &send).await;
    assert_eq!(exit_code(&ran), 0, "{}", text(&ran));
    listener.set_nonblocking(false).expect("blocking");
    let (mut connection, _) = listener.accept().expect("the command connected");
    connection
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut received = String::new();
    connection
        .read_to_string(&mut received)
        .expect("what it sent");
    assert_eq!(received, "hello\n");
}

#[tokio::test]
async fn sandboxed_bash_cannot_signal_keel_or_see_its_keys() {
    let (s, _) = sandboxed(Mode::On);
    let ran = run(
        &s,
        &format!(
            "echo \"home=${{HOME-unset}} token=${{KEEL_TOKEN-unset}}\"; kill -0 {}",
            std::process::id()
        ),
    )
    .await;
    assert!(
        text(&ran).contains("home=unset token=unset"),
        "{}",
        text(&ran)
    );
    assert_ne!(exit_code(&ran), 0, "Keel's process cannot be signalled");
    assert!(
        text(&ran).contains("Operation not permitted"),
        "{}",
        text(&ran)
    );
}

#[tokio::test]
async fn a_session_directory_holding_keels_database_is_refused_before_anything_runs() {
    let mut s = Session::new();
    let db = s.root.join("keel.db");
    std::fs::write(&db, "db").expect("db");
    let protected = Arc::new(Protected::new(Some(&db), None, Vec::new()));
    s.context.sandbox = Sandbox::for_mode(Mode::On, &protected);
    let refused = s
        .call("bash", json!({ "command": "touch ran" }))
        .await
        .expect_err("refused");
    let Error::Sandbox(reason) = &refused else {
        panic!("{refused:?}")
    };
    assert!(reason.contains("keel.db"), "{reason}");
    assert!(reason.contains("sandbox = \"off\""), "{reason}");
    assert_eq!(refused.info().kind, "tool.sandbox");
    assert!(!s.root.join("ran").exists());

    // With the sandbox off, the agent's choice, it runs.
    s.context.sandbox = Sandbox::for_mode(Mode::Off, &protected);
    let ran = s
        .call("bash", json!({ "command": "touch ran" }))
        .await
        .expect("bash");
    assert_eq!(exit_code(&ran), 0);
    assert!(s.root.join("ran").exists());
}

#[tokio::test]
async fn a_sandboxed_commands_temporary_directory_is_removed_when_it_ends() {
    let (s, _) = sandboxed(Mode::On);
    let ran = run(&s, "echo \"$TMPDIR\"; touch \"$TMPDIR/left\"").await;
    let temp = PathBuf::from(text(&ran).trim());
    assert!(temp.starts_with(std::env::temp_dir()), "{}", temp.display());
    assert!(!temp.exists(), "{} is gone", temp.display());
}
