//! Socket-level load balancing: translate the destination once per socket
//! (TCP, connected UDP) or per datagram (unconnected UDP, whose datagrams to
//! a service keep to one backend while the flow is fresh), so packets travel
//! straight to the pod with no per-packet NAT. The `*4` hooks serve IPv4
//! services; the `*6` hooks serve IPv6 services from the IPv6 maps, and IPv6
//! sockets that reach an IPv4 service through its v4-mapped address
//! (`::ffff:10.96.0.10`), as dual-stack applications do, from the IPv4 maps.

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{
        bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, generated::bpf_set_retval,
    },
    programs::SockAddrContext,
};
use proxy_common::{
    AFFINITY_CLIENT_NETNS, Config, Counter, IPPROTO_TCP, IPPROTO_UDP, ServiceKey, ServiceKey6,
    ServiceValue, SockFlow, SockFlowKey, SockRevNat, SockRevNat6, SockRevNatKey, SockRevNatKey6,
    log_level,
    monitor::hook as monitor_hook,
    record::{Kind, Outcome, Program},
};

use crate::{
    lb::{self, ServiceMapKey, Verdict, Via},
    log,
    maps::{CONFIG, SOCK_FLOWS, SOCK_REV_NAT, SOCK_REV_NAT6, count},
    monitor::{self, EventAddr, What},
    report::{self, Denied, Site},
    stats::{self, Event},
};

/// What the hook sees: a socket's one destination (connect, getpeername)
/// or one datagram of an unconnected socket (sendmsg, recvmsg).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Socket,
    Datagram,
}

/// The third word of a v4-mapped IPv6 address (`::ffff:0:0/96`), as it lies
/// in memory.
const V4_MAPPED: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Return codes of cgroup sock_addr programs.
pub const ALLOW: i32 = 1;
pub const REJECT: i32 = 0;

const ECONNREFUSED: i32 = 111;

/// Whether the kernel has `bpf_set_retval` (5.18+): the agent probes and
/// sets it at load time. A frozen read-only global, so on older kernels the
/// verifier prunes the call it would reject, and a refusal fails
/// `connect()` with EPERM instead of ECONNREFUSED.
#[unsafe(no_mangle)]
static SET_RETVAL: u8 = 1;

#[inline(always)]
fn sock_addr(ctx: &SockAddrContext) -> &bpf_sock_addr {
    // SAFETY: the kernel hands every sock_addr program a valid context.
    unsafe { &*ctx.sock_addr }
}

/// An address and port.
type Addr<A> = (A, u16);

/// An address of a family the socket LB serves, and its maps.
pub trait SockAddress: Copy + PartialEq + EventAddr {
    type Key: ServiceMapKey;
    fn key(self, port: u16, proto: u8) -> Self::Key;
    /// The frontend address of a localhost NodePort, if this is one of
    /// kube-proxy's (IPv4 only): every 127.0.0.0/8 address is the one the
    /// agent plans them at, 127.0.0.1.
    fn localhost(self) -> Option<Self>;
    fn backend_addr(backend: &<Self::Key as ServiceMapKey>::Backend) -> Addr<Self>;
    /// Remembers that the socket `cookie`, sent to `backend`, was meant for
    /// `service` (its frontend `rev_nat_id`).
    fn remember_reverse(cookie: u64, backend: Addr<Self>, service: Addr<Self>, rev_nat_id: u32);
    /// What [`Self::remember_reverse`] remembered: the service address and
    /// its frontend's reverse-NAT id.
    fn reverse(cookie: u64, backend: Addr<Self>) -> Option<(Addr<Self>, u32)>;
}

impl SockAddress for [u8; 4] {
    type Key = ServiceKey;

    #[inline(always)]
    fn key(self, port: u16, proto: u8) -> ServiceKey {
        ServiceKey::new(self, port, proto, 0)
    }

    #[inline(always)]
    fn localhost(self) -> Option<Self> {
        (self[0] == 127).then_some([127, 0, 0, 1])
    }

    #[inline(always)]
    fn backend_addr(backend: &proxy_common::Backend) -> Addr<Self> {
        (backend.address, backend.port)
    }

