use std::collections::{BTreeMap, BTreeSet};

use super::{render::KUBELET_FIREWALL, *};

/// A fake kernel: keeps the chains a restore declares, fails the
/// commands a test scripts to fail, records every command.
#[derive(Default)]
struct Fake {
    chains: BTreeMap<&'static str, BTreeSet<String>>,
    log: Vec<String>,
    /// What each restore was given.
    restored: Vec<String>,
    /// Rules added with `-I`, as "table chain args" (comments unquoted).
    rules: BTreeSet<String>,
    /// Restores that must fail, counted down.
    failing_restores: usize,
    /// Another program holds the xtables lock: iptables exits 4.
    lock_held: bool,
    /// A kernel without the sctp match: restores with SCTP rules fail.
    no_sctp_match: bool,
    /// The iptables tools are not installed.
    not_installed: bool,
}

impl Fake {
    /// `iptables-save` of every table: its chains and the rules added
    /// with `-I` (comments unquoted, as the rules are kept).
    fn saved_tables(&self) -> String {
        let mut out = String::new();
        for table in CANARY_TABLES {
            let chains = self.chains.get(table).into_iter().flatten();
            let prefix = format!("{table} ");
            let rules = self.rules.iter().filter_map(|r| r.strip_prefix(&prefix));
            out += &format!("*{table}\n");
            out = chains.fold(out, |out, c| out + ":" + c + " - [0:0]\n");
            out = rules.fold(out, |out, r| out + "-A " + r + "\n");
            out += "COMMIT\n";
        }
        out
    }
}

