//! Service lookup and backend selection, independent of the hook that asks
//! and of the address family (each has its own services and backends maps,
//! found through the key's type).

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use proxy_common::{
    AffinityKey, AffinityKey6, AffinityValue, Backend, Backend6, Counter, SCOPE_INTERNAL,
    ServiceFlags, ServiceKey, ServiceKey6, ServiceValue,
    maglev::{self, CHUNK_SLOTS, MaglevKey},
};

use crate::maps::{AFFINITY, AFFINITY6, BACKENDS, BACKENDS6, MAGLEV, SERVICES, SERVICES6, count};
use crate::run::Run;

/// A services-map key, and so an address family: where its frontends and
/// backends are.
pub trait ServiceMapKey: Copy {
    type Backend: Copy;
    /// The entry at this key (frontend or slot), copied out.
    fn lookup(&self) -> Option<ServiceValue>;
    fn backend(id: u32) -> Option<Self::Backend>;
    fn with_slot(self, slot: u16) -> Self;
    fn with_scope(self, scope: u8) -> Self;
}

impl ServiceMapKey for ServiceKey {
    type Backend = Backend;

    #[inline(always)]
    fn lookup(&self) -> Option<ServiceValue> {
        // SAFETY: the value is copied out at once, before any other map operation.
        unsafe { SERVICES.get(self).copied() }
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<Backend> {
        // SAFETY: copied out at once.
        unsafe { BACKENDS.get(id).copied() }
    }

    #[inline(always)]
    fn with_slot(self, slot: u16) -> Self {
        ServiceKey::with_slot(self, slot)
    }

    #[inline(always)]
    fn with_scope(self, scope: u8) -> Self {
        ServiceKey::with_scope(self, scope)
    }
}

impl ServiceMapKey for ServiceKey6 {
    type Backend = Backend6;

    #[inline(always)]
    fn lookup(&self) -> Option<ServiceValue> {
        // SAFETY: as above.
        unsafe { SERVICES6.get(self).copied() }
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<Backend6> {
        // SAFETY: as above.
        unsafe { BACKENDS6.get(id).copied() }
    }

    #[inline(always)]
    fn with_slot(self, slot: u16) -> Self {
        ServiceKey6::with_slot(self, slot)
    }

    #[inline(always)]
    fn with_scope(self, scope: u8) -> Self {
        ServiceKey6::with_scope(self, scope)
    }
}

/// A client as session affinity knows it, and the map remembering it.
pub trait AffinityClient: Copy {
    type Key: Copy;
    fn key(self, rev_nat_id: u32) -> Self::Key;
    fn entry(key: &Self::Key) -> Option<*mut AffinityValue>;
    fn remember(key: &Self::Key, value: AffinityValue);
}

/// A netns cookie or an IPv4 address, as its kind (`AffinityKey::kind`) says.
impl AffinityClient for (u64, u8) {
    type Key = AffinityKey;

    #[inline(always)]
    fn key(self, rev_nat_id: u32) -> AffinityKey {
        AffinityKey { client: self.0, rev_nat_id, kind: self.1, _pad: [0; 3] }
    }

    #[inline(always)]
    fn entry(key: &AffinityKey) -> Option<*mut AffinityValue> {
        AFFINITY.get_ptr_mut(key)
    }

    #[inline(always)]
    fn remember(key: &AffinityKey, value: AffinityValue) {
        let _ = AFFINITY.insert(key, value, 0);
    }
}

/// An IPv6 address, whole (see `AffinityKey6`).
impl AffinityClient for [u8; 16] {
    type Key = AffinityKey6;

    #[inline(always)]
    fn key(self, rev_nat_id: u32) -> AffinityKey6 {
        AffinityKey6 { client: self, rev_nat_id, _pad: 0 }
    }

    #[inline(always)]
    fn entry(key: &AffinityKey6) -> Option<*mut AffinityValue> {
        AFFINITY6.get_ptr_mut(key)
    }

