//! Project instructions: what a project tells every agent working in it.
//!
//! For a session, Keel reads one instruction file per directory, from the repository root
//! (the nearest ancestor holding `.git`) down to the session directory, taking in each
//! directory the first name of [`Instructions::files`] that exists (`AGENTS.md`, else
//! `CLAUDE.md`), and a global file from Keel's config directory before them. Outside a
//! repository only the session directory is read. Each file is given to the model with
//! its path, after the agent's own system prompt.
//!
//! The files are read before every step, outside any transaction. What they say becomes
//! part of the context epoch's system prompt (`crate::epoch`): the first step fixes it,
//! and a file changed during a run reaches the model as a `context.system_updated`
//! message at the next step, never by rewriting what was sent before.

use std::path::{Path, PathBuf};

/// The names looked for in each directory, by default: the first that exists is read.
pub const DEFAULT_FILES: [&str; 2] = ["AGENTS.md", "CLAUDE.md"];

/// The most read of one file; the rest is left out, and the model told so.
pub const MAX_FILE_BYTES: usize = 64 * 1024;

/// Which instruction files apply to a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instructions {
    /// Candidate names in each directory, in order of preference. Empty: no project files.
    pub files: Vec<String>,
    /// The global file, read when it exists.
    pub global: Option<PathBuf>,
}

impl Default for Instructions {
    fn default() -> Self {
        Self {
            files: DEFAULT_FILES.iter().map(|&name| name.to_owned()).collect(),
            global: global_file(),
        }
    }
}

/// `AGENTS.md` in Keel's config directory: `$KEEL_CONFIG_HOME`, else
/// `$XDG_CONFIG_HOME/keel`, else `~/.config/keel`.
pub fn global_file() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let directory = var("KEEL_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CONFIG_HOME").map(|d| PathBuf::from(d).join("keel")))
        .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".config").join("keel")))?;
    Some(directory.join("AGENTS.md"))
}

impl Instructions {
    /// None at all: no project files and no global file.
    pub fn none() -> Self {
        Self {
            files: Vec::new(),
            global: None,
        }
    }

    /// Whether no file can ever apply.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.global.is_none()
    }

    /// The files that apply to `directory`, in the order the model gets them: the global
    /// file, then from the repository root down to `directory`. Only files that exist.
    pub fn files_for(&self, directory: &Path) -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = self
            .global
            .iter()
            .filter(|p| p.is_file())
            .cloned()
            .collect();
        if self.files.is_empty() {
            return found;
        }
        let ancestors: Vec<&Path> = directory.ancestors().collect();
        let root = ancestors
            .iter()
            .position(|dir| dir.join(".git").exists())
            .unwrap_or(0);
        for dir in ancestors[..=root].iter().rev() {
            if let Some(file) = self
                .files
                .iter()
                .map(|name| dir.join(name))
                .find(|path| path.is_file())
                && !found.contains(&file)
            {
                found.push(file);
            }
        }
        found
    }

    /// The text added to the system prompt for `directory`: each file with its path, or
    /// nothing. A file longer than [`MAX_FILE_BYTES`] is cut, and says so. `None` when a
    /// file that exists cannot be read (logged): the caller keeps the prompt it has rather
    /// than tell the model its instructions changed twice over a passing failure.
    pub fn read(&self, directory: &Path) -> Option<String> {
        let mut blocks = Vec::new();
        for path in self.files_for(directory) {
            let bytes = match std::fs::read(&path) {
                Ok(bytes) => bytes,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "an instruction file could not be read; the prompt stays as it was");
                    return None;
                }
            };
            let cut = bytes.len() > MAX_FILE_BYTES;
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_FILE_BYTES)]);
            let mut block = format!("Instructions from {}:\n{}", path.display(), text.trim_end());
            if cut {
                block.push_str(&format!(
                    "\n[cut: the file has {} bytes; only the first {MAX_FILE_BYTES} are shown]",
                    bytes.len()
                ));
            }
            blocks.push(block);
        }
        Some(blocks.join("\n\n"))
    }
}

/// The system prompt of a session's agent with its project instructions.
pub fn system_prompt(agent: &str, instructions: &str) -> String {
    if instructions.is_empty() {
        agent.to_owned()
    } else {
        format!("{agent}\n\n{instructions}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn files_are_read_from_the_repository_root_down_with_agents_md_before_claude_md() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("AGENTS.md");
        let repo = tmp.path().join("repo");
        let session = repo.join("crates").join("app");
        write(&outside, "never: above the repository");
        std::fs::create_dir_all(repo.join(".git")).unwrap();
        write(&repo.join("AGENTS.md"), "root rules");
        write(&repo.join("CLAUDE.md"), "shadowed by AGENTS.md");
        write(&repo.join("crates").join("CLAUDE.md"), "crates rules");
        write(&session.join("AGENTS.md"), "app rules\n\n");
        let global = tmp.path().join("config").join("AGENTS.md");
        write(&global, "global rules");
        let instructions = Instructions {
            global: Some(global.clone()),
            ..Instructions::default()
        };
        assert_eq!(
            instructions.files_for(&session),
            [
                global.clone(),
                repo.join("AGENTS.md"),
                repo.join("crates").join("CLAUDE.md"),
                session.join("AGENTS.md"),
            ]
        );
        let text = instructions.read(&session).unwrap();
        assert_eq!(
            text,
            format!(
                "Instructions from {}:\nglobal rules\n\nInstructions from {}:\nroot rules\n\n\
                 Instructions from {}:\ncrates rules\n\nInstructions from {}:\napp rules",
                global.display(),
                repo.join("AGENTS.md").display(),
                repo.join("crates").join("CLAUDE.md").display(),
                session.join("AGENTS.md").display(),
            )
        );
        assert_eq!(
            system_prompt("You are the agent.", &text),
            format!("You are the agent.\n\n{text}")
        );
    }

    #[test]
    fn outside_a_repository_only_the_session_directory_is_read() {
        let tmp = tempfile::tempdir().unwrap();
        let session = tmp.path().join("work");
        write(&tmp.path().join("AGENTS.md"), "a parent's, not read");
        write(&session.join("CLAUDE.md"), "session rules");
        let instructions = Instructions {
            global: None,
            ..Instructions::default()
        };
        assert_eq!(
            instructions.files_for(&session),
            [session.join("CLAUDE.md")]
        );
    }

    #[test]
    fn no_files_leave_the_agents_prompt_as_it_is_and_a_long_file_is_cut_saying_so() {
        let tmp = tempfile::tempdir().unwrap();
        let instructions = Instructions {
            global: None,
            ..Instructions::default()
        };
        assert_eq!(instructions.read(tmp.path()).unwrap(), "");
        assert_eq!(system_prompt("agent", ""), "agent");

        write(
            &tmp.path().join("AGENTS.md"),
            &"x".repeat(MAX_FILE_BYTES + 10),
        );
        let text = instructions.read(tmp.path()).unwrap();
        assert!(text.ends_with(&format!(
            "[cut: the file has {} bytes; only the first {MAX_FILE_BYTES} are shown]",
            MAX_FILE_BYTES + 10
        )));
        assert!(Instructions::none().read(tmp.path()).unwrap().is_empty());
    }
}
