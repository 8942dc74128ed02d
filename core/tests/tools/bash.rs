//! `bash`: the session directory, exit codes, output caps, progress, timeouts and interrupts
//! that kill the whole process group.

use keel_core::tool::{Error, Limits, Output};
use keel_schema::id::{CallId, SessionId};
use keel_schema::types::ToolContent;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::support::*;

#[tokio::test]
async fn bash_runs_in_the_session_directory_with_empty_stdin_and_interleaved_output() {
    let s = Session::new();
    s.file("here.txt", "");
    let ran = s
        .call(
            "bash",
            json!({ "command": "ls; echo to-stderr >&2; echo to-stdout; cat" }),
        )
        .await
        .expect("bash");
    assert_eq!(
        ran,
        Output {
            structured: json!({
                "exit_code": 0,
                "signal": null,
                "output": "here.txt\nto-stderr\nto-stdout\n",
                "truncated": false,
            }),
            content: vec![ToolContent::Text {
                text: "here.txt\nto-stderr\nto-stdout\n".into()
            }],
        }
    );
}

#[tokio::test]
async fn bash_tells_the_command_its_session_and_call_when_a_session_runs_it() {
    let mut s = Session::new();
    let command = json!({ "command": "echo \"[$KEEL_SESSION_ID] [$KEEL_CALL_ID]\"" });
    let alone = s.call("bash", command.clone()).await.expect("bash");
    assert_eq!(text(&alone), "[] []\n");
    let (session, call) = (SessionId::new(), CallId::new());
    s.context.call = Some((session, call));
    let ran = s.call("bash", command).await.expect("bash");
    assert_eq!(text(&ran), format!("[{session}] [{call}]\n"));
}

#[tokio::test]
async fn bash_reports_a_non_zero_exit_as_a_successful_call_stating_the_code() {
    let s = Session::new();
    let ran = s
        .call("bash", json!({ "command": "echo oops; exit 2" }))
        .await
        .expect("a non-zero exit is not a tool failure");
    assert_eq!(text(&ran), "oops\nexit code 2");
    assert_eq!(ran.structured["exit_code"], 2);
    let silent = s
        .call("bash", json!({ "command": "false" }))
        .await
        .expect("bash");
    assert_eq!(text(&silent), "exit code 1");
    let quiet = s
        .call("bash", json!({ "command": "true" }))
        .await
        .expect("bash");
    assert_eq!(text(&quiet), "(no output)");
}

#[tokio::test]
async fn bash_output_is_capped_at_max_output_bytes() {
    let s = Session::with_limits(Limits {
        max_output_bytes: 1000,
        ..Limits::default()
    });
    let ran = s
        .call(
            "bash",
            json!({ "command": "head -c 100000 /dev/zero | tr '\\0' a" }),
        )
        .await
        .expect("bash");
    let expected = format!("{}\n… output truncated: 99000 more bytes", "a".repeat(1000));
    assert_eq!(
        ran.structured,
        json!({ "exit_code": 0, "signal": null, "output": expected, "truncated": true })
    );
    assert_eq!(text(&ran), expected);
}

#[tokio::test]
async fn bash_offers_its_output_as_progress() {
    let (tx, mut rx) = mpsc::channel(16);
    let mut s = Session::new();
    s.context.progress = Some(tx);
    s.call("bash", json!({ "command": "echo hello" }))
        .await
        .expect("bash");
    assert_eq!(rx.recv().await, Some(json!({ "output": "hello\n" })));
}

#[tokio::test]
async fn bash_timeout_kills_the_whole_process_group_including_background_children() {
    let (tx, mut rx) = mpsc::channel(16);
    let mut s = Session::new();
    s.context.progress = Some(tx);
    // Generous enough for bash to start and print its pids before the timeout fires.
    let ran = s
        .call(
            "bash",
            json!({ "command": "sleep 100 & echo $$ $!; sleep 100; wait", "timeout_ms": 2000 }),
        )
        .await;
    assert_eq!(ran, Err(Error::Timeout(2000)));
    assert_eq!(ran.expect_err("timed out").info().kind, "tool.timeout");
    let printed = rx
        .try_recv()
        .expect("the pids were printed before the timeout");
    for pid in pids(&printed) {
        assert_process_ends(pid).await;
    }
}

#[tokio::test]
async fn bash_timeout_is_clamped_to_max_timeout() {
    let s = Session::with_limits(Limits {
        max_timeout_ms: 500,
        ..Limits::default()
    });
    let ran = s
        .call(
            "bash",
            json!({ "command": "sleep 100", "timeout_ms": 10_000_000 }),
        )
        .await;
    assert_eq!(ran, Err(Error::Timeout(500)));
}

#[tokio::test]
async fn bash_cancellation_kills_the_whole_process_group_and_is_interrupted() {
    let (tx, mut rx) = mpsc::channel(16);
    let mut s = Session::new();
    s.context.progress = Some(tx);
    let context = s.context.clone();
    let run = tokio::spawn(async move {
        call_with(
            &context,
            "bash",
            json!({ "command": "sleep 100 & echo $$ $!; wait" }),
        )
        .await
    });
    // Cancel only once the command has started its background child.
    let printed = rx.recv().await.expect("a progress chunk");
    s.context.cancel.cancel();
    let ran = run.await.expect("run task");
    assert_eq!(ran, Err(Error::Interrupted));
    for pid in pids(&printed) {
        assert_process_ends(pid).await;
    }
}

#[tokio::test]
async fn bash_returns_when_the_command_exits_without_waiting_for_background_children() {
    let s = Session::new();
    let ran = s
        .call(
            "bash",
            json!({ "command": "sleep 100 & echo $!; echo done", "timeout_ms": 60_000 }),
        )
        .await
        .expect("bash");
    let out = text(&ran);
    let mut lines = out.lines();
    let pid: i32 = lines
        .next()
        .and_then(|l| l.parse().ok())
        .expect("the background pid");
    assert_eq!(lines.next(), Some("done"));
    // Clean up the child this test left running on purpose.
    // SAFETY: kill only sends a signal.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_process_ends(pid).await;
}

/// The pids a command printed (as `echo $$ $!`) in a progress chunk.
fn pids(chunk: &Value) -> Vec<i32> {
    let output = chunk["output"].as_str().expect("output text");
    let pids: Vec<i32> = output
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert_eq!(pids.len(), 2, "{output:?}");
    pids
}

/// Waits (via a pidfd, without polling) until `pid` has exited; fails if it is still
/// running after a generous bound.
async fn assert_process_ends(pid: i32) {
    tokio::task::spawn_blocking(move || {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let error = std::io::Error::last_os_error();
            assert_eq!(
                error.raw_os_error(),
                Some(libc::ESRCH),
                "pidfd_open({pid}): {error}"
            );
            return; // already gone and reaped
        }
        let fd = i32::try_from(fd).expect("a descriptor fits in an int");
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the descriptor is closed right after.
        let ready = unsafe { libc::poll(&mut poll, 1, 30_000) };
        // SAFETY: closing the descriptor pidfd_open returned.
        unsafe { libc::close(fd) };
        assert_eq!(ready, 1, "process {pid} is still running");
    })
    .await
    .expect("pidfd wait");
}
