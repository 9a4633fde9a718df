//! `proxy-agent render iptables|nftables`: kube-proxy's rules for
//! manifests, printed.

use crate::{
    backend::{iptables, nftables},
    cli::{RenderArgs, RenderIptablesArgs},
    model::{IpFamily, Model},
    node,
    plan::Node,
    source::{Store, manifests::Manifests},
};

/// `render iptables`: kube-proxy's restore input for the manifests, on stdout.
pub fn iptables(args: &RenderIptablesArgs) -> anyhow::Result<()> {
    let (model, node, families) = load(&args.render)?;
    let traffic = args.render.node.traffic();
    for family in &families {
        let options = iptables::datapath::render_options(&node, &traffic, !args.no_nfacct, *family);
        if families.len() > 1 {
            println!("{}", family_header(*family, "iptables-restore", "ip6tables-restore"));
        }
        print!("{}", iptables::render::render(&model, &options));
    }
    Ok(())
}

/// `render nftables`: kube-proxy's nftables ruleset for the manifests, as
/// `nft -f` input, on stdout.
pub fn nftables(args: &RenderArgs) -> anyhow::Result<()> {
    let (model, node, families) = load(args)?;
    let traffic = args.node.traffic();
    for family in &families {
        let options = nftables::datapath::render_options(&node, &traffic, *family);
        if families.len() > 1 {
            println!("{}", family_header(*family, "table ip kube-proxy", "table ip6 kube-proxy"));
        }
        print!("{}", nftables::render::render(&model, &options));
    }
    Ok(())
}

/// The model of the manifests, the node they are rendered for, and the
/// families asked for.
fn load(args: &RenderArgs) -> anyhow::Result<(Model, Node, Vec<IpFamily>)> {
    args.node.check().map_err(anyhow::Error::msg)?;
    let mut manifests = Manifests::new(&args.manifests);
    // New bytes are taken on the second read that finds them.
    manifests.reload();
    let reload = manifests.reload();
    for err in &reload.errors {
        tracing::warn!("{err}");
    }
    anyhow::ensure!(
        reload.complete,
        "could not read every manifest under {}",
        args.manifests.display()
    );
    let mut store = Store::default();
    for err in store.replace(manifests.snapshot()).unnamed {
        tracing::warn!("invalid object skipped: {err}");
    }
    for (_, problem) in store.problems() {
        tracing::warn!("{problem}");
    }
    let model = store.into_model();
    let pod_interfaces: Vec<String> =
        crate::cli::DEFAULT_POD_INTERFACES.split(',').map(String::from).collect();
    let ips = match args.node.node_ip.as_slice() {
        [] => node::interface_ips(&pod_interfaces)?,
        ips => ips.to_vec(),
    };
    let node = Node {
        name: node::name(&args.node.hostname_override)?,
        ips,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
        localhost_nodeports: args.node.localhost_nodeports,
        zone: args.zone.clone(),
        // The rules pick at random and masquerade whatever the algorithm
        // and mode.
        lb_algorithm: Default::default(),
        lb_mode: Default::default(),
    };
    let families = match args.ip_family {
        Some(family) => vec![family],
        None => IpFamily::ALL.to_vec(),
    };
    Ok((model, node, families))
}

/// Where one family's part starts when both are printed (a comment to
/// both `iptables-restore` and `nft`).
fn family_header(family: IpFamily, v4: &str, v6: &str) -> String {
    let target = match family {
        IpFamily::V4 => v4,
        IpFamily::V6 => v6,
    };
    format!("# {family}: {target} input")
}
