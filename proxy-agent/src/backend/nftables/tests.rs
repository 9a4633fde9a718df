use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::model::{Cidr, Model};

use test_objects::{EndpointBuilder, Protocol::Tcp, ep, port, service};

/// A kernel as `nft` shows it: whether our table is there, the chains
/// `nft list chains` lists; and every command run.
#[derive(Default)]
struct Kernel {
    table: bool,
    chains: Vec<String>,
    refuse: bool,
    commands: Vec<(String, Option<String>)>,
}

#[derive(Clone, Default)]
struct Fake(Rc<RefCell<Kernel>>);

fn failed(stderr: &str) -> ExecError {
    ExecError::Failed {
        command: "nft".into(),
        status: "exit status: 1".into(),
        code: Some(1),
        stderr: stderr.into(),
    }
}

impl Runner for Fake {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError> {
        let mut k = self.0.borrow_mut();
        k.commands.push((format!("{program} {}", args.join(" ")), stdin.map(String::from)));
        match (program, args) {
            ("conntrack", _) => Err(failed("conntrack v1.4.7: 0 flow entries have been deleted.")),
            ("nft", ["-t", "list", "chain", _, _, "services"]) if k.table => {
                Ok("table ip kube-proxy {\n\tchain services {\n\t\tip daddr . meta l4proto . th dport vmap @service-ips\n\t}\n}\n".into())
            }
            ("nft", ["-t", "list", "chains", _]) => {
                let chains: String = k.chains.iter().map(|c| format!("\tchain {c} {{\n\t}}\n")).collect();
                Ok(format!("table ip filter {{\n\tchain INPUT {{\n\t}}\n}}\ntable ip kube-proxy {{\n{chains}}}\n"))
            }
            ("nft", ["-t", "list", "sets", family]) => {
                let ours = format!("table {family} kube-proxy {{\n\tset cluster-ips {{\n\t}}\n}}\n");
                let ours = if k.table && *family == "ip" { ours.as_str() } else { "" };
                Ok(format!("table {family} filter {{\n\tset x {{\n\t}}\n}}\n{ours}"))
            }
            ("nft", ["delete", "table", "ip", "kube-proxy"]) if k.table => {
                k.table = false;
                Ok(String::new())
            }
            ("nft", ["-f", "-"]) if k.refuse => {
                Err(failed("/dev/stdin:3:1-20: Error: Could not process rule: Operation not supported"))
            }
            ("nft", ["-f", "-"]) => {
                k.table = true;
                Ok(String::new())
            }
            _ => Err(failed("Error: No such file or directory")),
        }
    }
}

impl Fake {
    /// The transactions given to `nft -f -` since the last call.
    fn transactions(&self) -> Vec<String> {
        let mut k = self.0.borrow_mut();
        let all = std::mem::take(&mut k.commands);
        all.into_iter().filter(|(c, _)| c == "nft -f -").filter_map(|(_, input)| input).collect()
    }
}

fn options() -> Options {
    Options {
        family: IpFamily::V4,
        node_name: "node-a".into(),
        zone: None,
        node_ips: vec!["192.168.100.11".parse().unwrap()],
        nodeport_addresses: vec![],
        cluster_cidr: Some(Cidr::parse("10.244.0.0/16").unwrap()),
        masquerade_all: false,
    }
}

/// `ns/web` at 10.96.0.10:80 with these endpoints.
fn web(endpoints: Vec<EndpointBuilder>) -> Model {
    let svc = service("ns", "web").cluster_ip("10.96.0.10").port(port("http", 80));
    let slice = svc.slice().port("http", 8080, Tcp).endpoints(endpoints).build();
    crate::source::model_of(&[svc.build()], &[slice])
}

#[test]
fn the_first_sync_is_full_then_only_changes_are_written() {
    let fake = Fake::default();
    let mut backend = NftablesBackend::new(fake.clone(), options());
    let report = backend.sync(&web(vec![ep("10.244.1.2")])).unwrap();
    assert!(report.full);
    let txs = fake.transactions();
    assert_eq!(txs.len(), 1);
    assert!(txs[0].contains("delete chain ip kube-proxy nat-prerouting"), "base chains made anew");
    assert!(txs[0].contains("flush map ip kube-proxy service-ips"));
    assert!(
        txs[0].ends_with("delete chain ip kube-proxy mark-for-masquerade\n"),
        "an older agent's"
    );

    let report = backend.sync(&web(vec![ep("10.244.1.2")])).unwrap();
    assert!(!report.full);
    assert!(fake.transactions().is_empty(), "nothing changed: no transaction");

    let report = backend.sync(&web(vec![ep("10.244.1.2"), ep("10.244.1.3")])).unwrap();
    assert!(!report.full);
    assert_eq!(report.chains_written, 1, "the service chain");
    let txs = fake.transactions();
    assert_eq!(txs.len(), 1);
    assert!(!txs[0].contains("flush map"), "{}", txs[0]);
    assert!(txs[0].contains("dnat to 10.244.1.3:8080"), "{}", txs[0]);
    let hairpin = "add element ip kube-proxy hairpin-endpoints { 10.244.1.3 . 10.244.1.3 }";
    assert!(txs[0].contains(hairpin), "{}", txs[0]);
    // No chain named in a verdict: nft need not read the table's chains.
    assert!(!txs[0].contains("goto ") && !txs[0].contains("jump "), "{}", txs[0]);
}

