//! The eBPF mode as the agent's loop drives it (the first of the layers a
//! plan passes through, see the module above): the plan fitted into the
//! maps of the loaded [`BpfObject`], which grow with it; where the programs
//! attach; and their upkeep (interfaces that come and go, expired flows).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::atomic::Ordering::Relaxed,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use hashbrown::HashMap;
use proxy_common::{Config, MAX_SERVICE_ENTRIES};

use super::{
    BpfObject, CounterReader, EbpfError, MapSizes, TcAttach, TcRole,
    adopt::{self, NotAdopted},
    attach::Interfaces,
    carry::{KeptIds, Pinned},
    fit::{self, Capacity, Refusal},
    flows::Collected,
    frontend_stats,
    pod_programs::PodPrograms,
    reconciler::{Reconciler, SyncError, SyncReport},
    settings::{Acceleration, PodInterfacePrograms, Settings, TcAttachChoice},
    sock_end::SocketDestroy,
    state_sizes::StateSizes,
};
use crate::{
    backend::{Datapath, Extent, Scale, Synced, iptables, nftables},
    metrics::Metrics,
    model::{IpFamily, Model, ServiceName, v4, v6},
    netlink, node,
    plan::{Frontend, Node, Plan},
    sys,
};

/// A TCP flow translated per packet that never saw a reply lives this long.
const TCP_SYN_TIMEOUT_SECS: u32 = 60;
/// How long the socket path keeps an answered UDP flow on its backend: the
/// kernel's `nf_conntrack_udp_timeout_stream`, which kube-proxy leaves as
/// it is by default.
const UDP_STREAM_TIMEOUT_SECS: u32 = 120;
/// Expired conntrack entries are collected at least this often...
const GC_MIN: Duration = Duration::from_secs(1);
/// ...and at most this rarely.
const GC_MAX: Duration = Duration::from_secs(30);
/// Entries walked per second of interval: a collection reads the whole map
/// (in batches) and each expired entry again, so its interval grows with the map and the
/// agent's share of a CPU stays small under heavy traffic. The programs
/// ignore expired entries, and the LRU map evicts under pressure: the
/// collection only frees room early.
const GC_ENTRIES_PER_SEC: usize = 10_000;

/// How much lower the syncs of a partial source run than the lists.
const PARTIAL_SYNC_NICE: i32 = 10;

/// Logged when a change is applied in steps that each fit the maps.
const STEPWISE: &str =
    "old and new entries do not fit side by side: applying the change service by service";

/// When to collect again, after a collection that left `entries`.
fn gc_interval(entries: usize) -> Duration {
    Duration::from_secs((entries / GC_ENTRIES_PER_SEC) as u64).clamp(GC_MIN, GC_MAX)
}

/// The eBPF datapath and what looking after it needs.
pub struct EbpfDatapath {
    object: BpfObject,
    /// Where reading `object`'s adopted maps back stands.
    adopting: Adopting,
    /// Whether `object`'s programs are verified: not before the first sync,
    /// which knows what size of maps the source needs (one verifier run).
    verified: bool,
    /// Whether the maps were sized for what the whole source is expected
    /// to hold, at a sync of a part of it.
    estimated: bool,
    loading: Loading,
    cgroup: PathBuf,
    /// Name prefixes of pod-facing interfaces.
    pod_interfaces: Vec<String>,
    /// What the per-packet programs do there.
    pod_role: TcRole,
    /// Which pod interfaces need the replies program (`pod_role`
    /// `PodReplies`): the pods behind them, what they back, their flows.
    pods: PodPrograms,
    /// The node and pod interfaces, as last listed.
    facing: BTreeMap<String, node::Facing>,
    /// The node addresses the interfaces were last listed with.
    node_ips: Vec<IpAddr>,
    /// Where the programs were last attached (while serving).
    applied: Option<Interfaces>,
    /// Whether node interfaces run the XDP program.
    acceleration: Acceleration,
    /// When expired conntrack entries are next collected.
    next_gc: Instant,
    /// A previous agent's maps were pinned here at start.
    previous: bool,
    capacity: Capacity,
    /// The most entries a service map may grow to (`--bpf-lb-map-max`).
    bound: usize,
    /// Whether they may still grow (not after growing failed).
    growable: bool,
    /// The node addresses it took over with (`None`: not yet serving).
    serving: Option<Vec<IpAddr>>,
    /// The services that did not fit, as last logged.
    refused: BTreeMap<ServiceName, Refusal>,
    /// Whether the log said IPv6 flows fill the token-size maps (once).
    ipv6_outgrown_told: bool,
}

/// Where reading adopted service maps back stands.
enum Adopting {
    /// Read back, or none adopted.
    No,
    /// On its thread, while the source is read.
    Reading(adopt::Adoption),
    /// They could not be read back: new maps are to be made.
    Unreadable,
}

/// What loading the programs takes, kept to load them again into larger
/// maps.
struct Loading {
    tc_mode: TcAttach,
    root: PathBuf,
    /// The state maps' sizes: the same at every load, so a load into larger
    /// service maps reuses the pinned state maps.
    state: StateSizes,
    config: Config,
    socket_destroy: SocketDestroy,
    terminate_tcp: bool,
}

