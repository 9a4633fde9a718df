//! The iptables fallback: the rules kube-proxy's iptables mode writes, from
//! the same model as the BPF path, applied as kube-proxy applies them.
//! `render` is pure (model → rules), `chains` names chains as kube-proxy
//! does, `conntrack` finds stale conntrack entries, `exec` runs the tools.
//!
//! A sync writes one `iptables-restore --noflush` run. A full sync (the
//! first, after any failure, when the canary chain vanished, and hourly)
//! looks at every table once (`iptables-save`), adds the jumps from the
//! built-in chains and the chains they need where missing (`jumps`, one
//! restore), rewrites every chain and deletes the per-service chains the kernel holds that the rules no longer
//! use (left by anyone); a partial sync rewrites the top-level chains and
//! only the per-service chains whose rules changed, and deletes those it
//! wrote before that are no longer used.

pub mod chains;
pub mod conntrack;
pub mod counters;
pub mod datapath;
pub mod exec;
mod jumps;
pub mod render;

use std::time::{Duration, Instant};

use self::{
    exec::{ExecError, Runner},
    jumps::{saved_chains, saved_table},
    render::{ChainRef, Digests, Options, Ruleset, Scope, render},
};
use crate::{
    backend::conntrack_flows::{ConntrackFlows, FlowReport},
    model::{IpFamily, Model, Protocol},
};

const IPTABLES: &str = "iptables";
const RESTORE: &str = "iptables-restore";
const SAVE: &str = "iptables-save";
/// Wait up to 5 s for the xtables lock, polling every 100 ms, as kube-proxy.
const WAIT: [&str; 4] = ["-w", "5", "-W", "100000"];
/// kube-proxy's canary: when it disappears, someone flushed the tables.
pub const CANARY: &str = "KUBE-PROXY-CANARY";
/// Where the canary lives; mangle first: it is the cheap table to list.
const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];
/// A full sync at least this often, as kube-proxy does.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);
/// Lines shown around the one iptables-restore refused.
const CONTEXT_LINES: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error("iptables-restore refused the rules ({} sync): {source}{context}", if *.full { "full" } else { "partial" })]
    Restore { full: bool, source: ExecError, context: String },
    #[error("listing the tables: {source}")]
    List { source: ExecError },
    #[error("ensuring {what}: {source}")]
    Ensure { what: String, source: ExecError },
    #[error("removing the iptables mode's rules: {0}")]
    Cleanup(String),
}

/// What a sync did.
#[derive(Debug, Default)]
pub struct SyncReport {
    pub full: bool,
    /// Chains rewritten (declared in the restore input).
    pub chains_written: usize,
    /// Per-service chains deleted.
    pub chains_deleted: usize,
    /// Rules written, per table.
    pub rules_written: Vec<(&'static str, usize)>,
    /// The conntrack entries deleted after the rules were applied.
    pub flows: FlowReport,
}

/// `-w 5 -W 100000 -t TABLE OP CHAIN ARGS…`.
fn rule_args<'a>(table: &'a str, op: &'a str, chain: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut words = WAIT.to_vec();
    words.extend(["-t", table, op, chain]);
    words.extend(args);
    words
}

/// Whether `iptables --version` (`iptables v1.8.9 (nf_tables)`) names a
/// version with `MASQUERADE --random-fully` (1.6.2+), as kube-proxy checks.
pub fn random_fully(version: &str) -> bool {
    let Some(v) = version.split_whitespace().find_map(|w| w.strip_prefix('v')) else {
        return false;
    };
    let numbers: Vec<u32> = v.split('.').map_while(|n| n.parse().ok()).collect();
    numbers.as_slice() >= [1, 6, 2].as_slice()
}

/// The lines of `input` around the one iptables-restore names in `stderr`
/// (`… line 7 failed`, `Error occurred at line: 7`).
fn restore_context(input: &str, stderr: &str) -> String {
    let line: Option<usize> = stderr.split("line").skip(1).find_map(|rest| {
        let digits: String =
            rest.trim_start_matches([':', ' ']).chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    });
    line.map_or_else(String::new, |line| lines_around(input, line))
}

