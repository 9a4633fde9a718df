//! The deployment manifests cannot rot: every object decodes into its
//! Kubernetes type with no field lost (a typo would be), the commands parse
//! with the agent's own command line, the configuration parses without a
//! warning, and the agent is granted reads only.

use clap::Parser as _;
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;

const MANIFEST: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes/proxy-agent.yaml");

/// Whether everything `original` says is in `decoded` (what the type kept).
fn kept(original: &Value, decoded: &Value, path: &str) -> Result<(), String> {
    match (original, decoded) {
        (Value::Object(o), Value::Object(d)) => o.iter().try_for_each(|(k, v)| match d.get(k) {
            Some(dv) => kept(v, dv, &format!("{path}.{k}")),
            None => Err(format!("{path}.{k} was dropped: not a field of its type")),
        }),
        (Value::Array(o), Value::Array(d)) if o.len() == d.len() => o
            .iter()
            .zip(d)
            .enumerate()
            .try_for_each(|(i, (o, d))| kept(o, d, &format!("{path}[{i}]"))),
        // Numbers given as strings (or the other way) decode to the same.
        (o, d) if o == d || o.to_string().trim_matches('"') == d.to_string().trim_matches('"') => {
            Ok(())
        }
        (o, d) => Err(format!("{path}: {o} became {d}")),
    }
}

fn decode<T: DeserializeOwned + Serialize>(doc: &Value) -> T {
    let object: T = serde_json::from_value(doc.clone()).expect("decodes into its type");
    let decoded = serde_json::to_value(&object).unwrap();
    if let Err(e) = kept(doc, &decoded, "") {
        panic!("{}: {e}", doc["kind"]);
    }
    object
}

fn documents() -> Vec<Value> {
    let text = std::fs::read_to_string(MANIFEST).unwrap();
    serde_saphyr::read(&mut text.as_bytes()).map(Result::unwrap).collect()
}

/// The agent's command line, as the kubelet expands it.
fn agent_command(command: &[String]) -> proxy_agent::cli::Cli {
    let argv = command.iter().map(|a| a.replace("$(NODE_NAME)", "node-a"));
    proxy_agent::cli::Cli::try_parse_from(argv).expect("the agent accepts its command line")
}

#[test]
fn the_deployment_manifests_decode_and_fit_the_agent() {
    let docs = documents();
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"]
    );
    let _: ServiceAccount = decode(&docs[0]);
    let role: ClusterRole = decode(&docs[1]);
    let binding: ClusterRoleBinding = decode(&docs[2]);
    let config: ConfigMap = decode(&docs[3]);
    let daemonset: DaemonSet = decode(&docs[4]);

    // Reads only, of what the agent watches.
    let rules = role.rules.unwrap_or_default();
    for rule in &rules {
        assert!(rule.verbs.iter().all(|v| v == "list" || v == "watch"), "{rule:?}");
    }
    for resource in ["services", "nodes", "endpointslices"] {
        assert!(
            rules.iter().any(|r| r.resources.iter().flatten().any(|x| x == resource)),
            "{resource} not granted"
        );
    }
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());

    // The configuration the agent is pointed at parses without a warning.
    let conf = &config.data.unwrap()["config.conf"];
    let (_, warnings) = proxy_agent::config::parse("config.conf".as_ref(), conf).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");

    let pod = daemonset.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("proxy-agent"));
    let mounts_of = |c: &k8s_openapi::api::core::v1::Container| -> Vec<String> {
        c.volume_mounts.iter().flatten().map(|m| m.mount_path.clone()).collect()
    };
    let init = &pod.init_containers.unwrap()[0];
    let proxy_agent::cli::Command::PrepareNode(_) =
        agent_command(init.command.as_ref().unwrap()).command
    else {
        panic!("the init container prepares the node");
    };
    let agent = &pod.containers[0];
    let proxy_agent::cli::Command::Run(args) =
        agent_command(agent.command.as_ref().unwrap()).command
    else {
        panic!("the container runs the agent");
    };
    let mounts = mounts_of(agent);
    let mounted = |path: &std::path::Path| mounts.iter().any(|m| path.starts_with(m));
    assert!(mounted(args.config.as_ref().unwrap()), "the config file is mounted");
    assert!(mounted(args.cgroup_path.as_ref().unwrap()), "the host cgroup is mounted");
    assert!(mounted(&args.pins.bpffs_root), "bpffs is mounted");
    // The API server is reached directly, not through a ClusterIP this very
    // agent provides.
    let env: Vec<&str> = agent.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert!(env.contains(&"KUBERNETES_SERVICE_HOST") && env.contains(&"KUBERNETES_SERVICE_PORT"));
    let caps = agent.security_context.as_ref().unwrap().capabilities.as_ref().unwrap();
    assert!(caps.add.iter().flatten().any(|c| c == "BPF"));
    assert_ne!(agent.security_context.as_ref().unwrap().privileged, Some(true));
    let volumes: Vec<String> = pod.volumes.iter().flatten().map(|v| v.name.clone()).collect();
    for mount in agent.volume_mounts.iter().flatten() {
        assert!(volumes.contains(&mount.name), "{} has no volume", mount.name);
    }
}
