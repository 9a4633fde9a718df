//! The jumps from the built-in chains into ours, and the top-level chains
//! they jump to: ensured at a full sync and removed by cleanup, as
//! kube-proxy does, but each from one `iptables-save` of every table and
//! at most one `iptables-restore --noflush`, where kube-proxy runs a
//! command per chain and per rule (about 40 at a start, a noticeable part
//! of it where a process costs a tenth of a second). Pure: the caller runs
//! the tools.

use super::{
    CANARY, CANARY_TABLES,
    chains::is_service_chain,
    render::{KUBELET_FIREWALL, jump_rules},
};

/// The tables holding chains of ours.
const OUR_TABLES: [&str; 3] = ["filter", "nat", "mangle"];

/// One table's part of an `iptables-save` of every table (`*table` to its
/// `COMMIT`); empty where the table is not there or holds nothing.
pub(super) fn saved_table<'a>(saved: &'a str, table: &str) -> &'a str {
    let header = format!("*{table}\n");
    let Some(start) = saved.find(&header).filter(|&i| i == 0 || saved.as_bytes()[i - 1] == b'\n')
    else {
        return "";
    };
    let body = &saved[start + header.len()..];
    let end = if body.starts_with("COMMIT") {
        0
    } else {
        body.find("\nCOMMIT").map_or(body.len(), |end| end + 1)
    };
    &body[..end]
}

/// The chain names an `iptables-save` output declares.
pub(super) fn saved_chains(saved: &str) -> impl Iterator<Item = &str> {
    saved.lines().filter_map(|l| l.strip_prefix(':')?.split(' ').next())
}

/// The rules of `table` in `saved` that are a jump of `chain` to `target`,
/// as saved (`-A CHAIN …`).
fn saved_jumps<'a>(
    saved: &'a str,
    table: &str,
    chain: &'a str,
    target: &'a str,
) -> impl Iterator<Item = &'a str> {
    saved_table(saved, table).lines().filter(move |line| {
        let mut words = line.split(' ');
        words.next() == Some("-A")
            && words.next() == Some(chain)
            && words.collect::<Vec<_>>().windows(2).any(|w| w == ["-j", target])
    })
}

/// Whether `table` of an `iptables-save` holds a jump of `chain` to
/// `target` (whatever its matches: one per chain and target is ours).
pub(super) fn saved_jump(saved: &str, table: &str, chain: &str, target: &str) -> bool {
    saved_jumps(saved, table, chain, target).next().is_some()
}

/// A rule's arguments as a restore line takes them (words with spaces
/// quoted: the comments).
fn restore_args(args: &[&str]) -> String {
    let quoted: Vec<String> = args
        .iter()
        .map(|a| if a.contains(' ') { format!("\"{a}\"") } else { a.to_string() })
        .collect();
    quoted.join(" ")
}

/// The restore input that completes what a full sync needs around the
/// rules, from `saved` (every table): the canary chains, the chains the
/// built-in ones jump to (kubelet's `KUBE-FIREWALL` among them), and the
/// jumps, each inserted first (`-I`, as kube-proxy) where missing. `None`
/// when everything is there.
pub(super) fn missing(saved: &str) -> Option<String> {
    let jumps = jump_rules();
    let mut input = String::new();
    for table in CANARY_TABLES {
        let section = saved_table(saved, table);
        let mut chains: Vec<&str> = vec![CANARY];
        for (t, _, args) in &jumps {
            let target = args.last().copied().unwrap_or_default();
            if *t == table && !chains.contains(&target) {
                chains.push(target);
            }
        }
        let mut lines: Vec<String> = chains
            .into_iter()
            .filter(|chain| !saved_chains(section).any(|c| c == *chain))
            .map(|chain| format!(":{chain} - [0:0]"))
            .collect();
        for (_, chain, args) in jumps.iter().filter(|(t, _, _)| *t == table) {
            let target = args.last().copied().unwrap_or_default();
            if !saved_jump(saved, table, chain, target) {
                lines.push(format!("-I {chain} {}", restore_args(args)));
            }
        }
        if !lines.is_empty() {
            input += &format!("*{table}\n{}\nCOMMIT\n", lines.join("\n"));
        }
    }
    (!input.is_empty()).then_some(input)
}

/// The chains the iptables mode creates and removes: not the built-in ones,
/// and not kubelet's `KUBE-FIREWALL`, which it only ensures.
fn is_ours(chain: &str) -> bool {
    chain == CANARY
        || is_service_chain(chain)
        || chain == "KUBE-MARK-MASQ"
        || (chain != KUBELET_FIREWALL
            && jump_rules().iter().any(|(_, _, args)| args.last() == Some(&chain)))
}

