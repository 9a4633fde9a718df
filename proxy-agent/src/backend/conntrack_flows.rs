//! The kernel's conntrack entries the rule-based modes (iptables and
//! nftables: both NAT through netfilter's conntrack) delete after a sync,
//! with the `conntrack` tool: which ones is `iptables::conntrack`'s pure
//! decision; this keeps what is owed and runs the deletions.

use std::{collections::BTreeSet, net::IpAddr};

use super::iptables::{
    conntrack::{CleanedPorts, StaleFlows, cleaned_ports, frontends, stale_flows, untranslated},
    exec::{ExecError, Runner},
};
use crate::{
    metrics::Metrics,
    model::{IpFamily, Model},
};

const CONNTRACK: &str = "conntrack";

/// conntrack exits 1 with "0 flow entries …" when nothing matched.
fn nothing_matched(e: &ExecError) -> bool {
    matches!(e, ExecError::Failed { stderr, .. } if stderr.contains(" 0 flow entries"))
}

/// Runs `conntrack` on `family`'s table (the tool lists and deletes IPv4
/// entries unless told `-f ipv6`).
fn conntrack(
    runner: &mut impl Runner,
    family: IpFamily,
    args: &[&str],
) -> Result<String, ExecError> {
    let mut words = match family {
        IpFamily::V4 => vec![],
        IpFamily::V6 => vec!["-f", "ipv6"],
    };
    words.extend(args);
    runner.run(CONNTRACK, &words, None)
}

/// What the deletions after a sync did.
#[derive(Debug, Default)]
pub struct FlowReport {
    /// UDP and SCTP conntrack entry sets deleted (those that matched
    /// something).
    pub flushed: usize,
    /// Entries to service addresses made while the rules were missing,
    /// deleted.
    pub untranslated_deleted: usize,
    /// Deletions that failed (retried at the next sync); the rules are
    /// applied regardless.
    pub errors: Vec<String>,
}

impl FlowReport {
    /// Logs what was deleted and counts what failed.
    pub fn report(&self, metrics: &Metrics) {
        if self.flushed > 0 {
            tracing::info!(sets = self.flushed, "stale UDP/SCTP conntrack entries deleted");
        }
        if self.untranslated_deleted > 0 {
            tracing::info!(
                flows = self.untranslated_deleted,
                "conntrack entries made while the rules were missing deleted"
            );
        }
        for e in &self.errors {
            metrics.conntrack_cleanup_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!("could not delete stale conntrack entries (will retry): {e}");
        }
    }
}

/// One family's UDP and SCTP service ports as the last sync applied them,
/// and the deletions still owed.
#[derive(Debug)]
pub struct ConntrackFlows {
    family: IpFamily,
    cleaned: CleanedPorts,
    /// Stale entries whose deletion failed, tried again at the next sync.
    pending: BTreeSet<StaleFlows>,
}

impl ConntrackFlows {
    pub fn new(family: IpFamily) -> Self {
        ConntrackFlows { family, cleaned: CleanedPorts::new(), pending: BTreeSet::new() }
    }

    /// After a sync applied `model`: deletes the UDP and SCTP entries to
    /// endpoints that left and to services that got endpoints. Failures are reported
    /// and kept for the next sync, never fatal.
    pub fn after_sync(
        &mut self,
        runner: &mut impl Runner,
        model: &Model,
        node_ips: &[IpAddr],
        report: &mut FlowReport,
    ) {
        let cleaned = cleaned_ports(model, self.family, node_ips);
        let mut stale = stale_flows(&self.cleaned, &cleaned);
        stale.append(&mut self.pending);
        self.cleaned = cleaned;
        for flows in stale {
            let args = flows.args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match conntrack(runner, self.family, &args) {
                Ok(_) => report.flushed += 1,
                Err(e) if nothing_matched(&e) => {}
                Err(e) => {
                    report.errors.push(format!("{flows}: {e}"));
                    self.pending.insert(flows);
                }
            }
        }
    }

    /// Deletes the unanswered entries to `model`'s service addresses that
    /// were not translated (made while the rules were missing).
    pub fn delete_untranslated(
        &mut self,
        runner: &mut impl Runner,
        model: &Model,
        node_ips: &[IpAddr],
        report: &mut FlowReport,
    ) {
        let listing = match conntrack(runner, self.family, &["-L"]) {
            Ok(listing) => listing,
            Err(e) => return report.errors.push(format!("listing conntrack: {e}")),
        };
        let frontends = frontends(model, self.family, node_ips);
        for entry in untranslated(&listing, &frontends) {
            let args = entry.delete_args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match conntrack(runner, self.family, &args) {
                Ok(_) => report.untranslated_deleted += 1,
                Err(e) if nothing_matched(&e) => {} // gone meanwhile
                Err(e) => report.errors.push(format!("{entry:?}: {e}")),
            }
        }
    }
}
