//! Why an object, or part of one, was not used.

use super::vocabulary::{Protocol, ServiceName};

/// Why an object, or part of one, was not used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("Service {service}: invalid clusterIP {value:?}")]
    InvalidClusterIp { service: ServiceName, value: String },
    #[error("Service {service}: {why}")]
    InvalidIpFamilies { service: ServiceName, why: String },
    #[error("Service {service}: port {port_name:?} has invalid port number {port}")]
    InvalidPort { service: ServiceName, port_name: String, port: i32 },
    #[error("Service {service}: port {port_name:?} has unsupported protocol {protocol:?}")]
    UnsupportedProtocol { service: ServiceName, port_name: String, protocol: String },
    #[error("Service {service}: port {port}/{} is declared twice", protocol.as_str())]
    DuplicatePort { service: ServiceName, port: u16, protocol: Protocol },
    #[error("Service {service}: sessionAffinity timeoutSeconds {value} is outside 1..=86400")]
    InvalidAffinityTimeout { service: ServiceName, value: i32 },
    #[error("Service {service}: invalid {field} entry {value:?}")]
    InvalidAddress { service: ServiceName, field: &'static str, value: String },
    #[error("Service {service}: port {port_name:?} has invalid nodePort {port}")]
    InvalidNodePort { service: ServiceName, port_name: String, port: i32 },
    #[error("Service {service}: unknown sessionAffinity {value:?}")]
    InvalidAffinity { service: ServiceName, value: String },
    #[error("{kind} without metadata.name")]
    Unnamed { kind: &'static str },
    #[error("EndpointSlice {slice}: invalid endpoint address {value:?}")]
    InvalidEndpointAddress { slice: ServiceName, value: String },
    #[error("EndpointSlice {slice}: port {port_name:?} has unknown protocol {protocol:?}")]
    UnsupportedSlicePortProtocol { slice: ServiceName, port_name: String, protocol: String },
    #[error("EndpointSlice {slice}: port {port_name:?} has invalid port number {port:?}")]
    InvalidEndpointPort { slice: ServiceName, port_name: String, port: Option<i32> },
}

impl ModelError {
    /// The kind of object the error is about, for the metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::Unnamed { kind } => kind,
            ModelError::InvalidEndpointAddress { .. }
            | ModelError::InvalidEndpointPort { .. }
            | ModelError::UnsupportedSlicePortProtocol { .. } => "EndpointSlice",
            _ => "Service",
        }
    }
}
