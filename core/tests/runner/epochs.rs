//! Context epochs through the runner: the system prompt a request starts with is the
//! epoch's, from the log, whatever configuration the process that sends it runs with; a
//! changed prompt is a message of the transcript; a completed compaction starts the next
//! epoch from the prompt in effect, and a blocked one loses no update.

use keel_core::epoch::{self, Epoch};
use keel_core::instructions::Instructions;
use keel_core::provider::{self, Turn};
use keel_core::runner::{Agent, Runner};
use keel_schema::event::DurableEvent;
use keel_schema::id::SessionId;

use crate::compaction::{
    answer, driven_prompt, failing, request, request_compaction, user_text, with_history,
};
use crate::support::{Harness, Setup};

const NEW_PROMPT: &str = "You are Keel's review agent: read, never write.";

async fn current(h: &Harness, session: SessionId) -> Epoch {
    h.store
        .read(move |c| epoch::current(c, session))
        .await
        .unwrap()
        .expect("the session has an epoch")
}

/// The user turns of a request that carry a changed system prompt.
fn updates(request: &provider::Request) -> Vec<String> {
    request
        .turns
        .iter()
        .filter(|t| matches!(t, Turn::User { .. }))
        .map(user_text)
        .filter(|t| t.contains("The system instructions changed"))
        .collect()
}

/// A compaction requested now, carried out by `runner`'s next run.
async fn compact(h: &Harness, runner: &Runner, session: SessionId) {
    request_compaction(h, session).await;
    runner.run(session).await.unwrap();
}

fn count(log: &[keel_schema::event::Envelope], kind: &str) -> usize {
    log.iter()
        .filter(|e| e.event.type_name().ends_with(kind))
        .count()
}

#[tokio::test]
async fn one_durable_baseline_is_reused_after_the_context_producer_changes() {
    let h = Harness::new(Setup::default()).await;
    let original = Agent::default().system;
    let session = with_history(&h).await;
    assert_eq!(request(&h, 0).system, original);
    let first = current(&h, session).await;
    assert_eq!((first.epoch, first.system.as_str()), (1, original.as_str()));

    // A process with another configuration takes the session on: the request still
    // starts with the epoch's prompt, and the new one follows the prompt as a message.
    let changed = h.runner_with_system(NEW_PROMPT);
    driven_prompt(&h, session, "Review it.").await;
    answer(&h, "Reviewed.");
    changed.run(session).await.unwrap();
    let next = request(&h, 2);
    assert_eq!(
        next.system, original,
        "the baseline is the log's, not the config's"
    );
    let turns = updates(&next);
    assert_eq!(turns.len(), 1, "{:?}", next.turns);
    assert!(turns[0].contains(NEW_PROMPT));
    assert!(
        user_text(next.turns.last().unwrap()).contains(NEW_PROMPT),
        "the change comes where it happened: after everything before it"
    );

    // The next step reuses it all: nothing new is written, the same request prefix.
    driven_prompt(&h, session, "Again.").await;
    answer(&h, "Again reviewed.");
    changed.run(session).await.unwrap();
    let again = request(&h, 3);
    assert_eq!(again.system, original);
    assert_eq!(updates(&again).len(), 1);
    assert!(
        again
            .turns
            .iter()
            .take(next.turns.len())
            .eq(next.turns.iter())
    );
    let log = h.log(session).await;
    assert_eq!(count(&log, "context.system_updated"), 1);
    assert_eq!(count(&log, "context.epoch_started"), 1);
}

#[tokio::test]
async fn a_completed_compaction_rebuilds_the_baseline_from_the_prompt_in_effect() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    let changed = h.runner_with_system(NEW_PROMPT);
    driven_prompt(&h, session, "Review it.").await;
    answer(&h, "Reviewed.");
    changed.run(session).await.unwrap();

    answer(&h, "Read a.txt (alpha); reviewed it.");
    compact(&h, &changed, session).await;
    let log = h.log(session).await;
    let boundary = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::CompactionEnded(ended) => Some(ended.boundary_seq),
            _ => None,
        })
        .expect("the compaction ended");
    let epoch = current(&h, session).await;
    assert_eq!(
        (epoch.epoch, epoch.baseline_seq, epoch.system.as_str()),
        (2, boundary, NEW_PROMPT)
    );

    // The next request starts directly from the new baseline: the new prompt as the
    // system prompt, the summary, the prompt; the update was folded in.
    driven_prompt(&h, session, "And now?").await;
    answer(&h, "Done.");
    changed.run(session).await.unwrap();
    let after = request(&h, 4);
    assert_eq!(after.system, NEW_PROMPT);
    assert!(updates(&after).is_empty(), "{:?}", after.turns);
    assert_eq!(after.turns.len(), 2, "{:?}", after.turns);
    assert!(user_text(&after.turns[0]).contains("Read a.txt (alpha); reviewed it."));
    assert!(user_text(&after.turns[1]).contains("And now?"));
}

