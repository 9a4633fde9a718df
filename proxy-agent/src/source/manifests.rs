//! Services and EndpointSlices from a YAML file or a directory of them
//! (`*.yaml`, `*.yml`: multi-document; `*.json`: one or more JSON values;
//! lists such as `kind: List` too), re-read when their content changes.
//! JSON files are read by serde_json, streamed (see [`crate::json`]): for
//! a large file several times faster than YAML, as a JSON document needs no
//! indentation, anchors or plain-scalar typing.
//!
//! New bytes are used once two reads in a row agree, so a file caught in the
//! middle of a write (which may well parse) is not taken. Files degrade one
//! by one: a file that does not parse contributes nothing new (it keeps its
//! last good objects, if it had any), is reported once, and is read again
//! only when it changes; an object that does not decode (or has no kind) is
//! skipped and reported by kind and name, the rest of its file is used, and
//! the store keeps that object's last good version.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use super::snapshot::{ObjectRef, Snapshot};
use crate::{intern, model::ServiceName, yaml::Value};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: not valid {}, keeping its previous objects: {source}", source.format())]
    Syntax { path: PathBuf, source: SyntaxError },
    #[error("{path}: document {index}: {kind} {name}: {source}")]
    Decode { path: PathBuf, index: usize, kind: String, name: String, source: serde_json::Error },
    #[error("{path}: document {index} ({name}): skipped: {why}")]
    Skipped { path: PathBuf, index: usize, name: String, why: &'static str },
}

/// Why a file does not parse, in its format's words.
#[derive(Debug, thiserror::Error)]
pub enum SyntaxError {
    #[error(transparent)]
    Yaml(#[from] serde_saphyr::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl SyntaxError {
    fn format(&self) -> &'static str {
        match self {
            SyntaxError::Yaml(_) => "YAML",
            SyntaxError::Json(_) => "JSON",
        }
    }
}

impl ManifestError {
    /// The metric label: which kind of object (or file) was bad.
    pub fn kind(&self) -> &str {
        match self {
            ManifestError::Decode { kind, .. } => kind,
            ManifestError::Skipped { .. } => "unknown",
            ManifestError::Syntax { source: SyntaxError::Yaml(_), .. } => "yaml",
            ManifestError::Syntax { source: SyntaxError::Json(_), .. } => "json",
            ManifestError::Read { .. } => "file",
        }
    }

    /// The file (or manifests path) it is about.
    pub fn path(&self) -> &Path {
        match self {
            ManifestError::Read { path, .. }
            | ManifestError::Syntax { path, .. }
            | ManifestError::Decode { path, .. }
            | ManifestError::Skipped { path, .. } => path,
        }
    }
}

#[derive(Debug, Default)]
struct CachedFile {
    /// A digest of the bytes last parsed (whether they parsed or not).
    contents: u64,
    /// New bytes seen once (their digest), used if the next read finds
    /// them again.
    candidate: Option<u64>,
    /// The file's size, modification time and inode when `contents` was
    /// taken: while they stay, the file is not read again (a large
    /// manifest, or one that does not parse, is not re-read at every poll).
    stamp: Option<Stamp>,
    /// The bytes at `contents` were parsed, successfully or not.
    taken: bool,
    /// Parsed successfully at least once: `snapshot` holds its objects.
    loaded: bool,
    snapshot: Snapshot,
}

/// The manifests at one path, and what was last read from each file.
#[derive(Debug)]
pub struct Manifests {
    path: PathBuf,
    files: BTreeMap<PathBuf, CachedFile>,
    /// What [`Manifests::prime`] found, for the first reload.
    primed: Option<Reload>,
}

/// What a reload found.
#[derive(Debug, Default)]
pub struct Reload {
    pub changed: bool,
    pub errors: Vec<ManifestError>,
    /// Every file was read and parsed at least once: the snapshot is whole.
    pub complete: bool,
    /// Files whose new bytes are not taken yet (two reads have not agreed
    /// yet; a file rewritten all the time never is).
    pub moving: Vec<PathBuf>,
    /// Files taken that never parsed: their services are missing.
    pub unreadable: Vec<PathBuf>,
}

