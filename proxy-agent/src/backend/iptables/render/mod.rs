//! The `iptables-restore` input kube-proxy's iptables mode writes on a full
//! sync, from our model. Pure code.
//!
//! Same chains, rule order, match order and comments as kube-proxy, so an
//! operator can diff it against a kube-proxy node (sorted: kube-proxy walks
//! its services in Go map order, we walk them by name). The jumps from the
//! built-in chains are not part of the restore input; kube-proxy ensures
//! them with separate `iptables -C/-I` commands, listed by [`jump_rules`].
//!
//! One ruleset per IP family, as kube-proxy runs one proxier per family:
//! the IPv6 one (`ip6tables-restore` input) differs only where kube-proxy's
//! does: no localhost NodePorts (never served on `::1`, and kubelet's
//! `KUBE-FIREWALL` martian rule is IPv4's), so the NodePort jump excludes
//! `::1/128`.

mod options;
mod ruleset;
mod service_rules;

pub use self::{
    options::Options,
    ruleset::{ChainRef, Digests, Ruleset, Scope},
};
use self::{ruleset::Table, service_rules::ServiceRules};
use crate::model::{IpFamily, Model, Protocol};

/// kube-proxy's masquerade mark (bit 14), as it formats it.
const MARK: &str = "0x00004000";
/// Above this many endpoints kube-proxy drops per-endpoint comments.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// kubelet's chain dropping martian packets to 127.0.0.0/8 (which
/// route_localnet would let in): kube-proxy ensures it and its jumps, and
/// never removes them.
pub const KUBELET_FIREWALL: &str = "KUBE-FIREWALL";

/// The jumps from the built-in chains kube-proxy ensures outside the
/// restore input: (table, chain, arguments), each checked with `-C` and
/// inserted with `-I` when missing; kubelet's last.
pub fn jump_rules() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    let new = ["-m", "conntrack", "--ctstate", "NEW"];
    let jump = |table: &'static str,
                chain: &'static str,
                extra: &[&'static str],
                comment: &'static str,
                target: &'static str| {
        let mut args = extra.to_vec();
        if !comment.is_empty() {
            args.extend(["-m", "comment", "--comment", comment]);
        }
        args.extend(["-j", target]);
        (table, chain, args)
    };
    let external = "kubernetes externally-visible service portals";
    let portals = "kubernetes service portals";
    let firewall = "kubernetes load balancer firewall";
    vec![
        jump("filter", "INPUT", &new, external, "KUBE-EXTERNAL-SERVICES"),
        jump("filter", "FORWARD", &new, external, "KUBE-EXTERNAL-SERVICES"),
        jump("filter", "INPUT", &[], "kubernetes health check service ports", "KUBE-NODEPORTS"),
        jump("filter", "FORWARD", &new, portals, "KUBE-SERVICES"),
        jump("filter", "OUTPUT", &new, portals, "KUBE-SERVICES"),
        jump("filter", "FORWARD", &[], "kubernetes forwarding rules", "KUBE-FORWARD"),
        jump("filter", "INPUT", &new, firewall, "KUBE-PROXY-FIREWALL"),
        jump("filter", "OUTPUT", &new, firewall, "KUBE-PROXY-FIREWALL"),
        jump("filter", "FORWARD", &new, firewall, "KUBE-PROXY-FIREWALL"),
        jump("nat", "OUTPUT", &[], portals, "KUBE-SERVICES"),
        jump("nat", "PREROUTING", &[], portals, "KUBE-SERVICES"),
        jump("nat", "POSTROUTING", &[], "kubernetes postrouting rules", "KUBE-POSTROUTING"),
        jump("filter", "INPUT", &[], "", KUBELET_FIREWALL),
        jump("filter", "OUTPUT", &[], "", KUBELET_FIREWALL),
    ]
}