    #[inline(always)]
    fn remember_reverse(cookie: u64, backend: Addr<Self>, service: Addr<Self>, rev_nat_id: u32) {
        let key = SockRevNatKey { cookie, address: backend.0, port: backend.1, _pad: 0 };
        let rev = SockRevNat { address: service.0, port: service.1, _pad: 0, rev_nat_id };
        let _ = SOCK_REV_NAT.insert(key, rev, 0);
    }

    #[inline(always)]
    fn reverse(cookie: u64, backend: Addr<Self>) -> Option<(Addr<Self>, u32)> {
        let key = SockRevNatKey { cookie, address: backend.0, port: backend.1, _pad: 0 };
        // SAFETY: copied out at once.
        let rev = unsafe { SOCK_REV_NAT.get(key).copied() }?;
        Some(((rev.address, rev.port), rev.rev_nat_id))
    }
}

impl SockAddress for [u8; 16] {
    type Key = ServiceKey6;

    #[inline(always)]
    fn key(self, port: u16, proto: u8) -> ServiceKey6 {
        ServiceKey6::new(self, port, proto, 0)
    }

    #[inline(always)]
    fn localhost(self) -> Option<Self> {
        None
    }

    #[inline(always)]
    fn backend_addr(backend: &proxy_common::Backend6) -> Addr<Self> {
        (backend.address, backend.port)
    }

    #[inline(always)]
    fn remember_reverse(cookie: u64, backend: Addr<Self>, service: Addr<Self>, rev_nat_id: u32) {
        let key = SockRevNatKey6 { cookie, address: backend.0, port: backend.1, _pad: [0; 6] };
        let rev = SockRevNat6 { address: service.0, port: service.1, _pad: 0, rev_nat_id };
        let _ = SOCK_REV_NAT6.insert(key, rev, 0);
    }

    #[inline(always)]
    fn reverse(cookie: u64, backend: Addr<Self>) -> Option<(Addr<Self>, u32)> {
        let key = SockRevNatKey6 { cookie, address: backend.0, port: backend.1, _pad: [0; 6] };
        // SAFETY: copied out at once.
        let rev = unsafe { SOCK_REV_NAT6.get(key).copied() }?;
        Some(((rev.address, rev.port), rev.rev_nat_id))
    }
}

/// Where a hook finds the address the syscall uses (destination, or the
/// source a reply is reported from): the IPv4 one (the `*4` hooks), the
/// IPv4 address inside a v4-mapped IPv6 one, or an IPv6 one (both in the
/// `*6` hooks, which tell them apart per call). Each reads only the
/// address words the verifier lets its hooks read.
pub trait SockFamily {
    type Address: SockAddress;
    /// Whether the hooks are the `*6` ones (for the records).
    const IPV6_HOOKS: bool;
    /// The address, if it is of this family.
    fn user_addr(sa: &bpf_sock_addr) -> Option<Self::Address>;
    /// Rewrites it (a v4-mapped one keeps its `::ffff:` prefix).
    fn set_user_addr(sa: &mut bpf_sock_addr, address: Self::Address);
}

/// IPv4 sockets: the `*4` hooks.
pub enum V4 {}
/// IPv6 sockets addressing an IPv4 service through its v4-mapped address.
pub enum V4Mapped {}
/// IPv6 sockets addressing an IPv6 service.
pub enum V6 {}

impl SockFamily for V4 {
    type Address = [u8; 4];
    const IPV6_HOOKS: bool = false;

    #[inline(always)]
    fn user_addr(sa: &bpf_sock_addr) -> Option<[u8; 4]> {
        Some(sa.user_ip4.to_ne_bytes())
    }

    #[inline(always)]
    fn set_user_addr(sa: &mut bpf_sock_addr, address: [u8; 4]) {
        sa.user_ip4 = u32::from_ne_bytes(address);
    }
}

#[inline(always)]
fn is_v4_mapped(sa: &bpf_sock_addr) -> bool {
    sa.user_ip6[0] == 0 && sa.user_ip6[1] == 0 && sa.user_ip6[2] == V4_MAPPED
}

impl SockFamily for V4Mapped {
    type Address = [u8; 4];
    const IPV6_HOOKS: bool = true;

