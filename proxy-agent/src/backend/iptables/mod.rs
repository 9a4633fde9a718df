//! The iptables fallback: the rules kube-proxy's iptables mode writes, from
//! the same model as the BPF path, applied as kube-proxy applies them.
//! `render` is pure (model → rules), `chains` names chains as kube-proxy
//! does, `conntrack` finds stale UDP flows, `exec` runs the tools.
//!
//! A sync writes one `iptables-restore --noflush` transaction. A full sync
//! (the first, after any failure, when the canary chain vanished, and
//! hourly) rewrites every chain, ensures the jumps from the built-in chains
//! and deletes per-service chains left by anyone before; a partial sync
//! rewrites the top-level chains and only the per-service chains whose rules
//! changed, and deletes the ones no longer needed.

pub mod chains;
pub mod conntrack;
pub mod exec;
pub mod render;

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use self::{
    chains::is_service_chain,
    conntrack::{StaleFlows, UdpServices, frontends, stale_flows, udp_services, untranslated},
    exec::{ExecError, Runner},
    render::{ChainRef, Digests, Options, Ruleset, Scope, jump_rules, render},
};
use crate::model::Model;

const IPTABLES: &str = "iptables";
const RESTORE: &str = "iptables-restore";
const SAVE: &str = "iptables-save";
const CONNTRACK: &str = "conntrack";
/// Wait up to 5 s for the xtables lock, as kube-proxy does.
const WAIT: [&str; 2] = ["-w", "5"];
/// kube-proxy's canary: when it disappears, someone flushed the tables.
pub const CANARY: &str = "KUBE-PROXY-CANARY";
/// mangle first: it is the cheap table to list.
const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];
/// A full sync at least this often, as kube-proxy does.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error("iptables-restore refused the rules: {0}")]
    Restore(ExecError),
    #[error("listing the {table} table: {source}")]
    List { table: &'static str, source: ExecError },
    #[error("ensuring {what}: {source}")]
    Ensure { what: String, source: ExecError },
}

/// What a sync did.
#[derive(Debug, Default)]
pub struct SyncReport {
    pub full: bool,
    /// Chains rewritten (declared in the restore input).
    pub chains_written: usize,
    /// Per-service chains deleted.
    pub chains_deleted: usize,
    /// UDP conntrack entry sets deleted (those that matched something).
    pub flows_flushed: usize,
    /// Entries to service addresses made while the rules were missing,
    /// deleted.
    pub untranslated_deleted: usize,
    /// Deletions that failed; the rules are applied regardless.
    pub flow_errors: Vec<String>,
}

pub struct IptablesBackend<R: Runner> {
    runner: R,
    options: Options,
    /// Digests of the chains the kernel holds; `None`: the next sync is full.
    applied: Option<Digests>,
    last_full: Option<Instant>,
    /// The UDP services the rules serve, for stale conntrack entries.
    udp: UdpServices,
    /// The rules may have been missing (at startup, after a flush): flows
    /// to services made meanwhile were not translated.
    rules_were_missing: bool,
}

impl<R: Runner> IptablesBackend<R> {
    pub fn new(runner: R, options: Options) -> Self {
        IptablesBackend {
            runner,
            options,
            applied: None,
            last_full: None,
            udp: UdpServices::new(),
            rules_were_missing: true,
        }
    }

    /// Whether the next sync will be a full one.
    pub fn full_sync_due(&self) -> bool {
        self.applied.is_none() || self.last_full.is_none_or(|t| t.elapsed() >= FULL_SYNC_PERIOD)
    }

    /// Makes the kernel's rules those of `model`. Each table is replaced
    /// atomically; after any failure the next sync is a full one.
    pub fn sync(&mut self, model: &Model) -> Result<SyncReport, IptablesError> {
        let ruleset = render(model, &self.options);
        let full = self.full_sync_due();
        let applied = self.applied.take();
        let mut report = match (&applied, full) {
            (Some(applied), false) => {
                self.apply(&ruleset, Scope::ChangedSince(applied), applied.keys())?
            }
            _ => self.apply_full(&ruleset)?,
        };
        self.applied = Some(ruleset.digests());
        if full {
            self.last_full = Some(Instant::now());
        }
        let udp = udp_services(model, &self.options.node_ips);
        let stale = stale_flows(&self.udp, &udp);
        self.udp = udp;
        self.flush(&stale, &mut report);
        if self.rules_were_missing {
            self.delete_untranslated(model, &mut report);
            self.rules_were_missing = false;
        }
        Ok(report)
    }

