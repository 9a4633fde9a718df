//! What a source hands the store: everything it holds at one moment (the
//! manifests), or what changed since it was last asked (the API server).

use std::{collections::BTreeMap, sync::Arc};

use crate::{
    model::{self, ModelError, ParsedService, ParsedSlice, ServiceName},
    objects,
};

/// An object a source saw but could not decode.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ObjectRef {
    pub kind: String,
    pub name: ServiceName,
}

/// Everything a source holds at one moment, as read (what the proxy keeps
/// of each object, not the objects).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<(ServiceName, ParsedService)>,
    pub slices: Vec<(ServiceName, Arc<ParsedSlice>)>,
    /// Objects that did not decode.
    pub rejected: Vec<ObjectRef>,
    /// Objects without a name.
    pub unnamed: Vec<ModelError>,
}

impl Snapshot {
    /// Adds Service `name` (`None`: it has none).
    pub fn add_service(&mut self, name: Option<ServiceName>, service: objects::Service) {
        match name {
            Some(name) => {
                let parsed = model::parse_service(&name, service);
                self.services.push((name, parsed));
            }
            None => self.unnamed.push(ModelError::Unnamed { kind: "Service" }),
        }
    }

    /// Adds EndpointSlice `name` (`None`: it has none).
    pub fn add_slice(&mut self, name: Option<ServiceName>, slice: objects::EndpointSlice) {
        match name {
            Some(name) => {
                let parsed = Arc::new(model::parse_slice(&name, slice));
                self.slices.push((name, parsed));
            }
            None => self.unnamed.push(ModelError::Unnamed { kind: "EndpointSlice" }),
        }
    }
}

/// What changed in a source since it was last asked, by object name;
/// `None` means deleted.
#[derive(Debug, Default)]
pub struct Changes {
    pub services: BTreeMap<ServiceName, Option<ParsedService>>,
    pub slices: BTreeMap<ServiceName, Option<Arc<ParsedSlice>>>,
}
