//! Services, EndpointSlices and this node's Node from the API server, with
//! kube-rs watchers (list, then watch from the list's resource version;
//! relist after `410 Gone`; back off while the server is unreachable).
//!
//! As kube-proxy, Services and EndpointSlices labelled
//! `service.kubernetes.io/service-proxy-name` (another proxy's) or
//! `service.kubernetes.io/headless`, and headless Services
//! (`spec.clusterIP=None`), are filtered out by the server.
//!
//! Objects are read into what the proxy keeps of them as they arrive (the
//! store never holds whole API objects), and handed over as changes. Each
//! kind keeps its last complete list: a relist replaces it only once
//! complete (`InitDone`), so a connection lost halfway never removes
//! anything, and nothing is complete until every kind has been listed once.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, Resource, ResourceExt,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::Notify;

use super::snapshot::Changes;
use crate::{
    intern,
    model::{self, ParsedService, ParsedSlice, ServiceName},
    objects::{EndpointSlice, Service},
};

/// kube-proxy's selectors (the labels for both kinds).
pub const LABELS: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
pub const SERVICE_FIELDS: &str = "spec.clusterIP!=None";
/// Objects per list page: kube-rs's default and client-go's pager's.
pub const PAGE_SIZE: u32 = 500;

/// One kind's objects, as changes not yet taken. Only the names of the
/// objects are kept, to tell what a relist dropped.
struct Collection<P> {
    names: BTreeSet<ServiceName>,
    /// A list in progress, as it comes (in name order from the API
    /// server): replaces the objects once complete. A vector, then sorted
    /// and built into full `BTreeMap` nodes at once, where one filled entry
    /// by entry is half empty.
    relist: Option<Vec<(ServiceName, P)>>,
    /// Changes not yet taken; `None`: deleted.
    pending: BTreeMap<ServiceName, Option<P>>,
    /// Of the first list, the names of the objects already handed over
    /// while it was still arriving ([`Collection::take_listed`]).
    handed: Vec<ServiceName>,
    /// Objects of the first list so far (handed over or not).
    listed: usize,
    /// Objects handed over as changes so far, for the lists' progress.
    given: usize,
    /// Listed completely at least once.
    complete: bool,
}

impl<P> Default for Collection<P> {
    fn default() -> Self {
        Collection {
            names: BTreeSet::new(),
            relist: None,
            pending: BTreeMap::new(),
            handed: Vec::new(),
            listed: 0,
            given: 0,
            complete: false,
        }
    }
}

/// The name of `object`, shared with what is parsed of it.
fn name_of<K: ResourceExt>(object: &K) -> ServiceName {
    let meta = object.meta();
    let namespace = intern::name(meta.namespace.as_deref().unwrap_or_default());
    // `name_any`'s choice, without its copy.
    let name = meta.name.as_deref().or(meta.generate_name.as_deref()).unwrap_or_default();
    ServiceName { namespace, name: name.into() }
}

