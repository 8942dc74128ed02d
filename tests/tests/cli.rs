//! The `keel` command line, run as a user runs it.

use std::process::Command;

use keel_schema::event::catalog;
use keel_tests::{Server, keel_binary};

#[test]
fn keel_events_prints_every_catalog_entry() {
    let output = Command::new(keel_binary()).arg("events").output().unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), catalog().count());
    for (line, entry) in lines.iter().zip(catalog()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields[0], entry.type_name);
        assert_eq!(fields[1], format!("v{}", entry.version));
    }
    assert!(stdout.contains("session.next.tool.success"));
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("session.next.tool.success ") && l.ends_with("(read only)"))
    );
}

#[test]
fn keel_rejects_an_unknown_command_with_usage() {
    let output = Command::new(keel_binary()).arg("serv").output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("unrecognized subcommand 'serv'"),
        "{stderr}"
    );
    assert!(stderr.contains("Usage:"), "{stderr}");
}

/// Runs `keel` with `args` against `server`, from the server's directory.
fn keel(server: &Server, args: &[&str]) -> std::process::Output {
    Command::new(keel_binary())
        .args(args)
        .current_dir(server.directory())
        .env("KEEL_URL", &server.base_url)
        .env_remove("KEEL_TOKEN")
        .output()
        .unwrap()
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

#[test]
fn keel_prompt_streams_the_answer_and_tool_activity_then_says_idle() {
    let server = Server::start(&[]);
    let prompted = keel(&server, &["prompt", "--new", "what is here?"]);
    assert!(prompted.status.success(), "{}", stderr(&prompted));
    let session = stderr(&prompted)
        .lines()
        .find_map(|l| l.strip_prefix("session "))
        .expect("keel prompt --new names the session it created")
        .to_owned();
    let out = stdout(&prompted);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Let me look at the session directory.");
    assert_eq!(lines[1], r#"→ list {"path":"."}"#);
    assert!(lines[2].starts_with("✓ list "), "{out}");
    assert!(
        lines[3].starts_with("That is the session directory."),
        "{out}"
    );
    assert_eq!(lines[4], "── idle");
    assert_eq!(lines.len(), 5, "{out}");

    // The same session again, by id: only the new answer is printed.
    let again = keel(&server, &["prompt", &session, "and now?"]);
    assert!(again.status.success(), "{}", stderr(&again));
    let out = stdout(&again);
    assert!(!out.contains("Let me look"), "{out}");
    assert!(out.ends_with("── idle\n"), "{out}");

    let listed = keel(&server, &["sessions"]);
    assert!(listed.status.success());
    assert!(stdout(&listed).starts_with(&format!("{session}  demo/scripted")));

    let tailed = keel(&server, &["tail", &session, "--no-follow"]);
    assert!(tailed.status.success(), "{}", stderr(&tailed));
    let out = stdout(&tailed);
    let seqs: Vec<u64> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    let last = *seqs.last().unwrap();
    assert_eq!(seqs, (1..=last).collect::<Vec<_>>());
    assert!(out.ends_with(&format!("synced at seq {last}\n")), "{out}");

    let json = keel(
        &server,
        &["tail", &session, "--no-follow", "--json", "--after", "3"],
    );
    let envelopes: Vec<keel_schema::event::Envelope> = stdout(&json)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(envelopes.first().unwrap().seq, 4);
    assert_eq!(envelopes.last().unwrap().seq, last);

    let interrupted = keel(&server, &["interrupt", &session]);
    assert!(interrupted.status.success());
    assert_eq!(stdout(&interrupted), format!("{session} was not running\n"));
}

#[test]
fn keel_client_commands_fail_clearly() {
    let server = Server::start(&[]);
    let unknown = keel(
        &server,
        &["prompt", "ses_01JZ0000000000000000000000", "hello"],
    );
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        stderr(&unknown).contains("no session ses_01JZ0000000000000000000000"),
        "{}",
        stderr(&unknown)
    );

    let malformed = keel(&server, &["tail", "not-a-session"]);
    assert_eq!(malformed.status.code(), Some(2));
    assert!(stderr(&malformed).contains("not a session id"));

    let both = keel(
        &server,
        &["prompt", "--new", "ses_01JZ0000000000000000000000", "hi"],
    );
    assert_eq!(both.status.code(), Some(1));
    assert!(stderr(&both).contains("with --new, give only the prompt"));

    let nowhere = Command::new(keel_binary())
        .args(["sessions", "--url", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(nowhere.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&nowhere.stderr).contains("could not reach keel"),
        "{}",
        String::from_utf8_lossy(&nowhere.stderr)
    );
}

#[test]
fn the_client_example_prompts_and_prints_the_answer() {
    let server = Server::start(&[]);
    let output = Command::new(keel_tests::client_example())
        .arg("what is here?")
        .env("KEEL_URL", &server.base_url)
        .env_remove("KEEL_TOKEN")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let out = stdout(&output);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("session ses_"), "{out}");
    assert_eq!(lines[1], "Let me look at the session directory.");
    assert_eq!(lines[2], r#"[list {"path":"."}]"#);
    assert!(
        lines[3].starts_with("That is the session directory."),
        "{out}"
    );
    assert_eq!(lines[4], "[Succeeded]");
}
