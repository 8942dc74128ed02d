//! Configuration: `keel.toml`, read and turned into providers, model limits and agents.
//! (Flags and environment variables belong to the binary, which builds a node's options.)
//!
//! ```toml
//! default_model = "demo/scripted"
//! [provider.demo]
//! kind = "scripted"              # scripted, openai (any compatible server), anthropic
//! script = "script.json"         # optional; the built-in demo script otherwise
//! [provider.local]
//! kind = "openai"
//! base_url = "http://127.0.0.1:8080/v1"   # optional; OpenAI's endpoint otherwise
//! api_key_env = "LOCAL_KEY"      # optional; OPENAI_API_KEY otherwise, none for a base_url
//! [provider.anthropic]
//! kind = "anthropic"             # ANTHROPIC_API_KEY
//! thinking_budget = 8000         # optional: extended thinking
//! prompt_caching = false         # optional: on by default (cache breakpoints)
//! idle_timeout_ms = 300000       # optional, openai and anthropic: the longest silence
//!                                # of a stream (also connect_timeout_ms, 10 s by default,
//!                                # and first_byte_timeout_ms; both others 120 s)
//! [model."demo/scripted"]
//! context = 128000
//! output = 8192
//! [model."demo/scripted".price]  # optional: per million tokens, for step.ended.cost
//! input = 3.0
//! output = 15.0
//! cache_read = 0.3               # optional, like cache_write; the input price otherwise
//! [agent.build]
//! system = "You are …"
//! max_steps = 50
//! sandbox = "on"                 # bash: on (default), network, off (crate::tool::sandbox)
//! [agent.build.permissions]
//! bash = "ask"                   # allow (default), ask, deny
//! [mcp.github]                   # MCP tool servers (crate::mcp): command + args + env
//! url = "https://…/mcp"          # (stdio) or url + headers (streamable HTTP); see
//! headers = { Authorization = "Bearer ${GITHUB_TOKEN}" }   # docs/tools.md
//! [instructions]                 # project instructions (crate::instructions)
//! files = ["AGENTS.md", "CLAUDE.md"]   # per directory, the first that exists
//! global = "team/AGENTS.md"     # optional, relative to this file; "" for none; by
//!                                # default AGENTS.md in Keel's config directory
//! ```
//!
//! With no file, Keel serves the built-in scripted demo model as `demo/scripted`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_schema::types::ModelRef;
use serde::Deserialize;

use crate::instructions::Instructions;
use crate::mcp;
use crate::permission::{Policy, Rule};
use crate::provider::anthropic::Anthropic;
use crate::provider::openai::OpenAi;
use crate::provider::scripted::Scripted;
use crate::provider::{Provider, Timeouts};
use crate::runner::{Agent, ModelLimits, Prices};

/// What can be wrong with the configuration.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid keel.toml: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// A provider entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// `scripted`, `openai` (any OpenAI-compatible server) or `anthropic`.
    pub kind: String,
    pub base_url: Option<String>,
    pub api_key_env: Option<String>,
    /// For `scripted`: a JSON script file, relative to the config file.
    pub script: Option<PathBuf>,
    /// For `anthropic`: turns extended thinking on with this many tokens for it.
    pub thinking_budget: Option<u32>,
    /// For `anthropic`: cache breakpoints on the system prompt and the conversation
    /// (prompt caching); on unless `false`.
    pub prompt_caching: Option<bool>,
    /// For `openai` and `anthropic`: how long a request may wait to connect, for its
    /// response to start, and between pieces of the response (defaults in
    /// [`Timeouts::default`]).
    pub connect_timeout_ms: Option<u64>,
    pub first_byte_timeout_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
}

impl ProviderConfig {
    /// The request timeouts: the defaults, with what the entry sets. Zero is refused (it
    /// would fail every request).
    fn timeouts(&self, name: &str) -> Result<Timeouts, Error> {
        let defaults = Timeouts::default();
        let pick = |field: &str, value: Option<u64>, default: Duration| match value {
            None => Ok(default),
            Some(0) => Err(Error::Invalid(format!(
                "provider `{name}`: {field} must be at least 1"
            ))),
            Some(ms) => Ok(Duration::from_millis(ms)),
        };
        Ok(Timeouts {
            connect: pick(
                "connect_timeout_ms",
                self.connect_timeout_ms,
                defaults.connect,
            )?,
            first_byte: pick(
                "first_byte_timeout_ms",
                self.first_byte_timeout_ms,
                defaults.first_byte,
            )?,
            idle: pick("idle_timeout_ms", self.idle_timeout_ms, defaults.idle)?,
        })
    }

    /// Whether the entry sets a timeout (which only HTTP providers have).
    fn sets_timeouts(&self) -> bool {
        self.connect_timeout_ms.is_some()
            || self.first_byte_timeout_ms.is_some()
            || self.idle_timeout_ms.is_some()
    }

