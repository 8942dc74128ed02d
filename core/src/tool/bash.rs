//! `bash`: runs a shell command in the session directory.
//!
//! The command runs as `bash -c <command>` with the session directory as its working
//! directory, stdin from `/dev/null`, and stdout and stderr sharing one pipe (so they
//! interleave as a terminal would show them). It is the leader of its own process group.
//!
//! Invariants:
//! - a non-zero exit is a successful call whose output states the exit code; only a
//!   failure to start, a timeout or an interrupt is an error;
//! - on timeout ([`Error::Timeout`]), interrupt ([`Error::Interrupted`]) or when the run is
//!   dropped, the whole process group is killed with `SIGKILL`, background children
//!   included, before the call returns;
//! - when the command exits by itself, the call returns: background processes it left
//!   running are not waited for (their later output is not read);
//! - the output kept is at most [`Limits::max_output_bytes`], noted when cut; all of it is
//!   offered as progress (`{"output": "..."}`) without ever waiting on a full channel.
//!
//! Run for a session, the command sees `KEEL_SESSION_ID` and `KEEL_CALL_ID`: a script
//! that changes the world can use the call id as an idempotency key.
//!
//! With a [`Sandbox`] in the context (every agent's default) the command runs confined
//! ([`super::sandbox`]): it writes only in the session directory and its own `$TMPDIR`,
//! cannot read Keel's database or configuration, has no network unless allowed, and
//! inherits none of Keel's secrets. A refusal the sandbox makes before the command runs
//! fails the call with [`Error::Sandbox`]; when a command fails on a denied access, the
//! output ends with a `blocked by sandbox: …` line saying what the sandbox allows, so the
//! model can adapt. Without one, the command can do anything the user running Keel can,
//! and the permission policy is what guards it.
//!
//! [`Limits::max_output_bytes`]: super::Limits::max_output_bytes

use std::io::{self, Read as _};
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use keel_schema::types::Effect;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::sandbox::{Prepared, Sandbox};
use super::truncate::Capped;
use super::{Context, Error, Output, Run, Tool, input, text};

/// Size of one read from the output pipe.
const CHUNK_BYTES: usize = 8192;
/// Output read after the command exits, at most: background children may still be writing,
/// and the call must not wait for them.
const MAX_DRAIN_BYTES: usize = 1024 * 1024;

/// The `bash` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Bash;

/// Input of `bash`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The command, run with `bash -c` in the session directory.
    pub command: String,
    /// How long it may run, in milliseconds (default and maximum are configured).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

impl Tool for Bash {
    fn name(&self) -> &'static str {
        "bash"
    }

    fn description(&self) -> &'static str {
        "Run a shell command with bash in the session directory; returns its combined \
         stdout and stderr and, if not zero, its exit code."
    }

    fn effect(&self) -> Effect {
        Effect::Write
    }

    fn input_schema(&self) -> Value {
        input::schema::<Input>()
    }

    fn permission_pattern(&self, input: &Value, _root: &Path) -> String {
        input::field(input, "command", "").to_owned()
    }

    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(async move {
            let input: Input = input::parse(input)?;
            let timeout_ms = input
                .timeout_ms
                .unwrap_or(context.limits.default_timeout_ms)
                .min(context.limits.max_timeout_ms);
            run(&input.command, timeout_ms, context).await
        })
    }
}

