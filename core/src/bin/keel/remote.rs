//! The `keel` commands that talk to a running server through keel-client: `prompt`,
//! `sessions`, `tail`, `interrupt`.

use std::io::{IsTerminal, Write};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use keel_client::schema::api::{
    CreateSession, ListSessionsQuery, LogItem, PermissionReply, PromptRequest, QuestionReply,
    Session,
};
use keel_client::schema::event::DurableEvent;
use keel_client::schema::id::{InputId, SessionId};
use keel_client::schema::types::{Decision, Delivery, Outcome, Part};
use keel_client::{Client, LogOptions};

use crate::screen::Screen;

/// Where the server is; shared by every client command.
#[derive(clap::Args)]
pub struct Remote {
    /// The Keel server.
    #[arg(long, env = "KEEL_URL", default_value = "http://127.0.0.1:4096")]
    url: String,
    /// The server's bearer token.
    #[arg(long, env = "KEEL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A PEM CA certificate to trust for an https server, besides the system's roots
    /// (for a private CA or a self-signed certificate).
    #[arg(long, env = "KEEL_CA_CERT")]
    ca_cert: Option<std::path::PathBuf>,
}

impl Remote {
    fn client(&self) -> Result<Client> {
        let mut client = Client::new(&self.url)?;
        if let Some(path) = &self.ca_cert {
            let pem = std::fs::read(path).map_err(|e| {
                anyhow::anyhow!("cannot read the CA certificate {}: {e}", path.display())
            })?;
            client = client.with_ca_certificate(&pem)?;
        }
        Ok(match &self.token {
            Some(token) => client.with_token(token),
            None => client,
        })
    }
}

#[derive(clap::Args)]
pub struct Prompt {
    #[command(flatten)]
    remote: Remote,
    /// The session to prompt, then the prompt; with `--new`, only the prompt.
    #[arg(value_name = "SESSION|--new> <TEXT", num_args = 1..=2, required = true)]
    words: Vec<String>,
    /// Create a session (in the current directory) and prompt it.
    #[arg(long)]
    new: bool,
    /// Join the running step at its next boundary instead of waiting for the session to
    /// be idle.
    #[arg(long)]
    steer: bool,
}

#[derive(clap::Args)]
pub struct Sessions {
    #[command(flatten)]
    remote: Remote,
    /// How many sessions to list, newest first.
    #[arg(long, default_value_t = 20)]
    limit: u32,
}

#[derive(clap::Args)]
pub struct Tail {
    #[command(flatten)]
    remote: Remote,
    session: SessionId,
    /// Start after this seq (0: the whole log).
    #[arg(long, default_value_t = 0)]
    after: u64,
    /// Stop at the end of the history instead of following live events.
    #[arg(long)]
    no_follow: bool,
    /// Print each event as its JSON envelope, one per line.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct Interrupt {
    #[command(flatten)]
    remote: Remote,
    session: SessionId,
}

