//! How many flows a node tracks, as kube-proxy sizes the kernel's conntrack
//! table: `--conntrack-max-per-core` times the CPUs, at least
//! `--conntrack-min` (its flags and `conntrack.maxPerCore`/`min`). The
//! iptables and nftables modes raise `nf_conntrack_max` to it as kube-proxy does; the
//! eBPF mode sizes its flow maps by it (`ebpf::state_sizes`). Pure: the
//! CPU count and the kernel's values are handed in.

/// kube-proxy's defaults.
pub const DEFAULT_MAX_PER_CORE: u32 = 32_768;
pub const DEFAULT_MIN: u32 = 131_072;

/// `--conntrack-max-per-core` and `--conntrack-min`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackLimit {
    pub max_per_core: u32,
    pub min: u32,
}

impl Default for ConntrackLimit {
    fn default() -> Self {
        ConntrackLimit { max_per_core: DEFAULT_MAX_PER_CORE, min: DEFAULT_MIN }
    }
}

impl ConntrackLimit {
    /// The flows tracked on a node of `cpus` CPUs; `None` with 0 per core,
    /// which tells kube-proxy to leave `nf_conntrack_max` as it is.
    pub fn max(self, cpus: u32) -> Option<u32> {
        (self.max_per_core > 0).then(|| self.max_per_core.saturating_mul(cpus).max(self.min))
    }
}

/// What the iptables mode writes to the kernel (kube-proxy's rules):
/// `nf_conntrack_max` only ever raised, and the hash table's buckets
/// (`nf_conntrack`'s `hashsize`) set to a quarter of the maximum where
/// they are fewer, whether or not the maximum was raised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelWrites {
    pub max: Option<u32>,
    pub hashsize: Option<u32>,
}

/// The writes that bring the kernel's `current_max` and `current_hashsize`
/// (unreadable: not written) to `max`.
pub fn kernel_writes(max: u32, current_max: u32, current_hashsize: Option<u32>) -> KernelWrites {
    let buckets = max / 4;
    KernelWrites {
        max: (current_max < max).then_some(max),
        hashsize: current_hashsize.filter(|&h| h < buckets).map(|_| buckets),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_maximum_is_per_core_times_cpus_at_least_the_minimum() {
        let default = ConntrackLimit::default();
        assert_eq!(default.max(2), Some(131_072), "the minimum on a small node");
        assert_eq!(default.max(4), Some(131_072));
        assert_eq!(default.max(8), Some(262_144), "32768 per core beyond 4 CPUs");
        let limit = ConntrackLimit { max_per_core: 1000, min: 0 };
        assert_eq!(limit.max(3), Some(3000));
        let huge = ConntrackLimit { max_per_core: u32::MAX, min: 0 };
        assert_eq!(huge.max(4), Some(u32::MAX), "saturates");
    }

    #[test]
    fn zero_per_core_leaves_the_kernel_alone() {
        let off = ConntrackLimit { max_per_core: 0, min: 131_072 };
        assert_eq!(off.max(64), None);
    }

    #[test]
    fn the_kernel_is_only_raised() {
        let none = KernelWrites { max: None, hashsize: None };
        assert_eq!(kernel_writes(131_072, 262_144, Some(65_536)), none);
        assert_eq!(kernel_writes(131_072, 131_072, Some(32_768)), none, "equal: nothing");
        let raised = kernel_writes(524_288, 262_144, Some(65_536));
        assert_eq!(raised, KernelWrites { max: Some(524_288), hashsize: Some(131_072) });
    }

    #[test]
    fn the_hash_size_follows_even_when_the_maximum_is_high_enough() {
        // kube-proxy checks the buckets after the maximum, raised or not.
        let writes = kernel_writes(131_072, 262_144, Some(16_384));
        assert_eq!(writes, KernelWrites { max: None, hashsize: Some(32_768) });
        assert_eq!(kernel_writes(131_072, 0, None).hashsize, None, "unreadable: not written");
    }
}
