//! The `keel` command line, run as a user runs it.

use std::process::Command;

use keel_schema::event::catalog;
use keel_tests::keel_binary;

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