/// The lines of `input` around `line` (1-based), that one marked, on lines
/// of their own; nothing for line 0.
pub(crate) fn lines_around(input: &str, line: usize) -> String {
    if line == 0 {
        return String::new();
    }
    let first = line.saturating_sub(CONTEXT_LINES).max(1);
    let shown: Vec<String> = input
        .lines()
        .enumerate()
        .skip(first - 1)
        .take(line + CONTEXT_LINES + 1 - first)
        .map(|(i, text)| format!("{}{:>6}: {text}", if i + 1 == line { ">" } else { " " }, i + 1))
        .collect();
    format!("\n{}", shown.join("\n"))
}

pub struct IptablesBackend<R: Runner> {
    runner: R,
    options: Options,
    /// Digests of the chains the kernel holds; `None`: the next sync is full.
    applied: Option<Digests>,
    last_full: Option<Instant>,
    /// The conntrack entries owed a deletion.
    flows: ConntrackFlows,
    /// The rules were missing (someone flushed them, or nobody wrote them
    /// yet): flows to services made meanwhile were not translated.
    rules_were_missing: bool,
}

impl<R: Runner> IptablesBackend<R> {
    pub fn new(runner: R, options: Options) -> Self {
        IptablesBackend {
            runner,
            flows: ConntrackFlows::new(options.family),
            options,
            applied: None,
            last_full: None,
            rules_were_missing: false,
        }
    }

    /// The family whose rules it writes.
    pub fn family(&self) -> IpFamily {
        self.options.family
    }

