//! Label and field selectors, as list and watch requests give them.

use anyhow::bail;
use serde_json::Value;

/// A label or field selector requirement.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// The field selectors the server answers (others get 400, as the real
/// server for an unsupported field label).
pub(super) const FIELDS: [&str; 3] = ["metadata.name", "metadata.namespace", "spec.clusterIP"];

impl Requirement {
    pub(super) fn key(&self) -> &str {
        match self {
            Requirement::Exists(k)
            | Requirement::NotExists(k)
            | Requirement::Equals(k, _)
            | Requirement::NotEquals(k, _)
            | Requirement::In(k, _)
            | Requirement::NotIn(k, _) => k,
        }
    }

    pub(super) fn matches(&self, get: &dyn Fn(&str) -> Option<String>) -> bool {
        match self {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Equals(k, v) => get(k).as_deref() == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k).as_deref() != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
        }
    }
}

/// Parses `a,!b,c=d,e!=f,g in (h,i),j notin (k)`.
pub(super) fn parse_selector(text: &str) -> anyhow::Result<Vec<Requirement>> {
    let mut requirements = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        // A comma inside parentheses does not end a requirement.
        let end = {
            let mut depth = 0;
            rest.char_indices()
                .find(|(_, c)| {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    *c == ',' && depth == 0
                })
                .map_or(rest.len(), |(i, _)| i)
        };
        let term = rest[..end].trim();
        rest = rest.get(end + 1..).unwrap_or("").trim();
        let set = |op: &str| -> Option<(String, Vec<String>)> {
            let (key, values) = term.split_once(op)?;
            let values = values.trim().strip_prefix('(')?.strip_suffix(')')?;
            Some((
                key.trim().to_string(),
                values.split(',').map(|v| v.trim().to_string()).collect(),
            ))
        };
        let requirement = if let Some((k, vs)) = set(" notin ") {
            Requirement::NotIn(k, vs)
        } else if let Some((k, vs)) = set(" in ") {
            Requirement::In(k, vs)
        } else if let Some((k, v)) = term.split_once("!=") {
            Requirement::NotEquals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            Requirement::Equals(k.trim().into(), v.trim().into())
        } else if let Some(k) = term.strip_prefix('!') {
            Requirement::NotExists(k.trim().into())
        } else if !term.is_empty() {
            Requirement::Exists(term.into())
        } else {
            bail!("empty requirement in selector {text:?}");
        };
        requirements.push(requirement);
    }
    Ok(requirements)
}

/// What a list or watch request selects.
#[derive(Clone, Debug, Default)]
pub(super) struct Selector {
    pub(super) namespace: Option<String>,
    pub(super) labels: Vec<Requirement>,
    pub(super) fields: Vec<Requirement>,
}

impl Selector {
    /// Neither labels nor fields: the API server then says how many objects
    /// a page leaves (`remainingItemCount`).
    pub(super) fn counts_remaining(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    pub(super) fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        if self.namespace.as_ref().is_some_and(|ns| meta["namespace"].as_str() != Some(ns)) {
            return false;
        }
        let label = |k: &str| meta["labels"][k].as_str().map(str::to_string);
        let field = |k: &str| match k {
            "metadata.name" => meta["name"].as_str().map(str::to_string),
            "metadata.namespace" => Some(meta["namespace"].as_str().unwrap_or("").to_string()),
            // kube-proxy watches Services with spec.clusterIP!=None.
            "spec.clusterIP" => {
                Some(object["spec"]["clusterIP"].as_str().unwrap_or("").to_string())
            }
            _ => None,
        };
        self.labels.iter().all(|r| r.matches(&label))
            && self.fields.iter().all(|r| r.matches(&field))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_parse_like_kubernetes() {
        let s = parse_selector("!service.kubernetes.io/service-proxy-name,app=web,tier in (a, b)")
            .unwrap();
        assert_eq!(
            s,
            [
                Requirement::NotExists("service.kubernetes.io/service-proxy-name".into()),
                Requirement::Equals("app".into(), "web".into()),
                Requirement::In("tier".into(), vec!["a".into(), "b".into()]),
            ]
        );
        assert_eq!(
            parse_selector("metadata.name=node-a").unwrap(),
            [Requirement::Equals("metadata.name".into(), "node-a".into())]
        );
    }
}