impl Loading {
    /// Makes the service maps at `capacity`, carrying the state maps pinned
    /// under the root over (a previous agent's, or this one's when they
    /// grow), and configures them; the programs are verified by the caller
    /// (while the maps fill), then [`Self::finish`]ed; nothing is attached.
    /// Frontends and backends keep the ids `ids` gives.
    fn prepare(&self, capacity: Capacity, ids: KeptIds) -> anyhow::Result<BpfObject> {
        let sizes = MapSizes {
            services: map_size(capacity.services),
            backends: map_size(capacity.backends),
            rev_nat: map_size(capacity.rev_nat),
        };
        let mut object = BpfObject::prepare(self.tc_mode, sizes, self.state, Some(&self.root), ids)
            .context("loading the BPF object")?;
        object.configure(&self.config).context("writing the datapath settings")?;
        Ok(object)
    }

    /// The object an agent starts with: the previous agent's service maps
    /// adopted where they can be ([`adopt`]: their entries then read back
    /// on a thread of their own), else maps of `capacity` keeping the
    /// previous agent's ids; and the capacity it has.
    fn prepare_first(
        &self,
        capacity: Capacity,
        bound: usize,
    ) -> anyhow::Result<(Capacity, BpfObject, Adopting)> {
        let bound = map_size(bound);
        let alone = sys::hold_lock(&self.root).unwrap_or_else(|e| {
            tracing::warn!(error = %e, root = %self.root.display(), "could not lock the pins' directory");
            false
        });
        let pinned = match alone {
            true => Pinned::open(&self.root).map_err(|_| NotAdopted::None),
            false => Err(NotAdopted::InUse),
        };
        let maglev = self.config.maglev_table_size;
        let adoptable = pinned.and_then(|pinned| {
            adopt::adoptable(&pinned, bound, maglev).map(|sizes| (pinned, sizes))
        });
        match adoptable {
            Ok((pinned, sizes)) => {
                let adopted = Capacity {
                    services: sizes.services as usize,
                    backends: sizes.backends as usize,
                    rev_nat: sizes.rev_nat as usize,
                    source_ranges: capacity.source_ranges,
                };
                let mut record = Reconciler::with_capacity(sizes);
                record.set_maglev_table_size(maglev);
                let started = self.prepare(adopted, KeptIds::Adopted).and_then(|object| {
                    let adoption = adopt::Adoption::start(&pinned, record)?;
                    Ok((object, adoption))
                });
                match started {
                    Ok((object, adoption)) => {
                        return Ok((adopted, object, Adopting::Reading(adoption)));
                    }
                    Err(e) => tracing::warn!(
                        "could not adopt the previous agent's service maps, making new ones: {e:#}"
                    ),
                }
            }
            Err(NotAdopted::None) => {}
            Err(why) => tracing::info!(
                "the previous agent's service maps are not adopted ({why}): new ones are made, its ids kept"
            ),
        }
        Ok((capacity, self.prepare(capacity, KeptIds::Pinned)?, Adopting::No))
    }

    /// What verified programs are set up with: the reader of their decision
    /// records and the way sockets are ended.
    fn finish(&self, object: &mut BpfObject) {
        // Read whatever the level: it can change while the programs run.
        match object.take_records() {
            Ok(records) => object.keep_records_reader(super::records::drain(records)),
            Err(e) => tracing::warn!(error = %e, "the programs' decision records cannot be read"),
        }
        let ending = object.choose_socket_ending(self.socket_destroy, self.terminate_tcp);
        tracing::info!(way = ending.describe(), "sockets connected to removed endpoints are ended");
    }
}

/// What the per-packet programs do on pod interfaces: only replies where
/// the socket programs translate every pod's connections (`auto`: they are
/// attached to the cgroup2 root for every network namespace; `replies`: the
/// operator says so for another cgroup). A pod's ClusterIP traffic must meet
/// one or the other.
fn pod_role(
    wanted: PodInterfacePrograms,
    at_cgroup_root: bool,
    host_netns_only: bool,
) -> anyhow::Result<TcRole> {
    Ok(match wanted {
        PodInterfacePrograms::Full => TcRole::Full,
        PodInterfacePrograms::Auto if at_cgroup_root && !host_netns_only => TcRole::PodReplies,
        PodInterfacePrograms::Auto => TcRole::Full,
        PodInterfacePrograms::Replies => {
            anyhow::ensure!(
                !host_netns_only,
                "--pod-interface-programs replies with --socket-lb-host-netns-only would translate pods' service traffic nowhere"
            );
            TcRole::PodReplies
        }
    })
}

/// Whether `cgroup` is the cgroup2 mount's root (every process is in it).
fn is_cgroup2_root(cgroup: &Path) -> bool {
    let canonical = |p: &Path| std::fs::canonicalize(p).ok();
    let root = sys::cgroup2_root().ok();
    root.and_then(|root| canonical(&root)).is_some_and(|root| Some(root) == canonical(cgroup))
}

/// Whether this node has IPv6, as far as the agent knows at start: an IPv6
/// node address (`--node-ip`, the Node object's InternalIPs, or the
/// interfaces' addresses) or an IPv6 `--cluster-cidr`. Without, the IPv6
/// state maps take a token size; a node that gains an address through its
/// Node object restarts the agent (as for any address change), which then
/// sizes them in full and carries their entries over.
fn has_ipv6(node: &Node, settings: &Settings) -> bool {
    node.ips.iter().any(IpAddr::is_ipv6) || settings.traffic.cluster_cidr(IpFamily::V6).is_some()
}