#[tokio::test]
async fn system_updates_made_while_the_rebaseline_is_blocked_are_preserved() {
    let h = Harness::new(Setup::default()).await;
    let original = Agent::default().system;
    let session = with_history(&h).await;
    let changed = h.runner_with_system(NEW_PROMPT);
    driven_prompt(&h, session, "Review it.").await;
    answer(&h, "Reviewed.");
    changed.run(session).await.unwrap();

    // The summary request fails: no new epoch, and the update stays where it was.
    failing(
        &h,
        provider::Error::Server {
            status: 502,
            message: "Bad Gateway".into(),
        },
    );
    compact(&h, &changed, session).await;
    let log = h.log(session).await;
    assert_eq!(count(&log, "compaction.failed"), 1);
    let blocked = current(&h, session).await;
    assert_eq!(
        (
            blocked.epoch,
            blocked.system.as_str(),
            blocked.effective_system.as_str()
        ),
        (1, original.as_str(), NEW_PROMPT)
    );

    // Meanwhile the prompt changes again; both updates reach the model, in order.
    let third = "You are Keel's plan agent: plan, never write.";
    let planning = h.runner_with_system(third);
    driven_prompt(&h, session, "Plan it.").await;
    answer(&h, "Planned.");
    planning.run(session).await.unwrap();
    let request_while_blocked = request(&h, 4);
    assert_eq!(request_while_blocked.system, original);
    let turns = updates(&request_while_blocked);
    assert_eq!(turns.len(), 2, "{:?}", request_while_blocked.turns);
    assert!(turns[0].contains(NEW_PROMPT) && turns[1].contains(third));

    // Once the compaction goes through, the new epoch starts from the last update.
    answer(&h, "Reviewed, then planned.");
    compact(&h, &planning, session).await;
    let epoch = current(&h, session).await;
    assert_eq!((epoch.epoch, epoch.system.as_str()), (2, third));
    driven_prompt(&h, session, "Go on.").await;
    answer(&h, "Going on.");
    planning.run(session).await.unwrap();
    let after = request(&h, 6);
    assert_eq!(after.system, third);
    assert!(updates(&after).is_empty(), "{:?}", after.turns);
}

#[tokio::test]
async fn project_instructions_join_the_epochs_prompt_and_a_changed_file_is_appended_as_an_update() {
    let h = Harness::new(Setup {
        instructions: Some(Instructions {
            global: None,
            ..Instructions::default()
        }),
        ..Setup::default()
    })
    .await;
    let agents_md = h.workspace.path().join("AGENTS.md");
    std::fs::write(&agents_md, "Run the tests before you answer.\n").unwrap();
    let session = h.session_on("driven").await;
    driven_prompt(&h, session, "Fix it.").await;
    answer(&h, "Fixed.");
    h.runner.run(session).await.unwrap();
    let agent = Agent::default().system;
    let first = format!(
        "{agent}\n\nInstructions from {}:\nRun the tests before you answer.",
        agents_md.display()
    );
    assert_eq!(request(&h, 0).system, first);
    assert_eq!(current(&h, session).await.system, first);

    // The file changes during the run: the epoch's prompt stays, and the new text
    // reaches the model once, as an update where it happened.
    std::fs::write(&agents_md, "Never touch the tests.\n").unwrap();
    driven_prompt(&h, session, "Again.").await;
    answer(&h, "Done.");
    h.runner.run(session).await.unwrap();
    let next = request(&h, 1);
    assert_eq!(next.system, first, "history is never rewritten");
    let turns = updates(&next);
    assert_eq!(turns.len(), 1, "{:?}", next.turns);
    assert!(turns[0].contains("Never touch the tests."));
    assert!(!turns[0].contains("Run the tests before you answer."));

    // Unchanged since: nothing more is written.
    driven_prompt(&h, session, "Once more.").await;
    answer(&h, "Done again.");
    h.runner.run(session).await.unwrap();
    let log = h.log(session).await;
    assert_eq!(count(&log, "context.system_updated"), 1);
    assert_eq!(count(&log, "context.epoch_started"), 1);
}
