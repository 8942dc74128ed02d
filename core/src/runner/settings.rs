//! What a runner is built from: its owner and lease, the agents, the providers, the
//! tools and their limits, the retry policy and the models' limits.

use std::collections::HashMap;
use std::sync::Arc;

use keel_schema::id::OwnerId;
use keel_schema::types::ModelRef;

use super::{ModelLimits, RetryPolicy};
use crate::event::view;
use crate::instructions::Instructions;
use crate::permission::{self, Permissions};
use crate::provider::Provider;
use crate::tool::{self, Registry};

/// An agent: a system prompt, the tools it offers the model and their permission rules,
/// optionally its own model and temperature, and a step limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Agent {
    pub system: String,
    pub max_steps: u32,
    /// What its calls may do; by default tools that only read run and others ask.
    pub permissions: Permissions,
    /// The model its sessions use unless they choose one; `None`: the default model.
    pub model: Option<ModelRef>,
    /// Which tools the model is offered, as name patterns (`github_*`); `None`: all.
    pub tools: Option<Vec<String>>,
    pub temperature: Option<f64>,
    /// How its `bash` commands are confined ([`tool::sandbox`]).
    pub sandbox: tool::sandbox::Mode,
}

impl Agent {
    /// Whether the model may call `tool` under this agent.
    pub fn offers(&self, tool: &str) -> bool {
        self.tools
            .as_ref()
            .is_none_or(|patterns| patterns.iter().any(|p| permission::matches(p, tool)))
    }
}

impl Default for Agent {
    fn default() -> Self {
        Self {
            system: "You are Keel's build agent, a careful software engineer. Use the tools to \
                     inspect and change files in the session directory."
                .into(),
            max_steps: 50,
            permissions: Permissions::default(),
            model: None,
            tools: None,
            temperature: None,
            sandbox: tool::sandbox::Mode::default(),
        }
    }
}

/// Everything a runner needs.
#[derive(Clone)]
pub struct Settings {
    pub owner: OwnerId,
    pub lease_ms: i64,
    pub agents: HashMap<String, Agent>,
    /// Providers by the name models use (`provider/model`).
    pub providers: HashMap<String, Arc<dyn Provider>>,
    pub tools: Registry,
    pub limits: tool::Limits,
    /// How failed provider requests are retried.
    pub retry: RetryPolicy,
    /// Limits of the models that have them configured, by `provider/id`: the output
    /// limit of each request and the threshold of automatic compaction. A model without
    /// limits is never compacted automatically.
    pub models: HashMap<String, ModelLimits>,
    /// The project instruction files added to every agent's system prompt.
    pub instructions: Instructions,
    /// Prices of the models that have them configured, by `provider/id`.
    pub prices: HashMap<String, Prices>,
    /// MCP tool servers, whose tools are offered beside `tools`.
    pub mcp: Arc<crate::mcp::Servers>,
    /// What sandboxed commands may not touch: Keel's database, configuration and keys.
    pub protected: Arc<tool::sandbox::Protected>,
}

/// What a model costs, in currency units per million tokens of each kind.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Prices {
    pub input: f64,
    pub output: f64,
    pub cache_read: f64,
    pub cache_write: f64,
}

impl Prices {
    /// The cost of `usage`. Input counts the tokens not read from or written to a cache
    /// (as both adapters report it); output includes reasoning.
    pub fn cost(&self, usage: &keel_schema::types::Usage) -> f64 {
        let tokens = |count: u64, price: f64| count as f64 * price;
        (tokens(usage.input, self.input)
            + tokens(usage.output, self.output)
            + tokens(usage.cache_read, self.cache_read)
            + tokens(usage.cache_write, self.cache_write))
            / 1_000_000.0
    }
}

impl Settings {
    /// The sandbox of the agent named `agent`'s commands; `None` when it has
    /// `sandbox = "off"` (an unknown agent gets the default).
    pub(super) fn sandbox(&self, agent: &str) -> Option<tool::sandbox::Sandbox> {
        let mode = self.agent(agent).unwrap_or_default().sandbox;
        tool::sandbox::Sandbox::for_mode(mode, &self.protected)
    }

    /// The agent named `name`: a configured one, or the built-in `build`.
    pub(super) fn agent(&self, name: &str) -> Option<Agent> {
        match self.agents.get(name) {
            Some(agent) => Some(agent.clone()),
            None if name == "build" => Some(Agent::default()),
            None => None,
        }
    }

    /// Whether a step of a session with `info` may start in the boundary's transaction:
    /// its agent and provider resolve (a step that cannot gets its error before
    /// `step.started`), and its model has no limits (automatic compaction, which comes
    /// before `step.started`, cannot be due).
    pub(super) fn starts_directly(&self, info: &view::SessionInfo) -> bool {
        (info.agent == "build" || self.agents.contains_key(&info.agent))
            && self.providers.contains_key(&info.model.provider)
            && !self.models.contains_key(&info.model.to_string())
    }
}