/// What cleanup removes, from `saved` (every table): the restore input
/// that flushes our chains, deletes each jump to them from the built-in
/// chains as saved (as often as it is there: two agents racing insert
/// twice), and deletes the chains; with the number of chains. `None` on a
/// clean node.
pub(super) fn removal(saved: &str) -> Option<(String, usize)> {
    let jumps = jump_rules();
    let mut input = String::new();
    let mut chains = 0;
    for table in OUR_TABLES {
        let ours: Vec<&str> =
            saved_chains(saved_table(saved, table)).filter(|c| is_ours(c)).collect();
        if ours.is_empty() {
            continue;
        }
        input += &format!("*{table}\n");
        for chain in &ours {
            input += &format!(":{chain} - [0:0]\n");
        }
        for (_, chain, args) in jumps.iter().filter(|(t, _, _)| *t == table) {
            let target = args.last().copied().unwrap_or_default();
            if target == KUBELET_FIREWALL {
                continue;
            }
            for rule in saved_jumps(saved, table, chain, target) {
                input += &format!("-D{}\n", &rule["-A".len()..]);
            }
        }
        for chain in &ours {
            input += &format!("-X {chain}\n");
        }
        input += "COMMIT\n";
        chains += ours.len();
    }
    (chains > 0).then_some((input, chains))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `iptables-save` would show after `input` was restored into
    /// `saved` (`-I` rules appended: the order does not matter here).
    fn restored(saved: &str, input: &str) -> String {
        let mut out = String::new();
        for table in OUR_TABLES {
            let mut lines: Vec<String> =
                saved_table(saved, table).lines().map(String::from).collect();
            for line in saved_table(input, table).lines() {
                if line.starts_with(':') {
                    lines.insert(0, line.to_string());
                } else if let Some(rule) = line.strip_prefix("-I ") {
                    lines.push(format!("-A {rule}"));
                }
            }
            out += &format!("*{table}\n{}\nCOMMIT\n", lines.join("\n"));
        }
        out
    }

    #[test]
    fn saved_jumps_are_found_in_their_table_and_chain() {
        let saved = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\nCOMMIT\n*nat\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n";
        assert!(saved_jump(saved, "filter", "INPUT", "KUBE-NODEPORTS"));
        assert!(saved_jump(saved, "nat", "OUTPUT", "KUBE-SERVICES"));
        assert!(!saved_jump(saved, "filter", "OUTPUT", "KUBE-SERVICES"));
        assert!(!saved_jump(saved, "nat", "INPUT", "KUBE-NODEPORTS"));
        assert!(!saved_jump(saved, "mangle", "OUTPUT", "KUBE-SERVICES"));
        assert_eq!(saved_table(saved, "nat"), ":OUTPUT ACCEPT [0:0]\n-A OUTPUT -j KUBE-SERVICES\n");
        // A table saved empty ends at its own COMMIT, not the next one's.
        let saved = "*nat\nCOMMIT\n*filter\n:KUBE-SERVICES - [0:0]\nCOMMIT\n";
        assert_eq!(saved_table(saved, "nat"), "");
        assert_eq!(saved_table(saved, "filter"), ":KUBE-SERVICES - [0:0]\n");
    }

    #[test]
    fn saved_chains_are_read_from_declarations() {
        let saved = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-SEP-Y\nCOMMIT\n";
        assert_eq!(saved_chains(saved).collect::<Vec<_>>(), ["PREROUTING", "KUBE-SVC-X"]);
    }

    #[test]
    fn a_bare_node_gets_every_chain_and_jump_and_a_complete_one_nothing() {
        let bare = "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n*nat\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        let input = missing(bare).unwrap();
        let inserted: Vec<&str> = input.lines().filter(|l| l.starts_with("-I ")).collect();
        assert_eq!(inserted.len(), jump_rules().len());
        assert!(inserted.contains(&"-I FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES"), "{input}");
        assert!(inserted.contains(&"-I OUTPUT -j KUBE-FIREWALL"), "{input}");
        // Each table's canary, and each chain once however many jump to it.
        for (table, chains) in [
            ("mangle", vec![CANARY]),
            ("nat", vec![CANARY, "KUBE-SERVICES", "KUBE-POSTROUTING"]),
            (
                "filter",
                vec![
                    CANARY,
                    "KUBE-EXTERNAL-SERVICES",
                    "KUBE-NODEPORTS",
                    "KUBE-SERVICES",
                    "KUBE-FORWARD",
                    "KUBE-PROXY-FIREWALL",
                    KUBELET_FIREWALL,
                ],
            ),
        ] {
            assert_eq!(saved_chains(saved_table(&input, table)).collect::<Vec<_>>(), chains);
        }
        assert_eq!(missing(&restored(bare, &input)), None);
    }

    #[test]
    fn only_what_is_missing_is_added() {
        let all = restored("", &missing("").unwrap());
        // Someone deleted one jump and one chain (and so its jumps).
        let partial = all
            .lines()
            .filter(|l| !l.starts_with("-A OUTPUT -m conntrack") && !l.contains("KUBE-FORWARD"))
            .collect::<Vec<_>>()
            .join("\n");
        let input = missing(&partial).unwrap();
        assert_eq!(
            input,
            "*filter\n:KUBE-FORWARD - [0:0]\n-I OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-I FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n-I OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\nCOMMIT\n"
        );
    }

    #[test]
    fn removal_deletes_each_saved_jump_as_saved_and_leaves_kubelets_chain() {
        let saved = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-FIREWALL - [0:0]\n:CUSTOM - [0:0]\n-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n-A INPUT -j KUBE-FIREWALL\n-A INPUT -j CUSTOM\nCOMMIT\n*nat\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        let (input, chains) = removal(saved).unwrap();
        assert_eq!(chains, 1);
        assert_eq!(
            input,
            "*filter\n:KUBE-NODEPORTS - [0:0]\n-D INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n-D INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n-X KUBE-NODEPORTS\nCOMMIT\n"
        );
        assert_eq!(removal("*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\nCOMMIT\n"), None);
    }
}