impl Manifests {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into(), files: BTreeMap::new(), primed: None }
    }

    /// Reads the files twice, `apart` from each other, as the agent's
    /// first two polls would, so that they are parsed by then; the first
    /// [`Manifests::reload`] returns what was found. At start this runs
    /// beside the programs' loading, which it would otherwise follow.
    pub fn prime(&mut self, apart: std::time::Duration) {
        let first = self.reload();
        if first.moving.is_empty() {
            self.primed = Some(first);
            return;
        }
        std::thread::sleep(apart);
        let mut second = self.reload();
        second.changed |= first.changed;
        self.primed = Some(second);
    }

    /// Re-reads every file; parses only those whose bytes changed.
    pub fn reload(&mut self) -> Reload {
        if let Some(primed) = self.primed.take() {
            return primed;
        }
        let mut reload = Reload::default();
        let paths = match list(&self.path) {
            Ok(paths) => paths,
            Err(source) => {
                reload.errors.push(ManifestError::Read { path: self.path.clone(), source });
                return reload;
            }
        };
        let before = self.files.len();
        self.files.retain(|path, _| paths.contains(path));
        reload.changed |= self.files.len() != before;
        for path in paths {
            let stamp = Stamp::of(&path);
            if let Some(cached) = self.files.get_mut(&path)
                && cached.taken
                && stamp.is_some()
                && cached.stamp == stamp
            {
                cached.candidate = None;
                continue;
            }
            let contents = match std::fs::read(&path) {
                Ok(contents) => contents,
                // Vanished between listing and reading: the next tick sees it gone.
                Err(source) => {
                    reload.errors.push(ManifestError::Read { path, source });
                    continue;
                }
            };
            let digest = digest(&contents);
            let cached = self.files.entry(path.clone()).or_default();
            if cached.taken && cached.contents == digest {
                cached.candidate = None;
                cached.stamp = stamp;
                continue;
            }
            if cached.candidate != Some(digest) {
                cached.candidate = Some(digest);
                continue;
            }
            cached.candidate = None;
            cached.contents = digest;
            cached.stamp = stamp;
            cached.taken = true;
            match parse(&path, &contents) {
                Ok((snapshot, errors)) => {
                    cached.snapshot = snapshot;
                    cached.loaded = true;
                    reload.errors.extend(errors);
                    reload.changed = true;
                }
                Err(source) => reload.errors.push(ManifestError::Syntax { path, source }),
            }
        }
        reload.complete = self.files.values().all(|f| f.loaded);
        let paths = |keep: fn(&CachedFile) -> bool| {
            self.files.iter().filter(|(_, f)| keep(f)).map(|(path, _)| path.clone()).collect()
        };
        reload.moving = paths(|f| !f.taken || f.candidate.is_some());
        reload.unreadable = paths(|f| f.taken && !f.loaded);
        reload
    }

    /// Everything the files hold now.
    pub fn snapshot(&self) -> Snapshot {
        let mut all = Snapshot::default();
        for file in self.files.values() {
            all.services.extend(file.snapshot.services.iter().cloned());
            all.slices.extend(file.snapshot.slices.iter().cloned());
            all.rejected.extend(file.snapshot.rejected.iter().cloned());
            all.unnamed.extend(file.snapshot.unnamed.iter().cloned());
        }
        all
    }
}

/// What tells a file changed without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: std::time::SystemTime,
    inode: u64,
}

impl Stamp {
    fn of(path: &Path) -> Option<Stamp> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).ok()?;
        Some(Stamp { len: meta.len(), modified: meta.modified().ok()?, inode: meta.ino() })
    }
}

/// Files are compared by digest: their bytes are not kept.
fn digest(contents: &[u8]) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    contents.hash(&mut hasher);
    hasher.finish()
}

