//! What the kernel can run, and the mode `auto` picks from it. The checks
//! are real (BTF support as aya detects it, the cgroup2 mount, loading and
//! verifying the very programs the agent would attach); the decision is a
//! pure function of their results.

use std::fmt::Write as _;

use aya::util::KernelVersion;

use super::{
    ebpf::{BpfObject, TcAttach, on_demand::Group},
    iptables::exec::{Runner as _, System},
};
use crate::{model::IpFamily, sys};

/// One kernel feature and whether this kernel has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Feature {
    pub name: &'static str,
    /// Without it the eBPF mode cannot run.
    pub required: bool,
    pub found: bool,
    /// What was found, or why not: whole (a failed load carries the
    /// verifier's log), as `--verbose` prints it.
    pub detail: String,
}

/// Where a load error's verifier log starts (aya's wording).
const VERIFIER_LOG: &str = "Verifier output:";

impl Feature {
    /// The detail on one line: up to the verifier log, if any, or the
    /// first line; says when more is left for `--verbose`.
    pub fn summary(&self) -> String {
        let head = self.detail.split(VERIFIER_LOG).next().unwrap_or_default();
        let head = head.lines().next().unwrap_or_default().trim_end().trim_end_matches('.');
        if head.len() == self.detail.trim_end().len() {
            head.to_string()
        } else {
            format!("{head} (whole detail: --verbose)")
        }
    }
}

/// The mode `--proxy-mode auto` picks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Ebpf,
    /// nft takes the nftables mode's ruleset; `missing` is the first
    /// missing feature the eBPF mode needs.
    Nftables {
        missing: &'static str,
    },
    /// Neither: the first missing feature the eBPF mode needs.
    Iptables {
        missing: &'static str,
    },
}

pub const BTF: &str = "BTF (kernel type information for BPF objects)";
pub const CGROUP2: &str = "cgroup v2 mounted";
pub const PROGRAMS: &str = "programs load (cgroup sock_addr, tc, helpers, BTF maps)";
pub const CGROUP_LINKS: &str = "bpf_link for cgroups (5.7+)";
pub const TCX: &str = "TCX attachment (6.6+; else clsact filters)";
pub const SOCK_ITERATORS: &str = "bpf_sock_destroy from socket iterators (6.5+)";
pub const SOCK_DESTROY: &str = "sock_diag SOCK_DESTROY (ends sockets to removed pods)";
pub const SET_RETVAL: &str = "bpf_set_retval (5.18+; else refusals are EPERM)";
pub const IPV6: &str = "IPv6 stack and ip6tables (IPv6 services)";
pub const MAGLEV: &str = "Maglev (--bpf-lb-algorithm maglev)";
pub const DSR: &str = "DSR (--bpf-lb-mode dsr|hybrid)";
pub const NETNS_COOKIE: &str = "network namespace cookie (SO_NETNS_COOKIE, 5.14+)";
pub const SCTP_SOCKETS: &str = "SCTP sockets (pods here speaking SCTP)";
pub const SCTP_PROGRAMS: &str = "SCTP programs (SCTP services, eBPF mode)";
pub const SCTP_MATCH: &str = "iptables sctp match (SCTP services, iptables mode)";
pub const NFTABLES: &str = "nft 1.0.1+ takes the nftables mode's ruleset";
pub const XDP: &str = "XDP program (--bpf-lb-acceleration; links 5.9+)";

/// Picks the mode: eBPF when every required feature is there, else
/// nftables where nft takes its ruleset, else iptables.
pub fn decide(features: &[Feature]) -> Decision {
    let nftables = features.iter().any(|f| f.name == NFTABLES && f.found);
    match features.iter().find(|f| f.required && !f.found) {
        Some(missing) if nftables => Decision::Nftables { missing: missing.name },
        Some(missing) => Decision::Iptables { missing: missing.name },
        None => Decision::Ebpf,
    }
}

/// How far a probe goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// What choosing the mode needs (`--proxy-mode auto`, at every start).
    Mode,
    /// Everything, for `probe`: also the programs loaded only on demand.
    All,
}