    /// The provider's key: from the variable `api_key_env` names, else from the kind's
    /// usual variable (`default_env`). A provider at its vendor's endpoint needs one; a
    /// provider with a `base_url` (a local server, say) may go without.
    fn api_key(&self, name: &str, default_env: &str) -> Result<Option<String>, Error> {
        let read = |var: &str| std::env::var(var).ok().filter(|v| !v.trim().is_empty());
        if let Some(var) = &self.api_key_env {
            return read(var).map(Some).ok_or_else(|| {
                Error::Invalid(format!(
                    "provider `{name}`: api_key_env names `{var}`, which is not set"
                ))
            });
        }
        match (read(default_env), &self.base_url) {
            (Some(key), _) => Ok(Some(key)),
            (None, Some(_)) => Ok(None),
            (None, None) => Err(Error::Invalid(format!(
                "provider `{name}` needs an API key: set {default_env}, or name another \
                 variable with api_key_env"
            ))),
        }
    }
}

/// A model's limits and prices.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The context window in tokens: with `output`, the limits automatic compaction uses.
    pub context: Option<u64>,
    /// The output limit of each request, in tokens.
    pub output: Option<u64>,
    /// What the model costs, per million tokens.
    pub price: Option<PriceConfig>,
}

/// `[model."provider/id".price]`: currency units per million tokens. Cached input costs
/// the input price unless set.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    pub input: f64,
    pub output: f64,
    pub cache_read: Option<f64>,
    pub cache_write: Option<f64>,
}

/// An agent entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub system: Option<SystemConfig>,
    pub max_steps: Option<u32>,
    /// `provider/model`: what its sessions use unless they choose a model.
    pub model: Option<String>,
    /// Which tools the model is offered, as name patterns; all when absent.
    pub tools: Option<Vec<String>>,
    /// Sampling temperature, 0 to 2.
    pub temperature: Option<f64>,
    /// By tool name (or name pattern): one word, or a table of patterns to words.
    #[serde(default)]
    pub permissions: HashMap<String, PermissionConfig>,
    /// How its `bash` runs: `on` (the default), `network` or `off` ([`crate::tool::sandbox`]).
    pub sandbox: Option<crate::tool::sandbox::Mode>,
}

/// An agent's system prompt: the text, or `{ file = "…" }` relative to the config file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SystemConfig {
    Text(String),
    File { file: PathBuf },
}

/// A tool's permission: `"ask"`, or `{ "git status" = "allow", "*" = "ask" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PermissionConfig {
    Word(String),
    Patterns(HashMap<String, String>),
}

/// `[mcp.NAME]`: an MCP tool server, reached by `command` (stdio) or `url` (streamable
/// HTTP).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: HashMap<String, String>,
    pub url: Option<String>,
    /// Header values may name environment variables: `"Bearer ${GITHUB_TOKEN}"`.
    #[serde(default)]
    pub headers: HashMap<String, String>,
    pub enabled: Option<bool>,
    /// How long starting, and each call, may take.
    pub timeout_ms: Option<u64>,
    /// Which of its tools are offered (name patterns); all by default.
    pub tools: Option<Vec<String>>,
    /// `first-use` (the default) or `serve`: started with the node.
    pub start: Option<String>,
    /// Effect classes by the server's tool name: `read` or `write`, overriding the
    /// tool's annotations.
    #[serde(default)]
    pub effects: HashMap<String, String>,
}

/// `[instructions]`: which project instruction files every agent is given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstructionsConfig {
    /// The names looked for in each directory, first found read (`AGENTS.md`, then
    /// `CLAUDE.md`); `[]` reads no project file.
    pub files: Option<Vec<String>>,
    /// The global file, relative to the config file; `""` for none. By default
    /// `AGENTS.md` in Keel's config directory.
    pub global: Option<PathBuf>,
}

/// `keel.toml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub default_model: String,
    #[serde(default)]
    pub provider: HashMap<String, ProviderConfig>,
    #[serde(default)]
    pub model: HashMap<String, ModelConfig>,
    #[serde(default)]
    pub agent: HashMap<String, AgentConfig>,
    #[serde(default)]
    pub instructions: InstructionsConfig,
    #[serde(default)]
    pub mcp: HashMap<String, McpConfig>,
    /// Where relative paths in the file are resolved from.
    #[serde(skip)]
    pub base: PathBuf,
    /// The file it was read from, if any.
    #[serde(skip)]
    pub path: Option<PathBuf>,
}

/// Where `keel serve` keeps its SQLite database when `--db` is not given:
/// `$KEEL_DATA_HOME`, else `$XDG_DATA_HOME/keel`, else `~/.local/share/keel`. Outside any
/// project, so the sandbox can keep commands away from it.
pub fn data_dir() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    var("KEEL_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| var("XDG_DATA_HOME").map(|d| PathBuf::from(d).join("keel")))
        .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".local/share/keel")))
}

