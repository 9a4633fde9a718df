//! The code that touches the kernel.

pub mod ebpf;
pub mod iptables;
