//! `agentstack env ...`

pub mod import;
pub mod init;
pub mod list;
pub mod run;
pub mod serve;
pub mod validate;