async fn run(command: &str, timeout_ms: u64, context: &Context) -> Result<Output, Error> {
    if context.cancel.is_cancelled() {
        return Err(Error::Interrupted);
    }
    let failed = |e: io::Error| Error::Io(format!("could not run bash: {e}"));
    let sandbox = match &context.sandbox {
        Some(sandbox) => {
            let name = context
                .call
                .map_or_else(|| "bash".to_owned(), |(_, call)| call.to_string());
            let (sandbox, directory) = (sandbox.clone(), context.directory.clone());
            // Building the rules lists directories and opens the paths granted.
            let prepared =
                super::blocking(move || Prepared::new(&sandbox, &directory, &name)).await?;
            Some(Arc::new(prepared))
        }
        None => None,
    };
    let (output_tx, mut output_rx) = pipe::pipe().map_err(failed)?;
    // The child's end must block: a child writing to a non-blocking stdout gets EAGAIN.
    let stdout = output_tx.into_blocking_fd().map_err(failed)?;
    let stderr = stdout.try_clone().map_err(failed)?;
    let mut child = {
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(command)
            .current_dir(&context.directory)
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .process_group(0)
            .kill_on_drop(true);
        if let Some((session, call)) = context.call {
            cmd.env("KEEL_SESSION_ID", session.to_string())
                .env("KEEL_CALL_ID", call.to_string());
        }
        if let (Some(prepared), Some(Sandbox { protected, .. })) = (&sandbox, &context.sandbox) {
            confine(&mut cmd, prepared, protected);
        }
        cmd.spawn().map_err(failed)?
        // `cmd` drops here with our copies of the pipe's write end, so the read end sees
        // end-of-file once the command and its children are done with it.
    };
    let mut group = Group::of(&child)?;

    let mut output = Capped::new(context.limits.max_output_bytes);
    let mut progress = Progress::new(context.progress.clone());
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut closed = false;
    let deadline = tokio::time::sleep(Duration::from_millis(timeout_ms));
    tokio::pin!(deadline);
    let status = loop {
        tokio::select! {
            biased;
            () = context.cancel.cancelled() => {
                group.kill_and_reap(&mut child).await?;
                return Err(Error::Interrupted);
            }
            () = &mut deadline => {
                group.kill_and_reap(&mut child).await?;
                return Err(Error::Timeout(timeout_ms));
            }
            read = output_rx.read(&mut buf), if !closed => match read {
                Ok(0) => closed = true,
                Ok(n) => {
                    output.push(&buf[..n]);
                    progress.send(&buf[..n]);
                }
                Err(e) => {
                    group.kill_and_reap(&mut child).await?;
                    return Err(Error::Io(format!("reading the command's output: {e}")));
                }
            },
            status = child.wait() => {
                // Reaped: the group id may be reused once its last member is gone, so it
                // must never be signalled from here on.
                group.disarm();
                break status.map_err(|e| Error::Io(format!("waiting for bash: {e}")))?;
            }
        }
    };
    // The command is done; what it wrote before exiting is in the pipe.
    if !closed {
        drain(output_rx, &mut output, &mut progress)?;
    }
    progress.flush();
    Ok(result(status, output, sandbox.as_deref()))
}

/// Runs `cmd` in the prepared sandbox, without Keel's secrets in its environment.
fn confine(cmd: &mut Command, prepared: &Arc<Prepared>, protected: &super::sandbox::Protected) {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| protected.hides_variable(n)) {
            cmd.env_remove(name);
        }
    }
    for variable in ["TMPDIR", "TMP", "TEMP"] {
        cmd.env(variable, prepared.temp());
    }
    let prepared = prepared.clone();
    // SAFETY: `apply` makes only system calls (no allocation, no lock), which is what may
    // run between fork and exec.
    unsafe {
        cmd.pre_exec(move || prepared.apply());
    }
}

/// Reads what is already in the pipe without waiting for writers that are still alive.
fn drain(
    reader: pipe::Receiver,
    output: &mut Capped,
    progress: &mut Progress,
) -> Result<(), Error> {
    let failed = |e: io::Error| Error::Io(format!("reading the command's output: {e}"));
    // A raw non-blocking read asks the pipe itself; the async reader would answer from
    // readiness the reactor may not have seen yet.
    let mut pipe = std::fs::File::from(reader.into_nonblocking_fd().map_err(failed)?);
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut drained = 0;
    while drained < MAX_DRAIN_BYTES {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                drained += n;
                output.push(&buf[..n]);
                progress.send(&buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(failed(e)),
        }
    }
    Ok(())
}

/// Messages of the errors a sandbox's refusals surface as (EACCES, EPERM).
const DENIALS: &[&str] = &["Permission denied", "Operation not permitted"];

fn result(status: ExitStatus, output: Capped, sandbox: Option<&Prepared>) -> Output {
    let empty = output.is_empty();
    let output = output.finish();
    let mut shown = output.text.clone();
    // A failed command that was refused something may have met the sandbox rather than
    // the file's own permissions: say what the sandbox allows, so the model can adapt.
    let blocked = sandbox
        .filter(|_| status.code() != Some(0) && DENIALS.iter().any(|d| output.text.contains(d)));
    let ending = match (status.code(), status.signal()) {
        (Some(0), _) => None,
        (Some(code), _) => Some(format!("exit code {code}")),
        (None, Some(signal)) => Some(format!("killed by signal {signal}")),
        (None, None) => Some("exited without a status".to_owned()),
    };
    match ending {
        Some(ending) if empty => shown = ending,
        Some(ending) => {
            if !shown.ends_with('\n') {
                shown.push('\n');
            }
            shown.push_str(&ending);
        }
        None if empty => shown = "(no output)".to_owned(),
        None => {}
    }
    if let Some(prepared) = blocked {
        shown.push_str(&format!(
            "\nblocked by sandbox: a command here may write only in the session directory \
             and $TMPDIR, cannot read Keel's own files{}; a denial above may come from it. \
             Work within that, or ask the user.",
            if prepared.network() {
                ""
            } else {
                " and has no network"
            }
        ));
    }
    let mut structured = json!({
        "exit_code": status.code(),
        "signal": status.signal(),
        "output": output.text,
        "truncated": output.truncated,
    });
    if let Some(prepared) = sandbox {
        structured["sandbox"] = json!({
            "network": prepared.network(),
            "blocked": blocked.is_some(),
        });
    }
    Output {
        structured,
        content: text(shown),
    }
}

