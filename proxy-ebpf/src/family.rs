//! What the per-packet path does differently per address family: its maps
//! (services, conntrack, affinity, source ranges), its `CONFIG` fields and
//! its FIB lookup. The packet path itself (`tc_lb`, `conntrack`, `reject`)
//! is written once over [`Family`]; each family's copy keeps only its own.

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibLookup, bpf_redir_neigh},
    maps::lpm_trie::Key,
    programs::TcContext,
};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use proxy_common::{
    AFFINITY_CLIENT_IPV4, Backend, Backend6, BackendFlags, Config, CtEntry, CtEntry6, CtKey,
    CtKey6, CtValue, FragRewrite, SOURCE_RANGE_PREFIX_BITS, ServiceKey, ServiceKey6,
    SourceRangeKey, SourceRangeKey6, dsr, maglev,
};

use crate::{
    lb::{AffinityClient, ServiceMapKey},
    maps::{
        CONNTRACK, CONNTRACK6, DSR_PENDING, DSR_PENDING6, FRAGMENTS, SOURCE_RANGES, SOURCE_RANGES6,
    },
    packet::{self, DsrPending, IpHeader, Packet},
};

pub trait Family: IpHeader {
    type Entry: CtValue<Key = Self::Tuple>;
    type Service: ServiceMapKey<Backend = Self::Backend>;
    type Backend: Copy;
    /// A client as per-packet session affinity remembers it.
    type Client: AffinityClient;
    /// `AF_INET` or `AF_INET6`, as the FIB lookup takes it.
    const AF: u8;

    /// Runs one step of the packet path: inlined for IPv4, whose path stays
    /// as it was; a BPF call of its own for IPv6, whose 16-byte tuples
    /// would not fit one 512-byte frame. Steps called one after the other
    /// share the stack their frames take in turn.
    fn step<R>(f: impl FnOnce() -> R) -> R;

    fn service_key(daddr: Self::Addr, dport: u16, proto: u8) -> Self::Service;
    /// Whether `daddr` is a loopback address a localhost NodePort answers
    /// on (127.0.0.0/8; none for IPv6, as kube-proxy).
    fn is_localhost(daddr: Self::Addr) -> bool;
    /// A backend's address, port and flags.
    fn backend(b: &Self::Backend) -> (&Self::Addr, u16, BackendFlags);
    fn client(saddr: Self::Addr) -> Self::Client;
    /// A new flow's `maglev::flow_hash`.
    fn flow_hash(t: &Self::Tuple) -> u32;

    fn ct_get_ptr_mut(key: &Self::Tuple) -> Option<*mut Self::Entry>;
    fn ct_insert(key: &Self::Tuple, entry: &Self::Entry, flags: u64) -> Result<(), i32>;
    fn ct_remove(key: &Self::Tuple);

    /// The node address masqueraded flows take (all zero: none).
    fn snat_addr(cfg: &Config) -> Self::Addr;
    /// Whether `addr` is in the family's `--cluster-cidr`; `None` when none
    /// is set.
    fn in_cluster_cidr(cfg: &Config, addr: Self::Addr) -> Option<bool>;
    /// Whether `saddr` is in the frontend's loadBalancerSourceRanges.
    fn source_allowed(rev_nat_id: u32, saddr: Self::Addr) -> bool;

    /// Leaves a first fragment's translation for its datagram's later
    /// fragments (IPv4; IPv6 fragments pass untouched).
    fn remember_fragment(pkt: &Packet<Self::Tuple>, to: &Self::Tuple);

    /// The bytes the DSR option or header adds (`dsr::overhead`).
    const DSR_OVERHEAD: u16;
    /// The service a packet sent here by direct server return names (its
    /// DSR option or header).
    fn dsr_service(ctx: &TcContext) -> Option<(Self::Addr, u16)>;
    /// Leaves for [`Self::take_pending_dsr`] what direct server return does
    /// to the packet of `t` (`on`, see `packet::DsrPending`; for an
    /// insertion, `t`'s destination is the service). Through a per-CPU map,
    /// whose values the verifier does not track: the paths with and
    /// without DSR stay one up to where it acts.
    fn pend_dsr(on: u8, t: &Self::Tuple);
    /// What [`Self::pend_dsr`] left.
    fn take_pending_dsr() -> Option<DsrPending<Self::Addr>>;
    /// Inserts the DSR option (IPv4) or header (IPv6) naming `pending`'s
    /// service into a packet of `proto` rewritten to its backend.
    fn insert_dsr(ctx: &TcContext, proto: u8, pending: &DsrPending<Self::Addr>) -> Result<(), i64>;

    /// Fills the FIB lookup's addresses.
    fn fib_addrs(fib: &mut FibLookup, to: &Self::Tuple);
    /// The next hop the FIB found, for `bpf_redirect_neigh`.
    fn next_hop(fib: &FibLookup, nh: &mut bpf_redir_neigh);
}

impl Family for Ipv4Hdr {
    type Entry = CtEntry;
    type Service = ServiceKey;
    type Backend = Backend;
    type Client = (u64, u8);
    const AF: u8 = 2;

