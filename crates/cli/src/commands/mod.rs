//! One module per command group, one file per verb.

pub mod env;

use crate::Exit;
use crate::args::{Cli, Command, EnvCommand};

/// Runs the parsed command.
pub async fn run(cli: Cli) -> Result<(), Exit> {
    match cli.command {
        Command::Env(command) => match command {
            EnvCommand::List(args) => env::list::run(args),
            EnvCommand::Serve(args) => env::serve::run(args).await,
            EnvCommand::Run(args) => env::run::run(args).await,
            EnvCommand::Validate(args) => env::validate::run(args).await,
            EnvCommand::Init(args) => env::init::run(args),
        },
    }
}
