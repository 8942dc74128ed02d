//! Permission rules: whether an agent's call runs, asks a person first, or is refused.
//!
//! Rules are kept per tool name, and a name may be a pattern (`github_*` covers every tool
//! of the `github` MCP server). A tool's rule is one policy for all its calls, or a list
//! of patterns matched against what the call would touch: the command for `bash`, the
//! path for file tools ([`crate::tool::Tool::permission_pattern`]). Of the patterns that
//! match, the most specific wins: the one with the most literal characters, and of equals
//! the strictest policy. A call no rule decides is allowed when its tool only reads and
//! asked about otherwise, so a service configured with nothing never runs a command or
//! changes a file without a person's yes.
//!
//! Patterns: `*` is any run of characters (`/` and spaces included), `?` one character,
//! `\` makes the next character literal. A pattern matches the whole text.

use keel_schema::types::Effect;

/// What happens to a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Policy {
    Allow,
    /// Publish `permission.requested` and wait for a reply.
    Ask,
    Deny,
}

impl Policy {
    /// `allow`, `ask` or `deny`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "allow" => Some(Self::Allow),
            "ask" => Some(Self::Ask),
            "deny" => Some(Self::Deny),
            _ => None,
        }
    }
}

/// A tool's rule: one policy, or policies by what the call touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    Policy(Policy),
    /// `(pattern, policy)`; calls no pattern matches get the default of their tool.
    Patterns(Vec<(String, Policy)>),
}

/// What [`Permissions::decide`] found for a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub policy: Policy,
    /// The pattern of the rule that decided, when a pattern rule other than the
    /// catch-all `*` did: what an `always` answer to the ask then allows. `None`: an
    /// `always` allows this exact call's pattern again, nothing wider.
    pub rule: Option<String>,
}

/// An agent's permission rules, by tool name or tool name pattern.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Permissions {
    rules: Vec<(String, Rule)>,
}

impl Permissions {
    /// Every call of every tool allowed: for tests and trusted set-ups, never a default.
    pub fn allow_all() -> Self {
        Self::default().with("*", Rule::Policy(Policy::Allow))
    }

    /// These rules with `rule` for the tools `tool` names (replacing an earlier one).
    pub fn with(mut self, tool: &str, rule: Rule) -> Self {
        self.set(tool, rule);
        self
    }

    pub fn set(&mut self, tool: &str, rule: Rule) {
        self.rules.retain(|(name, _)| name != tool);
        self.rules.push((tool.to_owned(), rule));
    }

    /// The rule for calls of `tool` whose permission pattern is `value`; `effect` is the
    /// tool's, for the default.
    pub fn decide(&self, tool: &str, effect: Effect, value: &str) -> Verdict {
        let default = Verdict {
            policy: match effect {
                Effect::Read => Policy::Allow,
                Effect::Write => Policy::Ask,
            },
            rule: None,
        };
        let Some(rule) = most_specific(
            self.rules
                .iter()
                .filter(|(name, _)| matches(name, tool))
                .map(|(name, rule)| (name.as_str(), rule, rule_strictness(rule))),
        ) else {
            return default;
        };
        match rule {
            Rule::Policy(policy) => Verdict {
                policy: *policy,
                rule: None,
            },
            Rule::Patterns(patterns) => most_specific(
                patterns
                    .iter()
                    .filter(|(pattern, _)| matches(pattern, value))
                    .map(|(pattern, policy)| (pattern.as_str(), (pattern, policy), *policy)),
            )
            .map_or(default, |(pattern, policy)| Verdict {
                policy: *policy,
                rule: (pattern != "*").then(|| pattern.clone()),
            }),
        }
    }
}

/// How strict a tool's rule is, to break a tie between two tool patterns.
fn rule_strictness(rule: &Rule) -> Policy {
    match rule {
        Rule::Policy(policy) => *policy,
        Rule::Patterns(patterns) => patterns
            .iter()
            .map(|(_, p)| *p)
            .max()
            .unwrap_or(Policy::Allow),
    }
}

/// Of `(pattern, item, policy)`, the item of the pattern with the most literal
/// characters, the strictest policy breaking ties.
fn most_specific<'a, T>(candidates: impl Iterator<Item = (&'a str, T, Policy)>) -> Option<T> {
    candidates
        .max_by_key(|(pattern, _, policy)| (literal_chars(pattern), *policy))
        .map(|(_, item, _)| item)
}

fn literal_chars(pattern: &str) -> usize {
    let mut count = 0;
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        match c {
            '*' | '?' => {}
            '\\' => {
                chars.next();
                count += 1;
            }
            _ => count += 1,
        }
    }
    count
}