    /// The tools it runs.
    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// This node's zone changed: the next sync renders for the new one.
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.options.zone = zone;
    }

    /// Whether the next sync will be a full one.
    pub fn full_sync_due(&self) -> bool {
        self.applied.is_none() || self.last_full.is_none_or(|t| t.elapsed() >= FULL_SYNC_PERIOD)
    }

    /// Makes the kernel's rules those of `model`. After any failure the
    /// next sync is a full one. Rules refused for their SCTP ports (a
    /// kernel without the `sctp` match) are written again without them,
    /// and SCTP ports are left out from then on: the others are served.
    pub fn sync(&mut self, model: &Model) -> Result<SyncReport, IptablesError> {
        let mut report = match self.write_rules(model) {
            Err(refused @ IptablesError::Restore { .. })
                if self.options.sctp
                    && model
                        .ports_of(self.options.family)
                        .any(|p| p.protocol == Protocol::Sctp) =>
            {
                self.options.sctp = false;
                match self.write_rules(model) {
                    Ok(report) => {
                        tracing::warn!(family = %self.options.family, "SCTP service ports are not served: iptables-restore refused their rules (is the kernel's sctp match, xt_sctp, missing?), the rules without them are in: {refused}");
                        report
                    }
                    Err(e) => {
                        // Not SCTP's doing.
                        self.options.sctp = true;
                        return Err(e);
                    }
                }
            }
            result => result?,
        };
        let node_ips = &self.options.node_ips;
        self.flows.after_sync(&mut self.runner, model, node_ips, &mut report.flows);
        if self.rules_were_missing {
            self.flows.delete_untranslated(&mut self.runner, model, node_ips, &mut report.flows);
            self.rules_were_missing = false;
        }
        Ok(report)
    }

    /// One attempt at the rules of `model`.
    fn write_rules(&mut self, model: &Model) -> Result<SyncReport, IptablesError> {
        let ruleset = render(model, &self.options);
        let full = self.full_sync_due();
        let applied = self.applied.take();
        let report = match (&applied, full) {
            (Some(applied), false) => {
                self.apply(&ruleset, Scope::ChangedSince(applied), applied.keys())?
            }
            _ => self.apply_full(&ruleset)?,
        };
        self.applied = Some(ruleset.digests());
        if full {
            self.last_full = Some(Instant::now());
        }
        Ok(report)
    }

    /// A full sync: one look at every table says whether a previous
    /// agent's rules are serving (at the first), which chains and jumps
    /// around the rules are missing, and which per-service chains exist.
    fn apply_full(&mut self, ruleset: &Ruleset) -> Result<SyncReport, IptablesError> {
        let saved =
            self.runner.run(SAVE, &[], None).map_err(|source| IptablesError::List { source })?;
        if self.last_full.is_none() {
            self.rules_were_missing =
                !saved_chains(saved_table(&saved, "mangle")).any(|c| c == CANARY);
        }
        if let Some(input) = jumps::missing(&saved) {
            let restore = [WAIT[0], WAIT[1], WAIT[2], WAIT[3], "--noflush"];
            self.runner.run(RESTORE, &restore, Some(&input)).map_err(|source| {
                IptablesError::Ensure {
                    what: "the chains and jumps around the rules".into(),
                    source,
                }
            })?;
        }
        // Per-service chains only live in nat.
        let existing: Vec<ChainRef> =
            saved_chains(saved_table(&saved, "nat")).map(|c| ("nat", c.to_string())).collect();
        self.apply(ruleset, Scope::Full, &existing)
    }

    /// One restore of `scope`, deleting the per-service chains of
    /// `previous` that `ruleset` no longer has.
    fn apply<'a>(
        &mut self,
        ruleset: &Ruleset,
        scope: Scope,
        previous: impl IntoIterator<Item = &'a ChainRef>,
    ) -> Result<SyncReport, IptablesError> {
        let stale = ruleset.stale_chains(previous);
        let input = ruleset.restore_input(scope, &stale);
        let full = matches!(scope, Scope::Full);
        let args = [WAIT[0], WAIT[1], WAIT[2], WAIT[3], "--noflush", "--counters"];
        self.runner.run(RESTORE, &args, Some(&input)).map_err(|source| {
            let context = match &source {
                ExecError::Failed { stderr, .. } => restore_context(&input, stderr),
                _ => String::new(),
            };
            IptablesError::Restore { full, source, context }
        })?;
        let mut rules_written = Vec::new();
        for line in input.lines() {
            if let Some(name) = line.strip_prefix('*') {
                rules_written.push((if name == "filter" { "filter" } else { "nat" }, 0));
            } else if line.starts_with("-A ")
                && let Some((_, count)) = rules_written.last_mut()
            {
                *count += 1;
            }
        }
        Ok(SyncReport {
            full,
            chains_written: input.lines().filter(|l| l.starts_with(':')).count() - stale.len(),
            chains_deleted: stale.len(),
            rules_written,
            ..SyncReport::default()
        })
    }

    /// Whether a previous agent's rules are in place (its canary chain);
    /// when iptables cannot tell, taken as yes (waiting is the safe side).
    pub fn rules_present(&mut self) -> bool {
        !canary_missing(&mut self.runner, "mangle").unwrap_or(false)
    }

    /// The first table whose canary chain is gone, if any (mangle only,
    /// unless `thorough`): the rules were flushed by someone else, and the
    /// next sync is a full one.
    pub fn canary_gone(&mut self, thorough: bool) -> Result<Option<&'static str>, ExecError> {
        let tables = if thorough { &CANARY_TABLES[..] } else { &CANARY_TABLES[..1] };
        for table in tables {
            if canary_missing(&mut self.runner, table)? {
                self.applied = None;
                self.rules_were_missing = true;
                return Ok(Some(table));
            }
        }
        Ok(None)
    }
}

/// Whether the canary is missing from `table` (iptables exits 1); other
/// failures (the lock held too long) are errors, not a verdict.
fn canary_missing(runner: &mut impl Runner, table: &str) -> Result<bool, ExecError> {
    match runner.run(IPTABLES, &rule_args(table, "-S", CANARY, &[]), None) {
        Ok(_) => Ok(false),
        Err(e) if e.is_exit_1() => Ok(true),
        Err(e) => Err(e),
    }
}