    #[inline(always)]
    fn user_addr(sa: &bpf_sock_addr) -> Option<[u8; 4]> {
        is_v4_mapped(sa).then(|| sa.user_ip6[3].to_ne_bytes())
    }

    #[inline(always)]
    fn set_user_addr(sa: &mut bpf_sock_addr, address: [u8; 4]) {
        sa.user_ip6[3] = u32::from_ne_bytes(address);
    }
}

impl SockFamily for V6 {
    type Address = [u8; 16];
    const IPV6_HOOKS: bool = true;

    #[inline(always)]
    fn user_addr(sa: &bpf_sock_addr) -> Option<[u8; 16]> {
        let mut address = [0u8; 16];
        for (i, word) in sa.user_ip6.iter().enumerate() {
            address[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
        }
        Some(address)
    }

    #[inline(always)]
    fn set_user_addr(sa: &mut bpf_sock_addr, address: [u8; 16]) {
        for (i, word) in sa.user_ip6.iter_mut().enumerate() {
            let b = &address[i * 4..i * 4 + 4];
            *word = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

/// Rewrites the address and port the syscall uses.
#[inline(always)]
fn set_user<F: SockFamily>(ctx: &SockAddrContext, (address, port): Addr<F::Address>) {
    // SAFETY: valid context; the hook's address words and user_port are
    // writable in these hooks.
    let sa = unsafe { &mut *ctx.sock_addr };
    F::set_user_addr(sa, address);
    sa.user_port = u16::to_be(port) as u32;
}

/// The service (address, port, protocol) the syscall addresses, if TCP or
/// UDP of the family.
#[inline(always)]
fn destination<F: SockFamily>(sa: &bpf_sock_addr) -> Option<(Addr<F::Address>, u8)> {
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    Some(((F::user_addr(sa)?, u16::from_be(sa.user_port as u16)), proto))
}

/// Whether the socket's call to a frontend is translated here: every
/// socket's, or with `--socket-lb-host-netns-only` only the node's own, so
/// pods (service meshes, VMs) see the ClusterIP and the per-packet path
/// serves them. A localhost NodePort only ever the node's: a pod's
/// loopback is its own. A call of its own: inlined, it took the `*6`
/// hooks' frame past what 6.1's verifier allows a chain of calls (512
/// bytes, each frame rounded up to 32).
#[inline(never)]
fn in_scope(ctx: &SockAddrContext, cfg: &Config, localhost: bool) -> bool {
    if cfg.socket_lb_node_only == 0 && !localhost {
        return true;
    }
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    cfg.node_netns_cookie != 0 && netns == cfg.node_netns_cookie
}

impl Hook {
    /// The translating hook's name in monitor events.
    #[inline(always)]
    fn event<F: SockFamily>(self) -> u8 {
        match (self, F::IPV6_HOOKS) {
            (Hook::Socket, false) => monitor_hook::CONNECT4,
            (Hook::Datagram, false) => monitor_hook::SENDMSG4,
            (Hook::Socket, true) => monitor_hook::CONNECT6,
            (Hook::Datagram, true) => monitor_hook::SENDMSG6,
        }
    }

    /// The program's name, for the decision records.
    #[inline(always)]
    fn program<F: SockFamily>(self, translate: bool) -> Program {
        match (self, translate, F::IPV6_HOOKS) {
            (Hook::Socket, true, false) => Program::Connect4,
            (Hook::Datagram, true, false) => Program::Sendmsg4,
            (Hook::Socket, false, false) => Program::Getpeername4,
            (Hook::Datagram, false, false) => Program::Recvmsg4,
            (Hook::Socket, true, true) => Program::Connect6,
            (Hook::Datagram, true, true) => Program::Sendmsg6,
            (Hook::Socket, false, true) => Program::Getpeername6,
            (Hook::Datagram, false, true) => Program::Recvmsg6,
        }
    }
}

/// `connect6` and `sendmsg6`: a v4-mapped destination is an IPv4 service's
/// address, any other an IPv6 one's. Each family's path is a BPF call of
/// its own, so the verifier's 512-byte stack holds one of them at a time.
#[inline(always)]
pub fn try_translate6(ctx: &SockAddrContext, hook: Hook) -> i32 {
    if is_v4_mapped(sock_addr(ctx)) {
        try_translate::<V4Mapped>(ctx, hook)
    } else {
        try_translate::<V6>(ctx, hook)
    }
}

/// `recvmsg6` and `getpeername6`, as [`try_translate6`].
#[inline(always)]
pub fn try_reverse6(ctx: &SockAddrContext, hook: Hook) -> i32 {
    if is_v4_mapped(sock_addr(ctx)) {
        try_reverse::<V4Mapped>(ctx, hook)
    } else {
        try_reverse::<V6>(ctx, hook)
    }
}

/// `connect4` and `sendmsg4` (and their `*6` twins): pick a backend and
/// rewrite the destination. The clients are pods and node processes,
/// in-cluster clients all (the node's own as kube-proxy's "LOCAL traffic"
/// rules treat it).
#[inline(never)]
pub fn try_translate<F: SockFamily>(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let Some(((address, port), proto)) = destination::<F>(sock_addr(ctx)) else {
        return ALLOW;
    };
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    let program = hook.program::<F>(true);
    // Only a flag outlives the lookup: the `*6` hooks' stack is short.
    let (key, localhost) = match address.localhost() {
        Some(localhost) => (localhost.key(port, proto), true),
        None => (address.key(port, proto), false),
    };
    let Some(svc) = lb::lookup_frontend(&key) else {
        if cfg.log_level >= log_level::TRACE {
            log::socket(program, log_level::TRACE, Kind::NoService, (address, port), proto);
        }
        return ALLOW;
    };
    // One kind of record for both cases (a pod's localhost NodePort, a pod's
    // socket under --socket-lb-host-netns-only): the words say both.
    if !in_scope(ctx, cfg, localhost) {
        if cfg.log_level >= log_level::TRACE {
            log::socket(program, log_level::TRACE, Kind::NotInScope, (address, port), proto);
        }
        return ALLOW;
    }
    let (key, svc) = lb::in_cluster_scope(&key, &svc);
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // An unconnected UDP socket's datagrams to a service stay on one backend
    // while the flow is fresh, as conntrack keeps a 5-tuple on one pod.
    // Affinity decides alone where the service has it.
    let flow = (hook == Hook::Datagram
        && proto == IPPROTO_UDP
        && svc.count != 0
        && !svc.flags.is_affinity())
    .then_some(SockFlowKey { cookie, rev_nat_id: svc.rev_nat_id, _pad: 0 });
    // A flow to start: none remembered (or it went stale).
    let (verdict, new_flow) = match flow
        .as_ref()
        .and_then(|flow| flow_backend::<<F::Address as SockAddress>::Key>(cfg, flow, &svc))
    {
        Some(verdict) => (verdict, None),
        None => {
            let client = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
            (lb::choose(&key, &svc, (client, AFFINITY_CLIENT_NETNS)), flow)
        }
    };
    match verdict {
        Verdict::NoBackend => {
            let call = Call::<F> { hook, program, service: (address, port), proto };
            report::denied(&call, cfg, svc.rev_nat_id, Denied::Refused);
            // Fail the call at once with ECONNREFUSED instead of EPERM.
            // SAFETY: reading a global the loader initialised.
            if unsafe { core::ptr::read_volatile(&SET_RETVAL) } != 0 {
                unsafe { bpf_set_retval(-ECONNREFUSED) };
            }
            REJECT
        }
        Verdict::Backend { backend, backend_id, rev_nat_id, via } => {
            // A datagram of a remembered flow is no new one.
            if !matches!(via, Via::Flow) {
                stats::count(rev_nat_id, Event::SOCKET_CONNECTION);
            }
            if let Some(flow) = new_flow {
                remember(&flow, backend_id);
            }
            let to = F::Address::backend_addr(&backend);
            if cfg.log_level >= log_level::DEBUG {
                log::socket_backend(program, ((address, port), proto), to, via, svc.flags);
            }
            // A datagram of a known flow is no new decision.
            if !matches!(via, Via::Flow) {
                let what = What::Translated(rev_nat_id);
                monitor::socket(|| hook.event::<F>(), (address, port), to, proto, what);
            }
            F::Address::remember_reverse(cookie, to, (address, port), rev_nat_id);
            set_user::<F>(ctx, to);
            ALLOW
        }
    }
}

/// A call to a service, as `report` tells of its refusal (the socket hooks
/// drop nothing).
struct Call<F: SockFamily> {
    hook: Hook,
    program: Program,
    service: Addr<F::Address>,
    proto: u8,
}

impl<F: SockFamily> Site for Call<F> {
    const REFUSED: Event = Event::SOCKET_REFUSED;

    #[inline(always)]
    fn stat(&self, rev_nat_id: u32, event: Event) {
        stats::count(rev_nat_id, event);
    }

    #[inline(always)]
    fn record(&self, cfg: &Config, _refused: Outcome) {
        if cfg.log_level >= log_level::INFO {
            let level = log_level::INFO;
            log::socket(self.program, level, Kind::Refused, self.service, self.proto);
        }
    }

    #[inline(always)]
    fn event(&self, what: What) {
        let (service, proto) = (self.service, self.proto);
        monitor::socket(|| self.hook.event::<F>(), service, service, proto, what);
    }
}

/// The backend of the socket's flow `key` to `svc`, if the flow is fresh
/// and the backend still exists; the datagram refreshes it.
#[inline(always)]
fn flow_backend<K: ServiceMapKey>(
    cfg: &Config,
    key: &SockFlowKey,
    svc: &ServiceValue,
) -> Option<Verdict<K::Backend>> {
    let entry = SOCK_FLOWS.get_ptr_mut(key)?;
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: the LRU entry may be recycled concurrently; at worst we read a
    // stale backend id, which is then checked against the backends map.
    let flow = unsafe { *entry };
    if !flow.is_fresh(cfg, now) {
        return None;
    }
    let backend = K::backend(flow.backend_id)?;
    unsafe { (*entry).last_used_ns = now };
    count(Counter::ServiceHit);
    let (backend_id, rev_nat_id) = (flow.backend_id, svc.rev_nat_id);
    Some(Verdict::Backend { backend, backend_id, rev_nat_id, via: Via::Flow })
}

/// Starts the socket's flow `key` on `backend_id`.
#[inline(always)]
fn remember(key: &SockFlowKey, backend_id: u32) {
    let now = unsafe { bpf_ktime_get_ns() };
    let flow = SockFlow { last_used_ns: now, backend_id, answered: 0, _pad: [0; 3] };
    let _ = SOCK_FLOWS.insert(key, flow, 0);
}

/// `recvmsg4` and `getpeername4` (and their `*6` twins): show the service
/// address instead of the backend's to the socket that was translated. A
/// datagram's reply marks its socket's flow answered (it then lives longer).
#[inline(never)]
pub fn try_reverse<F: SockFamily>(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let sa = sock_addr(ctx);
    let Some(address) = F::user_addr(sa) else { return ALLOW };
    let peer = (address, u16::from_be(sa.user_port as u16));
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let Some((service, rev_nat_id)) = F::Address::reverse(cookie, peer) else {
        return ALLOW;
    };
    // Only while the service still exists: a reply from a pod that is no
    // longer behind it should show its own address. The socket got either
    // scope of the address (the internal one has its own id).
    let frontend = service.0.localhost().unwrap_or(service.0).key(service.1, sa.protocol as u8);
    let Some(svc) = lb::lookup_frontend(&frontend) else {
        if CONFIG.get(0).is_some_and(|cfg| cfg.log_level >= log_level::DEBUG) {
            log::service_gone(hook.program::<F>(false), peer, service);
        }
        return ALLOW;
    };
    if svc.rev_nat_id == rev_nat_id
        || lb::in_cluster_scope(&frontend, &svc).1.rev_nat_id == rev_nat_id
    {
        count(Counter::RevNat);
        set_user::<F>(ctx, service);
        if hook == Hook::Datagram {
            let flow = SockFlowKey { cookie, rev_nat_id, _pad: 0 };
            if let Some(entry) = SOCK_FLOWS.get_ptr_mut(flow) {
                // SAFETY: a one-byte store into a live entry.
                unsafe { (*entry).answered = 1 };
            }
        }
    }
    ALLOW
}
