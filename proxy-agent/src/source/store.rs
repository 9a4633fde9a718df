//! The store: the objects the proxy works from, each in its last good
//! version, and the model of them, rebuilt one service at a time.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::SystemTime,
};

use super::snapshot::{Changes, ObjectRef, Snapshot};
use crate::{
    compact,
    model::{
        self, ForwardingMode, LbAlgorithm, Model, ModelError, ParsedSlice, ServiceName, ServicePort,
    },
};

/// The objects the proxy works from and the model of them. A Service that
/// becomes invalid (or an object that stops decoding) keeps its last good
/// version: bad input never takes down what was being served.
#[derive(Debug, Default)]
pub struct Store {
    /// The last good version of each Service.
    services: BTreeMap<ServiceName, Arc<[ServicePort]>>,
    /// EndpointSlices by name, and the names of each service's slices
    /// (sorted; a vector, as most services have one or two: a set's first
    /// node would cost half a KiB per service).
    slices: BTreeMap<ServiceName, Arc<ParsedSlice>>,
    slices_of: BTreeMap<ServiceName, Vec<ServiceName>>,
    /// Services whose latest version is invalid, and why.
    invalid: BTreeMap<ServiceName, ModelError>,
    /// Served services whose algorithm or forwarding-mode annotation has
    /// an unknown value: the problem's message.
    unknown_annotations: BTreeMap<ServiceName, Vec<String>>,
    /// Slices with skipped parts.
    slice_errors: BTreeMap<ServiceName, Vec<ModelError>>,
    /// Objects whose latest version does not decode (manifests).
    rejected: BTreeSet<ObjectRef>,
    model: Model,
}

/// What applying changes did.
#[derive(Debug, Default)]
pub struct StoreUpdate {
    /// Services and EndpointSlices added, changed or removed.
    pub service_changes: usize,
    pub endpoint_changes: usize,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the slices
    /// added or changed: when the change that led to them happened.
    pub trigger_times: Vec<SystemTime>,
    /// The services whose ports or endpoints may have changed.
    pub touched: BTreeSet<ServiceName>,
    /// Objects without a name, which no store can hold.
    pub unnamed: Vec<ModelError>,
}

impl Store {
    /// Applies a source's changes and rebuilds the model of the services
    /// they touch.
    pub fn apply(&mut self, changes: Changes) -> StoreUpdate {
        let mut update = StoreUpdate::default();
        let (services, slices) = (changes.services.len(), changes.slices.len());
        for (name, service) in changes.services {
            match service {
                Some(Err(err)) => {
                    self.invalid.insert(name, err);
                }
                Some(Ok(ports)) => {
                    self.invalid.remove(&name);
                    let unknown = unknown_annotations(&name, &ports);
                    match unknown.is_empty() {
                        true => self.unknown_annotations.remove(&name),
                        false => self.unknown_annotations.insert(name.clone(), unknown),
                    };
                    if self.services.get(&name) != Some(&ports) {
                        self.services.insert(name.clone(), ports);
                        update.service_changes += 1;
                        update.touched.insert(name);
                    }
                }
                None => {
                    self.invalid.remove(&name);
                    self.unknown_annotations.remove(&name);
                    if self.services.remove(&name).is_some() {
                        update.service_changes += 1;
                        update.touched.insert(name);
                    }
                }
            }
        }
        for (name, slice) in changes.slices {
            let old = match slice {
                Some(slice) if self.slices.get(&name) == Some(&slice) => continue,
                Some(slice) => {
                    update.trigger_times.extend(slice.trigger_time);
                    self.link(&name, slice.service.as_ref(), &mut update.touched);
                    match slice.errors.is_empty() {
                        true => self.slice_errors.remove(&name),
                        false => self.slice_errors.insert(name.clone(), slice.errors.clone()),
                    };
                    self.slices.insert(name.clone(), slice)
                }
                None => {
                    self.slice_errors.remove(&name);
                    self.slices.remove(&name)
                }
            };
            match old {
                Some(old) => {
                    update.endpoint_changes += 1;
                    if let Some(service) = old.service.clone() {
                        self.unlink_if_moved(&name, service, &mut update.touched);
                    }
                }
                None => update.endpoint_changes += usize::from(self.slices.contains_key(&name)),
            }
        }
        for name in &update.touched {
            let ports = self.services.get(name).map(|p| &p[..]).unwrap_or_default();
            let slices = self.slices_of.get(name).into_iter().flatten();
            let slices = slices.filter_map(|s| self.slices.get(s).map(|s| &**s));
            let ports = model::with_endpoints(ports, slices);
            self.model.set_service(name.clone(), ports);
        }
        compact::refill(&mut self.services, services);
        compact::refill(&mut self.slices, slices);
        compact::refill(&mut self.slices_of, slices);
        self.model.refill(update.touched.len());
        update
    }