impl<P> Collection<P> {
    /// Applies one watcher event, reading objects with `parse`; whether
    /// there are changes to take.
    fn apply<K: ResourceExt>(
        &mut self,
        event: watcher::Event<K>,
        parse: fn(&ServiceName, K) -> P,
    ) -> bool {
        match event {
            watcher::Event::Init => {
                // A first list started again: what the cut one handed over
                // is known by name, and deleted at `InitDone` unless listed.
                let handed = std::mem::take(&mut self.handed);
                self.names.extend(handed);
                self.listed = 0;
                self.relist = Some(Vec::new());
                false
            }
            watcher::Event::InitApply(object) => {
                let name = name_of(&object);
                let parsed = parse(&name, object);
                self.relist.get_or_insert_with(Vec::new).push((name, parsed));
                // A first list's objects are worth taking a page at a time
                // (a relist's only once complete).
                self.listed += 1;
                !self.complete && self.listed.is_multiple_of(PAGE_SIZE as usize)
            }
            watcher::Event::InitDone => {
                let mut listed = self.relist.take().unwrap_or_default();
                // Stable: of an object listed twice, the later one is kept.
                listed.sort_by(|a, b| a.0.cmp(&b.0));
                listed.dedup_by(|later, earlier| {
                    let same = later.0 == earlier.0;
                    if same {
                        std::mem::swap(later, earlier);
                    }
                    same
                });
                let mut handed = std::mem::take(&mut self.handed);
                handed.sort_unstable();
                let is_listed = |n: &ServiceName| {
                    listed.binary_search_by(|(k, _)| k.cmp(n)).is_ok()
                        || handed.binary_search(n).is_ok()
                };
                for gone in self.names.iter().filter(|n| !is_listed(n)) {
                    self.pending.insert(gone.clone(), None);
                }
                self.names = listed.iter().map(|(name, _)| name.clone()).chain(handed).collect();
                let listed = listed.into_iter().map(|(name, p)| (name, Some(p)));
                if self.pending.is_empty() {
                    // Built in one go from the sorted list (the first list
                    // of 100,000), not inserted one by one.
                    self.pending = listed.collect();
                } else {
                    self.pending.extend(listed);
                }
                self.complete = true;
                true
            }
            watcher::Event::Apply(object) => {
                let name = name_of(&object);
                let parsed = parse(&name, object);
                self.names.insert(name.clone());
                self.pending.insert(name, Some(parsed));
                true
            }
            watcher::Event::Delete(object) => {
                let name = name_of(&object);
                self.names.remove(&name);
                self.pending.insert(name, None);
                true
            }
        }
    }
}

impl<P> Collection<P> {
    /// While the first list arrives: the objects it brought so far. They
    /// are known by name from then on, so a list cut short and started
    /// again deletes those it no longer has once it completes. Nothing
    /// once listed whole.
    fn take_listed(&mut self) -> Vec<(ServiceName, P)> {
        let Some(relist) = self.relist.as_mut().filter(|_| !self.complete) else {
            return Vec::new();
        };
        let taken = std::mem::take(relist);
        self.handed.extend(taken.iter().map(|(name, _)| name.clone()));
        taken
    }

    /// Objects handed over, and how many the kind holds: once listed, its
    /// list's; before, `total` (the server's count).
    fn progress(&self, total: Option<usize>) -> (usize, Option<usize>) {
        (self.given, if self.complete { Some(self.names.len()) } else { total })
    }
}

/// This node's Node object.
#[derive(Default)]
struct NodeWatch {
    node: Option<Node>,
    relist: Option<Option<Node>>,
    listed: bool,
}

impl NodeWatch {
    fn apply(&mut self, event: watcher::Event<Node>) -> bool {
        match event {
            watcher::Event::Init => self.relist = Some(None),
            watcher::Event::InitApply(node) => self.relist = Some(Some(node)),
            watcher::Event::InitDone => {
                self.node = self.relist.take().flatten();
                self.listed = true;
            }
            watcher::Event::Apply(node) => self.node = Some(node),
            watcher::Event::Delete(_) => self.node = None,
        }
        true
    }
}

// A slice's parse, shared, the object named as [`name_of`] reads it (as a
// Service's): the API server sends none without a name or namespace.
fn parse_slice(name: &ServiceName, slice: EndpointSlice) -> Arc<ParsedSlice> {
    Arc::new(model::parse_slice(name, slice))
}

#[derive(Default)]
struct Shared {
    services: Collection<ParsedService>,
    slices: Collection<Arc<ParsedSlice>>,
    node: NodeWatch,
    /// The service the first list of slices has come to (their owner's
    /// name, in the server's order): services wait for it while both list.
    slices_reached: Option<ServiceName>,
    /// How many of each kind the API server holds, as counted at start.
    totals: Totals,
    /// Bumped at every change of what the source serves.
    generation: u64,
    /// Watch failures (connection lost, 410 Gone, …), by kind.
    errors: BTreeMap<&'static str, u64>,
}

/// The objects of each kind the API server holds, as it said at start (its
/// `remainingItemCount`); `None` where it did not say.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    services: Option<usize>,
    slices: Option<usize>,
}

impl Shared {
    /// Every kind listed completely at least once.
    fn complete(&self) -> bool {
        self.services.complete && self.slices.complete && self.node.listed
    }