    /// Deletes the entries to service addresses that were not translated.
    fn delete_untranslated(&mut self, model: &Model, report: &mut SyncReport) {
        let listing = match self.runner.run(CONNTRACK, &["-L"], None) {
            Ok(listing) => listing,
            Err(e) => return report.flow_errors.push(format!("listing conntrack: {e}")),
        };
        let frontends = frontends(model, &self.options.node_ips);
        for entry in untranslated(&listing, &frontends) {
            let args = entry.delete_args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match self.runner.run(CONNTRACK, &args, None) {
                Ok(_) => report.untranslated_deleted += 1,
                // Gone meanwhile.
                Err(ExecError::Failed { stderr, .. }) if stderr.contains(" 0 flow entries") => {}
                Err(e) => report.flow_errors.push(format!("{entry:?}: {e}")),
            }
        }
    }

    fn apply_full(&mut self, ruleset: &Ruleset) -> Result<SyncReport, IptablesError> {
        self.ensure_chains_and_jumps()?;
        let mut existing = Vec::new();
        for table in ["filter", "nat"] {
            let saved = self
                .runner
                .run(SAVE, &["-t", table], None)
                .map_err(|source| IptablesError::List { table, source })?;
            existing.extend(saved_chains(&saved).map(|c| (table, c.to_string())));
        }
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
        self.restore(&input)?;
        Ok(SyncReport {
            full: matches!(scope, Scope::Full),
            chains_written: input.lines().filter(|l| l.starts_with(':')).count() - stale.len(),
            chains_deleted: stale.len(),
            ..SyncReport::default()
        })
    }

    fn restore(&mut self, input: &str) -> Result<(), IptablesError> {
        let args = [WAIT[0], WAIT[1], "--noflush", "--counters"];
        self.runner.run(RESTORE, &args, Some(input)).map(drop).map_err(IptablesError::Restore)
    }