/// Runs the checks on this kernel (needs root to load programs).
pub fn run(reach: Reach) -> Vec<Feature> {
    let kernel = KernelVersion::current().ok();
    let at_least = |major, minor| kernel.is_some_and(|v| v >= KernelVersion::new(major, minor, 0));
    let version = kernel.map_or_else(|| "unknown kernel".to_string(), |v| format!("kernel {v}"));
    let btf = aya::features().btf().is_some();
    let cgroup2 = sys::cgroup2_root();
    let mut programs = BpfObject::load(TcAttach::for_this_kernel());
    let iterators = programs.as_mut().ok().map(BpfObject::load_socket_iterators);
    let sctp_programs = match reach {
        Reach::All => programs.as_mut().ok().map(|p| p.load_group(Group::Sctp)),
        Reach::Mode => None,
    };
    let xdp = match reach {
        Reach::All => programs.as_mut().ok().map(BpfObject::load_xdp),
        Reach::Mode => None,
    };
    let destroy = super::ebpf::sock_diag::probe();
    let set_retval = crate::backend::ebpf::has_set_retval();
    let ipv6 = ipv6();
    let netns_cookie = sys::netns_cookie();
    let sctp_sockets = kernel_part(registered("/proc/net/protocols", "SCTP"), "sctp");
    // The list is ip_tables' (iptables-legacy): with nft alone it is not
    // there, and a loaded xt_sctp is in /sys/module.
    let sctp_match = kernel_part(registered("/proc/net/ip_tables_matches", "sctp"), "xt_sctp");
    let nftables = nftables();
    vec![
        Feature {
            name: BTF,
            required: true,
            found: btf,
            detail: if btf { "supported".into() } else { "BPF_BTF_LOAD refused".into() },
        },
        Feature {
            name: CGROUP2,
            required: true,
            found: cgroup2.is_ok(),
            detail: match &cgroup2 {
                Ok(path) => path.display().to_string(),
                Err(e) => e.to_string(),
            },
        },
        Feature {
            name: PROGRAMS,
            required: true,
            found: programs.is_ok(),
            detail: match &programs {
                Ok(_) => "verified".into(),
                Err(e) => e.to_string(),
            },
        },
        Feature {
            name: CGROUP_LINKS,
            required: true,
            found: at_least(5, 7),
            detail: version.clone(),
        },
        Feature { name: TCX, required: false, found: at_least(6, 6), detail: version },
        Feature {
            name: SET_RETVAL,
            required: false,
            found: set_retval,
            detail: if set_retval {
                "connect() to a service without endpoints: ECONNREFUSED".into()
            } else {
                "connect() to a service without endpoints: EPERM".into()
            },
        },
        Feature {
            name: SOCK_ITERATORS,
            required: false,
            found: matches!(iterators, Some(Ok(()))),
            detail: match &iterators {
                Some(Ok(())) => "verified; ends sockets to removed pods".into(),
                // The verifier's log follows on more lines: the table keeps the first.
                Some(Err(e)) => {
                    let e = e.to_string();
                    format!("{}; sock_diag is used instead", e.lines().next().unwrap_or_default())
                }
                None => "programs do not load".into(),
            },
        },
        Feature {
            name: SOCK_DESTROY,
            required: false,
            found: destroy.is_ok(),
            detail: match &destroy {
                Ok(()) => "supported".into(),
                Err(e) => format!(
                    "{e} (CONFIG_INET_DIAG_DESTROY?): connected UDP sockets keep a removed endpoint"
                ),
            },
        },
        // Both are in the programs just verified (their maps, the hash,
        // bpf_skb_adjust_room at the network layer, the FIB lookup): what
        // they need beyond that is memory and a network, said here.
        in_programs(
            MAGLEV,
            programs.is_ok(),
            "a table per external frontend that asks for it, 2 bytes an entry (32 KiB at 16381)",
        ),
        in_programs(
            DSR,
            programs.is_ok(),
            "the network between nodes must carry IPv4 options and IPv6 destination options, and let replies leave with the service's address",
        ),
        Feature {
            name: XDP,
            required: false,
            found: matches!(xdp, Some(Ok(()))),
            detail: match &xdp {
                Some(Ok(())) if at_least(5, 9) => "verified; attached by pinned links, in driver mode where the interface's driver supports it".into(),
                Some(Ok(())) => "verified; attached through netlink (no XDP links before 5.9), in driver mode where the interface's driver supports it".into(),
                Some(Err(e)) => format!("{}: --bpf-lb-acceleration cannot be used", e.to_string().lines().next().unwrap_or_default()),
                None if programs.is_err() => "programs do not load".into(),
                None => "not probed".into(),
            },
        },
        Feature {
            name: NETNS_COOKIE,
            required: false,
            found: netns_cookie.is_ok(),
            detail: match &netns_cookie {
                Ok(_) => "the socket programs tell the node's own sockets: localhost NodePorts (127.0.0.0/8) served, --socket-lb-host-netns-only possible".into(),
                Err(e) => format!("{e}: in the eBPF mode, no localhost NodePorts and no --socket-lb-host-netns-only (the iptables mode serves localhost NodePorts)"),
            },
        },
        Feature {
            name: IPV6,
            required: false,
            found: ipv6.is_ok(),
            detail: match ipv6 {
                Ok(version) => format!(
                    "enabled, {version}: both modes serve IPv6 services (the iptables mode on a node with an IPv6 address)"
                ),
                Err(why) => format!("{why}: IPv6 services are not served"),
            },
        },
        Feature {
            name: SCTP_SOCKETS,
            required: false,
            found: sctp_sockets.is_ok(),
            detail: match sctp_sockets {
                Ok(how) => how,
                Err(why) => format!("{why} (CONFIG_IP_SCTP): no pod here can open an SCTP socket"),
            },
        },
        Feature {
            name: SCTP_PROGRAMS,
            required: false,
            found: matches!(sctp_programs, Some(Ok(()))),
            detail: match &sctp_programs {
                Some(Ok(())) => "verified: the eBPF mode translates SCTP per packet (its programs loaded for the first SCTP frontend)".into(),
                Some(Err(e)) => format!("{}: the eBPF mode leaves SCTP packets untouched", e.to_string().lines().next().unwrap_or_default()),
                None if programs.is_err() => "programs do not load".into(),
                None => "not probed".into(),
            },
        },
        Feature {
            name: SCTP_MATCH,
            required: false,
            found: sctp_match.is_ok(),
            detail: match sctp_match {
                Ok(how) => format!("{how}: SCTP service ports get rules in iptables mode"),
                Err(why) => format!(
                    "{why} (CONFIG_NETFILTER_XT_MATCH_SCTP): the iptables mode leaves SCTP service ports out (the eBPF mode serves them per packet)"
                ),
            },
        },
        Feature {
            name: NFTABLES,
            required: false,
            found: nftables.is_ok(),
            detail: match nftables {
                Ok(version) => format!("{version}: --proxy-mode nftables can run"),
                Err(why) => format!("{why}: --proxy-mode nftables cannot run"),
            },
        },
    ]
}