    /// The changes not yet taken, and the first lists' objects so far: a
    /// service once the slices have come to it (a service planned without
    /// its endpoints would be written twice), every slice.
    fn take_changes(&mut self) -> Changes {
        let mut changes = Changes {
            services: std::mem::take(&mut self.services.pending),
            slices: std::mem::take(&mut self.slices.pending),
        };
        let slices = self.slices.take_listed();
        if let Some(owner) = slices.iter().rev().find_map(|(_, slice)| slice.service.clone()) {
            self.slices_reached = Some(owner);
        }
        changes.slices.extend(slices.into_iter().map(|(name, slice)| (name, Some(slice))));
        let services = self.services.take_listed();
        changes.services.extend(services.into_iter().map(|(name, parsed)| (name, Some(parsed))));
        if !self.slices.complete {
            // Given at a later take, once the slices come to them.
            self.services.pending = match &self.slices_reached {
                Some(reached) => split_after(&mut changes.services, reached),
                None => std::mem::take(&mut changes.services),
            };
        }
        self.services.given += changes.services.values().filter(|c| c.is_some()).count();
        self.slices.given += changes.slices.values().filter(|c| c.is_some()).count();
        changes
    }
}

/// Splits off the entries of `map` after `key`.
fn split_after<V>(
    map: &mut BTreeMap<ServiceName, V>,
    key: &ServiceName,
) -> BTreeMap<ServiceName, V> {
    let mut after = map.split_off(key);
    if let Some(value) = after.remove(key) {
        map.insert(key.clone(), value);
    }
    after
}

/// How far the first lists have come: of each kind, the objects handed
/// over and how many it holds (as the API server said before the list is
/// complete).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ListProgress {
    pub services: (usize, Option<usize>),
    pub slices: (usize, Option<usize>),
}

impl ListProgress {
    /// How many times more frontends, and more endpoints, the whole lists
    /// hold than those handed over (for sizing the maps before the lists
    /// end); `None` without the counts or before anything was handed over.
    /// A slice's endpoints count only once its service is there too.
    pub fn ratios(&self) -> Option<(f64, f64)> {
        let ratio = |(handed, total): (usize, Option<usize>)| {
            let total = total?;
            (handed > 0).then(|| (total.max(handed) as f64) / handed as f64)
        };
        let frontends = ratio(self.services)?;
        Some((frontends, frontends.max(ratio(self.slices)?)))
    }
}

/// The API-server source. Its watchers run on a thread of their own (a
/// runtime of one worker), so that the lists keep arriving while the loop
/// writes what came before.
pub struct KubeSource {
    shared: Arc<Mutex<Shared>>,
    changed: Arc<Notify>,
    seen: u64,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        // Dropped inside the loop's runtime: its tasks are left to stop
        // with the thread, not waited for.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The client configuration from `--kubeconfig`, else `KUBECONFIG` or
/// `~/.kube/config`, else the in-cluster service account.
pub async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Config> {
    Ok(match kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no kubeconfig and not in a cluster")?,
    })
}

/// A client of [`config`]'s, on the caller's runtime.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    Client::try_from(config(kubeconfig).await?).context("building the API client")
}

impl KubeSource {
    /// Starts watching; the source is complete once every kind is listed.
    pub fn start(config: kube::Config, node_name: &str) -> anyhow::Result<Self> {
        Self::start_paged(config, node_name, PAGE_SIZE)
    }

