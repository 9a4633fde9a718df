//! The nftables mode: the ruleset kube-proxy's nftables mode writes, from
//! the same model as the other modes, applied as kube-proxy's knftables
//! applies it: `nft -f -` of a text transaction, one per sync and family,
//! which the kernel applies whole or not at all. `render` is pure (model →
//! ruleset, and the transactions that write it), `datapath` drives it.
//!
//! A full sync (the first, after any failure, when the table was deleted
//! or flushed by someone, and hourly) rewrites every chain and element and
//! removes the per-service chains and affinity sets the kernel holds that
//! the ruleset no longer has; a partial sync writes only the chains,
//! elements and affinity sets that differ from what the last sync applied.
//! A chain no longer used is flushed at once and deleted at a later sync
//! (as kube-proxy does: before Linux 6.2 the kernel notices a moment late
//! that no map element jumps to it).

pub mod datapath;
pub mod render;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    io,
    sync::Arc,
    time::{Duration, Instant},
};

use self::render::{
    Applied, ElementKey, Existing, Options, Ruleset, SyncWriter, TABLE, Transaction,
    is_affinity_set, is_service_chain, render_port,
};
use crate::{
    backend::{
        conntrack_flows::{ConntrackFlows, FlowReport},
        iptables::{
            FULL_SYNC_PERIOD,
            exec::{ExecError, Runner},
            lines_around,
        },
    },
    model::{IpFamily, Model, ServicePort, ServicePortName},
};

/// The ports a sync renders again: their parts as applied and as they are
/// now, and each port as it is now (`None`: removed).
struct Change {
    old: Ruleset,
    new: Ruleset,
    ports: Vec<(Arc<ServicePortName>, Option<ServicePort>)>,
}

const NFT: &str = "nft";
/// A flushed chain is deleted this long after, at the next sync.
const STALE_CHAIN_DELAY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum NftablesError {
    #[error("nft refused the ruleset ({} sync): {source}{context}", if *.full { "full" } else { "partial" })]
    Apply { full: bool, source: ExecError, context: String },
    #[error("listing table {family} {TABLE}: {source}")]
    List { family: &'static str, source: ExecError },
    #[error("removing the nftables mode's tables: {}", .0.join("; "))]
    Cleanup(Vec<String>),
}

/// What a sync did.
#[derive(Debug, Default)]
pub struct SyncReport {
    pub full: bool,
    /// Per-service chains written.
    pub chains_written: usize,
    /// Per-service chains deleted (flushed by an earlier sync).
    pub chains_deleted: usize,
    /// Set and map elements added or deleted.
    pub elements_written: usize,
    /// Stale chains whose deletion failed (a later full sync finds them).
    pub cleanup_error: Option<String>,
    /// The conntrack entries deleted after the ruleset was applied.
    pub flows: FlowReport,
}

/// A sync's transaction as written, what it applies, the ports it was
/// rendered from and whether two of them claim one element.
struct Written {
    tx: Transaction,
    applied: Applied,
    ports: HashMap<Arc<ServicePortName>, ServicePort>,
    conflicts: bool,
}

/// Adds every port of `model` to `writer`, writing its text into `out` as
/// it goes, then ends it (`existing`: see [`SyncWriter::finish`]): the
/// transaction's text is all in `out`. Each port is rendered twice, its
/// chains declared in a first pass and filled in a second (see
/// [`SyncWriter::declare`]), rather than every port's part held.
fn write_ports(
    mut writer: SyncWriter,
    model: &Model,
    options: &Options,
    existing: Option<&Existing>,
    out: &mut dyn io::Write,
) -> io::Result<Written> {
    for port in model.ports_of(options.family) {
        writer.declare(&render_port(port, options));
        writer.drain_into(out)?;
    }
    let mut ports = HashMap::new();
    let mut conflicts = false;
    for port in model.ports_of(options.family) {
        conflicts |= writer.fill(&render_port(port, options));
        writer.drain_into(out)?;
        ports.insert(port.name.clone(), port.clone());
    }
    let (mut tx, applied) = writer.finish(existing);
    out.write_all(tx.text.as_bytes())?;
    tx.text.clear();
    Ok(Written { tx, applied, ports, conflicts })
}

/// A transaction nft did not get whole.
fn unwritten(full: bool, source: io::Error) -> NftablesError {
    NftablesError::Apply {
        full,
        source: ExecError::Io { program: NFT.into(), source },
        context: String::new(),
    }
}

/// `ip` or `ip6`: the table's family as nft names it.
fn nft_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// The line nft names in `stderr` (`/dev/stdin:7:1-30: Error: …`), with
/// the lines around it.
fn transaction_context(input: &str, stderr: &str) -> String {
    let line = stderr.split("/dev/stdin:").nth(1).and_then(|rest| {
        rest.chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
    });
    line.map_or_else(String::new, |line| lines_around(input, line))
}

/// nft's word for a table, chain or set that is not there.
fn is_absent(e: &ExecError) -> bool {
    matches!(e, ExecError::Failed { stderr, .. } if stderr.contains("No such file or directory"))
}

/// The names of the chains and of the sets (and maps) of our table in
/// `nft list chains|sets` output, which lists every table of a family.
fn listed(text: &str, what: &str) -> Vec<String> {
    let mut ours = false;
    let mut names = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["table", _, table, "{"] => ours = *table == TABLE,
            [kind, name, "{"] if ours && *kind == what => names.push(name.to_string()),
            _ => {}
        }
    }
    names
}

