//! YAML through serde-saphyr, the parser kube itself uses (serde_yaml is
//! archived). Documents are read as JSON values, then decoded with
//! serde_json: objects decode from the shapes the API server sends, and a
//! document's kind and name can be read before (and whether or not) it
//! decodes.

use serde::de::DeserializeOwned;

pub type Value = serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Not YAML.
    #[error(transparent)]
    Syntax(Box<serde_saphyr::Error>),
    /// YAML, but not the value expected.
    #[error(transparent)]
    Decode(#[from] serde_json::Error),
}

/// The parser's options. No budget of events and nodes: the files are the
/// operator's, a manifest may hold any number of documents and one of them
/// may be a `kind: List` of a whole cluster's Services, and counting costs
/// a third of the parse time; the alias replay limits (against alias bombs)
/// and the parser's nesting limits stay. Errors are one line, without a
/// snippet of the file: they go to the log.
fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: None,
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
    let value: Value = serde_saphyr::from_str_with_options(text, options())
        .map_err(|e| YamlError::Syntax(Box::new(e)))?;
    Ok(serde_json::from_value(value)?)
}