/// The demo provider's name and the default model with no configuration.
pub const DEMO_MODEL: &str = "demo/scripted";

impl Default for Config {
    fn default() -> Self {
        Self {
            default_model: DEMO_MODEL.into(),
            provider: HashMap::from([(
                "demo".to_owned(),
                ProviderConfig {
                    kind: "scripted".into(),
                    base_url: None,
                    api_key_env: None,
                    script: None,
                    thinking_budget: None,
                    prompt_caching: None,
                    connect_timeout_ms: None,
                    first_byte_timeout_ms: None,
                    idle_timeout_ms: None,
                },
            )]),
            model: HashMap::new(),
            agent: HashMap::new(),
            instructions: InstructionsConfig::default(),
            mcp: HashMap::new(),
            base: PathBuf::from("."),
            path: None,
        }
    }
}

impl Config {
    /// Reads `path`, or the defaults when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Self, Error> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config = Self::parse(&text).map_err(|message| Error::Parse {
            path: path.to_owned(),
            message,
        })?;
        config.base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        config.path = Some(path.to_owned());
        Ok(config)
    }

    /// The environment variables that hold keys: the providers' (named by `api_key_env`,
    /// and the vendors' usual ones) and those MCP headers name. Sandboxed commands never
    /// see them.
    pub fn key_variables(&self) -> Vec<String> {
        let mut names = vec!["OPENAI_API_KEY".to_owned(), "ANTHROPIC_API_KEY".to_owned()];
        names.extend(self.provider.values().filter_map(|p| p.api_key_env.clone()));
        for server in self.mcp.values() {
            for value in server.headers.values() {
                let mut rest = value.as_str();
                while let Some(start) = rest.find("${") {
                    let Some(end) = rest[start..].find('}') else {
                        break;
                    };
                    names.push(rest[start + 2..start + end].to_owned());
                    rest = &rest[start + end..];
                }
            }
        }
        names.sort();
        names.dedup();
        names
    }

    /// Parses the text of a `keel.toml`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let config: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        let (provider, _) = config.default_model.split_once('/').ok_or_else(|| {
            format!(
                "default_model `{}` is not `provider/model`",
                config.default_model
            )
        })?;
        if !config.provider.contains_key(provider) {
            return Err(format!(
                "default_model `{}` names provider `{provider}`, which has no [provider.{provider}] table",
                config.default_model
            ));
        }
        for (name, model) in &config.model {
            if model.context.is_some() != model.output.is_some() {
                return Err(format!(
                    "[model.\"{name}\"] sets one of `context` and `output`: set both (the \
                     limits automatic compaction uses) or neither"
                ));
            }
            if let Some(price) = model.price {
                let all = [
                    Some(price.input),
                    Some(price.output),
                    price.cache_read,
                    price.cache_write,
                ];
                if all.into_iter().flatten().any(|p| !p.is_finite() || p < 0.0) {
                    return Err(format!(
                        "[model.\"{name}\".price]: prices are numbers of at least 0"
                    ));
                }
            }
        }
        Ok(config)
    }

    /// The providers, built.
    pub fn providers(&self) -> Result<HashMap<String, Arc<dyn Provider>>, Error> {
        let mut built: HashMap<String, Arc<dyn Provider>> = HashMap::new();
        for (name, provider) in &self.provider {
            if provider.thinking_budget.is_some() && provider.kind != "anthropic" {
                return Err(Error::Invalid(format!(
                    "provider `{name}`: thinking_budget is an anthropic setting, not {}",
                    provider.kind
                )));
            }
            if provider.prompt_caching.is_some() && provider.kind != "anthropic" {
                return Err(Error::Invalid(format!(
                    "provider `{name}`: prompt_caching is an anthropic setting, not {}",
                    provider.kind
                )));
            }
            if provider.sets_timeouts() && provider.kind == "scripted" {
                return Err(Error::Invalid(format!(
                    "provider `{name}`: timeouts are settings of openai and anthropic \
                     providers; a scripted one makes no requests"
                )));
            }
            let client = |e: reqwest::Error| {
                Error::Invalid(format!(
                    "provider `{name}`: its HTTP client cannot be built: {e}"
                ))
            };
            let adapter: Arc<dyn Provider> = match provider.kind.as_str() {
                "scripted" => match &provider.script {
                    None => Arc::new(Scripted::demo()),
                    Some(file) => {
                        let path = self.base.join(file);
                        let text =
                            std::fs::read_to_string(&path).map_err(|source| Error::Read {
                                path: path.clone(),
                                source,
                            })?;
                        Arc::new(Scripted::from_json(&text).map_err(|e| {
                            Error::Invalid(format!(
                                "the script {} is not valid: {e}",
                                path.display()
                            ))
                        })?)
                    }
                },
                "openai" => Arc::new(
                    OpenAi::new(
                        provider.base_url.clone(),
                        provider.api_key(name, "OPENAI_API_KEY")?,
                        provider.timeouts(name)?,
                    )
                    .map_err(client)?,
                ),
                "anthropic" => {
                    let adapter = Anthropic::new(
                        provider.base_url.clone(),
                        provider.api_key(name, "ANTHROPIC_API_KEY")?,
                        provider.timeouts(name)?,
                    )
                    .map_err(client)?;
                    let adapter = match provider.thinking_budget {
                        Some(budget) => adapter.with_thinking(budget),
                        None => adapter,
                    };
                    Arc::new(if provider.prompt_caching == Some(false) {
                        adapter.without_caching()
                    } else {
                        adapter
                    })
                }
                other => {
                    return Err(Error::Invalid(format!(
                        "provider `{name}` has unknown kind `{other}` (scripted, openai, anthropic)"
                    )));
                }
            };
            built.insert(name.clone(), adapter);
        }
        Ok(built)
    }

    /// The configured model limits, by `provider/id`: models with both `context` and
    /// `output` (one alone is refused by [`Config::parse`]).
    pub fn models(&self) -> HashMap<String, ModelLimits> {
        self.model
            .iter()
            .filter_map(|(name, m)| {
                let limits = ModelLimits {
                    context: m.context?,
                    output: m.output?,
                };
                Some((name.clone(), limits))
            })
            .collect()
    }

    /// The configured model prices, by `provider/id`.
    pub fn prices(&self) -> HashMap<String, Prices> {
        self.model
            .iter()
            .filter_map(|(name, m)| {
                let price = m.price?;
                let prices = Prices {
                    input: price.input,
                    output: price.output,
                    cache_read: price.cache_read.unwrap_or(price.input),
                    cache_write: price.cache_write.unwrap_or(price.input),
                };
                Some((name.clone(), prices))
            })
            .collect()
    }

    /// Which project instruction files are read.
    pub fn instructions(&self) -> Instructions {
        let defaults = Instructions::default();
        Instructions {
            files: self.instructions.files.clone().unwrap_or(defaults.files),
            global: match &self.instructions.global {
                None => defaults.global,
                Some(path) if path.as_os_str().is_empty() => None,
                Some(path) => Some(self.base.join(path)),
            },
        }
    }

    /// The enabled MCP servers, sorted by name. Tool names a server could offer that clash
    /// with a built-in tool, or two servers whose names clash once sanitised, are refused.
    pub fn mcp_servers(&self) -> Result<Vec<mcp::Spec>, Error> {
        let mut names: Vec<&String> = self.mcp.keys().collect();
        names.sort();
        let mut specs = Vec::new();
        let mut exposed: HashMap<String, &str> = HashMap::new();
        for name in names {
            let entry = &self.mcp[name];
            let invalid = |what: String| Error::Invalid(format!("mcp server `{name}`: {what}"));
            if name.is_empty() {
                return Err(invalid("the name is empty".into()));
            }
            let prefix = mcp::exposed_name(name, "");
            if let Some(other) = exposed.insert(prefix.clone(), name) {
                return Err(invalid(format!(
                    "its tools would be named like those of `{other}` (`{prefix}…`)"
                )));
            }
            if let Some(builtin) = crate::tool::builtins()
                .iter()
                .find(|t| t.name().starts_with(&prefix))
            {
                return Err(invalid(format!(
                    "its tools would be named like the built-in `{}`",
                    builtin.name()
                )));
            }
            if entry.enabled == Some(false) {
                continue;
            }
            let transport = match (&entry.command, &entry.url) {
                (Some(command), None) => {
                    if !entry.headers.is_empty() {
                        return Err(invalid("`headers` go with `url`, not `command`".into()));
                    }
                    mcp::Transport::Stdio {
                        command: command.clone(),
                        args: entry.args.clone(),
                        env: entry.env.clone(),
                    }
                }
                (None, Some(url)) => {
                    if !entry.args.is_empty() || !entry.env.is_empty() {
                        return Err(invalid(
                            "`args` and `env` go with `command`, not `url`".into(),
                        ));
                    }
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        return Err(invalid(format!("`{url}` is not an http(s) URL")));
                    }
                    let mut headers = Vec::new();
                    let mut keys: Vec<&String> = entry.headers.keys().collect();
                    keys.sort();
                    for key in keys {
                        let value = expand_env(&entry.headers[key]).map_err(|var| {
                            invalid(format!("header `{key}` names `{var}`, which is not set"))
                        })?;
                        headers.push((key.clone(), value));
                    }
                    mcp::Transport::Http {
                        url: url.clone(),
                        headers,
                    }
                }
                _ => {
                    return Err(invalid(
                        "set either `command` (stdio) or `url` (HTTP)".into(),
                    ));
                }
            };
            let eager = match entry.start.as_deref() {
                None | Some("first-use") => false,
                Some("serve") => true,
                Some(other) => {
                    return Err(invalid(format!(
                        "start `{other}` is not first-use or serve"
                    )));
                }
            };
            let mut effects = HashMap::new();
            for (tool, effect) in &entry.effects {
                let effect = match effect.as_str() {
                    "read" => mcp::Class::Read,
                    "idempotent" => mcp::Class::Idempotent,
                    "write" => mcp::Class::Write,
                    other => {
                        return Err(invalid(format!(
                            "the effect `{other}` of `{tool}` is not read, idempotent or write"
                        )));
                    }
                };
                effects.insert(tool.clone(), effect);
            }
            let timeout = match entry.timeout_ms {
                Some(0) => return Err(invalid("timeout_ms must be more than 0".into())),
                Some(ms) => Duration::from_millis(ms),
                None => mcp::DEFAULT_TIMEOUT,
            };
            specs.push(mcp::Spec {
                name: name.clone(),
                transport,
                timeout,
                tools: entry.tools.clone(),
                eager,
                effects,
            });
        }
        Ok(specs)
    }

    /// The agents, with `build` always present.
    pub fn agents(&self) -> Result<HashMap<String, Agent>, Error> {
        let mut agents = HashMap::from([("build".to_owned(), Agent::default())]);
        for (name, entry) in &self.agent {
            let invalid = |what: String| Error::Invalid(format!("agent `{name}`: {what}"));
            let mut agent = Agent::default();
            match &entry.system {
                None => {}
                Some(SystemConfig::Text(text)) => agent.system = text.clone(),
                Some(SystemConfig::File { file }) => {
                    let path = self.base.join(file);
                    agent.system = std::fs::read_to_string(&path).map_err(|e| {
                        invalid(format!(
                            "could not read its system prompt {}: {e}",
                            path.display()
                        ))
                    })?;
                }
            }
            if let Some(max_steps) = entry.max_steps {
                agent.max_steps = max_steps.max(1);
            }
            if let Some(model) = &entry.model {
                let model: ModelRef = model
                    .parse()
                    .map_err(|e| invalid(format!("model `{model}`: {e}")))?;
                if !self.provider.contains_key(&model.provider) {
                    return Err(invalid(format!(
                        "model `{model}`: no provider `{}` is configured",
                        model.provider
                    )));
                }
                agent.model = Some(model);
            }
            if let Some(tools) = &entry.tools {
                if tools.iter().any(|t| t.trim().is_empty()) {
                    return Err(invalid("an empty name in `tools`".into()));
                }
                agent.tools = Some(tools.clone());
            }
            if let Some(temperature) = entry.temperature {
                if !(0.0..=2.0).contains(&temperature) {
                    return Err(invalid(format!(
                        "temperature {temperature} is not between 0 and 2"
                    )));
                }
                agent.temperature = Some(temperature);
            }
            agent.sandbox = entry.sandbox.unwrap_or_default();
            let word = |tool: &str, pattern: Option<&str>, word: &str| {
                Policy::parse(word).ok_or_else(|| {
                    let which = pattern.map_or_else(String::new, |p| format!(" pattern `{p}`"));
                    invalid(format!(
                        "permission `{word}` for `{tool}`{which} is not allow, ask or deny"
                    ))
                })
            };
            for (tool, permission) in &entry.permissions {
                let rule = match permission {
                    PermissionConfig::Word(policy) => Rule::Policy(word(tool, None, policy)?),
                    PermissionConfig::Patterns(patterns) if patterns.is_empty() => {
                        return Err(invalid(format!("the pattern table of `{tool}` is empty")));
                    }
                    PermissionConfig::Patterns(patterns) => {
                        let mut rules = patterns
                            .iter()
                            .map(|(pattern, policy)| {
                                Ok((pattern.clone(), word(tool, Some(pattern), policy)?))
                            })
                            .collect::<Result<Vec<_>, Error>>()?;
                        // A fixed order, so equal rules always resolve alike.
                        rules.sort();
                        Rule::Patterns(rules)
                    }
                };
                agent.permissions.set(tool, rule);
            }
            agents.insert(name.clone(), agent);
        }
        Ok(agents)
    }
}