    #[inline(always)]
    fn remember(key: &AffinityKey6, value: AffinityValue) {
        let _ = AFFINITY6.insert(key, value, 0);
    }
}

/// What the choice of a backend for a frontend decided.
pub enum Verdict<B> {
    /// A service with no backend: refuse.
    NoBackend,
    /// Send to this backend; replies must look like they come from the service.
    Backend { backend: B, backend_id: u32, rev_nat_id: u32, via: Via },
}

/// How a backend was chosen (for the decision records and `explain`).
pub use proxy_common::record::Via;

#[inline(always)]
pub fn lookup_frontend<K: ServiceMapKey>(key: &K) -> Option<ServiceValue> {
    key.lookup()
}

/// The frontend an in-cluster client (a pod, the node) of `key`, found as
/// `svc`, gets: with two scopes, the internal-scope entry at the same
/// address (every endpoint, as kube-proxy sends such clients of an
/// `externalTrafficPolicy: Local` address to the service's cluster-wide
/// chain); else, or while that entry is missing (mid-sync), `svc` itself.
/// One flag test for every other frontend.
#[inline(always)]
pub fn in_cluster_scope<K: ServiceMapKey>(key: &K, svc: &ServiceValue) -> (K, ServiceValue) {
    if svc.flags.has_two_scopes() {
        let internal = key.with_scope(SCOPE_INTERNAL);
        if let Some(value) = lookup_frontend(&internal) {
            return (internal, value);
        }
    }
    (*key, *svc)
}

/// How a new flow's backend is picked where no affinity entry decides.
pub enum Pick<H: FnOnce() -> u32> {
    /// At random: the socket hooks, which see no flow to hash.
    Random,
    /// By the flow's hash (`maglev::flow_hash`, computed by `hash` only for
    /// a frontend with a Maglev table: the other paths stay as short as they
    /// were, which older verifiers count) in tables of this size where the
    /// frontend has one, else at random: the per-packet path.
    Hashed { hash: H, table_size: u32 },
}

/// A pick at random (`Pick::Random` of no hash function).
pub const RANDOM: Pick<fn() -> u32> = Pick::Random;

/// Picks a backend of the frontend `svc` (found at `key`) for `client`.
#[inline(always)]
pub fn choose<K: ServiceMapKey, C: AffinityClient>(
    key: &K,
    svc: &ServiceValue,
    client: C,
) -> Verdict<K::Backend> {
    choose_in(key, svc, client, Run::Real, RANDOM)
}

/// As [`choose`], picking as `pick` says; an explain run's packet neither
/// remembers nor refreshes an affinity entry.
#[inline(always)]
pub fn choose_in<K: ServiceMapKey, C: AffinityClient, H: FnOnce() -> u32>(
    key: &K,
    svc: &ServiceValue,
    client: C,
    run: Run,
    pick: Pick<H>,
) -> Verdict<K::Backend> {
    count(Counter::ServiceHit);
    if svc.count == 0 {
        count(Counter::NoBackend);
        return Verdict::NoBackend;
    }
    let affinity_key = client.key(svc.rev_nat_id);
    let affine = svc.flags.is_affinity();
    let now = unsafe { bpf_ktime_get_ns() };
    if affine
        && let Some((backend_id, backend)) = affine_backend::<K, C>(&affinity_key, svc, now, run)
    {
        count(Counter::AffinityHit);
        return Verdict::Backend {
            backend,
            backend_id,
            rev_nat_id: svc.rev_nat_id,
            via: Via::Affinity,
        };
    }
    let via = Via::Algorithm;
    // Either way a slot, then one lookup of it: the two ways join before
    // the lookups, which older verifiers (6.1) would otherwise walk twice.
    let hashed = match pick {
        Pick::Hashed { hash, table_size } if svc.flags.uses_maglev() => {
            maglev_slot(svc.rev_nat_id, hash(), table_size)
        }
        _ => None,
    };
    // A table missing mid-sync: at random.
    let slot = hashed.unwrap_or_else(|| random_slot(svc.count));
    let Some((backend_id, backend)) = backend_in(key, slot) else {
        count(Counter::SlotMiss);
        return Verdict::NoBackend;
    };
    count(Counter::BackendPicked);
    if affine && run == Run::Real {
        let value = AffinityValue { last_used_ns: now, backend_id, _pad: 0 };
        C::remember(&affinity_key, value);
    }
    Verdict::Backend { backend, backend_id, rev_nat_id: svc.rev_nat_id, via }
}

/// The slot the frontend's Maglev table of `size` entries gives a flow of
/// `hash`, read in the table's chunk in place (8 KiB: never copied to the
/// stack). One branch, the chunk's lookup: the path is close to what older
/// verifiers (6.1) take.
#[inline(always)]
fn maglev_slot(rev_nat_id: u32, hash: u32, size: u32) -> Option<u16> {
    let entry = maglev::entry(hash, size);
    let chunk = MaglevKey { rev_nat_id, chunk: entry / CHUNK_SLOTS as u32 };
    // SAFETY: one entry read at once; the agent replaces a table by
    // rewriting its chunks, and any slot a chunk names exists meanwhile.
    // An entry is never 0 (slot 0 is the frontend: its backend id 0 names
    // no backend, and the caller refuses).
    Some(unsafe { MAGLEV.get(chunk) }?.slots[entry as usize % CHUNK_SLOTS])
}

/// The remembered backend of `key`, if its entry is younger than the
/// service's timeout and the backend still exists. A hit refreshes the entry,
/// as kube-proxy's `-m recent --set` does on every new connection.
#[inline(always)]
fn affine_backend<K: ServiceMapKey, C: AffinityClient>(
    key: &C::Key,
    svc: &ServiceValue,
    now: u64,
    run: Run,
) -> Option<(u32, K::Backend)> {
    let entry = C::entry(key)?;
    // SAFETY: the LRU entry may be recycled concurrently; at worst we read a
    // stale backend id, which is then checked against the backends map.
    let (last_used, backend_id) = unsafe { ((*entry).last_used_ns, (*entry).backend_id) };
    let timeout_ns = svc.affinity_timeout_secs as u64 * 1_000_000_000;
    if now.wrapping_sub(last_used) > timeout_ns {
        return None;
    }
    let backend = K::backend(backend_id)?;
    if run == Run::Real {
        unsafe { (*entry).last_used_ns = now };
    }
    Some((backend_id, backend))
}

/// Uniform choice over slots `1..=count`, as iptables' statistic chain.
#[inline(always)]
fn random_slot(count: u16) -> u16 {
    (unsafe { bpf_get_prandom_u32() } % count as u32) as u16 + 1
}

/// The backend in `slot` of the frontend at `key`.
#[inline(always)]
fn backend_in<K: ServiceMapKey>(key: &K, slot: u16) -> Option<(u32, K::Backend)> {
    let id = lookup_frontend(&key.with_slot(slot))
        // A slot beyond a count that shrank after we read it: fall back to
        // slot 1, which exists unless the service is losing its last backend
        // (then the caller refuses, as it would a moment later).
        .or_else(|| lookup_frontend(&key.with_slot(1)))?
        .backend_id;
    Some((id, K::backend(id)?))
}

/// A new flow's decision on the per-packet path (`tc_lb::decide`, on tc's
/// ingress or XDP's): its frontend, how it leaves and why its backend (the
/// translated tuple is the caller's).
#[derive(Clone, Copy)]
pub struct Translation {
    pub rev_nat_id: u32,
    pub snat: bool,
    pub dsr: bool,
    pub via: Via,
    pub flags: ServiceFlags,
}
