//! Service discovery as plain data: the environment variables through which the
//! components of a job group find each other.
//!
//! Every instance (a replica, or a node of a multi-node component) gets:
//!
//! | variable | value |
//! |---|---|
//! | `AGENTSTACK_<COMPONENT>_ADDRS` | for every component: its instances' `host:port`, comma-separated, in order (replica 0 or node rank 0 first) |
//! | `AGENTSTACK_COMPONENT` | the instance's own component |
//! | `AGENTSTACK_REPLICA` | its replica index (0 for components without `replicas`) |
//! | `AGENTSTACK_PORT` | the port it should listen on (its own address's port), when it has one |
//! | `SKYPILOT_NODE_RANK` | its node's rank within the component, 0 to `num_nodes - 1` |
//! | `SKYPILOT_NODE_IPS` | the component's node addresses, one per line (SkyPilot's format) |
//! | `SKYPILOT_NUM_NODES` | the component's `num_nodes` |
//! | `SKYPILOT_NUM_GPUS_PER_NODE` | its accelerator count per node (0 without) |
//! | `SKYPILOT_JOBGROUP_NAME` | the group's name |
//!
//! `<COMPONENT>` is the name upper-cased with `-` as `_` (`env-server` →
//! `AGENTSTACK_ENV_SERVER_ADDRS`). The SkyPilot names mean what they mean in SkyPilot;
//! a replica of a replicated component is a one-node task of its own, as a SkyServe
//! replica is.
//!
//! Backends that learn addresses only once everything is placed (Slurm, Ray) write the
//! variables to a file with [`env_file`] that the node's script waits for (see
//! [`crate::entrypoint`]); Kubernetes knows its DNS names up front.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::spec::JobGroup;

pub use agentstack_static::env_vars::{AGENTSTACK_COMPONENT, AGENTSTACK_PORT, AGENTSTACK_REPLICA};
/// SkyPilot: the node's rank in the task, from 0.
pub const SKYPILOT_NODE_RANK: &str = "SKYPILOT_NODE_RANK";
/// SkyPilot: the task's node addresses, one per line.
pub const SKYPILOT_NODE_IPS: &str = "SKYPILOT_NODE_IPS";
/// SkyPilot: how many nodes the task spans.
pub const SKYPILOT_NUM_NODES: &str = "SKYPILOT_NUM_NODES";
/// SkyPilot: accelerators per node.
pub const SKYPILOT_NUM_GPUS_PER_NODE: &str = "SKYPILOT_NUM_GPUS_PER_NODE";
/// SkyPilot: the job group's name.
pub const SKYPILOT_JOBGROUP_NAME: &str = "SKYPILOT_JOBGROUP_NAME";

/// The variable that lists `component`'s addresses: `AGENTSTACK_<COMPONENT>_ADDRS`.
pub fn addrs_var(component: &str) -> String {
    format!(
        "AGENTSTACK_{}_ADDRS",
        component.to_ascii_uppercase().replace('-', "_")
    )
}

/// Whether the launcher sets `name`, so a spec's `envs` may not.
pub fn is_reserved(name: &str) -> bool {
    name.starts_with("SKYPILOT_")
        || [AGENTSTACK_COMPONENT, AGENTSTACK_REPLICA, AGENTSTACK_PORT].contains(&name)
        || (name.starts_with("AGENTSTACK_") && name.ends_with("_ADDRS"))
}

/// Where one instance can be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// A host name or IP address (IPv6 without brackets).
    pub host: String,
    /// The port, for components that listen on one.
    pub port: Option<u16>,
}

impl Endpoint {
    /// An endpoint.
    pub fn new(host: impl Into<String>, port: Option<u16>) -> Self {
        Self {
            host: host.into(),
            port,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.port, self.host.contains(':')) {
            (Some(port), true) => write!(f, "[{}]:{port}", self.host),
            (Some(port), false) => write!(f, "{}:{port}", self.host),
            (None, _) => f.write_str(&self.host),
        }
    }
}

impl FromStr for Endpoint {
    type Err = DiscoveryError;

    /// Reads `host`, `host:port`, `[v6]:port` or `[v6]`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| DiscoveryError::BadEndpoint {
            text: text.to_owned(),
            reason: reason.to_owned(),
        };
        let port = |p: &str| {
            p.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("the port is not 1 to 65535"))
        };
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(|| bad("no closing `]`"))?;
            match after {
                "" => (host, None),
                _ => match after.strip_prefix(':') {
                    Some(p) => (host, Some(port(p)?)),
                    None => return Err(bad("expected `:port` after `]`")),
                },
            }
        } else {
            match text.split_once(':') {
                Some((_, rest)) if rest.contains(':') => {
                    return Err(bad("write IPv6 addresses in brackets: [::1]:8000"));
                }
                Some((host, p)) => (host, Some(port(p)?)),
                None => (text, None),
            }
        };
        if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == ',' || c == '/') {
            return Err(bad("not a host name or address"));
        }
        Ok(Self::new(host, port))
    }
}