fn list(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !std::fs::metadata(path)?.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(path)? {
        let path = entry?.path();
        let manifest =
            matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"));
        // Editors' hidden swap and backup files are not manifests.
        let hidden = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
        if manifest && !hidden && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

/// Parses all documents of one file (JSON for `*.json`, else YAML). A
/// syntax error fails the whole file; an object that does not decode is
/// reported and listed as rejected.
fn parse(path: &Path, contents: &[u8]) -> Result<(Snapshot, Vec<ManifestError>), SyntaxError> {
    let mut snapshot = Snapshot::default();
    let mut errors = Vec::new();
    let mut index = 0;
    // Each document is read into what the proxy keeps of it before the
    // next is parsed: a large manifest is never held whole as values.
    let mut each = |mut value: Value| {
        let items = match value.get("kind").and_then(Value::as_str) {
            Some(kind) if kind.ends_with("List") => match value.get_mut("items").map(Value::take) {
                Some(Value::Array(items)) => items,
                _ => Vec::new(),
            },
            _ if value.is_null() => Vec::new(),
            _ => vec![value],
        };
        for value in items {
            let name = object_name(&value);
            decode(path, index, name, value, &mut snapshot, &mut errors);
            index += 1;
        }
    };
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => crate::json::for_each_document(contents, &mut each)?,
        _ => crate::yaml::for_each_document(contents, &mut each)?,
    }
    Ok((snapshot, errors))
}

/// Adds one object (`name`: its name, if it has one) to `snapshot`; one
/// that does not decode is reported and listed as rejected.
fn decode(
    path: &Path,
    index: usize,
    name: Option<ServiceName>,
    value: Value,
    snapshot: &mut Snapshot,
    errors: &mut Vec<ManifestError>,
) {
    let api_version = value.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
    if kind.is_empty() || api_version.is_empty() {
        // Not an object (a bare string, a list, a typo'd key): nothing to
        // serve from it, but the file's other objects are used.
        let name = name.map_or_else(|| "<unnamed>".to_string(), |n| n.to_string());
        let why = "no apiVersion and kind";
        errors.push(ManifestError::Skipped { path: path.to_path_buf(), index, name, why });
        return;
    }
    let decoded = match (api_version, kind.as_str()) {
        ("v1", "Service") => {
            serde_json::from_value(value).map(|s| snapshot.add_service(name.clone(), s))
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            serde_json::from_value(value).map(|s| snapshot.add_slice(name.clone(), s))
        }
        _ => {
            tracing::debug!(path = %path.display(), index, api_version, kind, "ignoring object");
            Ok(())
        }
    };
    if let Err(source) = decoded {
        let display = name.as_ref().map_or_else(|| "<unnamed>".to_string(), |n| n.to_string());
        if let Some(name) = name {
            snapshot.rejected.push(ObjectRef { kind: kind.clone(), name });
        }
        errors.push(ManifestError::Decode {
            path: path.to_path_buf(),
            index,
            kind,
            name: display,
            source,
        });
    }
}

/// As [`ServiceName::of`] reads it, the namespace shared.
fn object_name(value: &Value) -> Option<ServiceName> {
    let metadata = value.get("metadata")?;
    let name = metadata.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let namespace = metadata.get("namespace").and_then(Value::as_str).unwrap_or("default");
    Some(ServiceName { namespace: intern::name(namespace), name: name.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.2]}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
---
"#;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("proxy-manifests-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn multi_document_files_yield_services_and_slices() {
        let (snapshot, errors) = parse(Path::new("x.yaml"), GOOD.as_bytes()).unwrap();
        assert!(errors.is_empty());
        assert_eq!(snapshot.services.len(), 1);
        assert_eq!(snapshot.slices.len(), 1);
    }

    #[test]
    fn lists_are_flattened() {
        let list = "{apiVersion: v1, kind: List, items: [{apiVersion: v1, kind: Service, metadata: {name: a}}]}";
        let (snapshot, _) = parse(Path::new("x.yaml"), list.as_bytes()).unwrap();
        assert_eq!(snapshot.services.len(), 1);
    }

    #[test]
    fn json_files_say_what_yaml_files_say() {
        let mut items = Vec::new();
        crate::yaml::for_each_document(GOOD.as_bytes(), |v| items.push(v)).unwrap();
        // As `kubectl get -o json` writes a list: items before kind.
        let list =
            format!(r#"{{"apiVersion": "v1", "items": {}, "kind": "List"}}"#, Value::from(items));
        let (yaml, _) = parse(Path::new("x.yaml"), GOOD.as_bytes()).unwrap();
        let (json, errors) = parse(Path::new("x.json"), list.as_bytes()).unwrap();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(format!("{json:?}"), format!("{yaml:?}"));
        assert_eq!(json.services.len(), 1);
        let broken = parse(Path::new("x.json"), &list.as_bytes()[..list.len() - 1]).unwrap_err();
        let error = ManifestError::Syntax { path: "x.json".into(), source: broken };
        assert_eq!(error.kind(), "json");
        assert!(error.to_string().starts_with("x.json: not valid JSON, keeping"), "{error}");
    }

    #[test]
    fn typed_lists_are_flattened_too() {
        let list = "{apiVersion: v1, kind: ServiceList, items: [{apiVersion: v1, kind: Service, metadata: {name: a}}]}";
        let (snapshot, _) = parse(Path::new("x.yaml"), list.as_bytes()).unwrap();
        assert_eq!(snapshot.services.len(), 1);
    }

    #[test]
    fn undecodable_objects_are_reported_by_name() {
        let bad = "{apiVersion: v1, kind: Service, metadata: {name: bad, namespace: ns}, spec: {ports: [{port: eighty}]}}";
        let (snapshot, errors) = parse(Path::new("x.yaml"), bad.as_bytes()).unwrap();
        assert!(snapshot.services.is_empty());
        assert_eq!(snapshot.rejected[0].name.to_string(), "ns/bad");
        let message = errors[0].to_string();
        assert!(message.contains("Service ns/bad"), "{message}");
    }

    #[test]
    fn reload_notices_changes_and_keeps_the_last_good_file() {
        let dir = temp_dir("reload");
        std::fs::write(dir.join("a.yaml"), GOOD).unwrap();
        std::fs::write(dir.join(".a.yaml.swp"), "garbage: [").unwrap();
        let mut manifests = Manifests::new(&dir);
        let seen = manifests.reload();
        assert!(!seen.changed && !seen.complete, "new bytes wait for a second read");
        let first = manifests.reload();
        assert!(first.changed && first.complete && first.errors.is_empty(), "{first:?}");
        assert!(!manifests.reload().changed, "same bytes, no change");

        std::fs::write(dir.join("a.yaml"), "kind: [unclosed").unwrap();
        manifests.reload();
        let broken = manifests.reload();
        assert!(!broken.changed);
        assert!(matches!(broken.errors[0], ManifestError::Syntax { .. }));
        assert_eq!(manifests.snapshot().services.len(), 1, "last good objects kept");

        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        assert!(manifests.reload().changed);
        assert!(manifests.snapshot().services.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn priming_reads_twice_and_hands_its_finding_to_the_first_reload() {
        let dir = temp_dir("primed");
        std::fs::write(dir.join("good.yaml"), GOOD).unwrap();
        let mut manifests = Manifests::new(&dir);
        manifests.prime(std::time::Duration::ZERO);
        let first = manifests.reload();
        assert!(first.changed && first.complete && first.moving.is_empty(), "{first:?}");
        assert_eq!(manifests.snapshot().services.len(), 1);
        let again = manifests.reload();
        assert!(!again.changed && again.complete, "{again:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_file_is_reported_once_and_not_parsed_again() {
        let dir = temp_dir("broken");
        std::fs::write(dir.join("good.yaml"), GOOD).unwrap();
        std::fs::write(dir.join("garbage.yaml"), "kind: [unclosed\n\u{1}\u{2}").unwrap();
        let mut manifests = Manifests::new(&dir);
        let seen = manifests.reload();
        assert_eq!(seen.moving.len(), 2, "new bytes wait for a second read");
        let first = manifests.reload();
        assert!(first.changed && first.moving.is_empty() && !first.complete, "{first:?}");
        assert_eq!(first.unreadable, [dir.join("garbage.yaml")]);
        assert!(matches!(&first.errors[..], [ManifestError::Syntax { .. }]), "{first:?}");
        assert_eq!(first.errors[0].kind(), "yaml");
        assert_eq!(manifests.snapshot().services.len(), 1, "the good file is used");
        // Unchanged: not parsed again, so not reported again.
        for _ in 0..3 {
            let again = manifests.reload();
            assert!(again.errors.is_empty() && !again.changed, "{again:?}");
            assert!(again.moving.is_empty(), "{again:?}");
        }
        // Not even read: other bytes behind the same size, mtime and inode
        // go unseen.
        let garbage = dir.join("garbage.yaml");
        let stamp = std::fs::metadata(&garbage).unwrap();
        let same_size = format!("{:<1$}", "{}", stamp.len() as usize);
        let file = std::fs::OpenOptions::new().write(true).open(&garbage).unwrap();
        std::io::Write::write_all(&mut &file, same_size.as_bytes()).unwrap();
        file.set_modified(stamp.modified().unwrap()).unwrap();
        manifests.reload();
        assert!(!manifests.reload().complete, "not read again while its stamp stays");
        // Changed, still broken: reported once more.
        std::fs::write(dir.join("garbage.yaml"), "{{{").unwrap();
        manifests.reload();
        assert_eq!(manifests.reload().errors.len(), 1);
        assert!(manifests.reload().errors.is_empty());
        // Mended: whole.
        std::fs::write(dir.join("garbage.yaml"), GOOD.replace("web", "other")).unwrap();
        manifests.reload();
        let mended = manifests.reload();
        assert!(mended.changed && mended.complete && mended.unreadable.is_empty(), "{mended:?}");
        assert_eq!(manifests.snapshot().services.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_objects_are_skipped_by_name_and_the_rest_is_used() {
        let file = r#"
apiVersion: v1
kind: Service
metadata: {name: good}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
just a string
---
metadata: {name: kindless}
spec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: undecodable}
spec: {ports: "eighty"}
---
apiVersion: v1
kind: Service
metadata: {name: bad-protocol}
spec: {clusterIP: 10.96.0.12, ports: [{port: 80, protocol: QUIC}]}
"#;
        let (snapshot, errors) = parse(Path::new("x.yaml"), file.as_bytes()).unwrap();
        let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 3, "{messages:?}");
        assert!(messages[1].contains("default/kindless") && messages[1].contains("skipped"));
        assert!(messages[2].contains("Service default/undecodable"), "{messages:?}");
        // Decoded, and invalid for the model: the store reports it by name.
        let valid: Vec<_> = snapshot.services.iter().filter(|(_, s)| s.is_ok()).collect();
        assert_eq!(valid.len(), 1);
        assert_eq!(&*valid[0].0.name, "good");
        assert_eq!(snapshot.services.len(), 2, "bad-protocol is there, as invalid");
    }

    #[test]
    fn bytes_that_change_between_reads_are_not_taken() {
        let dir = temp_dir("torn");
        let file = dir.join("a.yaml");
        let mut manifests = Manifests::new(&file);
        // A writer caught mid-file: the first half parses on its own.
        let half = &GOOD[..GOOD.find("---").unwrap()];
        std::fs::write(&file, half).unwrap();
        assert!(!manifests.reload().changed);
        std::fs::write(&file, GOOD).unwrap();
        assert!(!manifests.reload().changed, "still moving");
        assert!(manifests.reload().changed);
        assert_eq!(manifests.snapshot().slices.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_path_is_an_error_that_keeps_state() {
        let dir = temp_dir("missing");
        let file = dir.join("one.yaml");
        std::fs::write(&file, GOOD).unwrap();
        let mut manifests = Manifests::new(&file);
        manifests.reload();
        manifests.reload();
        std::fs::remove_dir_all(&dir).unwrap();
        let reload = manifests.reload();
        assert!(!reload.changed);
        assert!(matches!(reload.errors[0], ManifestError::Read { .. }));
        assert_eq!(manifests.snapshot().services.len(), 1);
    }
}