    /// Starts watching, listing `page_size` objects a page (the list
    /// harness, `examples/list_source.rs`, compares sizes).
    pub fn start_paged(
        config: kube::Config,
        node_name: &str,
        page_size: u32,
    ) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("api-server")
            .enable_all()
            .build()
            .context("starting the API server source's thread")?;
        // The client's tasks (its connections) run there too, not on the
        // loop's thread, which a sync keeps busy.
        let _on_it = runtime.enter();
        let client = Client::try_from(config).context("building the API client")?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let changed = Arc::new(Notify::new());
        let watch = watcher::Config::default().page_size(page_size).labels(LABELS);
        let services = watch.clone().fields(SERVICE_FIELDS);
        let slices = watch;
        let node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        spawn_watch(Api::<Service>::all(client.clone()), services, &shared, &changed, |s, e| {
            s.services.apply(e, model::parse_service)
        });
        spawn_watch(
            Api::<EndpointSlice>::all(client.clone()),
            slices,
            &shared,
            &changed,
            |s, e| s.slices.apply(e, parse_slice),
        );
        spawn_watch(Api::<Node>::all(client.clone()), node, &shared, &changed, |s, e| {
            s.node.apply(e)
        });
        spawn_count(Api::<Service>::all(client.clone()), &shared, |t, n| t.services = n);
        spawn_count(Api::<EndpointSlice>::all(client), &shared, |t, n| t.slices = n);
        drop(_on_it);
        Ok(KubeSource { shared, changed, seen: 0, runtime: Some(runtime) })
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether anything changed since the last call, and whether every kind
    /// has been listed completely. While the first lists arrive, a change
    /// is a page of them (see [`Self::take_changes`]).
    pub fn poll(&mut self) -> (bool, bool) {
        let shared = self.shared();
        let (generation, complete) = (shared.generation, shared.complete());
        drop(shared);
        let changed = generation != self.seen;
        self.seen = generation;
        (changed, complete)
    }

    /// What is still being listed, for the log while the source is not
    /// whole.
    pub fn listing(&self) -> Vec<&'static str> {
        let shared = self.shared();
        let kinds = [
            ("Services", shared.services.complete),
            ("EndpointSlices", shared.slices.complete),
            ("Node", shared.node.listed),
        ];
        kinds.into_iter().filter(|(_, done)| !done).map(|(kind, _)| kind).collect()
    }

    /// How far the first lists have come.
    pub fn progress(&self) -> ListProgress {
        let shared = self.shared();
        ListProgress {
            services: shared.services.progress(shared.totals.services),
            slices: shared.slices.progress(shared.totals.slices),
        }
    }

    /// Woken at every change.
    pub fn notify(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    /// The changes since the last call; while the first lists arrive, what
    /// they brought so far (nothing is deleted before a list is complete).
    pub fn take_changes(&self) -> Changes {
        self.shared().take_changes()
    }

    /// This node's Node object, once listed (`None` if it does not exist).
    pub fn node(&self) -> Option<Node> {
        self.shared().node.node.clone()
    }

    /// Whether the Node list came in.
    pub fn node_listed(&self) -> bool {
        self.shared().node.listed
    }

    /// Watch failures so far, by kind.
    pub fn errors(&self) -> BTreeMap<&'static str, u64> {
        self.shared().errors.clone()
    }
}

/// Counts the objects of a kind once, with a list of one object: the API
/// server says how many remain (`remainingItemCount`) only for a list
/// without selectors, so the count holds those the selectors would leave
/// out too (an upper bound, for sizing). Not said: nothing is known.
fn spawn_count<K>(api: Api<K>, shared: &Arc<Mutex<Shared>>, set: fn(&mut Totals, Option<usize>))
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let shared = shared.clone();
    tokio::spawn(async move {
        let listed = api.list(&kube::api::ListParams::default().limit(1)).await;
        let total = match listed {
            Ok(list) => list
                .metadata
                .remaining_item_count
                .and_then(|remaining| Some(list.items.len() + usize::try_from(remaining).ok()?)),
            Err(e) => {
                tracing::debug!(error = %e, "could not count the objects to list");
                None
            }
        };
        set(&mut shared.lock().unwrap_or_else(|e| e.into_inner()).totals, total);
    });
}

