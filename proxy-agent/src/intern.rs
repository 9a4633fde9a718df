//! Values many objects name alike, held once: a cluster has hundreds of
//! thousands of objects and millions of endpoints over a few namespaces,
//! nodes and port names, where a copy each took an allocation and its
//! header. Kept per thread (the sources parse on a few), so no lock is
//! taken. Pure code.

use std::{borrow::Borrow, cell::RefCell, collections::HashSet, hash::Hash, sync::Arc};

/// A set of shared values. Values come and go (namespaces, nodes): those
/// nothing else holds any more are forgotten when a new one comes and the
/// set doubled since the last sweep, so it holds at most twice what was in
/// use then (and at least 64); its table keeps its largest size.
pub struct Interner<T: ?Sized> {
    known: HashSet<Arc<T>>,
    /// How many were known after the last sweep.
    swept: usize,
}

impl<T: ?Sized + Hash + Eq> Default for Interner<T> {
    fn default() -> Self {
        Interner { known: HashSet::new(), swept: 0 }
    }
}

impl<T: ?Sized + Hash + Eq> Interner<T> {
    /// The shared value equal to `value`, made by `make` when there is none.
    pub fn get<Q>(&mut self, value: &Q, make: impl FnOnce(&Q) -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        if let Some(known) = self.known.get(value) {
            return known.clone();
        }
        if self.known.len() >= 2 * self.swept.max(32) {
            self.known.retain(|v| Arc::strong_count(v) > 1);
            self.swept = self.known.len();
        }
        let new = make(value);
        self.known.insert(new.clone());
        new
    }
}

thread_local! {
    static NAMES: RefCell<Interner<str>> = RefCell::default();
}

/// The shared string equal to `name`: a namespace, a node or a port name.
pub fn name(name: &str) -> Arc<str> {
    NAMES.with_borrow_mut(|names| names.get(name, |n: &str| Arc::from(n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_held_once_and_forgotten_once_nothing_else_holds_it() {
        let mut names = Interner::<str>::default();
        let lab = names.get("lab", |n: &str| Arc::from(n));
        assert!(Arc::ptr_eq(&lab, &names.get("lab", |n: &str| Arc::from(n))));
        // Enough others, unused, for sweeps: those go, the one in use stays.
        for i in 0..1000 {
            names.get(format!("gone-{i}").as_str(), |n: &str| Arc::from(n));
        }
        assert!(names.known.len() < 100, "{} kept", names.known.len());
        assert!(Arc::ptr_eq(&lab, &names.get("lab", |n: &str| Arc::from(n))));
        assert!(Arc::ptr_eq(&name("web"), &name("web")), "per thread");
    }
}
