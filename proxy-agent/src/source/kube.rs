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
    /// Listed completely at least once.
    complete: bool,
}

impl<P> Default for Collection<P> {
    fn default() -> Self {
        Collection {
            names: BTreeSet::new(),
            relist: None,
            pending: BTreeMap::new(),
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
                self.relist = Some(Vec::new());
                false
            }
            watcher::Event::InitApply(object) => {
                let name = name_of(&object);
                let parsed = parse(&name, object);
                self.relist.get_or_insert_with(Vec::new).push((name, parsed));
                false
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
                let is_listed =
                    |n: &ServiceName| listed.binary_search_by(|(k, _)| k.cmp(n)).is_ok();
                for gone in self.names.iter().filter(|n| !is_listed(n)) {
                    self.pending.insert(gone.clone(), None);
                }
                self.names = listed.iter().map(|(name, _)| name.clone()).collect();
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
    /// Bumped at every change of what the source serves.
    generation: u64,
    /// Watch failures (connection lost, 410 Gone, …), by kind.
    errors: BTreeMap<&'static str, u64>,
}

impl Shared {
    /// Every kind listed completely at least once.
    fn complete(&self) -> bool {
        self.services.complete && self.slices.complete && self.node.listed
    }
}

/// The API-server source. Its watchers run as tasks until it is dropped.
pub struct KubeSource {
    shared: Arc<Mutex<Shared>>,
    changed: Arc<Notify>,
    seen: u64,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

/// A client from `--kubeconfig`, else `KUBECONFIG` or `~/.kube/config`,
/// else the in-cluster service account.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no kubeconfig and not in a cluster")?,
    };
    Client::try_from(config).context("building the API client")
}

impl KubeSource {
    /// Starts watching; the source is complete once every kind is listed.
    pub fn start(client: Client, node_name: &str) -> Self {
        Self::start_paged(client, node_name, PAGE_SIZE)
    }

    /// Starts watching, listing `page_size` objects a page (the list
    /// harness, `examples/list_source.rs`, compares sizes).
    pub fn start_paged(client: Client, node_name: &str, page_size: u32) -> Self {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let changed = Arc::new(Notify::new());
        let config = watcher::Config::default().page_size(page_size).labels(LABELS);
        let services = config.clone().fields(SERVICE_FIELDS);
        let slices = config;
        let node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let tasks = vec![
            spawn_watch(
                Api::<Service>::all(client.clone()),
                services,
                &shared,
                &changed,
                |s, e| s.services.apply(e, model::parse_service),
            ),
            spawn_watch(
                Api::<EndpointSlice>::all(client.clone()),
                slices,
                &shared,
                &changed,
                |s, e| s.slices.apply(e, parse_slice),
            ),
            spawn_watch(Api::<Node>::all(client), node, &shared, &changed, |s, e| s.node.apply(e)),
        ];
        KubeSource { shared, changed, seen: 0, tasks }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether anything changed since the last call, and whether every kind
    /// has been listed completely. Nothing is said to change before then:
    /// Services without their EndpointSlices are no state worth planning or
    /// writing (at 100,000 services, a sync and a sizing of the maps for
    /// nothing), so the first change taken is the whole first list.
    pub fn poll(&mut self) -> (bool, bool) {
        let shared = self.shared();
        let (generation, complete) = (shared.generation, shared.complete());
        drop(shared);
        if !complete {
            return (false, false);
        }
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

    /// Woken at every change.
    pub fn notify(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    /// The changes since the last call.
    pub fn take_changes(&self) -> Changes {
        let mut shared = self.shared();
        Changes {
            services: std::mem::take(&mut shared.services.pending),
            slices: std::mem::take(&mut shared.slices.pending),
        }
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

/// Runs one watcher into its collection, with kube-rs's default backoff
/// (0.8 s doubling to 30 s, reset by any success).
fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    shared: &Arc<Mutex<Shared>>,
    changed: &Arc<Notify>,
    apply: fn(&mut Shared, watcher::Event<K>) -> bool,
) -> tokio::task::JoinHandle<()>
where
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
    })
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
}
