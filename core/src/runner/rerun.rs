//! Calls a crash cut off that run again, once. Recovery spares a call whose `tool.called`
//! says it may run again (its tool only reads, or is idempotent) and lists it in
//! `step.recovered`; the execution that continues the session runs it at its first
//! boundary, before the model is asked anything, so the model sees its result as if the
//! crash had not happened. A spared call cut off again is failed by the next recovery
//! (`tool.interrupted-by-crash`), never run a third time.

use keel_schema::id::CallId;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::fence::Held;
use super::tools::result_event;
use super::{Engine, Error};
use crate::store::Direct as _;
use crate::tool;

impl Engine {
    /// Runs the session's spared calls, each once, committing each result.
    pub(super) async fn run_reruns(
        &self,
        held: &Held,
        cancel: &CancellationToken,
    ) -> Result<(), Error> {
        let session = held.claim.session_id;
        let pending = self
            .store
            .read(move |c| {
                let calls = crate::recovery::rerun_pending(c, session)?;
                if calls.is_empty() {
                    return Ok((Vec::new(), None, None));
                }
                let mut found = Vec::new();
                for call in calls {
                    found.push((call, call_input(c, session, call)?));
                }
                let info = crate::event::view::session_info(c, session)?;
                let (directory, agent) = info.map(|i| (i.directory, i.agent)).unzip();
                Ok::<_, crate::store::Error>((found, directory, agent))
            })
            .await?;
        let (calls, directory, agent) = pending;
        if calls.is_empty() {
            return Ok(());
        }
        // An MCP tool's server may not be started yet in this process.
        if !self.settings.mcp.is_empty() {
            self.settings.mcp.tools().await;
        }
        let directory = directory
            .and_then(|d| std::fs::canonicalize(d).ok())
            .unwrap_or_default();
        let sandbox = self.settings.sandbox(agent.as_deref().unwrap_or("build"));
        for (call_id, (name, input)) in calls {
            if !self.owns(held) {
                return Err(Error::OwnershipLost(session));
            }
            tracing::info!(%session, call = %call_id, tool = %name, "running again a call a crash cut off");
            let result = match self.tool(&name) {
                None => Err(tool::Error::Unavailable(format!(
                    "the `{name}` tool is not available to run this call again"
                ))),
                Some(tool) => {
                    let context = tool::Context {
                        directory: directory.clone(),
                        cancel: cancel.child_token(),
                        limits: self.settings.limits,
                        progress: None,
                        call: Some((session, call_id)),
                        sandbox: sandbox.clone(),
                    };
                    tool.run(input, &context).await
                }
            };
            self.commit(held, vec![result_event(call_id, result)])
                .await?;
        }
        Ok(())
    }
}

/// A spared call's tool and input, as its `tool.called` recorded them.
fn call_input(
    connection: &mut crate::store::Conn,
    session: keel_schema::id::SessionId,
    call: CallId,
) -> Result<(String, Value), crate::store::Error> {
    use crate::store::schema::session_tool;
    use diesel::prelude::*;
    let (name, input): (String, Option<String>) = session_tool::table
        .find((session.to_string(), call.to_string()))
        .select((session_tool::name, session_tool::input))
        .get_direct(connection)?;
    let input = input
        .map(|text| serde_json::from_str(&text))
        .transpose()
        .map_err(|e| crate::store::Error::Corrupt(format!("tool call {call} input: {e}")))?
        .unwrap_or(Value::Null);
    Ok((name, input))
}
