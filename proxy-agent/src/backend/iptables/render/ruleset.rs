//! The rules as tables of chains, and the restore input of them: whole, or
//! only the chains that changed.

use std::{
    collections::{BTreeMap, HashSet},
    fmt::{self, Write as _},
    hash::{DefaultHasher, Hasher as _},
};

use crate::backend::iptables::chains::is_service_chain;

/// One table's part of the restore input: its chains in declaration order,
/// and its `-A` lines in kube-proxy's order.
#[derive(Clone, Debug, Default)]
pub(super) struct Table {
    chains: Vec<String>,
    rules: Vec<String>,
}

impl Table {
    pub(super) fn chain(&mut self, name: &str) {
        self.chains.push(name.to_string());
    }

    pub(super) fn rule(&mut self, chain: &str, words: &[&str]) {
        self.rules.push(format!("-A {chain} {}", words.join(" ")));
    }

    /// Writes the chains and rules `include` selects, then declares and
    /// deletes the `stale` chains (after the rules that referenced them are
    /// flushed or rewritten).
    fn write(&self, out: &mut String, table: &str, include: impl Fn(&str) -> bool, stale: &[&str]) {
        let _ = writeln!(out, "*{table}");
        for chain in self
            .chains
            .iter()
            .map(String::as_str)
            .filter(|c| include(c))
            .chain(stale.iter().copied())
        {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        for line in self.rules.iter().filter(|line| include(rule_chain(line))) {
            let _ = writeln!(out, "{line}");
        }
        for chain in stale {
            let _ = writeln!(out, "-X {chain}");
        }
        let _ = writeln!(out, "COMMIT");
    }

    /// A digest of each chain's rules (chains without rules included).
    fn digests(&self) -> BTreeMap<&str, u64> {
        let mut hashers: BTreeMap<&str, DefaultHasher> =
            self.chains.iter().map(|c| (c.as_str(), DefaultHasher::new())).collect();
        for line in &self.rules {
            hashers.entry(rule_chain(line)).or_default().write(line.as_bytes());
        }
        hashers.into_iter().map(|(chain, h)| (chain, h.finish())).collect()
    }
}

/// The chain of an `-A CHAIN …` line.
fn rule_chain(line: &str) -> &str {
    line.split(' ').nth(1).unwrap_or_default()
}

/// The tables kube-proxy's iptables mode writes, as `iptables-restore`
/// input. `Display` gives a full sync's input.
#[derive(Clone, Debug, Default)]
pub struct Ruleset {
    pub(super) filter: Table,
    pub(super) nat: Table,
}

/// A table and one of its chains.
pub type ChainRef = (&'static str, String);

/// A digest of each chain's rules, to tell which chains changed.
pub type Digests = BTreeMap<ChainRef, u64>;

/// Which chains a restore rewrites.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// Every chain: a full sync.
    Full,
    /// The top-level chains, and the per-service chains whose rules differ
    /// from these digests of what was applied: a partial sync.
    ChangedSince(&'a Digests),
}

impl Ruleset {
    fn tables(&self) -> [(&'static str, &Table); 2] {
        [("filter", &self.filter), ("nat", &self.nat)]
    }

    pub fn digests(&self) -> Digests {
        self.tables()
            .into_iter()
            .flat_map(|(name, table)| {
                table.digests().into_iter().map(move |(c, d)| ((name, c.to_string()), d))
            })
            .collect()
    }

    /// The per-service chains among `existing` that this ruleset no longer
    /// has: a restore deletes them.
    pub fn stale_chains<'a>(
        &self,
        existing: impl IntoIterator<Item = &'a ChainRef>,
    ) -> Vec<ChainRef> {
        let current: HashSet<(&str, &str)> = self
            .tables()
            .into_iter()
            .flat_map(|(name, table)| table.chains.iter().map(move |c| (name, c.as_str())))
            .collect();
        existing
            .into_iter()
            .filter(|(table, chain)| is_service_chain(chain) && !current.contains(&(*table, chain)))
            .cloned()
            .collect()
    }

    /// The `iptables-restore --noflush` input for `scope`, deleting `stale`.
    pub fn restore_input(&self, scope: Scope, stale: &[ChainRef]) -> String {
        let digests = match scope {
            Scope::Full => Digests::new(),
            Scope::ChangedSince(_) => self.digests(),
        };
        let mut out = String::new();
        for (name, table) in self.tables() {
            let include = |chain: &str| match scope {
                Scope::Full => true,
                Scope::ChangedSince(applied) => {
                    let key = (name, chain.to_string());
                    !is_service_chain(chain) || applied.get(&key) != digests.get(&key)
                }
            };
            let stale: Vec<&str> =
                stale.iter().filter(|(t, _)| *t == name).map(|(_, c)| c.as_str()).collect();
            table.write(&mut out, name, include, &stale);
        }
        out
    }
}

impl fmt::Display for Ruleset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.restore_input(Scope::Full, &[]))
    }
}