/// Whether `family`'s table is listed in `nft -t list sets` output (ours
/// always has sets). The cheapest look with any nft: nft 1.0.6 reads every
/// rule of every table to list one chain or the tables (0.9 s and 3.3 s
/// beside 10,000 services, 37 s to list one chain beside 100,000), and
/// every element of a set to list it (0.56 s at 100,000), not for this.
fn lists_table(sets: &str, family: &str) -> bool {
    sets.lines().any(|l| l.split_whitespace().eq(["table", family, TABLE, "{"]))
}

/// Whether `family`'s table lost its dispatch rule (`services` looking up
/// `service-ips`): someone flushed its rules, or deleted it. Slow with nft
/// 1.0.6 (above): the datapath runs it beside the loop.
pub fn rules_gone(runner: &mut impl Runner, family: IpFamily) -> Result<bool, ExecError> {
    let family = nft_family(family);
    match runner.run(NFT, &["-t", "list", "chain", family, TABLE, "services"], None) {
        Ok(text) => Ok(!text.contains("@service-ips")),
        Err(e) if is_absent(&e) => Ok(true),
        Err(e) => Err(e),
    }
}

pub struct NftablesBackend<R: Runner> {
    runner: R,
    options: Options,
    /// What the kernel's table holds; `None`: the next sync is full.
    applied: Option<Applied>,
    /// Each port as its part of what was applied was rendered from: a
    /// sync renders only the ports that differ, and their parts as applied
    /// again from these (rendering is pure; a port's text is not kept).
    /// `None` while two ports claim one element.
    ports: Option<HashMap<Arc<ServicePortName>, ServicePort>>,
    last_full: Option<Instant>,
    /// A full sync of this agent made the base chains anew (the first
    /// does: another version may have left them with other priorities).
    base_chains_made: bool,
    /// Chains flushed as no longer used, and since when.
    stale: BTreeMap<String, Instant>,
    stale_delay: Duration,
    /// The conntrack entries owed a deletion.
    flows: ConntrackFlows,
    /// The table was missing (deleted or flushed by someone, or nobody
    /// wrote it yet): flows to services made meanwhile were not translated.
    table_was_missing: bool,
}

impl<R: Runner> NftablesBackend<R> {
    pub fn new(runner: R, options: Options) -> Self {
        NftablesBackend {
            runner,
            flows: ConntrackFlows::new(options.family),
            options,
            applied: None,
            ports: None,
            last_full: None,
            base_chains_made: false,
            stale: BTreeMap::new(),
            stale_delay: STALE_CHAIN_DELAY,
            table_was_missing: false,
        }
    }