    /// Records that slice `name` belongs to `service`.
    fn link(
        &mut self,
        name: &ServiceName,
        service: Option<&ServiceName>,
        touched: &mut BTreeSet<ServiceName>,
    ) {
        if let Some(service) = service {
            let names = self.slices_of.entry(service.clone()).or_default();
            if let Err(at) = names.binary_search(name) {
                names.insert(at, name.clone());
                names.shrink_to_fit();
            }
            touched.insert(service.clone());
        }
    }

    /// Slice `name` was `service`'s: unlinks it unless it still is.
    fn unlink_if_moved(
        &mut self,
        name: &ServiceName,
        service: ServiceName,
        touched: &mut BTreeSet<ServiceName>,
    ) {
        let still = self.slices.get(name).and_then(|s| s.service.as_ref()) == Some(&service);
        if !still && let Some(names) = self.slices_of.get_mut(&service) {
            names.retain(|n| n != name);
            if names.is_empty() {
                self.slices_of.remove(&service);
            }
        }
        touched.insert(service);
    }

    /// Replaces the contents with a whole snapshot (the manifests source):
    /// what it lacks is deleted, except objects it could not decode.
    pub fn replace(&mut self, snapshot: Snapshot) -> StoreUpdate {
        let mut changes = Changes::default();
        for (name, parsed) in snapshot.services {
            if changes.services.insert(name.clone(), Some(parsed)).is_some() {
                tracing::warn!(service = %name, "Service defined twice; the last definition wins");
            }
        }
        for (name, parsed) in snapshot.slices {
            changes.slices.insert(name, Some(parsed));
        }
        self.rejected = snapshot.rejected.into_iter().collect();
        let rejected = |kind: &str, name: &ServiceName| {
            self.rejected.contains(&ObjectRef { kind: kind.into(), name: name.clone() })
        };
        for name in self.services.keys().chain(self.invalid.keys()) {
            if !rejected("Service", name) {
                changes.services.entry(name.clone()).or_insert(None);
            }
        }
        for name in self.slices.keys() {
            if !rejected("EndpointSlice", name) {
                changes.slices.entry(name.clone()).or_insert(None);
            }
        }
        let mut update = self.apply(changes);
        update.unnamed = snapshot.unnamed;
        update
    }

    /// The model of the stored objects.
    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn into_model(self) -> Model {
        self.model
    }

    /// What is wrong with the stored objects as they stand, as (metric
    /// kind, message): invalid Services, skipped parts of slices, and
    /// objects served from their last good version.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        for err in self.invalid.values().chain(self.slice_errors.values().flatten()) {
            problems.push((err.kind(), format!("invalid object skipped: {err}")));
        }
        let kept_services = self.invalid.keys().filter(|name| self.services.contains_key(name));
        let kept_services = kept_services.map(|name| ("Service", name));
        let kept_rejected = self.rejected.iter().filter(|r| match r.kind.as_str() {
            "Service" => self.services.contains_key(&r.name),
            "EndpointSlice" => self.slices.contains_key(&r.name),
            _ => false,
        });
        let kept = kept_services.chain(kept_rejected.map(|r| (r.kind.as_str(), &r.name)));
        for (kind, name) in kept {
            problems.push(("kept", format!("{kind} {name}: serving the last good version")));
        }
        for message in self.unknown_annotations.values().flatten() {
            problems.push(("Service", message.clone()));
        }
        problems
    }
}