#[test]
fn a_refused_transaction_is_reported_with_its_line_and_the_next_sync_is_full() {
    let fake = Fake::default();
    let mut backend = NftablesBackend::new(fake.clone(), options());
    backend.sync(&web(vec![ep("10.244.1.2")])).unwrap();
    fake.0.borrow_mut().refuse = true;
    let err = backend.sync(&web(vec![ep("10.244.1.3")])).unwrap_err().to_string();
    assert!(err.contains("partial sync") && err.contains(">     3: "), "{err}");
    fake.0.borrow_mut().refuse = false;
    assert!(backend.full_sync_due());
    assert!(backend.sync(&web(vec![ep("10.244.1.3")])).unwrap().full);
}

#[test]
fn a_full_sync_declares_every_chain_before_any_rule_of_theirs() {
    let fake = Fake::default();
    let mut backend = NftablesBackend::new(fake.clone(), options());
    let two =
        [("a", "10.96.0.1", vec![ep("10.244.1.1")]), ("b", "10.96.0.2", vec![ep("10.244.2.1")])];
    backend.sync(&services(&two)).unwrap();
    let tx = fake.transactions().concat();
    // The per-service chains' names hold the service's: `…-ns/a/tcp/http`.
    let per_service = |verb: &str| {
        let prefix = format!("{verb} ip kube-proxy ");
        let lines = tx.lines().enumerate();
        let of = |l: &str| {
            l.starts_with(&prefix) && l.split(' ').nth(4).is_some_and(|c| c.contains("-ns/"))
        };
        lines.filter(|(_, l)| of(l)).map(|(i, _)| i).collect::<Vec<_>>()
    };
    let (chains, rules) = (per_service("add chain"), per_service("add rule"));
    assert_eq!((chains.len(), rules.is_empty()), (2, false), "{tx}");
    assert!(chains.iter().max() < rules.iter().min(), "{tx}");
}

#[test]
fn a_refused_full_sync_names_its_line_though_its_text_was_not_kept() {
    let fake = Fake::default();
    fake.0.borrow_mut().refuse = true;
    let mut backend = NftablesBackend::new(fake.clone(), options());
    let err = backend.sync(&web(vec![ep("10.244.1.2")])).unwrap_err().to_string();
    assert!(err.contains("full sync") && err.contains(">     3: add "), "{err}");
}

#[test]
fn chains_no_longer_used_are_flushed_then_deleted_at_a_later_sync() {
    let fake = Fake::default();
    let mut backend = NftablesBackend::new(fake.clone(), options());
    backend.stale_delay = Duration::ZERO;
    backend.sync(&web(vec![ep("10.244.1.2")])).unwrap();
    fake.transactions();
    // No endpoint: no service chain.
    backend.sync(&web(vec![])).unwrap();
    let txs = fake.transactions();
    let flushed: Vec<&str> =
        txs[0].lines().filter(|l| l.starts_with("flush chain") && l.contains("ns/web/")).collect();
    assert_eq!(flushed.len(), 1, "{}", txs[0]);
    assert!(backend.stale_chains_due(), "the loop is asked for a sync to delete it");
    let report = backend.sync(&web(vec![])).unwrap();
    assert_eq!(report.chains_deleted, 1);
    assert!(!backend.stale_chains_due());
    let txs = fake.transactions();
    assert_eq!(txs, [flushed[0].replacen("flush", "delete", 1) + "\n"]);

    // A full sync flushes the per-service chains the kernel holds that the
    // ruleset does not have, whoever left them.
    fake.0.borrow_mut().chains =
        vec!["services".into(), "service-AAAAAAAA-ns/gone/tcp/http".into()];
    backend.applied = None;
    backend.sync(&web(vec![ep("10.244.1.3")])).unwrap();
    let txs = fake.transactions();
    assert!(txs[0].contains("flush chain ip kube-proxy service-AAAAAAAA-ns/gone/tcp/http\n"));
    assert!(
        !txs[0].contains("flush chain ip kube-proxy services\nflush chain ip kube-proxy services")
    );
}

