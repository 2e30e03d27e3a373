//! The `agentstack` binary: everything lives in `agentstack-cli`.

fn main() -> std::process::ExitCode {
    agentstack_cli::main()
}