/// `text` with each `${VAR}` replaced by the variable's value; the name of the first one
/// that is not set otherwise.
fn expand_env(text: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            return Ok(out);
        };
        let var = &after[..end];
        out.push_str(&std::env::var(var).map_err(|_| var.to_owned())?);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_timeouts_are_the_defaults_with_what_the_file_sets() {
        let config = Config::parse(
            r#"
            default_model = "local/m"
            [provider.local]
            kind = "openai"
            base_url = "http://127.0.0.1:9/v1"
            idle_timeout_ms = 300000
            connect_timeout_ms = 2000
            "#,
        )
        .unwrap();
        assert_eq!(
            config.provider["local"].timeouts("local").unwrap(),
            Timeouts {
                connect: Duration::from_secs(2),
                first_byte: Timeouts::default().first_byte,
                idle: Duration::from_secs(300),
            }
        );
        assert!(config.providers().unwrap().contains_key("local"));
    }

    #[test]
    fn a_zero_timeout_or_a_timeout_on_a_scripted_provider_is_refused() {
        let zero = Config::parse(
            r#"
            default_model = "local/m"
            [provider.local]
            kind = "openai"
            base_url = "http://127.0.0.1:9/v1"
            first_byte_timeout_ms = 0
            "#,
        )
        .unwrap();
        let Err(Error::Invalid(message)) = zero.providers() else {
            panic!("a zero timeout is refused");
        };
        assert!(message.contains("first_byte_timeout_ms"), "{message}");
        let scripted = Config::parse(
            r#"
            default_model = "demo/scripted"
            [provider.demo]
            kind = "scripted"
            idle_timeout_ms = 1000
            "#,
        )
        .unwrap();
        let Err(Error::Invalid(message)) = scripted.providers() else {
            panic!("a timeout on a scripted provider is refused");
        };
        assert!(message.contains("scripted"), "{message}");
    }

    #[test]
    fn instruction_files_and_the_global_file_come_from_the_file_or_the_defaults() {
        let mut config = Config::parse(
            r#"
            default_model = "demo/scripted"
            [provider.demo]
            kind = "scripted"
            [instructions]
            files = ["KEEL.md"]
            global = "team/AGENTS.md"
            "#,
        )
        .unwrap();
        config.base = PathBuf::from("/etc/keel");
        assert_eq!(
            config.instructions(),
            Instructions {
                files: vec!["KEEL.md".into()],
                global: Some(PathBuf::from("/etc/keel/team/AGENTS.md")),
            }
        );
        let none = Config::parse(
            "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n\
             [instructions]\nfiles = []\nglobal = \"\"\n",
        )
        .unwrap();
        assert!(none.instructions().is_empty());
        assert_eq!(
            Config::load(None).unwrap().instructions(),
            Instructions::default()
        );
        let unknown = Config::parse(
            "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n\
             [instructions]\nfile = \"AGENTS.md\"\n",
        )
        .unwrap_err();
        assert!(unknown.contains("file"), "{unknown}");
    }

    #[test]
    fn prices_come_per_model_with_cached_input_at_the_input_price_unless_set() {
        let config = Config::parse(
            r#"
            default_model = "demo/scripted"
            [provider.demo]
            kind = "scripted"
            [model."demo/scripted".price]
            input = 3.0
            output = 15.0
            cache_read = 0.3
            [model."demo/other".price]
            input = 1.0
            output = 2.0
            "#,
        )
        .unwrap();
        let prices = config.prices();
        assert_eq!(
            prices["demo/scripted"],
            Prices {
                input: 3.0,
                output: 15.0,
                cache_read: 0.3,
                cache_write: 3.0,
            }
        );
        assert_eq!(prices["demo/other"].cache_read, 1.0);
        // Prices alone set no limits: no automatic compaction for these models.
        assert!(config.models().is_empty());
        let usage = keel_schema::types::Usage {
            input: 1_000_000,
            output: 2_000_000,
            reasoning: 500_000,
            cache_read: 1_000_000,
            cache_write: 0,
        };
        // Reasoning is part of output, so it is not paid twice.
        let cost = prices["demo/scripted"].cost(&usage);
        assert!((cost - (3.0 + 30.0 + 0.3)).abs() < 1e-9, "{cost}");
    }

    #[test]
    fn half_a_limit_or_a_negative_price_is_refused() {
        let base = "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n";
        let half = Config::parse(&format!(
            "{base}[model.\"demo/scripted\"]\ncontext = 1000\n"
        ))
        .unwrap_err();
        assert!(half.contains("set both"), "{half}");
        let negative = Config::parse(&format!(
            "{base}[model.\"demo/scripted\".price]\ninput = -1.0\noutput = 1.0\n"
        ))
        .unwrap_err();
        assert!(negative.contains("at least 0"), "{negative}");
    }

    #[test]
    fn no_file_means_the_demo_model() {
        let config = Config::load(None).unwrap();
        assert_eq!(config.default_model, DEMO_MODEL);
        assert!(config.providers().unwrap().contains_key("demo"));
    }

    #[test]
    fn a_full_file_parses_with_agents_and_permissions() {
        let config = Config::parse(
            r#"
            default_model = "demo/scripted"
            [provider.demo]
            kind = "scripted"
            [model."demo/scripted"]
            context = 1000
            output = 100
            [agent.build]
            max_steps = 3
            [agent.build.permissions]
            bash = "ask"
            [agent.review]
            model = "demo/scripted"
            tools = ["read", "grep", "github_*"]
            temperature = 0.2
            system = "Review only."
            [agent.review.permissions]
            "github_*" = "allow"
            [agent.review.permissions.bash]
            "git status" = "allow"
            "git push *" = "ask"
            "*" = "deny"
            "#,
        )
        .unwrap();
        let agents = config.agents().unwrap();
        let decide = |agent: &str, tool: &str, value: &str| {
            agents[agent]
                .permissions
                .decide(tool, keel_schema::types::Effect::Write, value)
                .policy
        };
        assert_eq!(agents["build"].max_steps, 3);
        assert_eq!(decide("build", "bash", "ls"), Policy::Ask);
        let review = &agents["review"];
        assert_eq!(review.model.as_ref().unwrap().to_string(), "demo/scripted");
        assert_eq!(review.temperature, Some(0.2));
        assert_eq!(review.system, "Review only.");
        assert!(review.offers("github_list_issues") && review.offers("read"));
        assert!(!review.offers("bash") && !review.offers("write"));
        assert_eq!(decide("review", "bash", "git status"), Policy::Allow);
        assert_eq!(decide("review", "bash", "git push origin"), Policy::Ask);
        assert_eq!(decide("review", "bash", "rm -rf /"), Policy::Deny);
        assert_eq!(decide("review", "github_close", ""), Policy::Allow);
    }

    #[test]
    fn an_agents_system_prompt_can_come_from_a_file_beside_the_config() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("review.md"), "Review carefully.\n").unwrap();
        let path = dir.path().join("keel.toml");
        std::fs::write(
            &path,
            "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n\
             [agent.review]\nsystem = { file = \"review.md\" }\n\
             [agent.missing]\nsystem = { file = \"nope.md\" }\n",
        )
        .unwrap();
        let config = Config::load(Some(&path)).unwrap();
        let error = config.agents().unwrap_err().to_string();
        assert!(
            error.contains("agent `missing`") && error.contains("nope.md"),
            "{error}"
        );
        let mut config = config;
        config.agent.remove("missing");
        assert_eq!(
            config.agents().unwrap()["review"].system,
            "Review carefully.\n"
        );
    }

    #[test]
    fn a_bad_agent_model_temperature_or_permission_word_is_named() {
        let base = "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n";
        let error = |agent: &str| {
            Config::parse(&format!("{base}[agent.a]\n{agent}"))
                .unwrap()
                .agents()
                .unwrap_err()
                .to_string()
        };
        assert!(error("model = \"other/m\"\n").contains("no provider `other`"));
        assert!(error("temperature = 3.0\n").contains("not between 0 and 2"));
        let word = error("[agent.a.permissions.bash]\n\"git *\" = \"yes\"\n");
        assert!(word.contains("`yes` for `bash` pattern `git *`"), "{word}");
        assert!(error("[agent.a.permissions]\nbash = {}\n").contains("empty"));
        let sandbox =
            Config::parse(&format!("{base}[agent.a]\nsandbox = \"maybe\"\n")).unwrap_err();
        assert!(sandbox.contains("unknown variant `maybe`"), "{sandbox}");
    }

    #[test]
    fn an_agents_sandbox_is_on_unless_it_says_otherwise() {
        let config = Config::parse(
            "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n\
             [agent.a]\nsandbox = \"off\"\n[agent.b]\nsandbox = \"network\"\n[agent.c]\n",
        )
        .unwrap();
        let agents = config.agents().unwrap();
        use crate::tool::sandbox::Mode;
        assert_eq!(agents["a"].sandbox, Mode::Off);
        assert_eq!(agents["b"].sandbox, Mode::Network);
        assert_eq!(agents["c"].sandbox, Mode::On);
        assert_eq!(agents["build"].sandbox, Mode::On);
    }

    #[test]
    fn the_variables_holding_keys_are_named() {
        let config = Config::parse(
            "default_model = \"o/m\"\n[provider.o]\nkind = \"openai\"\n\
             api_key_env = \"LOCAL_KEY\"\n[mcp.gh]\nurl = \"http://127.0.0.1:9/mcp\"\n\
             headers = { Authorization = \"Bearer ${GITHUB_TOKEN}\", X = \"${A}-${B}\" }\n",
        )
        .unwrap();
        assert_eq!(
            config.key_variables(),
            [
                "A",
                "ANTHROPIC_API_KEY",
                "B",
                "GITHUB_TOKEN",
                "LOCAL_KEY",
                "OPENAI_API_KEY"
            ]
        );
    }

    #[test]
    fn mistakes_are_named() {
        let unknown = Config::parse("default_model = \"x/y\"\nfoo = 1").unwrap_err();
        assert!(unknown.contains("unknown field `foo`"), "{unknown}");
        let missing = Config::parse("default_model = \"x/y\"").unwrap_err();
        assert!(missing.contains("[provider.x]"), "{missing}");
        let config = Config::parse(
            "default_model = \"o/m\"\n[provider.o]\nkind = \"openai\"\n\
             api_key_env = \"KEEL_TEST_VARIABLE_THAT_IS_NOT_SET\"",
        )
        .unwrap();
        let err = config.providers().err().unwrap().to_string();
        assert!(err.contains("KEEL_TEST_VARIABLE_THAT_IS_NOT_SET"), "{err}");
    }

    #[test]
    fn thinking_is_an_anthropic_setting() {
        let config = Config::parse(
            "default_model = \"a/claude\"\n[provider.a]\nkind = \"anthropic\"\n\
             base_url = \"http://127.0.0.1:9/\"\nthinking_budget = 4000",
        )
        .unwrap();
        assert!(config.providers().unwrap().contains_key("a"));
        let misplaced = Config::parse(
            "default_model = \"o/m\"\n[provider.o]\nkind = \"openai\"\n\
             base_url = \"http://127.0.0.1:9/v1\"\nthinking_budget = 4000",
        )
        .unwrap();
        let err = misplaced.providers().err().unwrap().to_string();
        assert!(err.contains("thinking_budget"), "{err}");
        let caching = Config::parse(
            "default_model = \"local/m\"\n[provider.local]\nkind = \"openai\"\n\
             base_url = \"http://127.0.0.1:9/v1\"\nprompt_caching = false",
        )
        .unwrap()
        .providers()
        .err()
        .unwrap()
        .to_string();
        assert!(
            caching.contains("prompt_caching is an anthropic setting"),
            "{caching}"
        );
    }

    #[test]
    fn a_compatible_server_needs_no_key() {
        let config = Config::parse(
            "default_model = \"local/llama\"\n[provider.local]\nkind = \"openai\"\n\
             base_url = \"http://127.0.0.1:8080/v1\"",
        )
        .unwrap();
        assert!(config.providers().unwrap().contains_key("local"));
    }

    #[test]
    fn mcp_servers_are_read_with_their_transport_headers_and_effects() {
        let home = std::env::var("HOME").unwrap_or_default();
        let config = Config::parse(
            r#"
            default_model = "demo/scripted"
            [provider.demo]
            kind = "scripted"
            [mcp.files]
            command = "files-server"
            args = ["--root", "/srv"]
            env = { LEVEL = "warn" }
            start = "serve"
            [mcp.web]
            url = "http://127.0.0.1:9/mcp"
            headers = { X-Home = "at ${HOME}" }
            tools = ["get_*"]
            timeout_ms = 500
            effects = { get_page = "read" }
            [mcp.off]
            command = "x"
            enabled = false
            "#,
        )
        .unwrap();
        let specs = config.mcp_servers().unwrap();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["files", "web"]);
        assert!(specs[0].eager);
        assert!(matches!(&specs[0].transport,
            mcp::Transport::Stdio { command, args, .. } if command == "files-server" && args.len() == 2));
        assert_eq!(
            specs[1].transport,
            mcp::Transport::Http {
                url: "http://127.0.0.1:9/mcp".into(),
                headers: vec![("X-Home".into(), format!("at {home}"))],
            }
        );
        assert_eq!(specs[1].timeout, Duration::from_millis(500));
        assert_eq!(specs[1].effects["get_page"], mcp::Class::Read);
        assert!(!specs[1].eager);
    }

    #[test]
    fn a_bad_mcp_server_is_named_with_what_is_wrong() {
        let base = "default_model = \"demo/scripted\"\n[provider.demo]\nkind = \"scripted\"\n";
        let error = |server: &str| {
            Config::parse(&format!("{base}{server}"))
                .unwrap()
                .mcp_servers()
                .unwrap_err()
                .to_string()
        };
        assert!(error("[mcp.a]\nargs = []\n").contains("either `command`"));
        assert!(error("[mcp.a]\ncommand = \"x\"\nurl = \"http://h\"\n").contains("either"));
        assert!(error("[mcp.a]\nurl = \"ftp://h\"\n").contains("not an http(s) URL"));
        assert!(
            error("[mcp.a]\nurl = \"http://h\"\nheaders = { T = \"${KEEL_UNSET_FOR_TEST}\" }\n")
                .contains("`KEEL_UNSET_FOR_TEST`, which is not set")
        );
        assert!(
            error("[mcp.a]\ncommand = \"x\"\nstart = \"now\"\n").contains("first-use or serve")
        );
        assert!(
            error("[mcp.a]\ncommand = \"x\"\neffects = { t = \"maybe\" }\n")
                .contains("read, idempotent or write")
        );
        assert!(
            error("[mcp.\"a.b\"]\ncommand = \"x\"\n[mcp.a_b]\ncommand = \"y\"\n")
                .contains("named like those of")
        );
    }
}
