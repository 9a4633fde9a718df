//! Where Services and EndpointSlices come from, and the store that keeps the
//! last good version of each.

pub mod kube;
pub mod manifests;

use std::{collections::BTreeMap, time::SystemTime};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::model::{self, ModelError, ServiceName};

/// An object a source saw but could not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectRef {
    pub kind: String,
    pub name: ServiceName,
}

/// Everything a source holds at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub rejected: Vec<ObjectRef>,
}

/// The objects the proxy works from. A Service that becomes invalid (or an
/// object that stops decoding) keeps its last good version: bad input never
/// takes down what was being served.
#[derive(Debug, Default)]
pub struct Store {
    services: BTreeMap<ServiceName, Service>,
    slices: BTreeMap<ServiceName, EndpointSlice>,
}

/// What replacing the store's contents changed, and found wrong.
#[derive(Debug, Default)]
pub struct StoreUpdate {
    pub errors: Vec<ModelError>,
    /// Objects served from their last good version.
    pub kept: Vec<ObjectRef>,
    /// Services and EndpointSlices added, changed or removed.
    pub service_changes: usize,
    pub endpoint_changes: usize,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the slices
    /// added or changed: when the change that led to them happened.
    pub trigger_times: Vec<SystemTime>,
}

/// The annotation the EndpointSlice controller sets to the time of the
/// change (a pod, a service) that led to the slice's current state.
const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// How many keys of two maps have different (or no) values.
fn differences<K: Ord, V: PartialEq>(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> usize {
    let changed = new.iter().filter(|(k, v)| old.get(k) != Some(v)).count();
    changed + old.keys().filter(|k| !new.contains_key(k)).count()
}

impl Store {
    /// Replaces the contents with `snapshot`, keeping last good versions.
    pub fn replace(&mut self, snapshot: Snapshot) -> StoreUpdate {
        let mut update = StoreUpdate::default();
        let mut services = BTreeMap::new();
        let keep_service =
            |name: &ServiceName, update: &mut StoreUpdate, services: &mut BTreeMap<_, _>| {
                if let Some(old) = self.services.get(name) {
                    services.insert(name.clone(), old.clone());
                    update.kept.push(ObjectRef { kind: "Service".into(), name: name.clone() });
                }
            };
        for service in snapshot.services {
            match (model::check_service(&service), ServiceName::of(&service.metadata)) {
                (Ok(()), Some(name)) => {
                    if services.insert(name.clone(), service).is_some() {
                        tracing::warn!(service = %name, "Service defined twice; the last definition wins");
                    }
                }
                (Err(err), name) => {
                    update.errors.push(err);
                    if let Some(name) = name {
                        keep_service(&name, &mut update, &mut services);
                    }
                }
                (Ok(()), None) => {}
            }
        }
        let mut slices: BTreeMap<_, _> = snapshot
            .slices
            .into_iter()
            .filter_map(|s| Some((ServiceName::of(&s.metadata)?, s)))
            .collect();
        for rejected in snapshot.rejected {
            match rejected.kind.as_str() {
                "Service" => keep_service(&rejected.name, &mut update, &mut services),
                "EndpointSlice" => {
                    if let Some(old) = self.slices.get(&rejected.name) {
                        slices.insert(rejected.name.clone(), old.clone());
                        update.kept.push(rejected);
                    }
                }
                _ => {}
            }
        }
        update.service_changes = differences(&self.services, &services);
        update.endpoint_changes = differences(&self.slices, &slices);
        update.trigger_times = slices
            .iter()
            .filter(|(name, slice)| self.slices.get(*name) != Some(*slice))
            .filter_map(|(_, slice)| {
                let annotations = slice.metadata.annotations.as_ref()?;
                crate::time::parse_rfc3339(annotations.get(TRIGGER_TIME)?)
            })
            .collect();
        self.services = services;
        self.slices = slices;
        update
    }

    /// kube-proxy's view of the stored objects.
    pub fn model(&self) -> model::Model {
        let services: Vec<_> = self.services.values().cloned().collect();
        let slices: Vec<_> = self.slices.values().cloned().collect();
        model::build(&services, &slices)
    }
}

/// The model of a YAML stream of Services and EndpointSlices, for tests.
#[cfg(test)]
pub(crate) fn model_from_yaml(yaml: &str) -> model::Model {
    use serde::Deserialize as _;
    let mut snapshot = Snapshot::default();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(doc).unwrap();
        match value.get("kind").and_then(|k| k.as_str()) {
            Some("Service") => snapshot.services.push(serde_yaml::from_value(value).unwrap()),
            Some("EndpointSlice") => snapshot.slices.push(serde_yaml::from_value(value).unwrap()),
            _ => {}
        }
    }
    let mut store = Store::default();
    store.replace(snapshot);
    let model = store.model();
    assert!(model.errors.is_empty(), "{:?}", model.errors);
    model
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn service(yaml: &str) -> Service {
        serde_yaml::from_str(yaml).unwrap()
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
        let update = store.replace(Snapshot { services: vec![good], ..Default::default() });
        assert!(update.errors.is_empty());

        let update = store.replace(Snapshot { services: vec![bad, new_bad], ..Default::default() });
        assert_eq!(update.errors.len(), 2);
        assert_eq!(
            update.kept,
            vec![ObjectRef {
                kind: "Service".into(),
                name: ServiceName { namespace: "default".into(), name: "web".into() }
            }]
        );
        let model = store.model();
        assert_eq!(model.ports().count(), 1);
        assert_eq!(model.ports().next().unwrap().port, 80);

        // Deleting it for real removes it.
        store.replace(Snapshot::default());
        assert!(store.model().ports().next().is_none());
    }

    #[test]
    fn changes_are_counted_with_their_trigger_times() {
        let slice = |ip: &str, at: &str| -> EndpointSlice {
            serde_yaml::from_str(&format!(
                "{{metadata: {{name: web-1, annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"{at}\"}}, labels: {{kubernetes.io/service-name: web}}}}, addressType: IPv4, endpoints: [{{addresses: [{ip}]}}]}}"
            ))
            .unwrap()
        };
        let web =
            service("{metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}}");
        let mut store = Store::default();
        let first = Snapshot {
            services: vec![web.clone()],
            slices: vec![slice("10.244.1.2", "2025-06-01T10:00:00Z")],
            ..Default::default()
        };
        let update = store.replace(first.clone());
        assert_eq!((update.service_changes, update.endpoint_changes), (1, 1));
        assert_eq!(update.trigger_times, [UNIX_EPOCH + Duration::from_secs(1_748_772_000)]);
        let update = store.replace(first);
        assert_eq!((update.service_changes, update.endpoint_changes), (0, 0));
        assert!(update.trigger_times.is_empty());
        let update = store.replace(Snapshot {
            services: vec![web],
            slices: vec![slice("10.244.1.3", "2025-06-01T12:00:01.5+02:00")],
            ..Default::default()
        });
        assert_eq!((update.service_changes, update.endpoint_changes), (0, 1));
        assert_eq!(update.trigger_times, [UNIX_EPOCH + Duration::new(1_748_772_001, 500_000_000)]);
        assert_eq!(store.replace(Snapshot::default()).service_changes, 1);
    }

    #[test]
    fn an_undecodable_object_keeps_its_last_good_version() {
        let good =
            service("{metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}}");
        let mut store = Store::default();
        store.replace(Snapshot { services: vec![good], ..Default::default() });
        let rejected = ObjectRef {
            kind: "Service".into(),
            name: ServiceName { namespace: "default".into(), name: "web".into() },
        };
        let update = store.replace(Snapshot { rejected: vec![rejected], ..Default::default() });
        assert_eq!(update.kept.len(), 1);
        assert_eq!(store.model().ports().count(), 1);
    }
}