    #[inline(always)]
    fn step<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    #[inline(always)]
    fn service_key(daddr: [u8; 4], dport: u16, proto: u8) -> ServiceKey {
        ServiceKey::new(daddr, dport, proto, 0)
    }

    #[inline(always)]
    fn is_localhost(daddr: [u8; 4]) -> bool {
        daddr[0] == 127
    }

    #[inline(always)]
    fn backend(b: &Backend) -> (&[u8; 4], u16, BackendFlags) {
        (&b.address, b.port, b.flags)
    }

    #[inline(always)]
    fn client(saddr: [u8; 4]) -> (u64, u8) {
        (u32::from_ne_bytes(saddr) as u64, AFFINITY_CLIENT_IPV4)
    }

    #[inline(always)]
    fn flow_hash(t: &CtKey) -> u32 {
        maglev::flow_hash(&[u32::from_be_bytes(t.saddr)], t.sport, t.dport, t.proto)
    }

    #[inline(always)]
    fn ct_get_ptr_mut(key: &CtKey) -> Option<*mut CtEntry> {
        CONNTRACK.get_ptr_mut(key)
    }

    #[inline(always)]
    fn ct_insert(key: &CtKey, entry: &CtEntry, flags: u64) -> Result<(), i32> {
        CONNTRACK.insert(key, entry, flags)
    }

    #[inline(always)]
    fn ct_remove(key: &CtKey) {
        let _ = CONNTRACK.remove(key);
    }

    #[inline(always)]
    fn snat_addr(cfg: &Config) -> [u8; 4] {
        cfg.snat_addr
    }

    #[inline(always)]
    fn in_cluster_cidr(cfg: &Config, addr: [u8; 4]) -> Option<bool> {
        let len = cfg.cluster_cidr_prefix;
        let mask = if len >= 32 { u32::MAX } else { !(u32::MAX >> len) };
        (len != 0)
            .then(|| u32::from_be_bytes(addr) & mask == u32::from_be_bytes(cfg.cluster_cidr) & mask)
    }

    #[inline(always)]
    fn source_allowed(rev_nat_id: u32, address: [u8; 4]) -> bool {
        let key = Key::new(SOURCE_RANGE_PREFIX_BITS + 32, SourceRangeKey { rev_nat_id, address });
        SOURCE_RANGES.get(&key).is_some()
    }

    #[inline(always)]
    fn remember_fragment(pkt: &Packet, to: &CtKey) {
        if let Some(key) = &pkt.first_fragment {
            let _ = FRAGMENTS.insert(key, FragRewrite { saddr: to.saddr, daddr: to.daddr }, 0);
        }
    }

    const DSR_OVERHEAD: u16 = dsr::overhead(false);

    #[inline(always)]
    fn dsr_service(ctx: &TcContext) -> Option<([u8; 4], u16)> {
        packet::dsr_service(ctx)
    }

    #[inline(always)]
    fn pend_dsr(on: u8, t: &CtKey) {
        if let Some(pending) = DSR_PENDING.get_ptr_mut(0) {
            let value = DsrPending { on, _pad: 0, port: t.dport, address: t.daddr };
            // SAFETY: this CPU's slot; a tc program is not preempted by
            // another program using it.
            unsafe { *pending = value };
        }
    }

    #[inline(always)]
    fn take_pending_dsr() -> Option<DsrPending<[u8; 4]>> {
        // SAFETY: as in `pend_dsr`, copied out at once.
        DSR_PENDING.get_ptr(0).map(|p| unsafe { *p })
    }

    #[inline(always)]
    fn insert_dsr(ctx: &TcContext, _proto: u8, pending: &DsrPending<[u8; 4]>) -> Result<(), i64> {
        packet::insert_dsr_option(ctx, pending.address, pending.port)
    }

    #[inline(always)]
    fn fib_addrs(fib: &mut FibLookup, to: &CtKey) {
        fib.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(to.saddr);
        fib.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(to.daddr);
    }

    #[inline(always)]
    fn next_hop(fib: &FibLookup, nh: &mut bpf_redir_neigh) {
        nh.__bindgen_anon_1.ipv4_nh = unsafe { fib.__bindgen_anon_4.ipv4_dst };
    }
}

#[inline(never)]
fn out_of_line<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// The 16 bytes as the FIB lookup's four words (network order, as in
/// memory), copied as they are.
#[inline(always)]
fn words(a: &[u8; 16]) -> [u32; 4] {
    // SAFETY: both are 16 bytes of plain data.
    unsafe { core::mem::transmute(*a) }
}

impl Family for Ipv6Hdr {
    type Entry = CtEntry6;
    type Service = ServiceKey6;
    type Backend = Backend6;
    type Client = [u8; 16];
    const AF: u8 = 10;

    #[inline(always)]
    fn step<R>(f: impl FnOnce() -> R) -> R {
        out_of_line(f)
    }

    #[inline(always)]
    fn service_key(daddr: [u8; 16], dport: u16, proto: u8) -> ServiceKey6 {
        ServiceKey6::new(daddr, dport, proto, 0)
    }