/// `keel prompt`: admits the prompt and streams the answer and tool activity until the
/// execution that took it in settles. Fails when that execution did not succeed.
pub async fn prompt(args: Prompt) -> Result<()> {
    let client = args.remote.client()?;
    let (session, text) = match (args.new, args.words.as_slice()) {
        (true, [text]) => (None, text.clone()),
        (false, [session, text]) => (Some(session.parse::<SessionId>()?), text.clone()),
        (true, _) => bail!("with --new, give only the prompt: keel prompt --new \"text\""),
        (false, _) => bail!("give a session and the prompt: keel prompt SESSION \"text\""),
    };
    let session = match session {
        Some(id) => client.get_session(id).await?,
        None => {
            let directory = std::env::current_dir()
                .context("reading the current directory")?
                .display()
                .to_string();
            let session = client
                .create_session(&CreateSession {
                    directory: Some(directory),
                    ..CreateSession::default()
                })
                .await?;
            eprintln!("session {}", session.id);
            session
        }
    };
    let input_id = InputId::new();
    let request = PromptRequest {
        id: Some(input_id.to_string()),
        parts: vec![Part::Text { text }],
        delivery: args.steer.then_some(Delivery::Steer),
        request_execution: None,
    };
    client.prompt(session.id, &request).await?;
    let options = LogOptions {
        after: session.last_seq,
        ephemeral: true,
        ..LogOptions::default()
    };
    let mut log = client.session_log_with(session.id, options);
    let mut screen = Screen::default();
    let mut promoted = false;
    let interactive = std::io::stdin().is_terminal();
    while let Some(item) = log.next().await {
        let envelope = match item? {
            LogItem::Ephemeral(event) => {
                screen.ephemeral(&event.event);
                continue;
            }
            LogItem::Synced(_) => continue,
            LogItem::Durable(envelope) => envelope,
        };
        screen.durable(&envelope);
        match &envelope.event {
            DurableEvent::Prompted(p) if p.input_id == input_id => promoted = true,
            DurableEvent::PromptCancelled(p) if p.input_id == input_id => {
                bail!("the prompt was cancelled before it ran");
            }
            DurableEvent::PermissionRequested(request) if interactive => {
                let decision = ask_permission()?;
                client
                    .reply_permission(
                        session.id,
                        request.request_id,
                        &PermissionReply { decision },
                    )
                    .await?;
            }
            DurableEvent::QuestionAsked(question) if interactive => {
                let reply = match read_line("answer (empty to dismiss): ")? {
                    answer if answer.is_empty() => QuestionReply::Dismiss { dismiss: true },
                    answer => QuestionReply::Answer { answer },
                };
                client
                    .reply_question(session.id, question.request_id, &reply)
                    .await?;
            }
            DurableEvent::ExecutionSettled(settled) if promoted => {
                return match settled.outcome {
                    Outcome::Succeeded => Ok(()),
                    outcome => bail!("the execution ended {outcome:?}"),
                };
            }
            _ => {}
        }
    }
    bail!("the log stream ended before the session went idle")
}

/// `keel sessions`: the newest sessions, one per line.
pub async fn sessions(args: Sessions) -> Result<()> {
    let client = args.remote.client()?;
    let page = client
        .list_sessions(&ListSessionsQuery {
            cursor: None,
            limit: Some(args.limit),
        })
        .await?;
    if page.items.is_empty() {
        println!("no sessions");
    }
    for Session {
        id,
        title,
        model,
        usage,
        cost,
        ..
    } in page.items
    {
        let title = title.unwrap_or_else(|| "(untitled)".into());
        let tokens = usage.input + usage.cache_read + usage.cache_write + usage.output;
        println!("{id}  {model}  {tokens} tokens  {cost:.4}  {title}");
    }
    Ok(())
}

/// `keel tail`: the session's durable log, one event per line, following live events.
pub async fn tail(args: Tail) -> Result<()> {
    let client = args.remote.client()?;
    let options = LogOptions {
        after: args.after,
        follow: !args.no_follow,
        ..LogOptions::default()
    };
    let mut log = client.session_log_with(args.session, options);
    let mut stdout = std::io::stdout().lock();
    while let Some(item) = log.next().await {
        match item? {
            LogItem::Durable(envelope) if args.json => {
                writeln!(stdout, "{}", serde_json::to_string(&envelope)?)?;
            }
            LogItem::Durable(envelope) => {
                let data = envelope.event.data()?;
                writeln!(
                    stdout,
                    "{:>6}  {}  {data}",
                    envelope.seq,
                    envelope.event.type_name()
                )?;
            }
            LogItem::Synced(marker) if !args.json => {
                writeln!(stdout, "  --    synced at seq {}", marker.last_seq)?;
            }
            LogItem::Synced(_) | LogItem::Ephemeral(_) => {}
        }
        stdout.flush()?;
    }
    Ok(())
}

/// `keel interrupt`.
pub async fn interrupt(args: Interrupt) -> Result<()> {
    let client = args.remote.client()?;
    if client.interrupt(args.session).await?.interrupted {
        println!("interrupted {}", args.session);
    } else {
        println!("{} was not running", args.session);
    }
    Ok(())
}

fn read_line(prompt: &str) -> Result<String> {
    eprint!("{prompt}");
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("reading the terminal")?;
    Ok(line.trim().to_owned())
}

fn ask_permission() -> Result<Decision> {
    loop {
        match read_line("allow [o]nce, [a]lways, or [r]eject? ")?.as_str() {
            "o" | "once" => return Ok(Decision::Once),
            "a" | "always" => return Ok(Decision::Always),
            "r" | "reject" => return Ok(Decision::Reject),
            _ => {}
        }
    }
}
