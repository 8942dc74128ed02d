//! The `keel` binary.
//!
//! Only the command-line surface exists so far; the engine behind it (store, execution,
//! server) is being built issue by issue. Commands that are not built yet say so and fail.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "keel",
    version,
    about = "A durable session engine for AI coding agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service.
    Serve,
    /// Print the event catalog: every event type, version and durability.
    Events,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Serve => {
            eprintln!(
                "keel serve is not built yet: this build has the event catalog and contracts \
                 only (see the README's status list)"
            );
            ExitCode::from(2)
        }
        Command::Events => {
            for entry in keel_schema::event::catalog() {
                let latest = if entry.latest { "" } else { " (read only)" };
                println!(
                    "{:<48} v{} {:?}{latest}",
                    entry.type_name, entry.version, entry.durability
                );
            }
            ExitCode::SUCCESS
        }
    }
}
