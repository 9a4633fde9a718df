//! Where Services and EndpointSlices come from (the manifests or the API
//! server), and the [`store`] that keeps the last good version of each and
//! the model built from them, one service at a time.

pub mod kube;
pub mod manifests;
pub mod snapshot;
pub mod store;

use self::{
    kube::KubeSource,
    manifests::{Manifests, Reload},
};
pub use self::{
    snapshot::{Changes, ObjectRef, Snapshot},
    store::{Store, StoreUpdate},
};
#[cfg(test)]
use crate::{
    model::{self, ServiceName},
    objects,
};

/// Where Services and EndpointSlices come from.
pub enum Source {
    Manifests(Manifests),
    Kube(KubeSource),
}

impl Source {
    /// What changed since the last reload; `None` where there is nothing to
    /// look at: manifest files are read at polls only, so that their new
    /// bytes are taken when two reads a poll apart agree (other rounds, a
    /// link event or a due sync, may come a moment after a read).
    pub fn reload(&mut self, polled: bool) -> Option<Reload> {
        match self {
            Source::Manifests(manifests) => polled.then(|| manifests.reload()),
            Source::Kube(kube) => {
                let (changed, complete) = kube.poll();
                Some(Reload { changed, complete, ..Reload::default() })
            }
        }
    }

    /// Brings `store` up to date with the source.
    pub fn update(&self, store: &mut Store) -> StoreUpdate {
        match self {
            Source::Manifests(manifests) => store.replace(manifests.snapshot()),
            Source::Kube(kube) => store.apply(kube.take_changes()),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Source::Manifests(_) => "manifests",
            Source::Kube(_) => "API server",
        }
    }
}

/// The model of a YAML stream of Services and EndpointSlices, for tests.
#[cfg(test)]
pub(crate) fn model_from_yaml(yaml: &str) -> model::Model {
    let (mut services, mut slices) = (Vec::new(), Vec::new());
    crate::yaml::for_each_document(yaml.as_bytes(), |value| {
        match value.get("kind").and_then(|k| k.as_str()) {
            Some("Service") => services.push(serde_json::from_value(value).unwrap()),
            Some("EndpointSlice") => slices.push(serde_json::from_value(value).unwrap()),
            _ => {}
        }
    })
    .unwrap();
    model_of(&services, &slices)
}

/// A snapshot of these objects, for tests.
#[cfg(test)]
pub(crate) fn snapshot_of(
    services: &[k8s_openapi::api::core::v1::Service],
    slices: &[k8s_openapi::api::discovery::v1::EndpointSlice],
) -> Snapshot {
    let mut snapshot = Snapshot::default();
    for s in services {
        snapshot.add_service(ServiceName::of(&s.metadata), objects::Service::from_api(s));
    }
    for s in slices {
        snapshot.add_slice(ServiceName::of(&s.metadata), objects::EndpointSlice::from_api(s));
    }
    snapshot
}

/// The model of these objects, all valid, for tests.
#[cfg(test)]
pub(crate) fn model_of(
    services: &[k8s_openapi::api::core::v1::Service],
    slices: &[k8s_openapi::api::discovery::v1::EndpointSlice],
) -> model::Model {
    let mut store = Store::default();
    store.replace(snapshot_of(services, slices));
    assert!(store.problems().is_empty(), "{:?}", store.problems());
    store.into_model()
}
