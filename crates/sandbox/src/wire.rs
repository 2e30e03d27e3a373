//! The conversation between the host and a sandbox's init process, over the init's
//! stdin and stdout: length-prefixed JSON headers, each followed by the raw bytes they
//! announce.
//!
//! ```text
//! host → init   argv: sandbox-init __agentstack-sandbox-init
//! host → init   Setup
//! init → host   Hello (ready, or the step that failed and why)
//! host → init   JobHeader, then stdin bytes, then each file's bytes in order
//! init → host   Report, then stdout bytes, then stderr bytes
//! ```

use std::io::{self, Read, Write};
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::job::{End, Limits, Usage};

/// The argument that turns the program into a sandbox init process.
pub const INIT_ARG: &str = "__agentstack-sandbox-init";

/// The init process's `argv[0]` and name: what a sandboxed command sees of its pid 1
/// (`/proc/1/cmdline`, `/proc/1/comm`) instead of the host program's path. The set-up
/// comes over stdin for the same reason.
pub const INIT_NAME: &str = "sandbox-init";

/// The largest header a peer may send.
const MAX_HEADER_BYTES: u32 = 4 << 20;

/// How the init process isolates the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// Namespaces (user, mount, PID, network, IPC, UTS, cgroup), a read-only root,
    /// rlimits, an unprivileged uid.
    Namespaces,
    /// A plain child process with rlimits in a temporary directory. For development
    /// only: the command sees the host's files and network.
    UnsafeNone,
}

/// What the init process is told when it starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Setup {
    /// How to isolate.
    pub isolation: Isolation,
    /// Extra host directories or files made visible read-only at the same path.
    pub read_only: Vec<PathBuf>,
    /// The host uid and gid the sandbox runs as when started by root.
    pub unprivileged_id: u32,
    /// The init program to bind at [`crate::PROGRAM_IN_SANDBOX`], if any: a link to it
    /// whose path reveals nothing of the host's.
    #[serde(default)]
    pub exposed_program: Option<PathBuf>,
}

/// The init process's first message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Hello {
    /// Isolated and waiting for a job.
    Ready,
    /// Setting up failed.
    Failed {
        /// The step that failed (e.g. "create user namespace").
        step: String,
        /// The system's error.
        message: String,
    },
}

/// A job as sent to the init process; the bytes follow the header.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobHeader {
    /// Command and arguments.
    pub argv: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Limits.
    pub limits: Limits,
    /// Length of the stdin bytes.
    pub stdin_len: u64,
    /// The files, in the order their bytes follow.
    pub files: Vec<FileHeader>,
}

/// One file of a job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHeader {
    /// Path relative to the scratch directory.
    pub path: String,
    /// Length of its bytes.
    pub len: u64,
    /// Mode 0755 instead of 0644.
    pub executable: bool,
}

/// The init process's answer to a job; stdout and stderr bytes follow.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// How the command ended.
    pub end: End,
    /// Resources used.
    pub usage: Usage,
    /// Length of the stdout bytes that follow.
    pub stdout_len: u64,
    /// Length of the stderr bytes that follow.
    pub stderr_len: u64,
    /// Whether stdout was cut.
    pub stdout_truncated: bool,
    /// Whether stderr was cut.
    pub stderr_truncated: bool,
    /// Why the command could not start, or what went wrong in the sandbox itself.
    pub error: Option<String>,
}

/// Writes one header.
pub fn write_header<T: Serialize>(out: &mut impl Write, value: &T) -> io::Result<()> {
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(&body)
}

/// Reads one header; `Ok(None)` at a clean end of stream.
pub fn read_header<T: DeserializeOwned>(input: &mut impl Read) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut body = vec![0u8; header_len(len)?];
    input.read_exact(&mut body)?;
    decode_header(&body).map(Some)
}

/// Decodes a header's body (after its length prefix).
pub fn decode_header<T: DeserializeOwned>(body: &[u8]) -> io::Result<T> {
    serde_json::from_slice(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Encodes a header into bytes (for async writers).
pub fn encode_header<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    write_header(&mut out, value).expect("writing to a Vec cannot fail");
    out
}

/// Decodes a header's length prefix.
pub fn header_len(prefix: [u8; 4]) -> io::Result<usize> {
    let len = u32::from_le_bytes(prefix);
    if len > MAX_HEADER_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("header of {len} bytes is over the {MAX_HEADER_BYTES}-byte limit"),
        ));
    }
    Ok(len as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_end_cleanly() {
        let mut buf = Vec::new();
        write_header(&mut buf, &Hello::Ready).unwrap();
        write_header(
            &mut buf,
            &Hello::Failed {
                step: "s".into(),
                message: "m".into(),
            },
        )
        .unwrap();
        let mut input = &buf[..];
        assert!(matches!(
            read_header(&mut input).unwrap(),
            Some(Hello::Ready)
        ));
        assert!(matches!(
            read_header(&mut input).unwrap(),
            Some(Hello::Failed { .. })
        ));
        assert!(read_header::<Hello>(&mut input).unwrap().is_none());
    }

    #[test]
    fn oversized_headers_are_refused() {
        let buf = (MAX_HEADER_BYTES + 1).to_le_bytes();
        assert!(read_header::<Hello>(&mut &buf[..]).is_err());
    }
}