#[test]
fn a_table_deleted_by_someone_is_written_again_whole() {
    let fake = Fake::default();
    let mut backend = NftablesBackend::new(fake.clone(), options());
    backend.sync(&web(vec![ep("10.244.1.2")])).unwrap();
    assert!(!backend.table_gone().unwrap());
    assert!(!rules_gone(&mut fake.clone(), IpFamily::V4).unwrap());
    fake.0.borrow_mut().table = false;
    assert!(rules_gone(&mut fake.clone(), IpFamily::V4).unwrap());
    assert!(backend.table_gone().unwrap());
    assert!(backend.sync(&web(vec![ep("10.244.1.2")])).unwrap().full);
    // The flows made meanwhile went untranslated: conntrack is listed.
    let commands = &fake.0.borrow().commands;
    assert!(commands.iter().any(|(c, _)| c == "conntrack -L"), "{commands:?}");
}

#[test]
fn cleanup_deletes_the_tables_nft_lists_and_only_looks_on_a_clean_node() {
    let fake = Fake::default();
    fake.0.borrow_mut().table = true;
    assert_eq!(cleanup(&mut fake.clone()).unwrap(), 1);
    assert_eq!(cleanup(&mut fake.clone()).unwrap(), 0);
    let commands: Vec<String> = fake.0.borrow().commands.iter().map(|(c, _)| c.clone()).collect();
    let looks = ["nft -t list sets ip", "nft -t list sets ip6"];
    let deletion = "nft delete table ip kube-proxy";
    assert_eq!(commands, [looks[0], deletion, looks[1], looks[0], looks[1]]);
}

/// Services `ns/<name>` at `ip`:80, each with its endpoints.
fn services(list: &[(&str, &str, Vec<EndpointBuilder>)]) -> Model {
    let mut objects = Vec::new();
    let mut slices = Vec::new();
    for (name, ip, endpoints) in list {
        let svc = service("ns", name).cluster_ip(ip).port(port("http", 80));
        slices.push(svc.slice().port("http", 8080, Tcp).endpoints(endpoints.clone()).build());
        objects.push(svc.build());
    }
    crate::source::model_of(&objects, &slices)
}

#[test]
fn a_partial_sync_renders_and_writes_only_the_ports_that_changed() {
    let fake = Fake::default();
    let mut backend = NftablesBackend::new(fake.clone(), options());
    let a = || ("a", "10.96.0.1", vec![ep("10.244.1.1")]);
    backend.sync(&services(&[a(), ("b", "10.96.0.2", vec![ep("10.244.2.1")])])).unwrap();
    fake.transactions();

    // b's endpoint changes: only b's chains, nothing of a's.
    let report =
        backend.sync(&services(&[a(), ("b", "10.96.0.2", vec![ep("10.244.2.2")])])).unwrap();
    assert!(!report.full);
    let tx = fake.transactions().concat();
    assert!(tx.contains("dnat to 10.244.2.2:8080") && !tx.contains("ns/a/"), "{tx}");
    // The old endpoint's hairpin element stays (another port may have it)
    // until a full sync.
    assert!(tx.contains("hairpin-endpoints { 10.244.2.2 . 10.244.2.2 }"), "{tx}");
    assert!(!tx.contains("delete element ip kube-proxy hairpin-endpoints"), "{tx}");

    // b goes: its element and chains; a untouched.
    backend.sync(&services(&[a()])).unwrap();
    let tx = fake.transactions().concat();
    assert!(tx.contains("delete element ip kube-proxy service-ips { 10.96.0.2 . tcp . 80 }"));
    assert!(tx.contains("delete element ip kube-proxy cluster-ips { 10.96.0.2 }"), "{tx}");
    assert!(!tx.contains("ns/a/") && !tx.contains("add "), "{tx}");

    // c claims a's address: rendered whole, a (first by name) keeps it,
    // and the maps hold what a whole render says.
    let c = ("c", "10.96.0.1", vec![ep("10.244.3.1")]);
    backend.sync(&services(&[a(), c.clone()])).unwrap();
    assert!(backend.ports.is_none(), "conflicting ports: rendered whole from now on");
    let whole = render::render(&services(&[a(), c]), &backend.options);
    assert_eq!(whole.partial(backend.applied.as_ref().unwrap()).text, "");
}