/// Runs one watcher into its collection, with kube-rs's default backoff
/// (0.8 s doubling to 30 s, reset by any success).
fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    shared: &Arc<Mutex<Shared>>,
    changed: &Arc<Notify>,
    apply: fn(&mut Shared, watcher::Event<K>) -> bool,
) where
    K: Resource + ResourceExt + Clone + PartialEq + std::fmt::Debug + Send + Sync + 'static,
    K: serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    let (shared, changed) = (shared.clone(), changed.clone());
    tokio::spawn(async move {
        // The metric label: one of the three kinds watched.
        let kind: &'static str = match K::kind(&K::DynamicType::default()).as_ref() {
            "Service" => "Service",
            "EndpointSlice" => "EndpointSlice",
            "Node" => "Node",
            _ => "other",
        };
        let mut events = std::pin::pin!(watcher(api, config).default_backoff());
        while let Some(event) = events.next().await {
            let mut shared = shared.lock().unwrap_or_else(|e| e.into_inner());
            match event {
                Ok(event) => {
                    if apply(&mut shared, event) {
                        shared.generation += 1;
                        changed.notify_one();
                    }
                }
                Err(e) => {
                    *shared.errors.entry(kind).or_default() += 1;
                    tracing::warn!(
                        kind,
                        "API server watch failed (serving the last lists, retrying): {e}"
                    );
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::parse_service;

    fn service(name: &str, port: i32) -> Service {
        let service = test_objects::service("lab", name).cluster_ip("10.96.0.10");
        Service::from_api(&service.port(test_objects::port(None, port)).build())
    }

    fn port_of(change: &Option<ParsedService>) -> Option<u16> {
        change.as_ref().map(|parsed| parsed.as_ref().unwrap()[0].port)
    }

    fn taken(services: &mut Collection<ParsedService>) -> Vec<(String, Option<u16>)> {
        let pending = std::mem::take(&mut services.pending);
        pending.iter().map(|(name, change)| (name.name.to_string(), port_of(change))).collect()
    }

    #[test]
    fn a_relist_replaces_the_objects_only_once_complete() {
        let mut services = Collection::default();
        assert!(!services.apply(watcher::Event::Init, parse_service));
        assert!(!services.apply(watcher::Event::InitApply(service("a", 80)), parse_service));
        assert!(!services.complete && services.pending.is_empty());
        assert!(services.apply(watcher::Event::InitDone, parse_service));
        assert!(services.apply(watcher::Event::Apply(service("b", 80)), parse_service));
        assert!(services.apply(watcher::Event::Apply(service("b", 81)), parse_service));
        assert_eq!(taken(&mut services), [("a".into(), Some(80)), ("b".into(), Some(81))]);

        // A relist that is cut short changes nothing; a complete one that
        // lacks `a` deletes it.
        services.apply(watcher::Event::Init, parse_service);
        services.apply(watcher::Event::InitApply(service("b", 81)), parse_service);
        assert!(services.pending.is_empty());
        services.apply(watcher::Event::Init, parse_service);
        services.apply(watcher::Event::InitApply(service("b", 81)), parse_service);
        assert!(services.apply(watcher::Event::InitDone, parse_service));
        assert_eq!(taken(&mut services), [("a".into(), None), ("b".into(), Some(81))]);
        assert!(services.apply(watcher::Event::Delete(service("b", 81)), parse_service));
        assert_eq!(taken(&mut services), [("b".into(), None)]);
        assert!(services.names.is_empty());

        // A list that names an object twice (out of order) keeps the later.
        services.apply(watcher::Event::Init, parse_service);
        for (name, port) in [("c", 80), ("b", 81), ("c", 82)] {
            services.apply(watcher::Event::InitApply(service(name, port)), parse_service);
        }
        assert!(services.apply(watcher::Event::InitDone, parse_service));
        assert_eq!(taken(&mut services), [("b".into(), Some(81)), ("c".into(), Some(82))]);
        assert_eq!(services.names.len(), 2);
    }

    fn names(listed: &[(ServiceName, ParsedService)]) -> Vec<String> {
        listed.iter().map(|(name, _)| name.name.to_string()).collect()
    }

    #[test]
    fn a_first_list_is_handed_over_as_it_arrives_and_deletes_only_once_complete() {
        let mut services = Collection::default();
        services.apply(watcher::Event::Init, parse_service);
        for name in ["a", "b"] {
            services.apply(watcher::Event::InitApply(service(name, 80)), parse_service);
        }
        assert_eq!(names(&services.take_listed()), ["a", "b"]);
        assert!(services.take_listed().is_empty(), "each object once");
        services.apply(watcher::Event::InitApply(service("c", 80)), parse_service);
        // The list is cut short and starts again without `a`: only its
        // completion deletes `a`; `c`, not yet handed over, just comes.
        services.apply(watcher::Event::Init, parse_service);
        for name in ["b", "c"] {
            services.apply(watcher::Event::InitApply(service(name, 81)), parse_service);
        }
        assert_eq!(names(&services.take_listed()), ["b", "c"]);
        services.apply(watcher::Event::InitApply(service("d", 81)), parse_service);
        assert!(services.pending.is_empty());
        assert!(services.apply(watcher::Event::InitDone, parse_service));
        assert_eq!(taken(&mut services), [("a".into(), None), ("d".into(), Some(81))]);
        let known: Vec<&str> = services.names.iter().map(|n| &*n.name).collect();
        assert_eq!(known, ["b", "c", "d"]);

        // Once complete, a relist is handed over only whole.
        services.apply(watcher::Event::Init, parse_service);
        services.apply(watcher::Event::InitApply(service("b", 82)), parse_service);
        assert!(services.take_listed().is_empty());
        assert!(services.apply(watcher::Event::InitDone, parse_service));
        assert_eq!(
            taken(&mut services),
            [("b".into(), Some(82)), ("c".into(), None), ("d".into(), None)]
        );
    }

    #[test]
    fn a_first_list_wakes_the_loop_a_page_at_a_time() {
        let mut services = Collection::default();
        services.apply(watcher::Event::Init, parse_service);
        let woken = (0..2 * PAGE_SIZE)
            .filter(|i| {
                let event = watcher::Event::InitApply(service(&format!("s{i}"), 80));
                services.apply(event, parse_service)
            })
            .count();
        assert_eq!(woken, 2);
    }

    #[test]
    fn services_wait_for_the_slices_to_come_to_them() {
        let mut shared = Shared::default();
        shared.services.apply(watcher::Event::Init, parse_service);
        shared.slices.apply(watcher::Event::Init, parse_slice);
        for name in ["a", "b", "c"] {
            shared.services.apply(watcher::Event::InitApply(service(name, 80)), parse_service);
        }
        let take = |shared: &mut Shared| {
            let changes = shared.take_changes();
            let services: Vec<String> =
                changes.services.keys().map(|n| n.name.to_string()).collect();
            (services, changes.slices.len())
        };
        assert_eq!(take(&mut shared), (vec![], 0), "no slice yet");
        let slice = |service: &str| {
            let svc = test_objects::service("lab", service).cluster_ip("10.96.0.10");
            let slice = svc.port(test_objects::port(None, 80)).slice();
            EndpointSlice::from_api(&slice.build())
        };
        shared.slices.apply(watcher::Event::InitApply(slice("b")), parse_slice);
        assert_eq!(take(&mut shared), (vec!["a".into(), "b".into()], 1));
        // Complete, its objects not all handed over: those held back count
        // as not there yet.
        shared.services.apply(watcher::Event::InitDone, parse_service);
        assert_eq!(shared.services.progress(Some(9)), (2, Some(3)));
        shared.slices.apply(watcher::Event::InitDone, parse_slice);
        assert_eq!(take(&mut shared), (vec!["c".into()], 0), "the slices are whole");
        assert_eq!(shared.services.progress(Some(9)), (3, Some(3)));
    }

    #[test]
    fn the_counts_say_how_much_more_the_whole_lists_hold() {
        let progress = |services, slices| ListProgress { services, slices };
        assert_eq!(progress((10, Some(100)), (50, Some(100))).ratios(), Some((10.0, 10.0)));
        assert_eq!(progress((50, Some(100)), (10, Some(100))).ratios(), Some((2.0, 10.0)));
        assert_eq!(progress((1, Some(1)), (1, Some(1))).ratios(), Some((1.0, 1.0)), "whole");
        assert_eq!(progress((0, Some(100)), (10, Some(100))).ratios(), None, "nothing yet");
        assert_eq!(progress((10, None), (10, Some(100))).ratios(), None, "not counted");
        // The counts hold objects the selectors leave out: never below 1.
        assert_eq!(progress((10, Some(5)), (10, Some(5))).ratios(), Some((1.0, 1.0)));
    }
}