/// [`cleanup`] in both iptables implementations (an agent may have used
/// either) and both families; those whose tools are missing have nothing to
/// remove. iptables-nft's only where a canary says the iptables mode left
/// something ([`cleanup_if_canary`]).
pub fn cleanup_every_backend() -> Result<usize, IptablesError> {
    let mut chains = 0;
    for xtables in [exec::Xtables::Nft, exec::Xtables::Legacy] {
        for family in IpFamily::ALL {
            let runner = &mut exec::System::new(xtables).for_family(family);
            chains += match xtables {
                exec::Xtables::Nft => cleanup_if_canary(runner)?,
                _ => cleanup(runner)?,
            };
        }
    }
    Ok(chains)
}

/// [`cleanup`], unless no table holds the iptables mode's canary: on a
/// clean node one `iptables -t TABLE -S KUBE-PROXY-CANARY` per table, which
/// reads that chain alone, whatever else the family holds.
///
/// Why: listing a table's chains reads every chain of the family, the
/// nftables mode's table `kube-proxy` included (a chain or more per
/// service port, and per endpoint in kube-proxy's layout: 1.1 million at
/// 100,000 services × 10 endpoints): the kernel filters a chain dump by
/// family only, and each message of the dump walks the chains from the
/// first to where the last one stopped, so the dump grows with the square
/// of the chains. Measured with iptables 1.8.9 and nft 1.0.6 beside an
/// `ip kube-proxy` table of 1.1 million chains (docs/benchmarks.md, "The
/// iptables mode's leftovers"): `iptables-nft-save` 66 s, 65 of them in the
/// kernel, and the same 66 s of kernel time for `iptables-nft-save -t nat`,
/// `iptables-nft -t nat -S` and `nft list table ip nat` (nft 1.0.6 fills
/// its cache with every chain of every table); `iptables-nft -t nat -S
/// KUBE-PROXY-CANARY`, which asks the kernel for chains by name (that one
/// and the table's built-in ones) and for their rules alone, 5 to 15 ms,
/// the chain there or not, as without the table.
///
/// Why the canary: the iptables mode (this agent's, and kube-proxy's)
/// creates `KUBE-PROXY-CANARY` in mangle, nat and filter in the same
/// restore as the other chains of the table and deletes it in the same
/// restore as them ([`jumps`]), so a table holding anything of the mode
/// holds the canary; kubelet's chains (`KUBE-FIREWALL`, its own canary)
/// never trigger the cleanup. A probe that cannot tell (another error
/// than "no such chain") falls back to the look at every table.
///
/// When the canary is there, the look at every table costs what it did:
/// the leftovers of an iptables mode serving as many services are as many
/// chains again, which no listing skips; that is once, after a change of
/// mode. iptables-legacy is not probed: its `iptables-save` reads only the
/// tables the legacy kernel interface holds (5 ms beside the 1.1 million
/// nf_tables chains), while a probe of a table would create it.
pub fn cleanup_if_canary(runner: &mut impl Runner) -> Result<usize, IptablesError> {
    if CANARY_TABLES.into_iter().all(|table| matches!(canary_missing(runner, table), Ok(true))) {
        return Ok(0);
    }
    cleanup(runner)
}

/// Removes the iptables mode's rules: the jumps from the built-in chains
/// (not kubelet's), then our chains. One `iptables-save` of every table
/// says what is there and one restore removes it, so a clean node costs
/// one command (an agent of another mode runs this for both iptables
/// implementations and both families at every start). Nothing to do
/// (`Ok(0)`) where iptables is not installed. Returns the number of chains
/// deleted.
pub fn cleanup(runner: &mut impl Runner) -> Result<usize, IptablesError> {
    let saved = match runner.run(SAVE, &[], None) {
        Ok(saved) => saved,
        Err(ExecError::Missing { .. }) => return Ok(0),
        Err(e) => return Err(IptablesError::Cleanup(format!("listing the tables: {e}"))),
    };
    let Some((input, chains)) = jumps::removal(&saved) else { return Ok(0) };
    let restore = [WAIT[0], WAIT[1], WAIT[2], WAIT[3], "--noflush"];
    match runner.run(RESTORE, &restore, Some(&input)) {
        Ok(_) => Ok(chains),
        Err(e) => Err(IptablesError::Cleanup(format!("deleting our jumps and chains: {e}"))),
    }
}

#[cfg(test)]
mod tests;
