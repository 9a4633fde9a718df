//! Services, EndpointSlices and this node's Node from the API server, with
//! kube-rs watchers (list, then watch from the list's resource version;
//! relist after `410 Gone`; back off while the server is unreachable).
//!
//! As kube-proxy, Services and EndpointSlices labelled
//! `service.kubernetes.io/service-proxy-name` (another proxy's) or
//! `service.kubernetes.io/headless`, and headless Services
//! (`spec.clusterIP=None`), are filtered out by the server.
//!
//! Each kind keeps its last complete list: a relist replaces it only once
//! complete (`InitDone`), so a connection lost halfway never removes
//! anything, and the snapshot is not complete until every kind has been
//! listed once.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::Notify;

use super::Snapshot;

/// kube-proxy's selectors (the labels for both kinds).
const LABELS: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
const SERVICE_FIELDS: &str = "spec.clusterIP!=None";

/// The objects of one kind, by namespace and name.
struct Collection<K> {
    objects: BTreeMap<(String, String), K>,
    /// A list in progress: replaces `objects` once complete.
    relist: Option<BTreeMap<(String, String), K>>,
    /// Listed completely at least once.
    complete: bool,
}

impl<K> Default for Collection<K> {
    fn default() -> Self {
        Collection { objects: BTreeMap::new(), relist: None, complete: false }
    }
}

fn key<K: ResourceExt>(object: &K) -> (String, String) {
    (object.namespace().unwrap_or_default(), object.name_any())
}

impl<K: ResourceExt + Clone + PartialEq> Collection<K> {
    /// Applies one watcher event; whether what the source serves changed.
    fn apply(&mut self, event: watcher::Event<K>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(object) => {
                self.relist.get_or_insert_with(BTreeMap::new).insert(key(&object), object);
                false
            }
            watcher::Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let changed = !self.complete || listed != self.objects;
                self.objects = listed;
                self.complete = true;
                changed
            }
            watcher::Event::Apply(object) => {
                self.objects.insert(key(&object), object.clone()).as_ref() != Some(&object)
            }
            watcher::Event::Delete(object) => self.objects.remove(&key(&object)).is_some(),
        }
    }
}

#[derive(Default)]
struct Shared {
    services: Collection<Service>,
    slices: Collection<EndpointSlice>,
    nodes: Collection<Node>,
    /// Bumped at every change of what the source serves.
    generation: u64,
    /// Watch failures (connection lost, 410 Gone, …), by kind.
    errors: BTreeMap<&'static str, u64>,
}

/// The API-server source. Its watchers run as tasks until it is dropped.
pub struct KubeSource {
    shared: Arc<Mutex<Shared>>,
    changed: Arc<Notify>,
    seen: u64,
    node_name: String,
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
    /// Starts watching; the snapshot is complete once every kind is listed.
    pub fn start(client: Client, node_name: &str) -> Self {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let changed = Arc::new(Notify::new());
        let services = watcher::Config::default().labels(LABELS).fields(SERVICE_FIELDS);
        let slices = watcher::Config::default().labels(LABELS);
        let node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let tasks = vec![
            spawn_watch(Api::<Service>::all(client.clone()), services, &shared, &changed, |s| {
                &mut s.services
            }),
            spawn_watch(
                Api::<EndpointSlice>::all(client.clone()),
                slices,
                &shared,
                &changed,
                |s| &mut s.slices,
            ),
            spawn_watch(Api::<Node>::all(client), node, &shared, &changed, |s| &mut s.nodes),
        ];
        KubeSource { shared, changed, seen: 0, node_name: node_name.to_string(), tasks }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether anything changed since the last call, and whether every kind
    /// has been listed completely.
    pub fn poll(&mut self) -> (bool, bool) {
        let shared = self.shared();
        let (generation, complete) = (
            shared.generation,
            shared.services.complete && shared.slices.complete && shared.nodes.complete,
        );
        drop(shared);
        let changed = generation != self.seen;
        self.seen = generation;
        (changed, complete)
    }

    /// Woken at every change.
    pub fn notify(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    pub fn snapshot(&self) -> Snapshot {
        let shared = self.shared();
        Snapshot {
            services: shared.services.objects.values().cloned().collect(),
            slices: shared.slices.objects.values().cloned().collect(),
            rejected: Vec::new(),
        }
    }

    /// This node's Node object, once listed (`None` if it does not exist).
    pub fn node(&self) -> Option<Node> {
        self.shared().nodes.objects.get(&(String::new(), self.node_name.clone())).cloned()
    }

    /// Whether the Node list came in.
    pub fn node_listed(&self) -> bool {
        self.shared().nodes.complete
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
    collection: fn(&mut Shared) -> &mut Collection<K>,
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
                    if collection(&mut shared).apply(event) {
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

    fn service(name: &str, port: i32) -> Service {
        serde_yaml::from_str(&format!(
            "{{metadata: {{name: {name}, namespace: lab}}, spec: {{clusterIP: 10.96.0.10, ports: [{{port: {port}}}]}}}}"
        ))
        .unwrap()
    }

    #[test]
    fn a_relist_replaces_the_objects_only_once_complete() {
        let mut services = Collection::default();
        assert!(!services.apply(watcher::Event::Init));
        assert!(!services.apply(watcher::Event::InitApply(service("a", 80))));
        assert!(!services.complete);
        assert!(services.apply(watcher::Event::InitDone), "the first list is a change");
        assert!(services.apply(watcher::Event::Apply(service("b", 80))));
        assert!(!services.apply(watcher::Event::Apply(service("b", 80))), "the same object again");
        assert!(services.apply(watcher::Event::Apply(service("b", 81))));

        // A relist that is cut short changes nothing; a complete one that
        // lacks `a` removes it.
        services.apply(watcher::Event::Init);
        services.apply(watcher::Event::InitApply(service("b", 81)));
        assert_eq!(services.objects.len(), 2);
        services.apply(watcher::Event::Init);
        services.apply(watcher::Event::InitApply(service("b", 81)));
        assert!(services.apply(watcher::Event::InitDone));
        assert_eq!(services.objects.keys().collect::<Vec<_>>(), [&("lab".into(), "b".into())]);
        // The same list again is no change.
        services.apply(watcher::Event::Init);
        services.apply(watcher::Event::InitApply(service("b", 81)));
        assert!(!services.apply(watcher::Event::InitDone));
        assert!(services.apply(watcher::Event::Delete(service("b", 81))));
    }
}
