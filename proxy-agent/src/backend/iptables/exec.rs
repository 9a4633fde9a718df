//! Running the iptables tools: the only I/O of the iptables mode, behind a
//! trait so the sync logic is tested without a kernel.

use std::{
    io::{self, Write as _},
    process::{Command, Stdio},
};

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("{program} is not installed")]
    Missing { program: String },
    #[error("running {program}: {source}")]
    Io { program: String, source: io::Error },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed { command: String, status: String, code: Option<i32>, stderr: String },
}

impl ExecError {
    /// The tool ran and exited 1: for iptables "no such chain or rule", for
    /// conntrack "nothing matched". Other codes (4: resource problem, such
    /// as the xtables lock) are real errors.
    pub fn is_exit_1(&self) -> bool {
        matches!(self, ExecError::Failed { code: Some(1), .. })
    }

    /// A rule or its target chain does not exist: exit 1, or exit 2 naming
    /// a missing chain (`-D … -j CHAIN` where CHAIN was never made).
    pub fn is_absent(&self) -> bool {
        self.is_exit_1()
            || matches!(self, ExecError::Failed { code: Some(2), stderr, .. } if stderr.contains("does not exist"))
    }
}

/// Runs a program with arguments and optional standard input.
pub trait Runner {
    /// Its standard output, or why it failed (with its standard error).
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError>;
}

/// The programs of this machine, found in `PATH`.
#[derive(Clone, Copy, Debug, Default)]
pub struct System;

impl Runner for System {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError> {
        let io_err = |source: io::Error| match source.kind() {
            io::ErrorKind::NotFound => ExecError::Missing { program: program.to_string() },
            _ => ExecError::Io { program: program.to_string(), source },
        };
        let mut child = Command::new(program)
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io_err)?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A tool that fails early closes its end: its status says why.
            let _ = pipe.write_all(input.as_bytes());
        }
        let out = child.wait_with_output().map_err(io_err)?;
        if !out.status.success() {
            return Err(ExecError::Failed {
                command: format!("{program} {}", args.join(" ")),
                status: out.status.to_string(),
                code: out.status.code(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
