//! One module per command group, one file per verb.

pub mod env;
pub mod eval;
pub mod hub;
pub mod launch;
pub mod model;
pub mod quickstart;
pub mod sandbox;
pub mod train;

use crate::Exit;
use crate::args::{
    Cli, Command, EnvCommand, HubCommand, HubUserCommand, ModelCommand, SandboxCommand,
    TrainCommand,
};

/// Runs the parsed command.
pub async fn run(cli: Cli) -> Result<(), Exit> {
    match cli.command {
        Command::Env(command) => match command {
            EnvCommand::List(args) => env::list::run(args),
            EnvCommand::Serve(args) => env::serve::run(args).await,
            EnvCommand::Run(args) => env::run::run(args).await,
            EnvCommand::Validate(args) => env::validate::run(args).await,
            EnvCommand::Init(args) => env::init::run(args),
            EnvCommand::Import(args) => env::import::run(args).await,
        },
        Command::Model(command) => match command {
            ModelCommand::Pull(args) => model::pull::run(args).await,
            ModelCommand::Info(args) => model::info::run(args).await,
            ModelCommand::Generate(args) => model::generate::run(args).await,
            ModelCommand::Serve(args) => model::serve::run(args).await,
            ModelCommand::Quantize(args) => model::quantize::run(args).await,
            ModelCommand::Imatrix(args) => model::imatrix::run(args).await,
            ModelCommand::Kld(args) => model::kld::run(args).await,
        },
        Command::Eval(args) => eval::run(*args).await,
        Command::Quickstart(args) => quickstart::run(args).await,
        Command::Sandbox(command) => match command {
            SandboxCommand::Run(args) => sandbox::run::run(args).await,
            SandboxCommand::Check(args) => sandbox::check::run(args).await,
        },
        Command::Hub(command) => match command {
            HubCommand::Serve(args) => hub::serve::run(args).await,
            HubCommand::User(HubUserCommand::Create(args)) => hub::user::create(args).await,
            HubCommand::Token(args) => hub::user::token(args).await,
            HubCommand::Login(args) => hub::login::run(args).await,
            HubCommand::Push(args) => hub::push::run(args).await,
            HubCommand::Pull(args) => hub::pull::run(args).await,
            HubCommand::Fork(args) => hub::fork::run(args).await,
            HubCommand::Search(args) => hub::search::run(args).await,
            HubCommand::Info(args) => hub::info::run(args).await,
            HubCommand::Leaderboard(args) => hub::leaderboard::run(args).await,
            HubCommand::Tag(args) => hub::tag::run(args).await,
            HubCommand::Check(args) => hub::check::run(args).await,
        },
        Command::Train(command) => match command {
            TrainCommand::Grpo(args) => {
                train::run(args, agentstack_rl::config::Algorithm::Grpo).await
            }
            TrainCommand::Distill(args) => {
                train::run(args, agentstack_rl::config::Algorithm::Distill).await
            }
            TrainCommand::Sft(args) => {
                train::run(args, agentstack_rl::config::Algorithm::Sft).await
            }
            TrainCommand::Export(args) => train::export(args).await,
        },
        Command::Launch(args) => launch::start::run(args).await,
        Command::Status(args) => launch::status::run(args).await,
        Command::Logs(args) => launch::logs::run(args).await,
        Command::Cancel(args) => launch::cancel::run(args).await,
        Command::Down(args) => launch::down::run(args).await,
        Command::Supervise(args) => launch::supervise(args).await,
    }
}
