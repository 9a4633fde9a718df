//! The iptables mode's per-service counters: the packet counters of
//! kube-proxy's rules (`iptables-save -c`, each family's), read for
//! [`crate::service_stats`] at most every few seconds and before each sync
//! rewrites (and so zeroes) them.

use std::time::Duration;

use super::exec::{Runner, System};
use crate::service_stats::{self, Coverage, Ids, Snapshot, Source};

/// A copy of every table per read: not for every scrape of a large ruleset.
const MIN_INTERVAL: Duration = Duration::from_secs(5);

pub struct RuleCounters {
    /// Each family's tools.
    systems: Vec<System>,
    /// Ids of the rules, by family, table and text.
    ids: Ids,
}

impl RuleCounters {
    pub fn new(systems: Vec<System>) -> Self {
        RuleCounters { systems, ids: Ids::default() }
    }
}

impl Source for RuleCounters {
    fn read(&mut self) -> anyhow::Result<Snapshot> {
        let mut rules = Vec::new();
        for (family, system) in self.systems.iter_mut().enumerate() {
            let saved = system.run("iptables-save", &["-c"], None)?;
            rules.extend(
                service_stats::rule_counters(&saved)
                    .into_iter()
                    .map(|(rule, name, stats)| (format!("{family} {rule}"), name, stats)),
            );
        }
        let ids = self.ids.assign(rules.iter().map(|(rule, _, _)| rule.as_str()));
        let frontends = ids
            .into_iter()
            .zip(rules)
            .map(|(id, (_, name, stats))| (id, Some(name), stats))
            .collect();
        // Rules have no map: a rewritten rule counts from zero, which the
        // totals tell by its counters going down.
        Ok(Snapshot { map_id: 0, frontends })
    }

    fn coverage(&self) -> Coverage {
        Coverage::Rules
    }

    fn min_interval(&self) -> Duration {
        MIN_INTERVAL
    }
}
