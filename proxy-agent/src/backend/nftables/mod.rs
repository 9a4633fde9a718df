//! The nftables mode: the ruleset kube-proxy's nftables mode writes, from
//! the same model as the other modes. `render` is pure (model → ruleset
//! and the transactions that apply it).

pub mod datapath;
pub mod render;
