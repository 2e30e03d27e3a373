//! `agentstack env ...`

pub mod init;
pub mod list;
pub mod run;
pub mod serve;
pub mod validate;