/// The command's process group, killed when this is dropped while armed, so a run that is
/// abandoned (its future dropped) leaves no process behind.
#[derive(Debug)]
struct Group {
    id: libc::pid_t,
    armed: bool,
}

impl Group {
    fn of(child: &Child) -> Result<Self, Error> {
        // `process_group(0)` made the child the leader of a group whose id is its pid.
        // `id()` is `None` only once the child has been reaped, which has not happened yet.
        let pid = child
            .id()
            .ok_or_else(|| Error::Io("bash exited before it could be tracked".into()))?;
        let id = libc::pid_t::try_from(pid)
            .map_err(|_| Error::Io(format!("process id {pid} out of range")))?;
        Ok(Self { id, armed: true })
    }

    fn kill(&self) -> io::Result<()> {
        // SAFETY: killpg only sends a signal; `id` is a process group we created.
        if unsafe { libc::killpg(self.id, libc::SIGKILL) } == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            // Every member is already gone.
            Some(libc::ESRCH) => Ok(()),
            _ => Err(error),
        }
    }

    /// Kills the group and reaps the leader, so nothing of the command outlives the call.
    async fn kill_and_reap(&mut self, child: &mut Child) -> Result<(), Error> {
        self.kill()
            .map_err(|e| Error::Io(format!("could not kill the command's processes: {e}")))?;
        self.armed = false;
        child
            .wait()
            .await
            .map_err(|e| Error::Io(format!("waiting for bash: {e}")))?;
        Ok(())
    }

    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.armed {
            // Nothing can be reported from a drop, and a group that cannot be signalled is
            // already gone or not ours to kill.
            if let Err(e) = self.kill() {
                tracing::warn!(group = self.id, error = %e, "could not kill an abandoned bash run");
            }
        }
    }
}

/// Output offered as progress, in whole UTF-8 characters (a character split across two
/// reads is held back until its end arrives).
struct Progress {
    sender: Option<mpsc::Sender<Value>>,
    pending: Vec<u8>,
}

impl Progress {
    fn new(sender: Option<mpsc::Sender<Value>>) -> Self {
        Self {
            sender,
            pending: Vec::new(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        if self.sender.is_none() {
            return;
        }
        self.pending.extend_from_slice(bytes);
        let complete = self.pending.len() - incomplete_tail(&self.pending);
        let chunk: Vec<u8> = self.pending.drain(..complete).collect();
        self.offer(&chunk);
    }

    fn flush(&mut self) {
        let rest = std::mem::take(&mut self.pending);
        self.offer(&rest);
    }

    fn offer(&self, bytes: &[u8]) {
        let Some(sender) = &self.sender else { return };
        if bytes.is_empty() {
            return;
        }
        let chunk = json!({ "output": String::from_utf8_lossy(bytes) });
        // Progress is ephemeral and best effort: a full or closed channel drops the chunk
        // rather than slowing the command; the final output carries everything kept.
        if let Err(e) = sender.try_send(chunk) {
            tracing::trace!(error = %e, "bash progress dropped");
        }
    }
}

/// How many bytes at the end of `bytes` start a UTF-8 character that is not complete yet.
fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=bytes.len().min(3) {
        let byte = bytes[bytes.len() - back];
        if byte & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for the lead
        }
        let needed = match byte {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if back < needed { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unfinished_character_at_the_end_is_held_back() {
        let e_acute = "é".as_bytes();
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail(&[b'a', e_acute[0]]), 1);
        assert_eq!(incomplete_tail("aé".as_bytes()), 0);
        let snake = "🐍".as_bytes();
        assert_eq!(incomplete_tail(&snake[..3]), 3);
        assert_eq!(incomplete_tail(snake), 0);
    }
}
