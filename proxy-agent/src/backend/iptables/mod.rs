//! The iptables fallback: the rules kube-proxy's iptables mode writes, from
//! the same model as the BPF path. `render` is pure (model → restore input);
//! `chains` names chains as kube-proxy does.

pub mod chains;
pub mod render;