fn log_state_sizes(settings: &Settings, cpus: u32, state: StateSizes) {
    let limit = settings.conntrack;
    let ipv6 = if state.ipv6_token() {
        "token size: this node has no IPv6 address or IPv6 --cluster-cidr (a restart with one sizes them in full)"
    } else {
        "as IPv4's"
    };
    tracing::info!(
        flows = state.flows,
        per_core = limit.max_per_core,
        cpus,
        min = limit.min,
        ipv6_flows = state.flows6,
        ipv6,
        "state maps sized as the kernel's conntrack table (--conntrack-max-per-core × CPUs, at least --conntrack-min)"
    );
}

fn map_size(entries: usize) -> u32 {
    u32::try_from(entries).unwrap_or(u32::MAX)
}

impl EbpfDatapath {
    /// Makes the maps (carrying a previous agent's state over) at the
    /// default size (at most `--bpf-lb-map-max`: the first sync makes them
    /// again at what the source holds, if larger), configures them and
    /// reserves the SNAT ports; the programs are verified at the first
    /// sync, into the maps it fills; nothing is attached yet.
    pub fn new(settings: &Settings, node: &Node) -> anyhow::Result<Self> {
        let cgroup = match &settings.cgroup {
            Some(path) => path.clone(),
            None => sys::cgroup2_root().context("finding the cgroup2 mount")?,
        };
        let root = settings.bpffs_root.clone();
        sys::ensure_bpffs_dir(&root).with_context(|| format!("preparing {}", root.display()))?;
        let previous = super::pinned(&root);
        let tc_mode = match settings.tc_attach {
            TcAttachChoice::Auto => TcAttach::for_this_kernel(),
            TcAttachChoice::Tcx => TcAttach::Tcx,
            TcAttachChoice::Netlink => TcAttach::Netlink,
        };
        let bound = settings.map_max as usize;
        let start = (MAX_SERVICE_ENTRIES as usize).min(bound);
        let capacity = Capacity {
            services: start,
            backends: start,
            rev_nat: start,
            source_ranges: proxy_common::MAX_SOURCE_RANGES as usize,
        };
        let node_netns_cookie = node_netns_cookie(settings, node)?;
        let cpus = sys::cpu_count();
        let ipv6 = has_ipv6(node, settings);
        let state = StateSizes::new(settings.conntrack, cpus, ipv6);
        log_state_sizes(settings, cpus, state);
        let loading = Loading {
            tc_mode,
            root,
            state,
            config: config(settings, &node.ips, node_netns_cookie),
            socket_destroy: settings.socket_destroy,
            terminate_tcp: settings.terminate_tcp_on_endpoint_removal,
        };
        let (capacity, object, adopting) = loading.prepare_first(capacity, bound)?;
        let (min, max) = settings.snat_port_range;
        if let Some((low, high)) = sys::ephemeral_ports()
            && min <= high
            && low <= max
        {
            tracing::warn!(
                "--snat-port-range {min}-{max} overlaps the node's ephemeral ports {low}-{high}: reserving them leaves fewer (or none) for the node's own connections, this agent's to the API server included"
            );
        }
        sys::reserve_ports(min, max).context("reserving the SNAT port range")?;
        let socket_lb = if settings.socket_lb_host_netns_only {
            "the node's network namespace only"
        } else {
            "every network namespace"
        };
        let bpf_log_level = settings.log_level;
        let pod_role = pod_role(
            settings.pod_interface_programs,
            is_cgroup2_root(&cgroup),
            settings.socket_lb_host_netns_only,
        )?;
        let pod_interfaces = match pod_role {
            TcRole::Full => "new flows to frontends and their replies, both directions",
            TcRole::PodReplies => {
                "replies of per-packet flows only, at ingress (the socket LB translates every pod's connections)"
            }
        };
        let service_maps = match object.adopted() {
            true => "the previous agent's, adopted",
            false => "new",
        };
        tracing::info!(?tc_mode, cgroup = %cgroup.display(), bpffs = %loading.root.display(), socket_lb, ?bpf_log_level, node_interfaces = "new flows to frontends and their replies, both directions", pod_interfaces, service_maps, "BPF object prepared (its programs verified at the first sync, into maps of the size it needs)");
        let pod_interfaces = settings.pod_interfaces.clone();
        let next_gc = Instant::now();
        Ok(EbpfDatapath {
            object,
            adopting,
            verified: false,
            estimated: false,
            loading,
            cgroup,
            pod_interfaces,
            pod_role,
            pods: PodPrograms::default(),
            facing: BTreeMap::new(),
            node_ips: node.ips.clone(),
            applied: None,
            acceleration: settings.acceleration,
            next_gc,
            previous,
            capacity,
            bound,
            growable: true,
            serving: None,
            refused: BTreeMap::new(),
            ipv6_outgrown_told: false,
        })
    }

    /// Says once when IPv6 flows fill the IPv6 flow maps made at the token
    /// size: the oldest lose their translation as new ones come.
    fn tell_ipv6_outgrown(&mut self) {
        let (state, held) = (self.loading.state, self.object.ipv6_flows_held());
        if !self.ipv6_outgrown_told && state.ipv6_outgrown(held) {
            self.ipv6_outgrown_told = true;
            tracing::warn!(
                held,
                entries = state.flows6,
                "IPv6 flows fill the IPv6 flow maps, made small as this node has no IPv6 address or IPv6 --cluster-cidr: give --cluster-cidr its IPv6 CIDR (or --node-ip an IPv6 address) and restart the agent"
            );
        }
    }