impl Runner for Fake {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError> {
        self.log.push(format!("{program} {}", args.join(" ")));
        if self.not_installed {
            return Err(ExecError::Missing { program: program.to_string() });
        }
        let failed = |stderr: &str| ExecError::Failed {
            command: program.to_string(),
            status: "exit status: 1".into(),
            code: Some(1),
            stderr: stderr.into(),
        };
        if self.lock_held && (program == IPTABLES || program == RESTORE) {
            return Err(ExecError::Failed {
                command: program.to_string(),
                status: "exit status: 4".into(),
                code: Some(4),
                stderr: "Another app is currently holding the xtables lock.".into(),
            });
        }
        let table = |args: &[&str]| {
            let t = args.iter().position(|a| *a == "-t").map(|i| args[i + 1]);
            CANARY_TABLES.into_iter().find(|x| Some(*x) == t).unwrap_or("filter")
        };
        match program {
            RESTORE => {
                self.restored.push(stdin.unwrap_or_default().to_string());
                if self.failing_restores > 0 {
                    self.failing_restores -= 1;
                    return Err(failed("iptables-restore: line 3 failed"));
                }
                if self.no_sctp_match && stdin.unwrap_or_default().contains("-p sctp") {
                    return Err(failed(
                        "Warning: Extension sctp revision 0 not supported, missing kernel module?\niptables-restore: line 40 failed",
                    ));
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
                    } else if let Some(rule) = line.strip_prefix("-I ") {
                        self.rules.insert(format!("{current} {}", rule.replace('"', "")));
                    } else if let Some(rule) = line.strip_prefix("-D ") {
                        let rule = format!("{current} {}", rule.replace('"', ""));
                        if !self.rules.remove(&rule) {
                            return Err(failed("iptables-restore: line 2 failed"));
                        }
                    }
                }
                Ok(String::new())
            }
            SAVE if args.is_empty() => Ok(self.saved_tables()),
            SAVE => Ok(self
                .chains
                .get(table(args))
                .into_iter()
                .flatten()
                .fold(String::new(), |out, c| out + ":" + c + " - [0:0]\n")),
            IPTABLES if args.contains(&"-N") || args.contains(&"-S") => {
                let chain = args[args.iter().position(|a| *a == "-N" || *a == "-S").unwrap() + 1];
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
                // -w 5 -W 100000 -t TABLE OP CHAIN ARGS...
                let t = args.iter().position(|a| *a == "-t").unwrap();
                let target = *args.last().unwrap();
                let table_chains = self.chains.get(args[t + 1]);
                if target.starts_with("KUBE-") && !table_chains.is_some_and(|c| c.contains(target))
                {
                    return Err(ExecError::Failed {
                        command: program.to_string(),
                        status: "exit status: 2".into(),
                        code: Some(2),
                        stderr: format!(
                            "iptables v1.8.9 (nf_tables): Chain '{target}' does not exist"
                        ),
                    });
                }
                let rule = format!("{} {}", args[t + 1], args[t + 3..].join(" "));
                let present = self.rules.contains(&rule);
                match (args[t + 2], present) {
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
    let mut options = Options { nfacct: false, ..render::tests::options() };
    options.cluster_cidr = None;
    options
}

/// Service `web` (dns 53/UDP → 5353) over `endpoints`, and `other`.
fn web(endpoints: &[&str]) -> Model {
    use test_objects::{Protocol::*, ep, port, service};
    let web = service("default", "web").cluster_ip("10.96.0.10").port(port("dns", 53).udp());
    let web_slice = web.slice().port("dns", 5353, Udp).endpoints(endpoints.iter().map(|e| ep(e)));
    let other = service("default", "other").cluster_ip("10.96.0.11").port(port(None, 80));
    let other_slice = other.slice().port(None, 8080, Tcp).endpoint(ep("10.244.9.9"));
    crate::source::model_of(
        &[web.build(), other.build()],
        &[web_slice.build(), other_slice.build()],
    )
}

/// The restores of rules (not of the chains and jumps around them).
fn rule_restores(fake: &Fake) -> Vec<&String> {
    fake.log.iter().filter(|l| l.starts_with(RESTORE) && l.ends_with("--counters")).collect()
}

#[test]
fn the_first_sync_is_full_and_the_next_rewrites_only_what_changed() {
    let mut backend = IptablesBackend::new(Fake::default(), options());
    let report = backend.sync(&web(&["10.244.1.2", "10.244.1.3"])).unwrap();
    assert!(report.full);
    // One look at every table, the missing chains and jumps in one
    // restore, the rules in another.
    let log = &backend.runner.log;
    assert_eq!(log[0], "iptables-save ", "{log:?}");
    assert_eq!(log.iter().filter(|l| l.starts_with(RESTORE)).count(), 2, "{log:?}");
    assert!(
        !log.iter().any(|l| l.starts_with("iptables -")),
        "no command per chain or rule: {log:?}"
    );
    let ensured = &backend.runner.restored[0];
    assert!(ensured.starts_with("*mangle\n:KUBE-PROXY-CANARY - [0:0]\n"), "{ensured}");
    assert!(
        ensured.contains(
            "\n-I PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
        ),
        "{ensured}"
    );
    assert_eq!(backend.runner.rules.len(), 14, "the jumps");
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
fn random_fully_where_iptables_has_it() {
    assert!(random_fully("iptables v1.8.9 (nf_tables)"));
    assert!(random_fully("iptables v1.6.2"));
    assert!(!random_fully("iptables v1.6.1"));
    assert!(!random_fully("iptables v1.4.21"));
    assert!(!random_fully("garbage"));
    let old = Options { random_fully: false, ..options() };
    let rules = render(&Model::default(), &old).to_string();
    assert!(rules.contains("-j MASQUERADE\n"), "{rules}");
    assert!(!rules.contains("--random-fully"), "{rules}");
}

#[test]
fn the_ipv6_backend_writes_the_ipv6_ports_and_cleans_ipv6_conntrack_entries() {
    use test_objects::{Protocol::*, ep, port, service};
    let mut v6 = options();
    v6.family = IpFamily::V6;
    v6.node_ips = vec!["fd00::11".parse().unwrap()];
    let mut backend = IptablesBackend::new(Fake::default(), v6);
    let dns = service("default", "dns").cluster_ip("10.96.0.10");
    let dns = dns.cluster_ips(&["10.96.0.10", "fd00:96::10"]);
    let dns = dns.port(port("dns", 53).udp());
    let slice = |family: &str, name: &str, ip: &str| {
        let slice = test_objects::slice("default", name).service("dns").address_type(family);
        slice.port("dns", 5353, Udp).endpoint(ep(ip)).build()
    };
    let model = |v6_endpoint: &str| {
        crate::source::model_of(
            &[dns.clone().build()],
            &[slice("IPv4", "dns-1", "10.244.1.2"), slice("IPv6", "dns-2", v6_endpoint)],
        )
    };
    backend.sync(&model("fd00:244::2")).unwrap();
    let seps = |b: &IptablesBackend<Fake>| {
        b.runner.chains["nat"].iter().filter(|c| c.starts_with("KUBE-SEP-")).count()
    };
    assert_eq!(seps(&backend), 1, "the IPv6 endpoint's chain only");
    backend.sync(&model("fd00:244::3")).unwrap();
    assert_eq!(seps(&backend), 1, "the old endpoint's chain deleted");
    let cleanups: Vec<&String> =
        backend.runner.log.iter().filter(|l| l.starts_with("conntrack ")).collect();
    let gone = "conntrack -f ipv6 -D -p udp --orig-dst fd00:96::10 --orig-port-dst 53 --dst-nat fd00:244::2";
    assert!(cleanups.iter().any(|l| *l == gone), "{cleanups:?}");
    assert!(cleanups.iter().all(|l| l.starts_with("conntrack -f ipv6 ")), "{cleanups:?}");
}

#[test]
fn a_failed_restore_makes_the_next_sync_full() {
    let mut backend = IptablesBackend::new(Fake::default(), options());
    backend.sync(&web(&["10.244.1.2"])).unwrap();
    backend.runner.failing_restores = 1;
    let err = backend.sync(&web(&["10.244.1.3"])).unwrap_err();
    assert!(matches!(err, IptablesError::Restore { full: false, .. }), "{err}");
    // The refused line and its neighbours are in the message.
    assert!(err.to_string().contains(">     3: "), "{err}");
    assert!(backend.full_sync_due());
    let report = backend.sync(&web(&["10.244.1.3"])).unwrap();
    assert!(report.full);
    // The full sync found the old endpoint's chain in the kernel and
    // deleted it.
    assert_eq!(report.chains_deleted, 1);
    assert_eq!(rule_restores(&backend.runner).len(), 3);
}

/// Service `web` of [`web`] with an SCTP port beside its UDP one.
fn web_with_sctp() -> Model {
    use test_objects::{Protocol::*, ep, port, service};
    let web = service("default", "web").cluster_ip("10.96.0.10").port(port("dns", 53).udp());
    let web = web.port(port("diameter", 3868).protocol(Sctp));
    let slice = web.slice().port("dns", 5353, Udp).port("diameter", 3868, Sctp);
    let slice = slice.endpoint(ep("10.244.1.2"));
    crate::source::model_of(&[web.build()], &[slice.build()])
}

#[test]
fn sctp_rules_go_in_where_the_kernel_takes_them() {
    let mut backend = IptablesBackend::new(Fake::default(), options());
    backend.sync(&web_with_sctp()).unwrap();
    assert_eq!(rule_restores(&backend.runner).len(), 1);
    assert!(backend.options.sctp);
}

#[test]
fn sctp_rules_refused_leave_sctp_ports_out_and_serve_the_rest() {
    let fake = Fake { no_sctp_match: true, ..Fake::default() };
    let mut backend = IptablesBackend::new(fake, options());
    let report = backend.sync(&web_with_sctp()).unwrap();
    assert!(report.full);
    assert!(!backend.options.sctp);
    // The UDP port's chains are in; the SCTP port's are not.
    let svcs = |b: &IptablesBackend<Fake>| {
        b.runner.chains["nat"].iter().filter(|c| c.starts_with("KUBE-SVC-")).count()
    };
    assert_eq!(svcs(&backend), 1);
    assert_eq!(rule_restores(&backend.runner).len(), 2, "refused once, then without SCTP");
    // Not tried again at every sync.
    backend.sync(&web_with_sctp()).unwrap();
    assert_eq!(rule_restores(&backend.runner).len(), 3);
    // A failure that is not SCTP's is an error, and SCTP is not blamed.
    let mut backend = IptablesBackend::new(Fake::default(), options());
    backend.runner.failing_restores = 2;
    assert!(backend.sync(&web_with_sctp()).is_err());
    assert!(backend.options.sctp);
}

#[test]
fn a_vanished_canary_forces_a_full_sync() {
    let mut backend = IptablesBackend::new(Fake::default(), options());
    backend.sync(&web(&["10.244.1.2"])).unwrap();
    assert_eq!(backend.canary_gone(true).unwrap(), None);
    assert!(!backend.full_sync_due());
    // Held lock: no verdict, no resync.
    backend.runner.lock_held = true;
    assert!(backend.canary_gone(false).is_err());
    assert!(!backend.full_sync_due());
    backend.runner.lock_held = false;
    backend.runner.chains.clear();
    assert_eq!(backend.canary_gone(false).unwrap(), Some("mangle"));
    assert!(backend.full_sync_due());
    backend.runner.log.clear();
    assert!(backend.sync(&web(&["10.244.1.2"])).unwrap().full);
    // Flows made while the rules were missing are looked for.
    assert!(backend.runner.log.contains(&"conntrack -L".to_string()));
    assert_eq!(backend.canary_gone(true).unwrap(), None);
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
    assert_eq!(deleted, 3 + 5 + 4 + 4, "canaries, filter, nat and service chains");
    // kubelet's KUBE-FIREWALL and its jumps stay, as with kube-proxy.
    assert_eq!(
        fake.chains["filter"].iter().collect::<Vec<_>>(),
        ["CUSTOM-CHAIN", KUBELET_FIREWALL]
    );
    assert!(fake.chains["nat"].is_empty() && fake.chains["mangle"].is_empty());
    assert_eq!(fake.rules.len(), 2, "{:?}", fake.rules);
    assert!(fake.rules.iter().all(|r| r.ends_with(KUBELET_FIREWALL)), "{:?}", fake.rules);
}

#[test]
fn cleanup_of_a_clean_node_is_one_look() {
    let mut fake = Fake::default();
    assert_eq!(cleanup(&mut fake).unwrap(), 0);
    assert_eq!(fake.log, ["iptables-save "]);
}

/// The probes of [`cleanup_if_canary`], one per table.
const PROBES: [&str; 3] = [
    "iptables -w 5 -W 100000 -t mangle -S KUBE-PROXY-CANARY",
    "iptables -w 5 -W 100000 -t nat -S KUBE-PROXY-CANARY",
    "iptables -w 5 -W 100000 -t filter -S KUBE-PROXY-CANARY",
];

/// A node the iptables mode served `web` on, then stopped.
fn left_by_the_iptables_mode() -> Fake {
    let mut backend = IptablesBackend::new(Fake::default(), options());
    backend.sync(&web(&["10.244.1.2"])).unwrap();
    let mut fake = backend.runner;
    fake.log.clear();
    fake
}

#[test]
fn the_canary_check_of_a_clean_node_lists_no_table() {
    let mut fake = Fake::default();
    assert_eq!(cleanup_if_canary(&mut fake).unwrap(), 0);
    assert_eq!(fake.log, PROBES);
    // kubelet's chains are not the iptables mode's leftovers.
    let kubelet = [("mangle", "KUBE-KUBELET-CANARY"), ("filter", KUBELET_FIREWALL)];
    for (table, chain) in kubelet {
        fake.chains.entry(table).or_default().insert(chain.into());
    }
    fake.rules.insert(format!("filter INPUT -j {KUBELET_FIREWALL}"));
    fake.log.clear();
    assert_eq!(cleanup_if_canary(&mut fake).unwrap(), 0);
    assert_eq!(fake.log, PROBES);
}

#[test]
fn a_canary_in_any_table_removes_what_the_iptables_mode_left() {
    let whole = left_by_the_iptables_mode();
    let mut fake = left_by_the_iptables_mode();
    assert_eq!(cleanup_if_canary(&mut fake).unwrap(), 3 + 5 + 4 + 4);
    // The first probe found it: then one look at every table, one restore.
    assert_eq!(fake.log[..2], [PROBES[0], "iptables-save "]);
    assert_eq!(fake.log.len(), 3, "{:?}", fake.log);
    let (removal, _) = jumps::removal(&whole.saved_tables()).unwrap();
    assert_eq!(fake.restored.last(), Some(&removal));
    assert_eq!(fake.chains["filter"].iter().collect::<Vec<_>>(), [KUBELET_FIREWALL]);
    // Someone deleted mangle's and nat's chains: filter's canary is enough.
    let mut fake = left_by_the_iptables_mode();
    fake.chains.get_mut("mangle").unwrap().clear();
    fake.chains.get_mut("nat").unwrap().clear();
    fake.rules.retain(|r| r.starts_with("filter "));
    assert_eq!(cleanup_if_canary(&mut fake).unwrap(), 6);
    assert_eq!(fake.log[..4], [PROBES[0], PROBES[1], PROBES[2], "iptables-save "]);
    assert_eq!(fake.chains["filter"].iter().collect::<Vec<_>>(), [KUBELET_FIREWALL]);
    assert!(fake.rules.iter().all(|r| r.ends_with(KUBELET_FIREWALL)), "{:?}", fake.rules);
}

#[test]
fn a_canary_check_that_cannot_tell_looks_at_every_table() {
    // Another failure than "no such chain" (exit 4): the look as before.
    let mut fake = Fake { lock_held: true, ..Fake::default() };
    assert_eq!(cleanup_if_canary(&mut fake).unwrap(), 0);
    assert_eq!(fake.log, [PROBES[0], "iptables-save "]);
    // Not installed: nothing to remove.
    let mut fake = Fake { not_installed: true, ..Fake::default() };
    assert_eq!(cleanup_if_canary(&mut fake).unwrap(), 0);
    assert_eq!(fake.log, [PROBES[0], "iptables-save "]);
}

#[test]
fn a_held_lock_never_doubles_a_jump() {
    let mut backend = IptablesBackend::new(Fake::default(), options());
    backend.runner.lock_held = true;
    assert!(matches!(backend.sync(&web(&[])), Err(IptablesError::Ensure { .. })));
    assert!(!backend.runner.log.iter().any(|l| l.contains(" -I ")));
    backend.runner.lock_held = false;
    backend.sync(&web(&[])).unwrap();
    assert_eq!(backend.runner.rules.len(), 14);
}

#[test]
fn restore_errors_show_the_refused_line() {
    let input = "*nat\n:A - [0:0]\n-A A -j B\n-A A -j C\nCOMMIT\n";
    let context = restore_context(input, "iptables-restore: line 3 failed");
    assert_eq!(context, "\n      1: *nat\n      2: :A - [0:0]\n>     3: -A A -j B\n      4: -A A -j C\n      5: COMMIT\n      6: ".trim_end_matches("\n      6: "));
    assert!(restore_context(input, "Error occurred at line: 2").contains(">     2: :A"));
    assert_eq!(restore_context(input, "unrelated"), "");
}