/// kube-proxy's floor for nft: older ones parse every table, and may choke
/// on another program's.
const NFT_MIN: (u32, u32, u32) = (1, 0, 1);

/// `nft --version` (`nftables v1.0.6 (Lester Gooch #5)`) as numbers.
fn nft_version(text: &str) -> Option<(u32, u32, u32)> {
    let version = text.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut numbers = version.split('.').map(|n| n.parse().ok());
    Some((numbers.next()??, numbers.next()??, numbers.next().flatten().unwrap_or(0)))
}

/// Whether the nftables mode can run: nft is there, recent enough, and it
/// and the kernel take a ruleset with every expression the mode writes:
/// committed for real (the kernel makes each expression, and refuses one
/// it lacks), in a table of its own deleted in the same transaction, so
/// nothing is ever seen of it.
fn nftables() -> Result<String, String> {
    let mut nft = System::default();
    let version = nft.run("nft", &["--version"], None).map_err(|e| e.to_string())?;
    let version = version.trim().to_string();
    match nft_version(&version) {
        Some(v) if v >= NFT_MIN => {}
        _ => return Err(format!("{version}: kube-proxy's ruleset needs nft 1.0.1 or later")),
    }
    let table = format!("ip {}", super::nftables::render::TABLE);
    let probe_table = format!("ip {}-probe", super::nftables::render::TABLE);
    let ruleset = super::nftables::render::Ruleset::probe().to_string();
    let ruleset = ruleset.replace(&format!(" {table} "), &format!(" {probe_table} "))
        + &format!("delete table {probe_table}\n");
    nft.run("nft", &["-f", "-"], Some(&ruleset))
        .map_err(|e| format!("{version} refuses the ruleset: {e}"))?;
    Ok(format!("{version}, ruleset committed and removed in one transaction"))
}

/// Whether the kernel's `list` under /proc names `name` (its first word on
/// a line): a protocol or match built in or loaded.
fn registered(list: &str, name: &str) -> bool {
    let text = std::fs::read_to_string(list).unwrap_or_default();
    text.lines().any(|l| l.split_whitespace().next() == Some(name))
}

