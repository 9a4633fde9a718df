//! Running the iptables tools: the only I/O of the iptables mode, behind a
//! trait so the sync logic is tested without a kernel.

use std::{
    io::{self, Write as _},
    process::{Child, Command, Output, Stdio},
};

use crate::model::IpFamily;

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
    /// a missing chain (`-D … -j CHAIN` where CHAIN was never made; legacy
    /// iptables says it cannot load the target).
    pub fn is_absent(&self) -> bool {
        self.is_exit_1()
            || matches!(self, ExecError::Failed { code: Some(2), stderr, .. }
                if stderr.contains("does not exist") || stderr.contains("Couldn't load target"))
    }
}

/// What writes a program's standard input (into a pipe, as it reads it).
pub type Input<'a> = &'a mut dyn FnMut(&mut dyn io::Write) -> io::Result<()>;

/// Runs a program with arguments and optional standard input.
pub trait Runner {
    /// Its standard output, or why it failed (with its standard error).
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError>;

    /// `run` with the standard input `input` writes, which need not be
    /// held whole: a large input is written as the program reads it.
    fn run_writing(
        &mut self,
        program: &str,
        args: &[&str],
        input: Input,
    ) -> Result<String, ExecError> {
        let mut text = Vec::new();
        input(&mut text).map_err(|source| ExecError::Io { program: program.into(), source })?;
        self.run(program, args, Some(&String::from_utf8_lossy(&text)))
    }
}

/// Which iptables implementation the tools drive (`--iptables-backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Xtables {
    /// The one the node already uses (kubelet's chains are there), as
    /// kube-proxy's image picks it; else the one holding more rules
    #[default]
    Auto,
    /// nf_tables (`iptables-nft`)
    Nft,
    /// The legacy xtables kernel interface (`iptables-legacy`)
    Legacy,
}

impl Xtables {
    /// The suffix of its tools' names (`iptables-nft-save`, …).
    fn suffix(self) -> Option<&'static str> {
        match self {
            Xtables::Auto => None,
            Xtables::Nft => Some("nft"),
            Xtables::Legacy => Some("legacy"),
        }
    }

    /// `Auto` made concrete on this node (see [`choose`]).
    pub fn resolve(self, runner: &mut impl Runner) -> Xtables {
        if self != Xtables::Auto {
            return self;
        }
        let mut saved = |backend: Xtables| {
            let save = format!("iptables-{}-save", backend.suffix().unwrap_or_default());
            runner.run(&save, &[], None).ok()
        };
        let (legacy, nft) = (saved(Xtables::Legacy), saved(Xtables::Nft));
        choose(legacy.as_deref(), nft.as_deref())
    }
}

/// Chains kubelet makes in the backend it uses (in `mangle`).
const KUBELET_HINTS: [&str; 2] = [":KUBE-IPTABLES-HINT ", ":KUBE-KUBELET-CANARY "];

/// The backend the node uses, from both backends' `iptables-save` (absent:
/// its tools are missing): the one with kubelet's chains, else the one with
/// more rules, else nf_tables (Debian's default since bullseye).
pub fn choose(legacy: Option<&str>, nft: Option<&str>) -> Xtables {
    let hinted =
        |save: Option<&str>| save.is_some_and(|s| KUBELET_HINTS.iter().any(|h| s.contains(h)));
    let rules =
        |save: Option<&str>| save.map_or(0, |s| s.lines().filter(|l| l.starts_with("-A ")).count());
    match (legacy, nft) {
        (Some(_), None) => Xtables::Legacy,
        _ if hinted(nft) => Xtables::Nft,
        _ if hinted(legacy) => Xtables::Legacy,
        _ if rules(legacy) > rules(nft) => Xtables::Legacy,
        _ => Xtables::Nft,
    }
}

/// The programs of this machine, found in `PATH`; `iptables`,
/// `iptables-save` and `iptables-restore` those of one backend when it is
/// set (else the node's `iptables` alternative), and of one IP family
/// (`ip6tables…` for IPv6).
#[derive(Clone, Copy, Debug)]
pub struct System {
    xtables: Xtables,
    family: IpFamily,
}

impl Default for System {
    fn default() -> Self {
        System::new(Xtables::default())
    }
}

impl System {
    pub fn new(xtables: Xtables) -> Self {
        System { xtables, family: IpFamily::V4 }
    }

    /// The same implementation's tools for `family`.
    pub fn for_family(self, family: IpFamily) -> Self {
        System { family, ..self }
    }

    /// `program` as this backend and family name it.
    fn program<'a>(&self, program: &'a str) -> std::borrow::Cow<'a, str> {
        let tool = match program {
            "iptables" => "",
            "iptables-save" => "-save",
            "iptables-restore" => "-restore",
            _ => return program.into(),
        };
        let base = match self.family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        match self.xtables.suffix() {
            Some(suffix) => format!("{base}-{suffix}{tool}").into(),
            None => format!("{base}{tool}").into(),
        }
    }
}

