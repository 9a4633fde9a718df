//! Whether a packet of no flow starts one, and how the new flow leaves
//! (SNAT, direct server return or neither).

use proxy_common::{Config, CtTuple, ServiceValue, explain::Decided, record::Outcome};

use super::Translation;
use crate::{
    family::Family,
    frame::Frame,
    lb::{self, Pick, Verdict},
    packet::{Flow, Packet},
    run::Run,
};

/// What a packet of no flow gets. (Its tag first, where BTF can describe
/// it: a niche inside a field is not.)
#[repr(u8)]
pub(crate) enum Decision {
    /// It is to no frontend: passed on.
    Pass,
    /// Dropped, for this reason, at this frontend (reverse-NAT id).
    Drop(Outcome, u32),
    /// To this frontend without endpoints: refused.
    Refuse(u32),
    /// A new flow, translated to the tuple [`decide`] wrote (its SNAT port
    /// yet to be found).
    Translate(Translation),
}

/// Whether a packet of no flow starts one: its frontend, a backend, SNAT
/// where kube-proxy would masquerade (the translated tuple in `flow.to`);
/// or its drop or refusal. The caller counts and records: a record's frame
/// would add to this step's. An explain run's packet notes the decision
/// (`explain`).
#[inline(always)]
pub(crate) fn decide<F: Family, const SCTP: bool>(
    ctx: &impl Frame,
    cfg: &Config,
    flow: &mut Flow<F::Tuple>,
) -> Decision {
    let pkt = &flow.pkt;
    let t = &pkt.tuple;
    // Localhost NodePorts are the node's own sockets' (the socket LB's): a
    // packet to 127.0.0.0/8 from an interface is martian, left to the stack
    // that drops it (kube-proxy guards them likewise, CVE-2020-8558).
    if F::is_localhost(t.daddr()) {
        return Decision::Pass;
    }
    let mut key = F::service_key(t.daddr(), t.dport(), t.proto());
    let Some(svc) = lb::lookup_frontend(&key) else { return Decision::Pass };
    let run = Run::of(ctx);
    run.frontend(ctx, svc.rev_nat_id);
    if svc.flags.has_source_ranges() && !F::source_allowed(svc.rev_nat_id, t.saddr()) {
        run.refused(ctx, Decided::SourceOutsideRanges);
        return Decision::Drop(Outcome::SourceOutsideRanges, svc.rev_nat_id);
    }
    let mut scoped = svc;
    if from_pods::<F>(cfg, t.saddr()) {
        (key, scoped) = lb::in_cluster_scope(&key, &svc);
    }
    let pick = Pick::Hashed { hash: || F::flow_hash(t), table_size: cfg.maglev_table_size };
    match lb::choose_in(&key, &scoped, F::client(t.saddr()), run, pick) {
        Verdict::NoBackend if scoped.flags.drops_when_empty() => {
            run.refused(ctx, Decided::NoLocalEndpoint);
            Decision::Drop(Outcome::NoLocalEndpoint, scoped.rev_nat_id)
        }
        Verdict::NoBackend => {
            run.refused(ctx, Decided::Refused);
            Decision::Refuse(scoped.rev_nat_id)
        }
        Verdict::Backend { backend, backend_id, rev_nat_id, via } => {
            let (snat, dsr) = dispatch::<F, SCTP>(&svc, cfg, pkt, &backend);
            run.translated(ctx, backend_id, (snat, dsr), via, scoped.flags);
            let (address, port, _) = F::backend(&backend);
            let saddr = if snat { F::snat_addr(cfg) } else { t.saddr() };
            let to = F::Tuple::new(saddr, *address, t.sport(), port, t.proto());
            flow.to = to;
            Decision::Translate(Translation { rev_nat_id, snat, dsr, via, flags: scoped.flags })
        }
    }
}

/// Whether a source is in-cluster as kube-proxy's local detector sees it:
/// in `--cluster-cidr` (none set, none is). The node's own traffic to its
/// addresses never passes tc ingress (only the socket hooks see it), and
/// another node's address is external to kube-proxy too.
#[inline(always)]
fn from_pods<F: Family>(cfg: &Config, saddr: F::Addr) -> bool {
    F::in_cluster_cidr(cfg, saddr) == Some(true)
}

/// How a new flow leaves, `(snat, dsr)`: kube-proxy's masquerade
/// decisions (external traffic with policy Cluster, a pod reaching itself
/// (hairpin), ClusterIP traffic from outside the cluster CIDR or all of it
/// with `--masquerade-all`), except that external traffic from outside the
/// cluster to a DSR frontend goes by direct server return to a backend on
/// another node (an unfragmented packet with a plain header, where the
/// option can go; a backend here needs no option, its replies pass this
/// node). `svc` is the frontend the client
/// addressed, whichever scope serves it: pods reaching a Local external
/// address are not masqueraded (kube-proxy's short-circuit skips the
/// ClusterIP's masquerade rule, which matches the ClusterIP). Two values
/// rather than one of three: `dsr` is only ever stored, never tested, up
/// to where the option goes in, so that the verifier walks the paths with
/// and without it as one (a value it must tell apart doubles every path
/// after it, past what 6.1 accepts). SCTP never goes direct (the model
/// gives its frontends SNAT): the SCTP programs carry no DSR path at all.
#[inline(always)]
fn dispatch<F: Family, const SCTP: bool>(
    svc: &ServiceValue,
    cfg: &Config,
    pkt: &Packet<F::Tuple>,
    backend: &F::Backend,
) -> (bool, bool) {
    let (address, _, flags) = F::backend(backend);
    let saddr = pkt.tuple.saddr();
    // A host-network backend answers from this node anyway, and a packet
    // from a node address to a node address would be a martian.
    if flags.is_host() {
        return (false, false);
    }
    if *address == saddr {
        return (true, false);
    }
    if svc.flags.is_external() {
        if svc.flags.is_local_only() {
            return (false, false);
        }
        let dsr = !SCTP
            && svc.flags.is_dsr()
            && pkt.plain_ip_header
            && pkt.first_fragment.is_none()
            && !from_pods::<F>(cfg, saddr);
        // A backend here: its replies pass this node, no option needed.
        return (!dsr, dsr && !flags.is_local());
    }
    let snat = cfg.masquerade_all != 0 || F::in_cluster_cidr(cfg, saddr) == Some(false);
    (snat, false)
}