/// Where every instance of every component is: component → its instances, in order
/// (replica index, or node rank).
pub type Addresses = BTreeMap<String, Vec<Endpoint>>;

/// What is wrong with the addresses given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    /// The group has no component of that name.
    #[error("there is no component named `{component}` (the components are: {known})")]
    UnknownComponent {
        /// The name asked for.
        component: String,
        /// The group's components, comma-separated.
        known: String,
    },
    /// A component has no addresses.
    #[error("no addresses for component `{component}`")]
    MissingAddresses {
        /// The component.
        component: String,
    },
    /// A component has a different number of addresses than instances.
    #[error("component `{component}` has {expected} instance(s) but {found} address(es)")]
    WrongCount {
        /// The component.
        component: String,
        /// Its replicas or nodes.
        expected: usize,
        /// Addresses given.
        found: usize,
    },
    /// Addresses were given for a component the group does not have.
    #[error("addresses given for `{component}`, which is not a component of the group")]
    StrayAddresses {
        /// The name.
        component: String,
    },
    /// The instance index is past the component's instances.
    #[error("component `{component}` has {instances} instance(s); there is no instance {instance}")]
    NoSuchInstance {
        /// The component.
        component: String,
        /// The index asked for.
        instance: usize,
        /// How many it has.
        instances: usize,
    },
    /// An address could not be read.
    #[error("`{text}` is not an address: {reason}")]
    BadEndpoint {
        /// The text.
        text: String,
        /// Why.
        reason: String,
    },
}

/// One instance's discovery variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceEnvironment {
    /// The component.
    pub component: String,
    /// The instance: replica index or node rank.
    pub instance: usize,
    /// The variables.
    pub vars: BTreeMap<String, String>,
}

/// Checks that `addresses` has one endpoint per instance of every component, and
/// nothing else.
pub fn check(group: &JobGroup, addresses: &Addresses) -> Result<(), DiscoveryError> {
    for task in &group.components {
        let given = addresses
            .get(&task.name)
            .ok_or_else(|| DiscoveryError::MissingAddresses {
                component: task.name.clone(),
            })?;
        if given.len() != task.instances() {
            return Err(DiscoveryError::WrongCount {
                component: task.name.clone(),
                expected: task.instances(),
                found: given.len(),
            });
        }
    }
    if let Some(stray) = addresses.keys().find(|k| group.component(k).is_none()) {
        return Err(DiscoveryError::StrayAddresses {
            component: stray.clone(),
        });
    }
    Ok(())
}

