//! One module per subcommand: each takes its parsed flags, does its work and
//! prints its output; `main` only parses and dispatches.

pub mod cleanup;
pub mod explain;
pub mod lb;
pub mod monitor;
pub mod prepare_node;
pub mod probe;
pub mod render;
pub mod run;