    /// Brings the maps to `plan`; when it outgrew them, into larger maps
    /// (see [`Self::grow`]); while it does not fit even so, to the part of
    /// it that does (see [`fit`]). The first sync of the whole source
    /// verifies the programs while it fills their maps, unless a sync of
    /// a part of it did (see [`Self::sync_partial`]).
    fn sync_maps(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        extent: Extent,
        metrics: &Metrics,
    ) -> anyhow::Result<SyncReport> {
        // Nothing compared adopted maps with the plan before the sync of
        // the whole: until it serves, it looks at every frontend.
        let dirty = dirty.filter(|_| self.serving.is_some() || !self.object.adopted());
        let partial = matches!((extent, &self.serving), (Extent::Partial { .. }, None));
        if !partial {
            self.finish_adopting()?;
        }
        if let (Extent::Partial { scale }, None) = (extent, &self.serving) {
            // The lists are still arriving, and their reading comes first:
            // on a node short of CPU, writing a part sooner is no gain if
            // the list then ends later. These writes (and the verifier's
            // threads) take the CPU the lists leave.
            // The loop's runtime, for the tasks the programs' setup starts
            // (their records' reader).
            let runtime = tokio::runtime::Handle::try_current().ok();
            return std::thread::scope(|scope| {
                let partial = scope.spawn(|| {
                    let _in_runtime = runtime.as_ref().map(|r| r.enter());
                    sys::lower_thread_priority(PARTIAL_SYNC_NICE);
                    self.sync_partial(plan, dirty, scale, metrics)
                });
                partial.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the sync's thread failed")))
            });
        }
        // Before the programs are verified, the plan's size is checked
        // first: maps too small for what the source holds are sized for it
        // before anything is written, not after a failed attempt to fill
        // them (which would verify the programs into the small ones).
        let outgrown =
            !self.verified && fit::grown(self.capacity, fit::needed(plan), self.bound).is_some();
        if self.verified && self.refused.is_empty() && !outgrown {
            match self.write(plan, dirty) {
                Err(SyncError::Capacity { .. }) => {}
                result => return Ok(result?),
            }
        }
        let larger = fit::grown(self.capacity, fit::needed(plan), self.bound);
        if let Some(larger) = larger.filter(|_| self.growable) {
            let served = self.served(plan);
            match self.grow(plan, &served, larger, metrics) {
                Ok(report) => return Ok(report),
                Err(e) => {
                    // Not tried again at every sync.
                    tracing::error!(
                        "could not grow the service maps, serving what fits in them: {e:#}"
                    );
                    self.growable = false;
                }
            }
        }
        if !self.verified {
            return self.verify_first(plan, dirty, metrics);
        }
        let served = self.served(plan);
        Ok(self.sync_fitted(plan, &served, metrics)?)
    }

    /// The first verification of the object's programs, beside its writes
    /// (see [`Self::verify_and_fill`]).
    fn verify_first(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        metrics: &Metrics,
    ) -> anyhow::Result<SyncReport> {
        self.verify_and_fill(plan, dirty, None, metrics).inspect_err(|_| {
            // Some programs may be loaded: a retry starts afresh (a failed
            // growth restores its own object instead), writing everything.
            let ids = self.kept_ids();
            if let Ok(fresh) = self.loading.prepare(self.capacity, ids) {
                self.object = fresh;
            }
        })
    }

    /// Before serving, while the source is still being read: writes what it
    /// holds so far into maps that nothing runs yet (a previous agent's
    /// programs keep serving from their own), so that the sync of the whole
    /// writes only the rest. The first that knows how much more the whole
    /// holds (`scale`) sizes the maps for it and verifies the programs
    /// beside its writes, while the lists go on; one that outgrows the maps
    /// makes them again, larger, and writes everything again (the programs
    /// are then verified again, at the sync of the whole).
    fn sync_partial(
        &mut self,
        plan: &Plan,
        mut dirty: Option<&BTreeSet<Frontend>>,
        scale: Option<Scale>,
        metrics: &Metrics,
    ) -> anyhow::Result<SyncReport> {
        let expected = |plan: &Plan| {
            let needed = fit::needed(plan);
            scale.map_or(needed, |scale| fit::extrapolated(needed, scale))
        };
        if !self.estimated && scale.is_some() && !plan.frontends.is_empty() {
            self.estimated = true;
            if self.presize(expected(plan)) {
                dirty = None;
            }
            if !self.verified {
                // Into adopted maps, nothing of a part of the source.
                let nothing = BTreeSet::new();
                let dirty = if self.object.adopted() { Some(&nothing) } else { dirty };
                return self.verify_first(plan, dirty, metrics);
            }
        }
        if self.object.adopted() {
            // A previous agent's programs serve from these maps: a part of
            // the source is not written into them (its Services would lose
            // the endpoints not listed yet). The sync of the whole writes
            // what changed.
            return Ok(SyncReport::default());
        }
        match self.write(plan, dirty) {
            Err(SyncError::Capacity { .. }) if self.presize(expected(plan)) => {
                Ok(self.write(plan, None)?)
            }
            Err(SyncError::Capacity { .. }) => {
                let served = self.served(plan);
                Ok(self.sync_fitted(plan, &served, metrics)?)
            }
            result => Ok(result?),
        }
    }