/// The discovery variables of instance `instance` of `component`.
pub fn environment(
    group: &JobGroup,
    addresses: &Addresses,
    component: &str,
    instance: usize,
) -> Result<BTreeMap<String, String>, DiscoveryError> {
    check(group, addresses)?;
    let task = group
        .component(component)
        .ok_or_else(|| DiscoveryError::UnknownComponent {
            component: component.to_owned(),
            known: group.component_names().join(", "),
        })?;
    let own = &addresses[component];
    let me = own
        .get(instance)
        .ok_or_else(|| DiscoveryError::NoSuchInstance {
            component: component.to_owned(),
            instance,
            instances: own.len(),
        })?;
    let mut vars = BTreeMap::new();
    for (name, endpoints) in addresses {
        let list: Vec<String> = endpoints.iter().map(Endpoint::to_string).collect();
        vars.insert(addrs_var(name), list.join(","));
    }
    let multi_node = task.num_nodes > 1;
    let set = |vars: &mut BTreeMap<String, String>, k: &str, v: String| {
        vars.insert(k.to_owned(), v);
    };
    set(&mut vars, AGENTSTACK_COMPONENT, component.to_owned());
    set(
        &mut vars,
        AGENTSTACK_REPLICA,
        if multi_node { 0 } else { instance }.to_string(),
    );
    if let Some(port) = me.port {
        set(&mut vars, AGENTSTACK_PORT, port.to_string());
    }
    set(
        &mut vars,
        SKYPILOT_NODE_RANK,
        if multi_node { instance } else { 0 }.to_string(),
    );
    let node_ips = if multi_node {
        own.iter()
            .map(|e| e.host.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        me.host.clone()
    };
    set(&mut vars, SKYPILOT_NODE_IPS, node_ips);
    set(&mut vars, SKYPILOT_NUM_NODES, task.num_nodes.to_string());
    let gpus = task.resources.accelerators.as_ref().map_or(0, |a| a.count);
    set(&mut vars, SKYPILOT_NUM_GPUS_PER_NODE, gpus.to_string());
    set(&mut vars, SKYPILOT_JOBGROUP_NAME, group.name.clone());
    Ok(vars)
}

/// The discovery variables of every instance of every component, in file order.
pub fn environments(
    group: &JobGroup,
    addresses: &Addresses,
) -> Result<Vec<InstanceEnvironment>, DiscoveryError> {
    let mut all = Vec::new();
    for task in &group.components {
        for instance in 0..task.instances() {
            all.push(InstanceEnvironment {
                component: task.name.clone(),
                instance,
                vars: environment(group, addresses, &task.name, instance)?,
            });
        }
    }
    Ok(all)
}

/// Variables as a shell file of `export NAME='value'` lines, for `.` to read.
pub fn env_file(vars: &BTreeMap<String, String>) -> String {
    vars.iter()
        .map(|(k, v)| format!("export {k}={}\n", crate::request::shell_quote(v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GROUP: &str = "
name: rl
execution: parallel
primary_tasks: [trainer]
---
name: env-server
replicas: 2
resources: {ports: 8000}
run: serve
---
name: trainer
num_nodes: 2
resources: {accelerators: A100:8}
run: train
";

    fn addresses() -> Addresses {
        let mut a = Addresses::new();
        a.insert(
            "env-server".into(),
            vec![
                "10.0.0.1:8000".parse().unwrap(),
                "10.0.0.2:8001".parse().unwrap(),
            ],
        );
        a.insert(
            "trainer".into(),
            vec!["node1".parse().unwrap(), "node2".parse().unwrap()],
        );
        a
    }

    #[test]
    fn replica_and_rank_variables() {
        let group = JobGroup::parse(GROUP).unwrap();
        let env = environment(&group, &addresses(), "env-server", 1).unwrap();
        assert_eq!(
            env["AGENTSTACK_ENV_SERVER_ADDRS"],
            "10.0.0.1:8000,10.0.0.2:8001"
        );
        assert_eq!(env["AGENTSTACK_TRAINER_ADDRS"], "node1,node2");
        assert_eq!(env[AGENTSTACK_COMPONENT], "env-server");
        assert_eq!(env[AGENTSTACK_REPLICA], "1");
        assert_eq!(env[AGENTSTACK_PORT], "8001");
        assert_eq!(env[SKYPILOT_NODE_RANK], "0");
        assert_eq!(env[SKYPILOT_NODE_IPS], "10.0.0.2");
        assert_eq!(env[SKYPILOT_NUM_NODES], "1");
        assert_eq!(env[SKYPILOT_NUM_GPUS_PER_NODE], "0");
        assert_eq!(env[SKYPILOT_JOBGROUP_NAME], "rl");

        let env = environment(&group, &addresses(), "trainer", 1).unwrap();
        assert_eq!(env[AGENTSTACK_REPLICA], "0");
        assert_eq!(env[SKYPILOT_NODE_RANK], "1");
        assert_eq!(env[SKYPILOT_NODE_IPS], "node1\nnode2");
        assert_eq!(env[SKYPILOT_NUM_NODES], "2");
        assert_eq!(env[SKYPILOT_NUM_GPUS_PER_NODE], "8");
        assert!(!env.contains_key(AGENTSTACK_PORT));

        assert_eq!(environments(&group, &addresses()).unwrap().len(), 4);
    }

    #[test]
    fn wrong_addresses_are_named() {
        let group = JobGroup::parse(GROUP).unwrap();
        let mut a = addresses();
        a.get_mut("env-server").unwrap().pop();
        assert_eq!(
            environment(&group, &a, "trainer", 0)
                .unwrap_err()
                .to_string(),
            "component `env-server` has 2 instance(s) but 1 address(es)"
        );
        a.remove("env-server");
        assert!(matches!(
            environment(&group, &a, "trainer", 0),
            Err(DiscoveryError::MissingAddresses { .. })
        ));
        let mut a = addresses();
        a.insert("ghost".into(), vec![]);
        assert!(matches!(
            check(&group, &a),
            Err(DiscoveryError::StrayAddresses { .. })
        ));
        assert!(matches!(
            environment(&group, &addresses(), "trainer", 2),
            Err(DiscoveryError::NoSuchInstance { .. })
        ));
        assert!(matches!(
            environment(&group, &addresses(), "nope", 0),
            Err(DiscoveryError::UnknownComponent { .. })
        ));
    }

    #[test]
    fn endpoints_read_and_print() {
        for text in ["h:80", "10.0.0.1", "[::1]:8000", "[fe80::1]"] {
            let e: Endpoint = text.parse().unwrap();
            let back = if text == "[fe80::1]" { "fe80::1" } else { text };
            assert_eq!(e.to_string(), back);
        }
        for bad in ["", "h:0", "h:x", "::1:80", "[::1", "a b", "h:1,h:2"] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn reserved_names() {
        assert!(is_reserved("SKYPILOT_NODE_RANK"));
        assert!(is_reserved("AGENTSTACK_TRAINER_ADDRS"));
        assert!(is_reserved("AGENTSTACK_PORT"));
        assert!(!is_reserved("AGENTSTACK_HOME"));
        assert_eq!(addrs_var("env-server-2"), "AGENTSTACK_ENV_SERVER_2_ADDRS");
    }
}
