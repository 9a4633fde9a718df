//! A frontend's backends, as the plan holds them: a list shared with the
//! model where it can be.

use std::{net::IpAddr, sync::Arc};

use crate::model::{Endpoint, EndpointAddr};

/// One backend of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendPlan {
    /// Of its frontend's family.
    pub addr: EndpointAddr,
    /// The endpoint runs on this node.
    pub local: bool,
    /// The endpoint's address is one of this node's (host network).
    pub host: bool,
}

/// A frontend's backends, sorted by address, unique. Most frontends
/// balance over every endpoint of their service port, which the model holds
/// already: they name its list rather than copy it (a million endpoints
/// would be held again, 22 bytes each).
#[derive(Clone, Default)]
pub struct BackendList(Repr);

#[derive(Clone)]
enum Repr {
    Listed(Box<[BackendPlan]>),
    /// Every endpoint of a port's list (sorted by address, unique, all of
    /// the frontend's family), none at a node address, and all on this
    /// node or none.
    Endpoints {
        list: Arc<[Endpoint]>,
        local: bool,
    },
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Listed(Box::default())
    }
}

impl BackendList {
    /// The backends `endpoints` (a service port's list) make, as node
    /// `node_name` with addresses `node_ips` sees them: named rather than
    /// copied when that is every endpoint, as [`Repr::Endpoints`] says.
    pub(super) fn of(
        endpoints: &Arc<[Endpoint]>,
        picked: &[&Endpoint],
        node_name: &str,
        node_ips: &[IpAddr],
    ) -> BackendList {
        let here = |e: &Endpoint| e.node_name() == Some(node_name);
        let host = |e: &Endpoint| node_ips.contains(&e.addr.ip());
        let local = endpoints.first().is_some_and(here);
        // Picked from the list in its order: as many is all of it.
        let whole = picked.len() == endpoints.len()
            && endpoints.windows(2).all(|w| w[0].addr < w[1].addr)
            && endpoints.iter().all(|e| here(e) == local && !host(e));
        if whole {
            return BackendList(Repr::Endpoints { list: endpoints.clone(), local });
        }
        let mut backends: Vec<_> = picked
            .iter()
            .map(|e| BackendPlan { addr: e.addr, local: here(e), host: host(e) })
            .collect();
        backends.sort();
        backends.dedup_by_key(|b| b.addr);
        BackendList::from(backends)
    }

    /// Whether it names its port's list rather than holding a copy.
    #[cfg(test)]
    pub(super) fn names_endpoints(&self) -> bool {
        matches!(self.0, Repr::Endpoints { .. })
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Listed(list) => list.len(),
            Repr::Endpoints { list, .. } => list.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> Iter<'_> {
        match &self.0 {
            Repr::Listed(list) => Iter(IterRepr::Listed(list.iter())),
            Repr::Endpoints { list, local } => Iter(IterRepr::Endpoints(list.iter(), *local)),
        }
    }
}

impl From<Vec<BackendPlan>> for BackendList {
    /// `list` sorted by address, unique (as it is taken).
    fn from(list: Vec<BackendPlan>) -> Self {
        BackendList(Repr::Listed(list.into_boxed_slice()))
    }
}

impl FromIterator<BackendPlan> for BackendList {
    /// `list` sorted by address, unique (as it is taken).
    fn from_iter<I: IntoIterator<Item = BackendPlan>>(list: I) -> Self {
        list.into_iter().collect::<Vec<_>>().into()
    }
}

impl<'a> IntoIterator for &'a BackendList {
    type Item = BackendPlan;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl PartialEq for BackendList {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Repr::Endpoints { list: a, local: l }, Repr::Endpoints { list: b, local: m })
                if Arc::ptr_eq(a, b) =>
            {
                l == m
            }
            _ => self.len() == other.len() && self.iter().eq(other.iter()),
        }
    }
}

impl Eq for BackendList {}

#[cfg(test)]
impl<const N: usize> PartialEq<[BackendPlan; N]> for BackendList {
    fn eq(&self, other: &[BackendPlan; N]) -> bool {
        self.iter().eq(other.iter().copied())
    }
}

impl std::fmt::Debug for BackendList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The backends of a [`BackendList`], in order.
#[derive(Clone)]
pub struct Iter<'a>(IterRepr<'a>);

#[derive(Clone)]
enum IterRepr<'a> {
    Listed(std::slice::Iter<'a, BackendPlan>),
    Endpoints(std::slice::Iter<'a, Endpoint>, bool),
}

impl Iterator for Iter<'_> {
    type Item = BackendPlan;

    fn next(&mut self) -> Option<BackendPlan> {
        match &mut self.0 {
            IterRepr::Listed(list) => list.next().copied(),
            IterRepr::Endpoints(list, local) => {
                list.next().map(|e| BackendPlan { addr: e.addr, local: *local, host: false })
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::Listed(list) => list.size_hint(),
            IterRepr::Endpoints(list, _) => list.size_hint(),
        }
    }
}

impl ExactSizeIterator for Iter<'_> {}