    /// Before serving: makes the service maps again, empty, at the size
    /// `expected` needs if theirs is smaller (nothing runs from them yet:
    /// no make-before-break, and the programs are verified into the new
    /// ones later); whether it did.
    fn presize(&mut self, expected: Capacity) -> bool {
        let larger = fit::grown(self.capacity, expected, self.bound).filter(|_| self.growable);
        let Some(larger) = larger else { return false };
        tracing::info!(from = ?self.capacity, to = ?larger, "sizing the service maps for what the source is expected to hold");
        let ids = self.kept_ids();
        match self.loading.prepare(larger, ids) {
            Ok(object) => {
                self.object = object;
                self.capacity = larger;
                self.verified = false;
                true
            }
            Err(e) => {
                tracing::warn!("could not make larger service maps, filling these: {e:#}");
                self.growable = false;
                false
            }
        }
    }

    /// The ids maps made to replace the current ones keep (adopted maps'
    /// once read back).
    fn kept_ids(&mut self) -> KeptIds {
        if let Err(e) = self.finish_adopting() {
            tracing::warn!("could not make new service maps: {e:#}");
        }
        KeptIds::These(self.object.reconciler().kept_ids())
    }

    /// Takes what the adopted maps hold once read back (waiting for it);
    /// where they could not be read, makes new maps instead, the previous
    /// agent's ids kept, which the first sync fills.
    fn finish_adopting(&mut self) -> anyhow::Result<()> {
        if let Adopting::Reading(adoption) = std::mem::replace(&mut self.adopting, Adopting::No) {
            let read = adoption.finish();
            match read.map_err(EbpfError::from).and_then(|read| self.object.take_adopted(read)) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(
                        "could not read the adopted service maps back, making new ones: {e}"
                    );
                    self.adopting = Adopting::Unreadable;
                }
            }
        }
        if let Adopting::Unreadable = self.adopting {
            self.object = self.loading.prepare(self.capacity, KeptIds::Pinned)?;
            self.verified = false;
            self.adopting = Adopting::No;
        }
        Ok(())
    }

    /// What the maps serve, named as `plan` names it.
    fn served(&self, plan: &Plan) -> Plan {
        self.object
            .reconciler()
            .installed_plan(|f| plan.frontends.get(f).map(|fp| fp.service.clone()))
    }

    /// Writes `plan` into the maps; into maps nothing serves from yet,
    /// without touching what a previous agent's programs read (see
    /// [`BpfObject::sync_unserved`]), and the programs loaded on demand only
    /// once the others are verified (the verification looks at the whole
    /// plan for them). Adopted maps serve already: written as a serving
    /// agent writes.
    fn write(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> Result<SyncReport, SyncError> {
        if self.serving.is_some() || self.object.adopted() {
            return self.object.sync(plan, dirty);
        }
        if self.verified {
            self.object.serve_on_demand(plan, dirty);
        }
        self.object.sync_unserved(plan, dirty)
    }

    /// Verifies the object's programs while its maps fill with `plan` (or
    /// with the part of it that fits, `served` being what they hold: `None`,
    /// what this object's maps hold), and sets them up; they serve once
    /// attached.
    fn verify_and_fill(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        served: Option<&Plan>,
        metrics: &Metrics,
    ) -> anyhow::Result<SyncReport> {
        let started = Instant::now();
        let synced =
            self.object.verify_while_syncing(plan, dirty).context("loading the BPF programs")?;
        let ms = started.elapsed().as_millis();
        tracing::info!(capacity = ?self.capacity, ms, "BPF programs verified while their maps filled");
        self.loading.finish(&mut self.object);
        self.verified = true;
        let report = match synced {
            Err(SyncError::Capacity { .. }) => {
                let own;
                let served = match served {
                    Some(served) => served,
                    None => {
                        own = self.served(plan);
                        &own
                    }
                };
                self.sync_fitted(plan, served, metrics)
            }
            Ok(report) => {
                self.report_refused(BTreeMap::new(), plan, metrics);
                Ok(report)
            }
            Err(e) => Err(e),
        };
        report.context("filling them")
    }

    /// Syncs the part of `plan` the maps hold, given what they serve now.
    fn sync_fitted(
        &mut self,
        plan: &Plan,
        served: &Plan,
        metrics: &Metrics,
    ) -> Result<SyncReport, SyncError> {
        let mut fitted = fit::fit(plan, served, self.capacity);
        let refused = std::mem::take(&mut fitted.refused);
        self.report_refused(refused, &fitted.plan, metrics);
        match self.write(&fitted.plan, None) {
            Err(SyncError::Capacity { .. }) => {
                tracing::info!("{STEPWISE}");
                self.object.sync_in_steps(served, &fitted.plan)
            }
            result => result,
        }
    }

    /// Make-before-break: loads the programs again into maps of `larger`
    /// capacity (the state maps carried over, ids kept), fills them, and
    /// once serving attaches them beside the running programs, which then
    /// go with their pins, as when an agent replaces another.
    fn grow(
        &mut self,
        plan: &Plan,
        served: &Plan,
        larger: Capacity,
        metrics: &Metrics,
    ) -> anyhow::Result<SyncReport> {
        let before = self.capacity;
        match self.serving {
            None => {
                tracing::info!(from = ?before, to = ?larger, "sizing the service maps for what the source holds")
            }
            Some(_) => {
                tracing::info!(from = ?before, to = ?larger, "the services outgrew the maps: growing them")
            }
        }
        let ids = self.kept_ids();
        let object = self.loading.prepare(larger, ids)?;
        let old = std::mem::replace(&mut self.object, object);
        let was_verified = std::mem::replace(&mut self.verified, false);
        self.capacity = larger;
        let mut fill = || -> anyhow::Result<SyncReport> {
            // Nothing runs the new programs yet: they are verified while the
            // maps fill, whole where they fit (the usual case, and the cheap
            // one).
            let report = self.verify_and_fill(plan, None, Some(served), metrics)?;
            if let Some(node_ips) = self.serving.clone() {
                // The programs attached now serve until the new ones are.
                self.activate(&node_ips, metrics).context("attaching to them")?;
            }
            Ok(report)
        };
        match fill() {
            Ok(report) => {
                tracing::info!(capacity = ?larger, "the service maps grew");
                Ok(report)
            }
            Err(e) => {
                self.object = old;
                self.verified = was_verified;
                self.capacity = before;
                Err(e)
            }
        }
    }

    /// Attaches the programs (beside what serves now, which then goes).
    fn activate(&mut self, node_ips: &[IpAddr], metrics: &Metrics) -> anyhow::Result<()> {
        self.list_interfaces(node_ips).context("listing interfaces")?;
        let wanted = self.interfaces();
        let root = &self.loading.root;
        self.object
            .activate(&self.cgroup, &wanted, root)
            .with_context(|| format!("attaching to {} and {wanted:?}", self.cgroup.display()))?;
        self.applied = Some(wanted);
        metrics.set_datapath(Box::new(CounterReader::open(root)?));
        metrics.set_service_stats_source(Box::new(frontend_stats::Pinned(root.clone())));
        let carried = self.object.carried().iter().map(|(m, c)| (*m, c.as_str())).collect();
        metrics.set_carried(carried);
        self.serving = Some(node_ips.to_vec());
        Ok(())
    }

    /// Logs each service that stopped or started fitting once, and counts
    /// those that do not (`served`: what the maps will hold).
    fn report_refused(
        &mut self,
        refused: BTreeMap<ServiceName, Refusal>,
        served: &Plan,
        metrics: &Metrics,
    ) {
        let bound = self.bound;
        for (name, refusal) in &refused {
            if self.refused.get(name) == Some(refusal) {
                continue;
            }
            let what = if refusal.kept_previous {
                "its change is not applied, it is served as before"
            } else {
                "it is not served"
            };
            tracing::warn!(service = %name, reason = refusal.reason.label(), "Service {name} does not fit: {}, {what} (the service maps are at their bound, --bpf-lb-map-max {bound})", refusal.reason);
        }
        for name in self.refused.keys().filter(|n| !refused.contains_key(*n)) {
            // Rare (a refusal ending): the walk over the plan is fine.
            if served.frontends.values().any(|fp| fp.service.service == *name) {
                tracing::info!(service = %name, "Service {name} fits again: served as planned");
            } else {
                tracing::info!(service = %name, "Service {name} is gone: no longer refused");
            }
        }
        metrics.set_services_refused(refused.values().map(|r| r.reason.label()));
        self.refused = refused;
    }

    /// Lists the node and pod interfaces of now.
    fn list_interfaces(&mut self, node_ips: &[IpAddr]) -> std::io::Result<()> {
        let interfaces = sys::interfaces()?;
        self.facing = node::tc_interfaces(&interfaces, node_ips, &self.pod_interfaces);
        self.node_ips = node_ips.to_vec();
        Ok(())
    }

    /// Lists the interfaces and reads the routes to the pod interfaces:
    /// which pods are behind them, and (from `plan`) what those back.
    /// Returns whether it looked at the whole plan.
    fn find_pods(&mut self, node_ips: &[IpAddr], plan: &Plan) -> std::io::Result<bool> {
        self.list_interfaces(node_ips)?;
        let index: HashMap<u32, &String> = self
            .facing
            .iter()
            .filter(|(_, facing)| **facing == node::Facing::Pod)
            .filter_map(|(name, _)| Some((sys::ifindex(name).ok()?, name)))
            .collect();
        let routes = netlink::host_routes()?;
        let routed =
            routes.iter().filter_map(|r| Some((r.address, index.get(&r.ifindex)?.to_string())));
        let replan = self.pods.routes(routed);
        if replan {
            self.pods.plan(plan, None);
        }
        Ok(replan)
    }

    /// Before a sync writes `plan`'s changes (`dirty`), the replies program
    /// goes on the interfaces of pods that back a frontend now; the routes
    /// are read again first where a backend on this node is not a routed
    /// pod yet (its pod may be new).
    fn follow_endpoints(&mut self, plan: &Plan, dirty: Option<&BTreeSet<Frontend>>) {
        if self.pod_role != TcRole::PodReplies {
            return;
        }
        let unrouted = |f: &Frontend| {
            let backends = plan.frontends.get(f).map(|fp| &fp.backends);
            backends
                .into_iter()
                .flatten()
                .any(|b| b.local && !b.host && !self.pods.is_routed(b.addr.ip()))
        };
        let stale =
            !self.pods.routes_read() || dirty.is_none_or(|dirty| dirty.iter().any(unrouted));
        let node_ips = self.node_ips.clone();
        let whole = stale
            && self.find_pods(&node_ips, plan).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "could not read the routes to pod interfaces");
                false
            });
        if !whole {
            self.pods.plan(plan, dirty);
        }
        self.reattach();
    }

    /// Where the programs go now: on the interfaces last listed, the pod
    /// interfaces that need nothing left bare.
    fn interfaces(&mut self) -> Interfaces {
        let bare = match self.pod_role {
            TcRole::PodReplies => self.pods.bare(Instant::now()),
            TcRole::Full => BTreeSet::new(),
        };
        let tc = self
            .facing
            .iter()
            .filter(|(name, _)| !bare.contains(*name))
            .map(|(name, facing)| {
                let role = match facing {
                    node::Facing::Node => TcRole::Full,
                    node::Facing::Pod => self.pod_role,
                };
                (name.clone(), role)
            })
            .collect();
        let xdp = super::node_interfaces(&self.facing);
        Interfaces { xdp, tc, acceleration: self.acceleration }
    }

    /// Attaches and detaches where [`Self::interfaces`] changed (serving).
    fn reattach(&mut self) {
        if self.serving.is_none() {
            return;
        }
        let wanted = self.interfaces();
        if self.applied.as_ref() != Some(&wanted) {
            self.object.set_interfaces(&self.loading.root, &wanted);
            self.applied = Some(wanted);
        }
    }
}

