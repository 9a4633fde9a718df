//! proxy-agent: an eBPF replacement for kube-proxy.
//!
//! `source` reads objects, `model` applies kube-proxy's semantics, `plan`
//! turns that into the desired datapath, `backend` writes it to the kernel;
//! `inspect` reads it back for operators.

pub mod agent;
pub mod backend;
pub mod cli;
pub mod commands;
pub mod compact;
pub mod config;
pub mod health;
pub mod http;
pub mod inspect;
pub mod intern;
pub mod json;
pub mod link_events;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod monitor;
pub mod netlink;
pub mod node;
pub mod objects;
pub mod packet_craft;
pub mod plan;
pub mod service_stats;
pub mod source;
pub mod sys;
pub mod time;
pub mod yaml;