    /// The family whose table it writes.
    pub fn family(&self) -> IpFamily {
        self.options.family
    }

    fn nft_family(&self) -> &'static str {
        nft_family(self.options.family)
    }

    /// This node's zone changed: the next sync renders every port for the
    /// new one.
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.options.zone = zone;
        self.ports = None;
    }

    /// Whether the next sync will be a full one.
    pub fn full_sync_due(&self) -> bool {
        self.applied.is_none() || self.last_full.is_none_or(|t| t.elapsed() >= FULL_SYNC_PERIOD)
    }

    /// Makes the kernel's table that of `model`, in one transaction. After
    /// a failure the next sync is a full one.
    pub fn sync(&mut self, model: &Model) -> Result<SyncReport, NftablesError> {
        let mut report = SyncReport::default();
        self.delete_stale_chains(&mut report);
        let full = self.full_sync_due();
        if self.last_full.is_none() {
            // First sync: a previous agent's table may be serving.
            self.table_was_missing = !self.table_present();
        }
        let tx = match self.applied.take() {
            Some(applied) if !full => match self.changed_ports(model, &applied) {
                Some(change) => self.sync_change(change, applied)?,
                None => self.sync_whole(model, Some(applied))?,
            },
            _ => self.sync_whole(model, None)?,
        };
        report.full = full;
        report.chains_written = tx.chains_written;
        report.elements_written = tx.elements_written;
        let node_ips = &self.options.node_ips;
        self.flows.after_sync(&mut self.runner, model, node_ips, &mut report.flows);
        if self.table_was_missing {
            self.flows.delete_untranslated(&mut self.runner, model, node_ips, &mut report.flows);
            self.table_was_missing = false;
        }
        Ok(report)
    }

    /// Renders every port and writes the whole ruleset (no `applied`: a
    /// full sync) or what differs from `applied`, a port at a time; keeps
    /// the ports for the next syncs (none while two ports claim one
    /// element: then every sync renders whole).
    fn sync_whole(
        &mut self,
        model: &Model,
        applied: Option<Applied>,
    ) -> Result<Transaction, NftablesError> {
        self.ports = None;
        let full = applied.is_none();
        let Written { tx, applied: after, ports, conflicts } = match &applied {
            Some(applied) => {
                let writer = SyncWriter::partial(self.options.family, applied);
                let mut text = Vec::new();
                let mut written = write_ports(writer, model, &self.options, None, &mut text)
                    .map_err(|e| unwritten(false, e))?;
                written.tx.text = String::from_utf8_lossy(&text).into_owned();
                self.apply(&written.tx, false)?;
                written
            }
            None => self.apply_full(model)?,
        };
        if full {
            self.base_chains_made = true;
            self.last_full = Some(Instant::now());
        }
        self.stale.retain(|chain, _| !after.has_chain(chain));
        self.note_stale(&tx);
        self.applied = Some(after);
        self.ports = (!conflicts).then_some(ports);
        Ok(tx)
    }

    /// A full sync, its transaction written into nft's standard input a
    /// port at a time (at 10,000 services × 10 endpoints it is 50 MB of
    /// text, which the agent would otherwise hold).
    fn apply_full(&mut self, model: &Model) -> Result<Written, NftablesError> {
        let existing = self.existing()?;
        let recreate = !self.base_chains_made;
        let options = &self.options;
        let write = |out: &mut dyn io::Write| {
            let writer = SyncWriter::full(&render::fixed(options), recreate);
            write_ports(writer, model, options, Some(&existing), out)
        };
        let mut written = None;
        let result = self.runner.run_writing(NFT, &["-f", "-"], &mut |pipe| {
            written = Some(write(pipe)?);
            Ok(())
        });
        let context = |source: &ExecError| match source {
            // Not kept: written again for the lines nft names.
            ExecError::Failed { stderr, .. } => {
                let mut text = Vec::new();
                let _ = write(&mut text);
                transaction_context(&String::from_utf8_lossy(&text), stderr)
            }
            _ => String::new(),
        };
        match (result, written) {
            (Ok(_), Some(written)) => Ok(written),
            (Err(source), _) => {
                Err(NftablesError::Apply { full: true, context: context(&source), source })
            }
            (Ok(_), None) => Err(unwritten(true, io::Error::other("nothing written"))),
        }
    }

    /// The ports that differ from the ports kept (added, changed, removed),
    /// their old and new parts rendered; `None` without ports kept, or
    /// when a new element's key is another port's (two ports claim it: the
    /// caller renders whole).
    fn changed_ports(&self, model: &Model, applied: &Applied) -> Option<Change> {
        let ports = self.ports.as_ref()?;
        let family = self.options.family;
        let mut change = Change {
            old: Ruleset::new(family, None),
            new: Ruleset::new(family, None),
            ports: Vec::new(),
        };
        let mut seen: HashSet<&ServicePortName> = HashSet::new();
        let mut conflict = false;
        for port in model.ports_of(family) {
            seen.insert(&port.name);
            let kept = ports.get(&port.name);
            if kept.is_some_and(|was| was == port) {
                continue;
            }
            if let Some(was) = kept {
                change.old.absorb(&render_port(was, &self.options));
            }
            conflict |= change.new.absorb(&render_port(port, &self.options));
            change.ports.push((port.name.clone(), Some(port.clone())));
        }
        for (name, was) in ports.iter().filter(|(name, _)| !seen.contains(&***name)) {
            change.old.absorb(&render_port(was, &self.options));
            change.ports.push((name.clone(), None));
        }
        let old_keys: HashSet<&ElementKey> = change.old.own_element_keys().collect();
        let taken = |key: &ElementKey| applied.has_element(key) && !old_keys.contains(key);
        conflict |= change.new.own_element_keys().any(taken);
        drop(old_keys);
        (!conflict).then_some(change)
    }

    /// Writes what differs in the ports of `change`: a change costs what it
    /// changes, plus a comparison per port.
    fn sync_change(
        &mut self,
        change: Change,
        mut applied: Applied,
    ) -> Result<Transaction, NftablesError> {
        let tx = change.new.partial(&change.old.applied());
        self.apply(&tx, false)?;
        applied.replace(&change.old, &change.new);
        self.applied = Some(applied);
        if let Some(ports) = self.ports.as_mut() {
            for (name, port) in change.ports {
                match port {
                    Some(port) => ports.insert(name, port),
                    None => ports.remove(&name),
                };
            }
        }
        self.stale.retain(|chain, _| !change.new.has_chain(chain));
        self.note_stale(&tx);
        Ok(tx)
    }

    /// Runs `tx` (nothing when it is empty); a refusal names its line.
    fn apply(&mut self, tx: &Transaction, full: bool) -> Result<(), NftablesError> {
        if tx.text.is_empty() {
            return Ok(());
        }
        self.runner.run(NFT, &["-f", "-"], Some(&tx.text)).map(drop).map_err(|source| {
            let context = match &source {
                ExecError::Failed { stderr, .. } => transaction_context(&tx.text, stderr),
                _ => String::new(),
            };
            NftablesError::Apply { full, source, context }
        })
    }

    /// The chains `tx` flushed, to delete a while later.
    fn note_stale(&mut self, tx: &Transaction) {
        let now = Instant::now();
        self.stale.extend(tx.stale_chains.iter().map(|c| (c.clone(), now)));
    }

    /// Whether chains flushed long enough ago wait for a sync to delete
    /// them (one with nothing else to write deletes them alone).
    pub fn stale_chains_due(&self) -> bool {
        self.stale.values().any(|since| since.elapsed() >= self.stale_delay)
    }

    /// Deletes the chains flushed long enough ago, in a transaction of
    /// their own; those it cannot delete are left to a full sync.
    fn delete_stale_chains(&mut self, report: &mut SyncReport) {
        let due: Vec<String> = self
            .stale
            .iter()
            .filter(|(_, since)| since.elapsed() >= self.stale_delay)
            .map(|(chain, _)| chain.clone())
            .collect();
        if due.is_empty() {
            return;
        }
        let family = self.nft_family();
        let text: String =
            due.iter().map(|c| format!("delete chain {family} {TABLE} {c}\n")).collect();
        due.iter().for_each(|c| {
            self.stale.remove(c);
        });
        match self.runner.run(NFT, &["-f", "-"], Some(&text)) {
            Ok(_) => report.chains_deleted = due.len(),
            Err(e) => report.cleanup_error = Some(e.to_string()),
        }
    }

    /// The per-service chains and the sets of the kernel's table (none
    /// when it is not there).
    fn existing(&mut self) -> Result<Existing, NftablesError> {
        let family = self.nft_family();
        let mut list = |what: &str, kind: &str| -> Result<Vec<String>, NftablesError> {
            match self.runner.run(NFT, &["-t", "list", what, family], None) {
                Ok(text) => Ok(listed(&text, kind)),
                Err(e) if is_absent(&e) => Ok(Vec::new()),
                Err(source) => Err(NftablesError::List { family, source }),
            }
        };
        let chains = list("chains", "chain")?.into_iter().filter(|c| is_service_chain(c));
        let sets = list("sets", "set")?.into_iter().filter(|s| is_affinity_set(s));
        Ok(Existing { chains: chains.collect(), sets: sets.collect() })
    }

    /// Whether the table is there; when nft cannot tell, taken as yes (but
    /// not without nft: nothing of ours can be there).
    pub fn table_present(&mut self) -> bool {
        match self.table_gone_now() {
            Ok(gone) => !gone,
            Err(ExecError::Missing { .. }) => false,
            Err(_) => true,
        }
    }

    fn table_gone_now(&mut self) -> Result<bool, ExecError> {
        let family = self.nft_family();
        let sets = self.runner.run(NFT, &["-t", "list", "sets", family], None)?;
        Ok(!lists_table(&sets, family))
    }

    /// Whether someone deleted the table since the last sync: then the
    /// next sync is a full one ([`NftablesBackend::lost_its_rules`]).
    pub fn table_gone(&mut self) -> Result<bool, ExecError> {
        let gone = self.table_gone_now()?;
        if gone {
            self.lost_its_rules();
        }
        Ok(gone)
    }

    /// The table was deleted or its rules flushed by someone: the next
    /// sync is a full one, and the flows made meanwhile are looked at.
    pub fn lost_its_rules(&mut self) {
        self.applied = None;
        self.table_was_missing = true;
    }
}