impl Datapath for EbpfDatapath {
    fn serves_ipv6(&self) -> bool {
        true
    }

    fn mode(&self) -> &'static str {
        "ebpf"
    }

    fn replaces_previous(&self) -> bool {
        self.previous
    }

    fn live_at_once(&self) -> bool {
        false
    }

    fn min_sync_period(&self) -> Duration {
        Duration::ZERO
    }

    fn sync(
        &mut self,
        _model: &Model,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        extent: Extent,
        metrics: &Metrics,
    ) -> anyhow::Result<Synced> {
        self.follow_endpoints(plan, dirty);
        let report = self.sync_maps(plan, dirty, extent, metrics).inspect_err(|_| {
            metrics.map_update_failures.fetch_add(1, Relaxed);
        })?;
        let state = self.object.reconciler();
        let backends = state.backend_count();
        metrics.set_map_entries(&state.map_entries());
        let source = match extent {
            Extent::Whole => "whole",
            Extent::Partial { .. } => "partial",
        };
        tracing::info!(
            frontends = state.frontend_count(),
            backends = state.backend_count(),
            writes = report.writes,
            source,
            "datapath synced"
        );
        if self.serving.is_none() && !self.object.adopted() {
            // The endpoints a sync before serving drops were in this
            // agent's maps only (a partial source's): flows and sockets
            // made through a previous agent's programs are not theirs (its
            // backends this agent does not serve are dealt with at the
            // takeover). Adopted maps' endpoints are the previous agent's:
            // those a sync drops left while no agent ran.
            return Ok(Synced { backends });
        }
        match self.object.flush_departed_flows(&report.departures) {
            Ok(0) => {}
            Ok(flushed) => tracing::info!(flushed, "UDP/SCTP flows to removed endpoints deleted"),
            Err(e) => tracing::warn!(error = %e, "could not flush UDP/SCTP flows"),
        }
        metrics.add_flow_growth(self.object.take_flow_growth());
        // Connected sockets would keep sending to the pod that left.
        let started = Instant::now();
        match self.object.end_sockets(&report.departures) {
            Ok(0) => {}
            Ok(ended) => {
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                tracing::info!(ended, ms, "sockets connected to removed endpoints ended")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not end sockets connected to removed endpoints")
            }
        }
        Ok(Synced { backends })
    }

    /// Collects expired flows, less often as the map fills.
    fn look_after(&mut self, _polls: u32, metrics: &Metrics) -> bool {
        if Instant::now() < self.next_gc {
            return false;
        }
        let began = Instant::now();
        let collected = self.object.collect_conntrack();
        metrics.add_flow_growth(self.object.take_flow_growth());
        let left = collected.as_ref().map_or(0, |c| c.left);
        self.next_gc = Instant::now() + gc_interval(left);
        match collected {
            Ok(Collected { deleted, left, backends }) => {
                self.pods.flows(began, backends);
                self.reattach();
                metrics.conntrack_entries.store(left as u64, Relaxed);
                metrics.set_map_entries(&[("CONNTRACK", left)]);
                if deleted > 0 {
                    tracing::debug!(deleted, left, "expired flows collected");
                }
                self.tell_ipv6_outgrown();
            }
            Err(e) => tracing::warn!(error = %e, "conntrack collection failed"),
        }
        false
    }

    /// The socket programs tell the node's sockets by its namespace's cookie.
    fn serves_localhost_nodeports(&self) -> bool {
        self.loading.config.node_netns_cookie != 0
    }

    /// The per-packet programs go on node- and pod-facing interfaces.
    fn follows_interfaces(&self) -> bool {
        true
    }

    fn scan_interfaces(&mut self, node_ips: &[IpAddr], plan: &Plan) {
        let listed = match self.pod_role {
            TcRole::PodReplies => self.find_pods(node_ips, plan).map(drop),
            TcRole::Full => self.list_interfaces(node_ips),
        };
        match listed {
            // Every time: an attachment that failed is tried again.
            Ok(()) => {
                let wanted = self.interfaces();
                self.object.set_interfaces(&self.loading.root, &wanted);
                self.applied = Some(wanted);
            }
            Err(e) => tracing::warn!(error = %e, "could not list interfaces"),
        }
    }

    /// Attaches the programs (beside a previous agent's, which then go).
    fn take_over(&mut self, node_ips: &[IpAddr], metrics: &Metrics) -> anyhow::Result<()> {
        self.activate(node_ips, metrics)
    }

    /// Rules would still catch host-network clients: they go once the
    /// programs serve.
    fn remove_other_mode(&self) -> anyhow::Result<()> {
        let chains = iptables::cleanup_every_backend()?;
        if chains > 0 {
            tracing::info!(chains, "removed the iptables mode's rules");
        }
        let tables = nftables::cleanup(&mut iptables::exec::System::default())?;
        if tables > 0 {
            tracing::info!(tables, "removed the nftables mode's tables");
        }
        Ok(())
    }
}

