//! The `keel` binary: `keel serve` runs a node (see `serve`); `keel prompt|sessions|tail|
//! interrupt` talk to a running one through keel-client (see `remote`); `keel events`
//! prints the catalog. Built with the `cli` feature (on by default); the library needs
//! none of this.

mod remote;
mod screen;
mod serve;

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
    Serve(serve::Serve),
    /// Prompt a session and stream the answer until the session is idle.
    Prompt(remote::Prompt),
    /// List the newest sessions.
    Sessions(remote::Sessions),
    /// Print a session's durable log, then follow it.
    Tail(remote::Tail),
    /// Interrupt a session's running execution.
    Interrupt(remote::Interrupt),
    /// Print the event catalog: every event type, version and durability.
    Events,
}

fn main() -> ExitCode {
    let command = Cli::parse().command;
    if let Command::Events = command {
        for entry in keel_schema::event::catalog() {
            let latest = if entry.latest { "" } else { " (read only)" };
            println!(
                "{:<48} v{} {:?}{latest}",
                entry.type_name, entry.version, entry.durability
            );
        }
        return ExitCode::SUCCESS;
    }
    let telemetry = match &command {
        Command::Serve(args) => match serve::init_logging(args) {
            Ok(telemetry) => Some(telemetry),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
        _ => None,
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let done = runtime.block_on(async move {
        match command {
            Command::Serve(args) => serve::serve(args).await,
            Command::Prompt(args) => remote::prompt(args).await,
            Command::Sessions(args) => remote::sessions(args).await,
            Command::Tail(args) => remote::tail(args).await,
            Command::Interrupt(args) => remote::interrupt(args).await,
            Command::Events => Ok(()),
        }
    });
    // The runtime goes first: the export sends what its tasks left behind.
    drop(runtime);
    if let Some(telemetry) = telemetry {
        telemetry.finish();
    }
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