/// Whether the kernel has a part: `registered`, or its `module` loaded, or
/// on the module lists (loaded on first use). Nothing is loaded here: as
/// kube-proxy opens no SCTP socket, loading SCTP is left to those who use
/// it.
fn kernel_part(registered: bool, module: &str) -> Result<String, String> {
    if registered || std::path::Path::new("/sys/module").join(module).exists() {
        return Ok("in the running kernel".into());
    }
    let file = format!("{module}.ko");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let dir = std::path::Path::new("/lib/modules").join(release.trim());
    let lists = ["modules.builtin", "modules.dep"].map(|f| std::fs::read_to_string(dir.join(f)));
    match lists.iter().flatten().any(|text| lists_module(text, &file)) {
        true => Ok(format!("{file}, loaded on first use")),
        false => Err(format!("not in this kernel, nor {file} in {}", dir.display())),
    }
}

/// Whether a `modules.dep` or `modules.builtin` text lists `module`
/// (`sctp.ko`, maybe compressed: `sctp.ko.xz`).
fn lists_module(text: &str, module: &str) -> bool {
    text.lines().filter_map(|l| l.split(':').next()?.rsplit('/').next()).any(|file| {
        file == module || file.strip_prefix(module).is_some_and(|rest| rest.starts_with('.'))
    })
}

/// A feature the verified programs hold (`loaded`), and what else it needs.
fn in_programs(name: &'static str, loaded: bool, needs: &str) -> Feature {
    let detail = if loaded { format!("verified; {needs}") } else { "programs do not load".into() };
    Feature { name, required: false, found: loaded, detail }
}

/// What serving IPv6 needs beyond the programs: the kernel's IPv6 stack,
/// enabled, and `ip6tables-restore` (for the iptables mode); its version.
fn ipv6() -> Result<String, String> {
    let disabled = std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6");
    match disabled.as_deref().map(str::trim) {
        Ok("0") => {}
        Ok(_) => return Err("disabled (net.ipv6.conf.all.disable_ipv6)".into()),
        Err(_) => return Err("no IPv6 stack in this kernel".into()),
    }
    let mut tools = System::default().for_family(IpFamily::V6);
    let version = tools.run("iptables-restore", &["--version"], None);
    version.map(|v| v.trim().to_string()).map_err(|e| format!("IPv6 enabled, but {e}"))
}

/// The probe as a table, one line per feature, and the decision.
/// Where the eBPF mode's programs go, and why.
const ATTACHMENTS: &str = "\
It attaches:
  connect4, sendmsg4, recvmsg4, getpeername4  the cgroup2 root (--cgroup-path): every socket's service connections, translated once
  connect6, sendmsg6, recvmsg6, getpeername6  the same for IPv6 sockets: IPv6 services, and IPv4 ones through v4-mapped addresses
  tc_ingress + tc_egress                      interfaces holding a node address: NodePort, externalIP, LB IP and forwarded ClusterIP traffic
  tc_pod_replies (ingress only)               pod interfaces (--pod-interfaces) of pods that back a service or have per-packet flows (others run nothing): only replies of those flows, as the socket LB covers the pods
                                              (tc_ingress + tc_egress there too with --pod-interface-programs full, a --cgroup-path below the root, or --socket-lb-host-netns-only)";

pub fn report(features: &[Feature]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<58} {:<9} {:<6} detail", "feature", "needed", "found");
    for f in features {
        let needed = if f.required { "ebpf" } else { "optional" };
        let found = if f.found { "yes" } else { "NO" };
        let _ = writeln!(out, "{:<58} {needed:<9} {found:<6} {}", f.name, f.summary());
    }
    let _ = match decide(features) {
        Decision::Ebpf => writeln!(out, "--proxy-mode auto would run: ebpf\n\n{ATTACHMENTS}"),
        Decision::Nftables { missing } => {
            writeln!(out, "--proxy-mode auto would run: nftables (missing: {missing})")
        }
        Decision::Iptables { missing } => {
            writeln!(out, "--proxy-mode auto would run: iptables (missing: {missing}; and nft)")
        }
    };
    out
}