/// The cookie of the node's network namespace (this process's), which the
/// socket programs tell the node's own sockets by; 0 where the kernel
/// cannot say it (`SO_NETNS_COOKIE`, 5.14+): then localhost NodePorts are
/// not served, and `--socket-lb-host-netns-only` cannot be.
fn node_netns_cookie(settings: &Settings, node: &Node) -> anyhow::Result<u64> {
    match sys::netns_cookie() {
        Ok(cookie) => Ok(cookie),
        Err(e) if settings.socket_lb_host_netns_only => {
            Err(e).context("reading this network namespace's cookie (--socket-lb-host-netns-only)")
        }
        Err(e) => {
            if node.serves_localhost_nodeports() {
                tracing::warn!(
                    "localhost NodePorts are not served: the socket programs cannot tell the node's own sockets without this network namespace's cookie (SO_NETNS_COOKIE, Linux 5.14+): {e}"
                );
            }
            Ok(0)
        }
    }
}

/// The programs' settings.
fn config(settings: &Settings, node_ips: &[IpAddr], node_netns_cookie: u64) -> Config {
    let traffic = &settings.traffic;
    let cluster_cidr =
        traffic.cluster_cidr(IpFamily::V4).and_then(|c| Some((v4(c.addr)?.octets(), c.len)));
    let (cidr, prefix) = cluster_cidr.unwrap_or(([0; 4], 0));
    let cluster_cidr6 =
        traffic.cluster_cidr(IpFamily::V6).and_then(|c| Some((v6(c.addr)?.octets(), c.len)));
    let (cidr6, prefix6) = cluster_cidr6.unwrap_or(([0; 16], 0));
    let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX).max(1);
    Config {
        // No node address (ClusterIPs only): nothing is SNATed to the node.
        snat_addr: node_ips.iter().find_map(|ip| v4(*ip)).map_or([0; 4], |ip| ip.octets()),
        cluster_cidr: cidr,
        cluster_cidr_prefix: prefix,
        masquerade_all: traffic.masquerade_all as u8,
        snat_port_min: settings.snat_port_range.0,
        snat_port_max: settings.snat_port_range.1,
        log_level: settings.log_level.word(),
        socket_lb_node_only: settings.socket_lb_host_netns_only as u8,
        tcp_syn_timeout_secs: TCP_SYN_TIMEOUT_SECS,
        tcp_established_timeout_secs: secs(settings.timeouts.tcp_established),
        tcp_close_wait_timeout_secs: secs(settings.timeouts.tcp_close_wait),
        tcp_time_wait_timeout_secs: secs(settings.timeouts.tcp_time_wait),
        udp_timeout_secs: secs(settings.timeouts.udp),
        udp_stream_timeout_secs: UDP_STREAM_TIMEOUT_SECS,
        node_netns_cookie,
        // No IPv6 node address: nothing is SNATed to the node over IPv6.
        snat_addr6: node_ips.iter().find_map(|ip| v6(*ip)).map_or([0; 16], |ip| ip.octets()),
        cluster_cidr6: cidr6,
        cluster_cidr6_prefix: prefix6,
        _pad6: [0; 3],
        maglev_table_size: settings.maglev_table_size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_collection_slows_down_as_the_map_fills() {
        assert_eq!(gc_interval(0), GC_MIN);
        assert_eq!(gc_interval(2_000), GC_MIN, "a small map is collected every second");
        assert_eq!(gc_interval(100_000), Duration::from_secs(10));
        assert_eq!(gc_interval(1_000_000), GC_MAX);
    }

    #[test]
    fn pod_interfaces_keep_only_replies_where_the_socket_lb_covers_every_pod() {
        use PodInterfacePrograms::*;
        let role = |wanted, at_root, host_only| pod_role(wanted, at_root, host_only).ok();
        assert_eq!(role(Auto, true, false), Some(TcRole::PodReplies));
        assert_eq!(role(Auto, false, false), Some(TcRole::Full), "a cgroup below the root");
        assert_eq!(role(Auto, true, true), Some(TcRole::Full), "pods' sockets untranslated");
        assert_eq!(role(Full, true, false), Some(TcRole::Full));
        assert_eq!(role(Replies, false, false), Some(TcRole::PodReplies), "the operator knows");
        assert_eq!(role(Replies, true, true), None, "nothing would translate pods' traffic");
    }
}
