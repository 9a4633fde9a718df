//! One endpoint of a service port: its address, its EndpointSlice
//! conditions, and where it runs.

use std::{cell::RefCell, sync::Arc};

use super::vocabulary::EndpointAddr;
use crate::intern::Interner;
pub use crate::objects::Hints;

/// One endpoint of a service port, with the EndpointSlice conditions.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    /// Of the family of its service port's cluster IP.
    pub addr: EndpointAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Its node and hints, behind a thin pointer (an endpoint is 32
    /// bytes): one allocation shared by the endpoints in the same place,
    /// as a cluster has millions of endpoints and few nodes.
    pub(super) place: Option<Arc<Place>>,
}

/// Where an endpoint runs and which clients it should serve.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct Place {
    node_name: Option<Arc<str>>,
    /// EndpointSlice hints, boxed: most endpoints have none.
    hints: Option<Box<Hints>>,
}

impl Place {
    /// `None` for an endpoint of no node without hints.
    pub(super) fn of(node_name: Option<Arc<str>>, hints: Option<Box<Hints>>) -> Option<Place> {
        (node_name.is_some() || hints.is_some()).then_some(Place { node_name, hints })
    }

    /// The shared place equal to this one: every endpoint on a node (with
    /// the same hints) names one, across slices.
    pub(super) fn shared(self) -> Arc<Place> {
        thread_local! {
            static PLACES: RefCell<Interner<Place>> = RefCell::default();
        }
        PLACES.with_borrow_mut(|places| places.get(&self, |place| Arc::new(place.clone())))
    }
}

impl Endpoint {
    /// An endpoint in these conditions, of no node and without hints.
    pub fn new(addr: EndpointAddr, ready: bool, serving: bool, terminating: bool) -> Self {
        Endpoint { addr, ready, serving, terminating, place: None }
    }

    /// The same on `node_name`, with `hints`.
    pub fn placed(self, node_name: Option<Arc<str>>, hints: Option<Box<Hints>>) -> Self {
        Endpoint { place: Place::of(node_name, hints).map(Arc::new), ..self }
    }

    pub fn node_name(&self) -> Option<&str> {
        self.place.as_ref()?.node_name.as_deref()
    }

    fn hints(&self) -> Option<&Hints> {
        self.place.as_ref()?.hints.as_deref()
    }

    pub fn zone_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.zones)
    }

    pub fn node_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.nodes)
    }
}
