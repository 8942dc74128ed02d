//! The runner: drains a session's inbox through the model and its tools.
//!
//! A drain promotes input at a boundary, brings the transcript up to date, and runs steps
//! until the model stops or nothing is left. Every durable write goes through the fence of
//! the execution's claim ([`crate::execution`]); after ownership is lost the runner makes
//! no provider request, starts no tool and publishes nothing, durable or ephemeral.
//!
//! The files, in the order a prompt meets them:
//! - `handle`: [`Runner`], the cloneable handle the service uses (wake, run, interrupt,
//!   reply, subscribe, lease renewal);
//! - `engine`: the coordinator's [`crate::coordinator::Work`]: a busy period's claim,
//!   cleanup and release, and the state every part shares;
//! - `drain`: the boundaries and the loop of steps;
//! - `step`: one step as a state machine: the provider's response, the calls it made;
//! - `receive`: the response read ahead on its own task, each event stamped on arrival;
//! - `outbox`: the step's output on its way out: deltas at once, commits behind them;
//! - `translate`: provider events into Keel's events, under the fragment rules;
//! - `tools`: a step's local calls: permissions, questions, starting tools, results;
//! - `retry`, `compaction`: what a step does when the provider refuses before output;
//! - `context`: the transcript as the provider's turns;
//! - `fence`: fenced commits and live publishing for a held claim;
//! - `live`: the hub that fans published events out to subscribers;
//! - `shutdown`: a planned shutdown's grace, and the continuation it leaves;
//! - `rerun`: calls a crash cut off that may run again, run once after recovery;
//! - `settings`, `error`: what a runner is built from, and how a drain fails.

mod compaction;
mod context;
mod drain;
mod engine;
mod error;
mod fence;
mod handle;
pub mod live;
mod outbox;
mod receive;
mod rerun;
mod retry;
mod settings;
mod shutdown;
mod step;
mod tools;
mod translate;

use engine::Engine;

pub use crate::permission::{Permissions, Policy, Rule};
pub use crate::request::Reply;
pub use compaction::{ModelLimits, needs_compaction};
pub use error::Error;
pub use handle::{Forwarder, Runner};
pub use live::Live;
pub use retry::RetryPolicy;
pub use settings::{Agent, Prices, Settings};
pub use shutdown::CONTINUATION as SHUTDOWN_CONTINUATION;
pub use step::StepSummary;