/// The rules for `model`'s ports of `opts.family`.
pub fn render(model: &Model, opts: &Options) -> Ruleset {
    let ports =
        || model.ports_of(opts.family).filter(|p| opts.sctp || p.protocol != Protocol::Sctp);
    let large = ports().map(|p| p.endpoints.len()).sum::<usize>() > LARGE_CLUSTER_ENDPOINTS;
    let mut filter = Table::default();
    let mut nat = Table::default();
    for chain in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
    ] {
        filter.chain(chain);
    }
    if opts.localhost_nodeports() {
        filter.chain("KUBE-FIREWALL");
        filter.rule(
            "KUBE-FIREWALL",
            &[
                "-m",
                "comment",
                "--comment",
                "\"block incoming localnet connections\"",
                "-d",
                "127.0.0.0/8",
                "!",
                "-s",
                "127.0.0.0/8",
                "-m",
                "conntrack",
                "!",
                "--ctstate",
                "RELATED,ESTABLISHED,DNAT",
                "-j",
                "DROP",
            ],
        );
    }
    for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        nat.chain(chain);
    }
    let not_marked = format!("{MARK}/{MARK}");
    nat.rule("KUBE-POSTROUTING", &["-m", "mark", "!", "--mark", &not_marked, "-j", "RETURN"]);
    nat.rule("KUBE-POSTROUTING", &["-j", "MARK", "--xor-mark", MARK]);
    let mut masquerade = vec![
        "-m",
        "comment",
        "--comment",
        "\"kubernetes service traffic requiring SNAT\"",
        "-j",
        "MASQUERADE",
    ];
    if opts.random_fully {
        masquerade.push("--random-fully");
    }
    nat.rule("KUBE-POSTROUTING", &masquerade);
    nat.rule("KUBE-MARK-MASQ", &["-j", "MARK", "--or-mark", MARK]);

    for port in ports() {
        ServiceRules::new(port, opts, large).write(&mut filter, &mut nat);
    }

    let nodeports =
        "\"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    if opts.nodeports_everywhere() {
        let mut words =
            vec!["-m", "comment", "--comment", nodeports, "-m", "addrtype", "--dst-type", "LOCAL"];
        match opts.family {
            IpFamily::V6 => words.extend(["!", "-d", "::1/128"]),
            IpFamily::V4 if !opts.localhost_nodeports() => {
                words.extend(["!", "-d", "127.0.0.0/8"]);
            }
            IpFamily::V4 => {}
        }
        words.extend(["-j", "KUBE-NODEPORTS"]);
        nat.rule("KUBE-SERVICES", &words);
    } else {
        for ip in opts
            .node_ips
            .iter()
            .filter(|ip| opts.nodeport_addresses.iter().any(|c| c.contains(**ip)))
        {
            let ip = ip.to_string();
            nat.rule(
                "KUBE-SERVICES",
                &["-m", "comment", "--comment", nodeports, "-d", &ip, "-j", "KUBE-NODEPORTS"],
            );
        }
    }

    if !opts.conntrack_tcp_liberal {
        let mut invalid = vec!["-m", "conntrack", "--ctstate", "INVALID"];
        if opts.nfacct {
            invalid.extend(["-m", "nfacct", "--nfacct-name", "ct_state_invalid_dropped_pkts"]);
        }
        invalid.extend(["-j", "DROP"]);
        filter.rule("KUBE-FORWARD", &invalid);
    }
    filter.rule(
        "KUBE-FORWARD",
        &[
            "-m",
            "comment",
            "--comment",
            "\"kubernetes forwarding rules\"",
            "-m",
            "mark",
            "--mark",
            &not_marked,
            "-j",
            "ACCEPT",
        ],
    );
    filter.rule(
        "KUBE-FORWARD",
        &[
            "-m",
            "comment",
            "--comment",
            "\"kubernetes forwarding conntrack rule\"",
            "-m",
            "conntrack",
            "--ctstate",
            "RELATED,ESTABLISHED",
            "-j",
            "ACCEPT",
        ],
    );

    Ruleset { filter, nat }
}

#[cfg(test)]
pub(crate) mod tests;