    #[inline(always)]
    fn is_localhost(_: [u8; 16]) -> bool {
        false
    }

    #[inline(always)]
    fn backend(b: &Backend6) -> (&[u8; 16], u16, BackendFlags) {
        (&b.address, b.port, b.flags)
    }

    #[inline(always)]
    fn client(saddr: [u8; 16]) -> [u8; 16] {
        saddr
    }

    #[inline(always)]
    fn flow_hash(t: &CtKey6) -> u32 {
        // Destructured, not indexed through a closure: LLVM left such a
        // closure a call of its own, with a bounds check's panic.
        let [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = t.saddr;
        let word = u32::from_be_bytes;
        let words =
            [word([a, b, c, d]), word([e, f, g, h]), word([i, j, k, l]), word([m, n, o, p])];
        maglev::flow_hash(&words, t.sport, t.dport, t.proto)
    }

    #[inline(always)]
    fn ct_get_ptr_mut(key: &CtKey6) -> Option<*mut CtEntry6> {
        CONNTRACK6.get_ptr_mut(key)
    }

    #[inline(always)]
    fn ct_insert(key: &CtKey6, entry: &CtEntry6, flags: u64) -> Result<(), i32> {
        CONNTRACK6.insert(key, entry, flags)
    }

    #[inline(always)]
    fn ct_remove(key: &CtKey6) {
        let _ = CONNTRACK6.remove(key);
    }

    #[inline(always)]
    fn snat_addr(cfg: &Config) -> [u8; 16] {
        cfg.snat_addr6
    }

    #[inline(always)]
    fn in_cluster_cidr(cfg: &Config, addr: [u8; 16]) -> Option<bool> {
        // Two 64-bit halves: the BPF target has no 128-bit shifts.
        let len = cfg.cluster_cidr6_prefix as u32;
        let half = |a: &[u8; 16], i: usize| {
            u64::from_be_bytes([
                a[i],
                a[i + 1],
                a[i + 2],
                a[i + 3],
                a[i + 4],
                a[i + 5],
                a[i + 6],
                a[i + 7],
            ])
        };
        let (hi, lo) = (mask64(len), mask64(len.saturating_sub(64)));
        let prefix = &cfg.cluster_cidr6;
        // Inline, not a `then` closure: LLVM called that out of line, and
        // `decide`'s frame held its registers across the calls (296 bytes,
        // 248 without), past 6.1's stack limit in `xdp_ingress6`.
        if len == 0 {
            return None;
        }
        Some(
            half(&addr, 0) & hi == half(prefix, 0) & hi
                && half(&addr, 8) & lo == half(prefix, 8) & lo,
        )
    }

    #[inline(always)]
    fn source_allowed(rev_nat_id: u32, address: [u8; 16]) -> bool {
        let key = Key::new(SOURCE_RANGE_PREFIX_BITS + 128, SourceRangeKey6 { rev_nat_id, address });
        SOURCE_RANGES6.get(&key).is_some()
    }

    #[inline(always)]
    fn remember_fragment(_pkt: &Packet<CtKey6>, _to: &CtKey6) {}

    const DSR_OVERHEAD: u16 = dsr::overhead(true);

    #[inline(always)]
    fn dsr_service(ctx: &TcContext) -> Option<([u8; 16], u16)> {
        packet::dsr_service6(ctx)
    }

    #[inline(always)]
    fn pend_dsr(on: u8, t: &CtKey6) {
        if let Some(pending) = DSR_PENDING6.get_ptr_mut(0) {
            // SAFETY: as for IPv4; field by field, no 24-byte copy on the
            // stack.
            unsafe {
                (*pending).on = on;
                (*pending).port = t.dport;
                (*pending).address = t.daddr;
            }
        }
    }

    #[inline(always)]
    fn take_pending_dsr() -> Option<DsrPending<[u8; 16]>> {
        // SAFETY: as for IPv4.
        DSR_PENDING6.get_ptr(0).map(|p| unsafe { *p })
    }

    #[inline(always)]
    fn insert_dsr(ctx: &TcContext, proto: u8, pending: &DsrPending<[u8; 16]>) -> Result<(), i64> {
        packet::insert_dsr_header6(ctx, proto, pending.address, pending.port)
    }

    #[inline(always)]
    fn fib_addrs(fib: &mut FibLookup, to: &CtKey6) {
        fib.__bindgen_anon_3.ipv6_src = words(&to.saddr);
        fib.__bindgen_anon_4.ipv6_dst = words(&to.daddr);
    }

    #[inline(always)]
    fn next_hop(fib: &FibLookup, nh: &mut bpf_redir_neigh) {
        nh.__bindgen_anon_1.ipv6_nh = unsafe { fib.__bindgen_anon_4.ipv6_dst };
    }
}

/// The mask of a prefix's first `len` bits in a 64-bit word.
#[inline(always)]
fn mask64(len: u32) -> u64 {
    match len {
        0 => 0,
        1..64 => !(u64::MAX >> len),
        _ => u64::MAX,
    }
}
