//! Creates a session, prompts it, follows its log until the run settles, and prints the
//! answer.
//!
//! ```text
//! cargo run --release -p keel-core -- serve          # in one terminal
//! cargo run -p keel-client --example prompt -- "What is in this directory?"
//! ```
//!
//! `KEEL_URL` (default `http://127.0.0.1:4096`) and `KEEL_TOKEN` say where Keel is.

use futures::StreamExt;
use keel_client::schema::api::{CreateSession, LogItem, PromptRequest};
use keel_client::schema::event::DurableEvent;
use keel_client::schema::types::Outcome;
use keel_client::{Client, Error};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let text = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is in this directory?".to_owned());
    let url = std::env::var("KEEL_URL").unwrap_or_else(|_| "http://127.0.0.1:4096".into());
    let mut client = Client::new(url)?;
    if let Ok(token) = std::env::var("KEEL_TOKEN") {
        client = client.with_token(token);
    }

    let session = client.create_session(&CreateSession::default()).await?;
    println!("session {}", session.id);
    client
        .prompt(session.id, &PromptRequest::text(text))
        .await?;

    // The log from its start: this session's whole story, each event once, in order.
    let mut log = client.session_log(session.id, 0);
    while let Some(item) = log.next().await {
        let LogItem::Durable(envelope) = item? else {
            continue;
        };
        match envelope.event {
            DurableEvent::TextEnded(text) => println!("{}", text.text),
            DurableEvent::ToolCalled(call) => println!("[{} {}]", call.name, call.input),
            DurableEvent::ExecutionSettled(settled) => {
                println!("[{:?}]", settled.outcome);
                return match settled.outcome {
                    Outcome::Succeeded => Ok(()),
                    _ => Err("the run did not succeed".into()),
                };
            }
            _ => {}
        }
    }
    Err(Error::Stream("the log ended before the run settled".into()).into())
}