/// Removes the nftables mode's tables (`ip kube-proxy`, `ip6 kube-proxy`)
/// where `nft -t list sets` shows them (ours always has sets): nothing more
/// to do on a clean node (an agent of another mode runs this at every
/// start), nor where nft is not installed. Not `nft list tables`: nft 1.0.6
/// reads every rule of every table for it, 3.3 s beside 10,000 services
/// and minutes beside 100,000. Returns the number of tables deleted.
pub fn cleanup(runner: &mut impl Runner) -> Result<usize, NftablesError> {
    let mut deleted = 0;
    let mut errors = Vec::new();
    for family in IpFamily::ALL.map(nft_family) {
        let sets = match runner.run(NFT, &["-t", "list", "sets", family], None) {
            Ok(sets) => sets,
            Err(ExecError::Missing { .. }) => return Ok(0),
            Err(e) => {
                errors.push(format!("listing the {family} sets: {e}"));
                continue;
            }
        };
        if !lists_table(&sets, family) {
            continue;
        }
        match runner.run(NFT, &["delete", "table", family, TABLE], None) {
            Ok(_) => deleted += 1,
            Err(e) if is_absent(&e) => {}
            Err(e) => errors.push(format!("{family} {TABLE}: {e}")),
        }
    }
    if errors.is_empty() { Ok(deleted) } else { Err(NftablesError::Cleanup(errors)) }
}

#[cfg(test)]
mod tests;
