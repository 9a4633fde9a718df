//! The ruleset kube-proxy's nftables mode writes, from our model. Pure
//! code.
//!
//! Same table (`ip kube-proxy`, `ip6 kube-proxy`), chains, sets, maps,
//! rules and element comments as kube-proxy's, so an operator can diff it
//! against a kube-proxy node. A service is found by one lookup in a
//! verdict map (`service-ips`, `service-nodeports`) whatever the number of
//! services, and its endpoint by `numgen random mod N` in a verdict map:
//! no rule is walked per service. One ruleset per IP family, as kube-proxy
//! runs one proxier per family.

mod names;
mod options;
mod ruleset;
mod service;

pub use self::{
    names::{is_affinity_set, is_service_chain},
    options::Options,
    ruleset::{Applied, Existing, Ruleset, TABLE, Transaction},
};
use crate::model::Model;

/// The ruleset for `model`'s ports of `opts.family`.
pub fn render(model: &Model, opts: &Options) -> Ruleset {
    let mut ruleset = Ruleset::new(opts.family, options::nodeport_ips(opts));
    for port in model.ports_of(opts.family) {
        service::write(&mut ruleset, port, opts);
    }
    ruleset
}

#[cfg(test)]
mod tests;