/// The problems of a service's balancing annotations with unknown values.
fn unknown_annotations(name: &ServiceName, ports: &[ServicePort]) -> Vec<String> {
    let Some(port) = ports.first() else { return Vec::new() };
    let mut problems = Vec::new();
    if port.lb_algorithm.is_unknown() {
        problems.push(model::balancing::unknown_value::<LbAlgorithm>(name, "--bpf-lb-algorithm"));
    }
    if port.forwarding_mode.is_unknown() {
        problems.push(model::balancing::unknown_value::<ForwardingMode>(name, "--bpf-lb-mode"));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects;
    use crate::source::{model_of, snapshot_of};
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use std::time::{Duration, UNIX_EPOCH};

    fn service(yaml: &str) -> Service {
        crate::yaml::from_str(yaml).unwrap()
    }

    use test_objects::{Protocol::Tcp, ep, port, slice};

    fn snapshot(services: &[Service], slices: &[EndpointSlice]) -> Snapshot {
        snapshot_of(services, slices)
    }

    /// `default/name` at `cluster_ip` on port 80.
    fn on_80(name: &str, cluster_ip: &str) -> Service {
        test_objects::service("default", name).cluster_ip(cluster_ip).port(port(None, 80)).build()
    }

    fn web(name: &str) -> ServiceName {
        ServiceName { namespace: "default".into(), name: name.into() }
    }

    #[test]
    fn an_algorithm_annotation_is_read_ours_first_and_an_unknown_one_reported() {
        use model::{Annotated, Choice::*, LbAlgorithm::*};
        let keys = LbAlgorithm::ANNOTATIONS;
        let annotated = |pairs: &[(&str, &str)]| {
            let mut svc = test_objects::service("default", "web")
                .cluster_ip("10.96.0.10")
                .node_port_type()
                .port(port(None, 80));
            for (key, value) in pairs {
                svc = svc.annotation(key, value);
            }
            svc.build()
        };
        let choice = |pairs: &[(&str, &str)]| {
            let mut store = Store::default();
            store.replace(snapshot(&[annotated(pairs)], &[]));
            let choice = store.model().ports().next().unwrap().lb_algorithm;
            (choice, store.problems())
        };
        assert_eq!(choice(&[]).0, NodeDefault);
        assert_eq!(choice(&[(keys[1], "maglev")]).0, Annotated(Maglev), "Cilium's");
        assert_eq!(choice(&[(keys[0], " Random ")]).0, Annotated(Random), "any case");
        assert_eq!(choice(&[(keys[0], "random"), (keys[1], "maglev")]).0, Annotated(Random));
        let (unknown, problems) = choice(&[(keys[1], "fastest")]);
        assert_eq!(unknown, Unknown);
        assert_eq!(unknown.or(Maglev), Maglev, "the node's default");
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].1.starts_with("Service default/web: annotation"), "{problems:?}");

        // Fixed, the problem goes; the service was served all along.
        let mut store = Store::default();
        store.replace(snapshot(&[annotated(&[(keys[1], "fastest")])], &[]));
        store.replace(snapshot(&[annotated(&[(keys[1], "maglev")])], &[]));
        assert!(store.problems().is_empty());
        // The forwarding mode's, Cilium's values.
        let modes = ForwardingMode::ANNOTATIONS;
        let mode = |value| {
            let mut store = Store::default();
            store.replace(snapshot(&[annotated(&[(modes[1], value)])], &[]));
            (store.model().ports().next().unwrap().forwarding_mode, store.problems().len())
        };
        assert_eq!(mode("dsr"), (Annotated(model::ForwardingMode::Dsr), 0));
        assert_eq!(mode("snat"), (Annotated(model::ForwardingMode::Snat), 0));
        assert_eq!(mode("geneve"), (Unknown, 1));
        assert!(store.problems().is_empty());
    }

    #[test]
    fn the_source_ranges_annotation_is_read_from_both_sources() {
        // Through the lean objects the sources decode (it was dropped).
        let svc = test_objects::service("default", "lb")
            .cluster_ip("10.96.0.10")
            .load_balancer_type()
            .port(port(None, 80))
            .ingress_ip("10.200.0.1")
            .annotation(crate::objects::SOURCE_RANGES_ANNOTATION, "192.168.0.0/16")
            .build();
        let model = model_of(&[svc], &[]);
        let ranges = model.ports().next().unwrap().source_ranges().to_vec();
        assert_eq!(ranges, [model::Cidr::parse("192.168.0.0/16").unwrap()]);
    }

    #[test]
    fn an_invalid_update_keeps_the_last_good_service() {
        let good =
            service("{metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}}");
        let bad =
            service("{metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [{port: 0}]}}");
        let new_bad =
            service("{metadata: {name: other}, spec: {clusterIP: bogus, ports: [{port: 80}]}}");
        let mut store = Store::default();
        store.replace(snapshot(&[good], &[]));
        assert!(store.problems().is_empty());

        let update = store.replace(snapshot(&[bad, new_bad], &[]));
        assert!(update.touched.is_empty(), "nothing served changed");
        let problems = store.problems();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems.contains(&(
                "kept",
                "Service default/web: serving the last good version".to_string()
            ))
        );
        assert_eq!(store.model().ports().count(), 1);
        assert_eq!(store.model().ports().next().unwrap().port, 80);

        // Deleting it for real removes it, and its problems.
        store.replace(Snapshot::default());
        assert!(store.model().ports().next().is_none());
        assert!(store.problems().is_empty());
    }

    #[test]
    fn changes_are_counted_with_their_trigger_times() {
        let slice = |ip: &str, at: &str| -> EndpointSlice {
            slice("default", "web-1").service("web").trigger_time(at).endpoint(ep(ip)).build()
        };
        let web_service = on_80("web", "10.96.0.10");
        let mut store = Store::default();
        let first = snapshot(
            std::slice::from_ref(&web_service),
            &[slice("10.244.1.2", "2025-06-01T10:00:00Z")],
        );
        let update = store.replace(first.clone());
        assert_eq!((update.service_changes, update.endpoint_changes), (1, 1));
        assert_eq!(update.trigger_times, [UNIX_EPOCH + Duration::from_secs(1_748_772_000)]);
        assert_eq!(update.touched, BTreeSet::from([web("web")]));
        let update = store.replace(first);
        assert_eq!((update.service_changes, update.endpoint_changes), (0, 0));
        assert!(update.trigger_times.is_empty() && update.touched.is_empty());
        let update = store.replace(snapshot(
            &[web_service],
            &[slice("10.244.1.3", "2025-06-01T12:00:01.5+02:00")],
        ));
        assert_eq!((update.service_changes, update.endpoint_changes), (0, 1));
        assert_eq!(update.trigger_times, [UNIX_EPOCH + Duration::new(1_748_772_001, 500_000_000)]);
        assert_eq!(store.replace(Snapshot::default()).service_changes, 1);
    }

    #[test]
    fn an_undecodable_object_keeps_its_last_good_version() {
        let mut store = Store::default();
        store.replace(snapshot(&[on_80("web", "10.96.0.10")], &[]));
        let rejected = ObjectRef { kind: "Service".into(), name: web("web") };
        store.replace(Snapshot { rejected: vec![rejected], ..Default::default() });
        assert_eq!(store.problems().len(), 1);
        assert_eq!(store.model().ports().count(), 1);
    }

    #[test]
    fn only_the_touched_services_are_rebuilt_and_slices_follow_their_label() {
        let mut store = Store::default();
        let mut changes = Changes::default();
        for name in ["a", "b"] {
            changes.services.insert(
                web(name),
                Some(model::parse_service(
                    &web(name),
                    objects::Service::from_api(&on_80(name, "10.96.0.1")),
                )),
            );
        }
        let labelled = |service: &str| {
            let s = slice("default", "s-1").service(service).port(None, 8080, Tcp);
            let slice = objects::EndpointSlice::from_api(&s.endpoint(ep("10.244.1.2")).build());
            Some(Arc::new(model::parse_slice(&web("s-1"), slice)))
        };
        changes.slices.insert(web("s-1"), labelled("a"));
        store.apply(changes);
        let endpoints = |store: &Store, name| store.model().service(&web(name))[0].endpoints.len();
        assert_eq!((endpoints(&store, "a"), endpoints(&store, "b")), (1, 0));

        // Relabelled: it moves from a to b, and both are rebuilt.
        let mut changes = Changes::default();
        changes.slices.insert(web("s-1"), labelled("b"));
        let update = store.apply(changes);
        assert_eq!(update.touched, BTreeSet::from([web("a"), web("b")]));
        assert_eq!((endpoints(&store, "a"), endpoints(&store, "b")), (0, 1));

        // Deleted: b loses it.
        let mut changes = Changes::default();
        changes.slices.insert(web("s-1"), None);
        let update = store.apply(changes);
        assert_eq!(update.touched, BTreeSet::from([web("b")]));
        assert_eq!(endpoints(&store, "b"), 0);
        assert!(store.slices_of.is_empty());
    }
}
