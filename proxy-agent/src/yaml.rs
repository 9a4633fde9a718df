//! YAML through serde-saphyr, the parser kube itself uses (serde_yaml is
//! archived). Documents are read as JSON values, then decoded with
//! serde_json: objects decode from the shapes the API server sends, and a
//! document's kind and name can be read before (and whether or not) it
//! decodes.

use serde::de::DeserializeOwned;

pub type Value = serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Not YAML (or past the parser's budget).
    #[error(transparent)]
    Syntax(#[from] serde_saphyr::Error),
    /// YAML, but not the value expected.
    #[error(transparent)]
    Decode(#[from] serde_json::Error),
}

/// The parser's limits. Per document: a manifest may hold any number of
/// documents; one document may be a `kind: List` of a whole cluster's
/// Services (tens of nodes each), so the node and event caps are far above
/// the defaults, while the alias caps (against alias bombs) stay. Errors
/// are one line, without a snippet of the file: they go to the log.
fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_reader_input_bytes: None,
            max_events: 100_000_000,
            max_nodes: 100_000_000,
            max_total_scalar_bytes: 1 << 30,
        },
        emit_comments: false,
        with_snippet: false,
    }
}

/// Calls `each` with every document of `bytes` in turn (empty documents
/// are skipped): a large file is never held whole as values. Stops at the
/// first error.
pub fn for_each_document(
    bytes: &[u8],
    mut each: impl FnMut(Value),
) -> Result<(), serde_saphyr::Error> {
    let mut reader = bytes;
    for document in serde_saphyr::read_with_options::<_, Value>(&mut reader, options()) {
        each(document?);
    }
    Ok(())
}

/// One document, decoded as `T`.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, YamlError> {
    let value: Value = serde_saphyr::from_str_with_options(text, options())?;
    Ok(serde_json::from_value(value)?)
}