    /// The canary chains, the chains the built-in chains jump to, and the
    /// jumps (inserted first when missing), as kube-proxy ensures them.
    fn ensure_chains_and_jumps(&mut self) -> Result<(), IptablesError> {
        let mut chains: BTreeSet<(&str, &str)> =
            CANARY_TABLES.iter().map(|table| (*table, CANARY)).collect();
        let jumps = jump_rules();
        chains.extend(jumps.iter().map(|(table, _, args)| (*table, *args.last().unwrap_or(&""))));
        for (table, chain) in chains {
            match self.runner.run(IPTABLES, &[WAIT[0], WAIT[1], "-t", table, "-N", chain], None) {
                Err(ExecError::Failed { stderr, .. }) if stderr.contains("already exists") => {}
                Err(source) => {
                    return Err(IptablesError::Ensure { what: format!("{table} {chain}"), source });
                }
                Ok(_) => {}
            }
        }
        for (table, chain, args) in &jumps {
            let rule = |op: &'static str| {
                let mut words = vec![WAIT[0], WAIT[1], "-t", table, op, chain];
                words.extend(args.iter().copied());
                words
            };
            if self.runner.run(IPTABLES, &rule("-C"), None).is_err() {
                self.runner.run(IPTABLES, &rule("-I"), None).map_err(|source| {
                    IptablesError::Ensure {
                        what: format!("{table} {chain} {}", args.join(" ")),
                        source,
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Deletes stale UDP conntrack entries; failures are reported, not fatal.
    fn flush(&mut self, stale: &BTreeSet<StaleFlows>, report: &mut SyncReport) {
        for flows in stale {
            let args = flows.args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match self.runner.run(CONNTRACK, &args, None) {
                Ok(_) => report.flows_flushed += 1,
                // conntrack exits 1 when nothing matched.
                Err(ExecError::Failed { stderr, .. }) if stderr.contains(" 0 flow entries") => {}
                Err(e) => report.flow_errors.push(format!("{flows}: {e}")),
            }
        }
    }

    /// The first table whose canary chain is gone, if any: the rules were
    /// flushed by someone else, and the next sync must be a full one.
    pub fn canary_gone(&mut self) -> Option<&'static str> {
        let gone = CANARY_TABLES.into_iter().find(|table| {
            self.runner.run(IPTABLES, &[WAIT[0], WAIT[1], "-t", table, "-S", CANARY], None).is_err()
        })?;
        self.applied = None;
        self.rules_were_missing = true;
        Some(gone)
    }
}

/// The chain names an `iptables-save` output declares.
fn saved_chains(saved: &str) -> impl Iterator<Item = &str> {
    saved.lines().filter_map(|l| l.strip_prefix(':')?.split(' ').next())
}

/// The chains the iptables mode creates (not the built-in ones).
fn is_ours(chain: &str) -> bool {
    chain == CANARY
        || is_service_chain(chain)
        || jump_rules().iter().any(|(_, _, args)| args.last() == Some(&chain))
        || chain == "KUBE-MARK-MASQ"
}

/// Removes every rule and chain of the iptables mode: the jumps from the
/// built-in chains, then our chains in every table. Nothing to do (`Ok(0)`)
/// where iptables is not installed. Returns the number of chains deleted.
pub fn cleanup(runner: &mut impl Runner) -> Result<usize, IptablesError> {
    for (table, chain, args) in jump_rules() {
        let mut words = vec![WAIT[0], WAIT[1], "-t", table, "-D", chain];
        words.extend(args.iter().copied());
        // A jump inserted twice (two agents racing) is deleted twice.
        for _ in 0..8 {
            match runner.run(IPTABLES, &words, None) {
                Ok(_) => {}
                Err(ExecError::Missing { .. }) => return Ok(0),
                Err(_) => break,
            }
        }
    }
    let mut input = String::new();
    let mut deleted = 0;
    for table in CANARY_TABLES {
        let saved = match runner.run(SAVE, &["-t", table], None) {
            Ok(saved) => saved,
            Err(ExecError::Missing { .. }) => return Ok(0),
            Err(source) => return Err(IptablesError::List { table, source }),
        };
        let ours: Vec<&str> = saved_chains(&saved).filter(|c| is_ours(c)).collect();
        if ours.is_empty() {
            continue;
        }
        // Flush them all first: they may jump to each other.
        input.push_str(&format!("*{table}\n"));
        for chain in &ours {
            input.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for chain in &ours {
            input.push_str(&format!("-X {chain}\n"));
        }
        input.push_str("COMMIT\n");
        deleted += ours.len();
    }
    if deleted > 0 {
        let args = [WAIT[0], WAIT[1], "--noflush"];
        runner.run(RESTORE, &args, Some(&input)).map_err(IptablesError::Restore)?;
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, net::Ipv4Addr};

    use super::*;

    /// A fake kernel: keeps the chains a restore declares, fails the
    /// commands a test scripts to fail, records every command.
    #[derive(Default)]
    struct Fake {
        chains: BTreeMap<&'static str, BTreeSet<String>>,
        log: Vec<String>,
        /// Rules added with `iptables -I`, as "table chain args".
        rules: BTreeSet<String>,
        /// Restores that must fail, counted down.
        failing_restores: usize,
    }

    impl Runner for Fake {
        fn run(
            &mut self,
            program: &str,
            args: &[&str],
            stdin: Option<&str>,
        ) -> Result<String, ExecError> {
            self.log.push(format!("{program} {}", args.join(" ")));
            let failed = |stderr: &str| ExecError::Failed {
                command: program.to_string(),
                status: "exit status: 1".into(),
                stderr: stderr.into(),
            };
            let table = |args: &[&str]| {
                let t = args.iter().position(|a| *a == "-t").map(|i| args[i + 1]);
                CANARY_TABLES.into_iter().find(|x| Some(*x) == t).unwrap_or("filter")
            };
            match program {
                RESTORE => {
                    if self.failing_restores > 0 {
                        self.failing_restores -= 1;
                        return Err(failed("line 7: Chain 'KUBE-SEP-X' does not exist"));
                    }
                    let mut current = "filter";
                    for line in stdin.unwrap_or_default().lines() {
                        if let Some(t) = line.strip_prefix('*') {
                            current = CANARY_TABLES.into_iter().find(|x| *x == t).unwrap();
                        } else if let Some(c) = line.strip_prefix(':') {
                            let name = c.split(' ').next().unwrap().to_string();
                            self.chains.entry(current).or_default().insert(name);
                        } else if let Some(c) = line.strip_prefix("-X ") {
                            self.chains.entry(current).or_default().remove(c);
                        }
                    }
                    Ok(String::new())
                }
                SAVE => Ok(self
                    .chains
                    .get(table(args))
                    .into_iter()
                    .flatten()
                    .fold(String::new(), |out, c| out + ":" + c + " - [0:0]\n")),
                IPTABLES if args.contains(&"-N") || args.contains(&"-S") => {
                    let chain =
                        args[args.iter().position(|a| *a == "-N" || *a == "-S").unwrap() + 1];
                    let chains = self.chains.entry(table(args)).or_default();
                    match (args.contains(&"-N"), chains.contains(chain)) {
                        (true, true) => Err(failed("iptables: Chain already exists.")),
                        (true, false) => {
                            chains.insert(chain.to_string());
                            Ok(String::new())
                        }
                        (false, true) => Ok(format!("-N {chain}\n")),
                        (false, false) => Err(failed("No chain/target/match by that name.")),
                    }
                }
                IPTABLES => {
                    // -w 5 -t TABLE OP CHAIN ARGS...
                    let rule = format!("{} {}", args[3], args[5..].join(" "));
                    let present = self.rules.contains(&rule);
                    match (args[4], present) {
                        ("-C", true) => Ok(String::new()),
                        ("-I", _) => Ok(self.rules.insert(rule)).map(|_| String::new()),
                        ("-D", true) => Ok(self.rules.remove(&rule)).map(|_| String::new()),
                        _ => Err(failed("Bad rule (does a matching rule exist in that chain?).")),
                    }
                }
                _ => Ok(String::new()),
            }
        }
    }

    fn options() -> Options {
        Options {
            node_name: "node-a".into(),
            node_ips: vec![Ipv4Addr::new(192, 168, 100, 11)],
            nodeport_addresses: vec![],
            cluster_cidr: None,
            masquerade_all: false,
            localhost_nodeports: true,
            nfacct: false,
            random_fully: true,
            conntrack_tcp_liberal: false,
        }
    }

    fn web(endpoints: &[&str]) -> Model {
        let eps: Vec<String> = endpoints.iter().map(|e| format!("{{addresses: [{e}]}}")).collect();
        crate::source::model_from_yaml(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{name: dns, port: 53, protocol: UDP}}]}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: other}}\nspec: {{clusterIP: 10.96.0.11, ports: [{{port: 80}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: dns, port: 5353, protocol: UDP}}]\nendpoints: [{}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: other-1, labels: {{kubernetes.io/service-name: other}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [10.244.9.9]}}]\n",
            eps.join(", ")
        ))
    }

    fn restores(fake: &Fake) -> Vec<&String> {
        fake.log.iter().filter(|l| l.starts_with(RESTORE)).collect()
    }

    #[test]
    fn the_first_sync_is_full_and_the_next_rewrites_only_what_changed() {
        let mut backend = IptablesBackend::new(Fake::default(), options());
        let report = backend.sync(&web(&["10.244.1.2", "10.244.1.3"])).unwrap();
        assert!(report.full);
        let log = backend.runner.log.join("\n");
        assert!(log.contains("iptables -w 5 -t mangle -N KUBE-PROXY-CANARY"), "{log}");
        assert!(log.contains("iptables -w 5 -t nat -I PREROUTING -m comment --comment kubernetes service portals -j KUBE-SERVICES"), "{log}");
        // Six top-level filter and four nat chains; web's SVC and two SEPs,
        // other's SVC and SEP.
        assert_eq!(report.chains_written, 6 + 4 + 3 + 2);

        backend.runner.log.clear();
        let report = backend.sync(&web(&["10.244.1.3"])).unwrap();
        assert!(!report.full);
        assert_eq!(report.chains_deleted, 1, "web's SEP for 10.244.1.2");
        // The top-level chains and web's SVC; nothing of `other`.
        assert_eq!(report.chains_written, 6 + 4 + 1);
        assert!(!backend.runner.log.iter().any(|l| l.contains("-N ") || l.contains("-I ")));
        assert_eq!(backend.runner.rules.len(), 14, "the jumps, once");
        // The removed endpoint's UDP flows are deleted.
        assert!(
            backend.runner.log.contains(
                &"conntrack -D -p udp --orig-dst 10.96.0.10 --orig-port-dst 53 --dst-nat 10.244.1.2"
                    .to_string()
            ),
            "{:?}",
            backend.runner.log
        );
        assert!(!backend.runner.chains["nat"].iter().any(|c| c == "KUBE-SEP-BFA6ODZ6ZPLOWUHI"));
    }

    #[test]
    fn a_failed_restore_makes_the_next_sync_full() {
        let mut backend = IptablesBackend::new(Fake::default(), options());
        backend.sync(&web(&["10.244.1.2"])).unwrap();
        backend.runner.failing_restores = 1;
        let err = backend.sync(&web(&["10.244.1.3"])).unwrap_err();
        assert!(matches!(err, IptablesError::Restore(_)), "{err}");
        assert!(backend.full_sync_due());
        let report = backend.sync(&web(&["10.244.1.3"])).unwrap();
        assert!(report.full);
        // The full sync found the old endpoint's chain in the kernel and
        // deleted it.
        assert_eq!(report.chains_deleted, 1);
        assert_eq!(restores(&backend.runner).len(), 3);
    }

    #[test]
    fn a_vanished_canary_forces_a_full_sync() {
        let mut backend = IptablesBackend::new(Fake::default(), options());
        backend.sync(&web(&["10.244.1.2"])).unwrap();
        assert_eq!(backend.canary_gone(), None);
        assert!(!backend.full_sync_due());
        backend.runner.chains.clear();
        assert_eq!(backend.canary_gone(), Some("mangle"));
        assert!(backend.full_sync_due());
        backend.runner.log.clear();
        assert!(backend.sync(&web(&["10.244.1.2"])).unwrap().full);
        // Flows made while the rules were missing are looked for.
        assert!(backend.runner.log.contains(&"conntrack -L".to_string()));
        assert_eq!(backend.canary_gone(), None);
    }

    #[test]
    fn cleanup_deletes_the_jumps_and_only_our_chains() {
        let mut fake = Fake::default();
        let mut backend = IptablesBackend::new(fake, options());
        backend.sync(&web(&["10.244.1.2"])).unwrap();
        fake = backend.runner;
        fake.chains.get_mut("filter").unwrap().insert("CUSTOM-CHAIN".into());
        fake.log.clear();
        let deleted = cleanup(&mut fake).unwrap();
        assert_eq!(deleted, 3 + 6 + 4 + 4, "canaries, filter, nat and service chains");
        assert_eq!(fake.chains["filter"].iter().collect::<Vec<_>>(), ["CUSTOM-CHAIN"]);
        assert!(fake.chains["nat"].is_empty() && fake.chains["mangle"].is_empty());
        assert!(fake.rules.is_empty(), "jumps left: {:?}", fake.rules);
    }

    #[test]
    fn saved_chains_are_read_from_declarations() {
        let saved = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-SEP-Y\nCOMMIT\n";
        assert_eq!(saved_chains(saved).collect::<Vec<_>>(), ["PREROUTING", "KUBE-SVC-X"]);
    }
}