/// Whether `pattern` matches the whole of `text` (see the module's documentation).
pub fn matches(pattern: &str, text: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let text: Vec<char> = text.chars().collect();
    // Iterative wildcard matching with one backtrack point: linear in practice, never
    // exponential.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, t));
                p += 1;
                continue;
            }
            Some('?') => {
                p += 1;
                t += 1;
                continue;
            }
            Some('\\') if pattern.get(p + 1) == Some(&text[t]) => {
                p += 2;
                t += 1;
                continue;
            }
            Some(&c) if c != '\\' && c == text[t] => {
                p += 1;
                t += 1;
                continue;
            }
            _ => {}
        }
        match star {
            Some((star_p, star_t)) => {
                p = star_p + 1;
                t = star_t + 1;
                star = Some((star_p, star_t + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// `text` as a pattern that matches only itself.
pub fn literal(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bash(rules: &[(&str, Policy)]) -> Permissions {
        Permissions::default().with(
            "bash",
            Rule::Patterns(rules.iter().map(|(p, x)| ((*p).to_owned(), *x)).collect()),
        )
    }

    #[test]
    fn patterns_match_the_whole_text_with_stars_questions_and_escapes() {
        assert!(matches("git status", "git status"));
        assert!(!matches("git status", "git status --short"));
        assert!(matches("git push *", "git push origin main"));
        assert!(!matches("git push *", "git pull"));
        assert!(matches("*", ""));
        assert!(matches("src/*.rs", "src/a/b.rs"));
        assert!(matches("a?c", "abc"));
        assert!(!matches("a?c", "ac"));
        assert!(matches("*a*b*c*", "xxaxxbxxcxx"));
        assert!(!matches("*a*b*c", "xxaxxbxxcxx"));
        assert!(matches(&literal("ls *"), "ls *"));
        assert!(!matches(&literal("ls *"), "ls *; rm -rf ~"));
        assert!(matches(r"a\\b", r"a\b"));
    }

    #[test]
    fn the_most_specific_bash_pattern_wins() {
        let rules = bash(&[
            ("git status", Policy::Allow),
            ("git push *", Policy::Ask),
            ("git *", Policy::Allow),
            ("*", Policy::Deny),
        ]);
        let decide = |command: &str| rules.decide("bash", Effect::Write, command);
        assert_eq!(decide("git status").policy, Policy::Allow);
        assert_eq!(decide("git log").policy, Policy::Allow);
        assert_eq!(
            decide("git push origin main"),
            Verdict {
                policy: Policy::Ask,
                rule: Some("git push *".into())
            }
        );
        assert_eq!(decide("rm -rf /").policy, Policy::Deny);
    }

    #[test]
    fn of_equally_specific_patterns_the_strictest_wins() {
        let rules = bash(&[("cargo *", Policy::Allow), ("*o test", Policy::Deny)]);
        // Both have six literal characters.
        assert_eq!(
            rules.decide("bash", Effect::Write, "cargo test").policy,
            Policy::Deny
        );
    }

    #[test]
    fn with_no_rule_tools_that_only_read_run_and_the_others_ask() {
        let none = Permissions::default();
        assert_eq!(none.decide("read", Effect::Read, "a").policy, Policy::Allow);
        assert_eq!(none.decide("bash", Effect::Write, "ls").policy, Policy::Ask);
        // A pattern table that matches nothing leaves the default too.
        let rules = bash(&[("git *", Policy::Allow)]);
        assert_eq!(
            rules.decide("bash", Effect::Write, "ls").policy,
            Policy::Ask
        );
    }

    #[test]
    fn a_tool_name_pattern_covers_a_servers_tools_and_an_exact_name_beats_it() {
        let rules = Permissions::default()
            .with("github_*", Rule::Policy(Policy::Allow))
            .with("github_delete_repo", Rule::Policy(Policy::Deny));
        let decide = |tool: &str| rules.decide(tool, Effect::Write, "").policy;
        assert_eq!(decide("github_list_issues"), Policy::Allow);
        assert_eq!(decide("github_delete_repo"), Policy::Deny);
        assert_eq!(decide("gitlab_x"), Policy::Ask);
    }

    #[test]
    fn the_catch_all_pattern_is_not_remembered_as_a_rule() {
        let rules = bash(&[("*", Policy::Ask)]);
        assert_eq!(
            rules.decide("bash", Effect::Write, "ls"),
            Verdict {
                policy: Policy::Ask,
                rule: None
            }
        );
    }
}
