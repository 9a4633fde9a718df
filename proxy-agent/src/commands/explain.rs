//! `proxy-agent explain`: what the datapath does with one packet, in words
//! (`inspect::explain`): in the eBPF mode computed by the real program
//! (`backend::ebpf::explain`), in the iptables mode by walking the rules
//! (`inspect::rule_walk`).

use std::{
    hash::{BuildHasher as _, Hasher as _},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use crate::{
    backend::{
        ebpf::{
            self, TC_INGRESS, TC_POD_REPLIES, XDP_INGRESS, XDP_INGRESS6,
            explain::{ExplainRun, Explainer},
        },
        iptables::exec::{Runner as _, System, Xtables},
    },
    cli::{ExplainArgs, InspectMode, Output},
    inspect::{
        self,
        explain::{
            Explanation, Query, craft, explain, explain_localhost, explain_nftables, explain_rules,
            is_localhost, route_interface, route_interface6, text, tuple,
        },
    },
    model::{IpFamily, Protocol},
    sys,
};
use anyhow::{Context as _, bail};
use proxy_common::TC_SCTP_PROGRAMS;

pub fn run(args: &ExplainArgs) -> anyhow::Result<()> {
    let ((from_ip, port), to) = (args.from, args.to);
    if from_ip.is_ipv4() != to.is_ipv4() {
        bail!("explain: --from {from_ip} and --to {to} are of different IP families");
    }
    let from = SocketAddr::new(from_ip, port.unwrap_or_else(ephemeral_port));
    let x = match super::lb::mode(&args.inspect) {
        InspectMode::Iptables => rules(args, from, to)?,
        InspectMode::Nftables => table(args, from, to)?,
        _ if is_localhost(to) => localhost(args, from, to)?,
        _ => program(args, from, to)?,
    };
    match args.inspect.output {
        Output::Table => print!("{}", text(&x)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&x)?),
    }
    Ok(())
}

/// The iptables mode: the rules `iptables-save` (`ip6tables-save`) prints,
/// walked.
fn rules(args: &ExplainArgs, from: SocketAddr, to: SocketAddr) -> anyhow::Result<Explanation> {
    let (family, tool) = match to {
        SocketAddr::V4(_) => (IpFamily::V4, "iptables"),
        SocketAddr::V6(_) => (IpFamily::V6, "ip6tables"),
    };
    let tools = System::new(Xtables::Auto.resolve(&mut System::default()));
    // The family's own tool: `iptables-save` is renamed for IPv6.
    let save = tools.for_family(family).run("iptables-save", &[], None);
    let save = save.context("reading the rules")?;
    let local = node_addresses(to)?;
    let program = format!("{tool} rules (nat KUBE-SERVICES, filter)");
    let query = Query::new(args.proto, from, to, program);
    Ok(explain_rules(&query, &save, &local))
}

/// The nftables mode: its tables as `nft list table` prints them, walked.
fn table(args: &ExplainArgs, from: SocketAddr, to: SocketAddr) -> anyhow::Result<Explanation> {
    let listed = super::lb::nft_tables()?;
    let family = if to.is_ipv4() { "ip" } else { "ip6" };
    let program =
        format!("nft table {family} kube-proxy (firewall-check, services, the endpoint checks)");
    let query = Query::new(args.proto, from, to, program);
    Ok(explain_nftables(&query, &listed, &node_addresses(to)?))
}

/// The node's addresses of `to`'s family (where NodePorts answer).
fn node_addresses(to: SocketAddr) -> anyhow::Result<Vec<IpAddr>> {
    Ok(sys::interfaces()
        .context("listing the node's addresses")?
        .into_values()
        .flatten()
        .filter(|ip| ip.is_ipv4() == to.is_ipv4())
        .collect())
}

/// The eBPF mode's localhost NodePorts: the socket programs' lookup, made
/// in the pinned service table.
fn localhost(args: &ExplainArgs, from: SocketAddr, to: SocketAddr) -> anyhow::Result<Explanation> {
    let entries = inspect::maps::read_pinned(&args.inspect.pins.bpffs_root)?;
    let program = "connect4/sendmsg4 (the socket LB), for the node's own sockets".into();
    let query = Query::new(args.proto, from, to, program);
    Ok(explain_localhost(&query, &entries))
}