impl Runner for System {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError> {
        let program = &*self.program(program);
        let piped = if stdin.is_some() { Stdio::piped() } else { Stdio::null() };
        let mut child = spawn(program, args, piped)?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A tool that fails early closes its end: its status says why.
            let _ = pipe.write_all(input.as_bytes());
        }
        let out = child.wait_with_output().map_err(io_error(program))?;
        outcome(program, args, &out)
    }

    fn run_writing(
        &mut self,
        program: &str,
        args: &[&str],
        input: Input,
    ) -> Result<String, ExecError> {
        let program = &*self.program(program);
        let mut child = spawn(program, args, Stdio::piped())?;
        let pipe = child.stdin.take();
        // Its output is read meanwhile: a program that writes much while
        // it reads would otherwise block, and the writer with it.
        let (out, written) = std::thread::scope(|scope| {
            let reader = scope.spawn(move || child.wait_with_output());
            let written = pipe.map_or(Ok(()), |pipe| {
                let mut pipe = io::BufWriter::with_capacity(1 << 16, pipe);
                input(&mut pipe).and_then(|()| pipe.flush())
            });
            (reader.join().unwrap_or_else(|_| Err(io::Error::other("reader panicked"))), written)
        });
        let out = out.map_err(io_error(program))?;
        let result = outcome(program, args, &out)?;
        // A program that fails early closes its end: its status says why;
        // one that succeeded took all of it.
        written.map_err(io_error(program))?;
        Ok(result)
    }
}

/// `program` started, its output piped.
fn spawn(program: &str, args: &[&str], stdin: Stdio) -> Result<Child, ExecError> {
    Command::new(program)
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_error(program))
}

/// What an I/O error running `program` means (not found: not installed).
fn io_error(program: &str) -> impl Fn(io::Error) -> ExecError + '_ {
    move |source| match source.kind() {
        io::ErrorKind::NotFound => ExecError::Missing { program: program.to_string() },
        _ => ExecError::Io { program: program.to_string(), source },
    }
}

/// A finished program's standard output, or why it failed.
fn outcome(program: &str, args: &[&str], out: &Output) -> Result<String, ExecError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_kubelet_uses_wins_then_the_one_with_more_rules() {
        let hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        let rules = "*nat\n-A KUBE-SERVICES -j X\n-A KUBE-SERVICES -j Y\nCOMMIT\n";
        let empty = "";
        assert_eq!(choose(Some(hint), Some(rules)), Xtables::Legacy, "kubelet's chains");
        assert_eq!(choose(Some(rules), Some(hint)), Xtables::Nft);
        assert_eq!(choose(Some(rules), Some(empty)), Xtables::Legacy, "more rules");
        assert_eq!(choose(Some(empty), Some(empty)), Xtables::Nft, "the default");
        assert_eq!(choose(Some(empty), None), Xtables::Legacy, "the only one installed");
        assert_eq!(choose(None, None), Xtables::Nft);
    }

    #[test]
    fn a_backend_renames_the_iptables_tools_only() {
        let legacy = System::new(Xtables::Legacy);
        assert_eq!(legacy.program("iptables-restore"), "iptables-legacy-restore");
        assert_eq!(legacy.program("iptables"), "iptables-legacy");
        assert_eq!(legacy.program("conntrack"), "conntrack");
        assert_eq!(System::default().program("iptables-save"), "iptables-save");
        let v6 = legacy.for_family(IpFamily::V6);
        assert_eq!(v6.program("iptables-restore"), "ip6tables-legacy-restore");
        assert_eq!(v6.program("conntrack"), "conntrack");
        assert_eq!(System::default().for_family(IpFamily::V6).program("iptables"), "ip6tables");
    }

    #[test]
    fn an_input_is_written_as_the_program_reads_it_and_a_failure_is_its_status() {
        // More than a pipe holds, while the program writes as much back:
        // neither side may wait for the other.
        let line = "x".repeat(1023) + "\n";
        let mut write =
            |out: &mut dyn io::Write| (0..1024).try_for_each(|_| out.write_all(line.as_bytes()));
        let echoed = System::default().run_writing("cat", &[], &mut write).unwrap();
        assert_eq!(echoed.len(), 1 << 20);
        let failed = System::default().run_writing("sh", &["-c", "exit 3"], &mut write);
        assert!(matches!(failed, Err(ExecError::Failed { code: Some(3), .. })), "{failed:?}");
        let missing = System::default().run_writing("no-such-program-here", &[], &mut write);
        assert!(matches!(missing, Err(ExecError::Missing { .. })), "{missing:?}");
    }
}