/// Each feature's whole detail where the table shortened it (a failed
/// load's verifier log), for `--verbose` and `--verifier-log`.
pub fn details(features: &[Feature]) -> String {
    let mut out = String::new();
    for f in features.iter().filter(|f| f.summary() != f.detail.trim_end()) {
        let _ = writeln!(out, "== {}\n{}", f.name, f.detail.trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(missing: &[&str]) -> Vec<Feature> {
        [(BTF, true), (CGROUP2, true), (PROGRAMS, true), (CGROUP_LINKS, true), (TCX, false)]
            .into_iter()
            .map(|(name, required)| Feature {
                name,
                required,
                found: !missing.contains(&name),
                detail: String::new(),
            })
            .collect()
    }

    #[test]
    fn a_complete_kernel_runs_ebpf() {
        assert_eq!(decide(&kernel(&[])), Decision::Ebpf);
        let table = report(&kernel(&[]));
        assert!(table.contains("tc_pod_replies (ingress only)"), "where programs go: {table}");
        // Without TCX the per-packet program uses clsact filters.
        assert_eq!(decide(&kernel(&[TCX])), Decision::Ebpf);
    }

    #[test]
    fn a_kernel_without_btf_falls_back_to_iptables() {
        assert_eq!(decide(&kernel(&[BTF])), Decision::Iptables { missing: BTF });
    }

    #[test]
    fn a_kernel_without_sock_addr_hooks_falls_back_and_says_why() {
        // The cgroup sock_addr programs fail verification or loading.
        let features = kernel(&[PROGRAMS, CGROUP_LINKS]);
        assert_eq!(decide(&features), Decision::Iptables { missing: PROGRAMS });
        let table = report(&features);
        assert!(table.contains("would run: iptables (missing: programs load"), "{table}");
        assert!(table.lines().filter(|l| l.contains(" NO ")).count() == 2, "{table}");
    }

    #[test]
    fn a_verifier_log_stays_out_of_the_table() {
        let mut features = kernel(&[PROGRAMS]);
        features[2].detail = "program connect4: the BPF_PROG_LOAD syscall returned Permission denied (os error 13). Verifier output: 0: (bf) r6 = r1\n1: (85) call 174\nunknown func\n".into();
        let table = report(&features);
        assert_eq!(table.lines().count(), 1 + features.len() + 1, "{table}");
        let line = table.lines().find(|l| l.contains(" NO ")).unwrap();
        assert!(line.ends_with("(os error 13) (whole detail: --verbose)"), "{line}");
        let details = details(&features);
        assert!(details.starts_with("== programs load") && details.contains("unknown func"));
        assert!(details.lines().count() == 4, "{details}");
    }

    #[test]
    fn modules_are_found_by_file_name_compressed_or_not() {
        let dep = "kernel/net/sctp/sctp.ko.xz: kernel/lib/libcrc32c.ko.xz kernel/net/udp_tunnel.ko\nkernel/net/netfilter/xt_sctp.ko:\n";
        assert!(lists_module(dep, "sctp.ko") && lists_module(dep, "xt_sctp.ko"));
        // A dependency is not the module itself, nor is a longer name.
        assert!(!lists_module(dep, "libcrc32c.ko") && !lists_module(dep, "ctp.ko"));
        assert!(!lists_module("kernel/net/sctp/sctp_diag.ko:\n", "sctp.ko"));
    }

    #[test]
    fn nft_versions_are_read_and_compared() {
        assert_eq!(nft_version("nftables v1.0.6 (Lester Gooch #5)"), Some((1, 0, 6)));
        assert_eq!(nft_version("nftables v0.9.8 (E.D.S.)"), Some((0, 9, 8)));
        assert!(nft_version("nftables v0.9.8 (E.D.S.)").unwrap() < NFT_MIN);
        assert_eq!(nft_version("nftables v1.1 (x)"), Some((1, 1, 0)));
        assert_eq!(nft_version("something else"), None);
    }

    #[test]
    fn no_cgroup2_means_iptables() {
        assert_eq!(decide(&kernel(&[CGROUP2])), Decision::Iptables { missing: CGROUP2 });
    }

    #[test]
    fn without_ebpf_nftables_comes_before_iptables() {
        let mut features = kernel(&[BTF]);
        features.push(Feature { name: NFTABLES, required: false, found: true, detail: "".into() });
        assert_eq!(decide(&features), Decision::Nftables { missing: BTF });
        assert!(report(&features).contains("auto would run: nftables (missing: BTF"));
        features.last_mut().unwrap().found = false;
        assert_eq!(decide(&features), Decision::Iptables { missing: BTF });
        // With eBPF there, nft does not matter.
        assert_eq!(decide(&kernel(&[])), Decision::Ebpf);
    }
}