/// The eBPF mode: the program attached to the interface, run.
fn program(args: &ExplainArgs, from: SocketAddr, to: SocketAddr) -> anyhow::Result<Explanation> {
    let from_ip = from.ip();
    let interface = match &args.interface {
        Some(interface) => interface.clone(),
        None => route(from_ip).with_context(|| {
            format!("no route to {from_ip} here: name the interface (--interface)")
        })?,
    };
    let ifindex = sys::ifindex(&interface)
        .with_context(|| format!("no interface {interface} in this network namespace"))?;
    let root = &args.inspect.pins.bpffs_root;
    let (program, note) = attached(root, &interface);
    let sctp = args.proto == Protocol::Sctp;
    let mut explainer = Explainer::load(root, sctp).with_context(|| {
        format!(
            "loading the per-packet programs with the maps pinned under {} (is the eBPF mode running here?)",
            root.display()
        )
    })?;
    let packet = craft(args.proto, from, to);
    let entries = inspect::maps::read_pinned(root)?;
    // XDP first where it runs: what it sends on or drops never meets tc.
    let xdp = ebpf::xdp_pinned(root).contains(&interface) && !sctp;
    let mut passed_up = None;
    if xdp {
        let refused6 = match from_ip.is_ipv6() {
            true => explainer.load_xdp6().err(),
            false => None,
        };
        let run = explainer.run_xdp(&packet, ifindex)?;
        if run.verdict != XDP_PASS {
            let run = ExplainRun { verdict: tc_verdict(run.verdict), ..run };
            let query = Query::new(args.proto, from, to, format!("{XDP_INGRESS} on {interface}"));
            let mut x = explain(&query, &run, &entries);
            x.notes.push(format!("at the driver hook (--bpf-lb-acceleration): {} before the kernel builds an skb; tc never sees it", xdp_action(run.verdict)));
            routed(&mut x, &run);
            return Ok(x);
        }
        passed_up = Some(match refused6 {
            Some(e) => format!(
                "{XDP_INGRESS} on {interface} passes IPv6 up to tc: this kernel's verifier refuses {XDP_INGRESS6}, so the agent runs XDP for IPv4 only (its log says so; {e})"
            ),
            None => format!(
                "{XDP_INGRESS} on {interface} passes it up to tc (not sent on from the driver hook: a pod or the host here, a next hop not behind an XDP interface, or a packet XDP leaves to tc); what tc does follows, XDP having decided a new flow's backend where it does"
            ),
        });
    }
    let run = explainer.run(program, &packet, ifindex)?;
    // SCTP goes on in its own program, which translates everything.
    let program_text = match sctp {
        false => format!("{program} on {interface}"),
        true => format!("{program} on {interface}, then {}", TC_SCTP_PROGRAMS[0]),
    };
    let query = Query {
        replies_only: program == TC_POD_REPLIES && !sctp,
        ..Query::new(args.proto, from, to, program_text)
    };
    let mut x = explain(&query, &run, &entries);
    x.notes.extend(note);
    x.notes.extend(passed_up);
    routed(&mut x, &run);
    Ok(x)
}

/// Where the FIB lookup sends a packet sent on: the route to its new
/// destination.
fn routed(x: &mut Explanation, run: &ExplainRun) {
    if run.verdict == REDIRECT
        && matches!(x.outcome, "translated" | "tracked")
        && let Some((_, _, dst)) = tuple(&run.packet)
        && let Some(iface) = route(dst.ip())
    {
        x.action = format!("{} through {iface}", x.action);
    }
}

/// XDP's verdicts (`XDP_DROP` 1, `XDP_PASS` 2, `XDP_TX` 3, `XDP_REDIRECT` 4)
/// as the tc verdicts an explanation reads: sent on, dropped, passed.
const XDP_PASS: i32 = 2;

fn tc_verdict(xdp: i32) -> i32 {
    match xdp {
        1 => SHOT,
        3 | 4 => REDIRECT,
        _ => -1,
    }
}

/// What XDP did, in words, from the tc verdict [`tc_verdict`] made.
fn xdp_action(verdict: i32) -> &'static str {
    match verdict {
        REDIRECT => "rewritten and sent on (XDP_TX, or a redirect to another XDP interface)",
        _ => "dropped (XDP_DROP)",
    }
}

/// The interface this node routes `ip` through (its family's route table).
fn route(ip: IpAddr) -> Option<String> {
    match ip {
        IpAddr::V4(ip) => route_interface(&std::fs::read_to_string("/proc/net/route").ok()?, ip),
        IpAddr::V6(ip) => {
            route_interface6(&std::fs::read_to_string("/proc/net/ipv6_route").ok()?, ip)
        }
    }
}

/// The tc verdicts of a redirect and a drop.
const REDIRECT: i32 = 7;
const SHOT: i32 = 2;

/// A port of the node's ephemeral range, at random.
fn ephemeral_port() -> u16 {
    let (min, max) = sys::ephemeral_ports().unwrap_or((32768, 60999));
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    min + (random % (max.saturating_sub(min) as u64 + 1)) as u16
}

/// The ingress program attached to `interface` (its TCX link's, pinned as
/// `links/tc-IFACE`); without one, `tc_ingress`, and a note saying so.
fn attached(root: &Path, interface: &str) -> (&'static str, Option<String>) {
    let name = ebpf::pinned_program(&root.join("links").join(format!("tc-{interface}")));
    match name.as_deref() {
        Some(TC_POD_REPLIES) => (TC_POD_REPLIES, None),
        Some(_) => (TC_INGRESS, None),
        None => (
            TC_INGRESS,
            Some(format!(
                "no TCX link of ours on {interface} (clsact filters, or none attached): explained with {TC_INGRESS}, the node interfaces' program"
            )),
        ),
    }
}
