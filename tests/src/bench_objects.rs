//! The objects `cargo xtask bench` programs and the harnesses measure with
//! the same shapes (`proxy-agent/examples/list_source.rs`): ClusterIP
//! service `s{i}` (10.96.0.10 on) with one port, its EndpointSlice `s{i}-1`
//! of IPv4 endpoints on `lab-node`; the first service is the NodePort
//! (30080, policy Local: the client is kept and no SNAT is done, so a
//! connection rate measures translation rather than SNAT port capacity, as
//! a closed flow's SNAT port rests 60 s), and its first endpoint the lab's
//! backend pod.

use std::net::Ipv4Addr;

use serde_json::{Value, json};

/// The port the backend pod serves the services on.
pub const SERVICE_PORT: u16 = 8080;
/// The lab's backend pod: service 0's first endpoint.
pub const POD: &str = "10.244.1.2";
/// The node the endpoints are on.
pub const NODE: &str = "lab-node";

/// Service `i`'s cluster IP, and whether it is the NodePort.
pub fn service(i: usize) -> (Ipv4Addr, bool) {
    (Ipv4Addr::from(0x0a60_0000u32 + 10 + i as u32), i == 0)
}

/// Endpoint `e` of service `i` (of `endpoints` each): the lab's pod for the
/// first, else an address of its own that nothing answers.
pub fn endpoint(i: usize, e: usize, endpoints: usize) -> String {
    if e == 0 && i == 0 {
        return POD.to_string();
    }
    let k = i * endpoints + e;
    format!("10.{}.{}.{}", 128 + k / 65_536, k / 256 % 256, k % 256)
}

/// Services `0..n` of `endpoints` endpoints each, as API objects: each
/// Service, then its EndpointSlice.
pub fn objects(n: usize, endpoints: usize) -> impl Iterator<Item = Value> {
    (0..n).flat_map(move |i| {
        let (ip, node_port) = service(i);
        let mut port = json!({"name": "http", "port": 80, "targetPort": SERVICE_PORT});
        let mut spec = json!({"clusterIP": ip.to_string()});
        if node_port {
            port["nodePort"] = json!(30080);
            spec["type"] = json!("NodePort");
            spec["externalTrafficPolicy"] = json!("Local");
        }
        spec["ports"] = json!([port]);
        let addresses = (0..endpoints)
            .map(|e| json!({"addresses": [endpoint(i, e, endpoints)], "nodeName": NODE}));
        let service = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("s{i}"), "namespace": "bench"}, "spec": spec});
        let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("s{i}-1"), "namespace": "bench",
                "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": SERVICE_PORT}],
            "endpoints": addresses.collect::<Vec<_>>()});
        [service, slice]
    })
}
