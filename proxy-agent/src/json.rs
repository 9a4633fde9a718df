//! JSON manifests, streamed: a file of one or more JSON values (objects,
//! arrays of objects, or lists such as `kubectl get -o json` prints) is read
//! one object at a time, never held whole as values. A list's `items` are
//! handed out as they are parsed, before the list's other keys (kubectl
//! writes `items` before `kind`), so an object with an `items` array is
//! taken for a list (`List`, `ServiceList`, ...): no Service or
//! EndpointSlice has one.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::yaml::Value;

/// Calls `each` with every object of `bytes` in turn; stops at the first
/// syntax error.
pub fn for_each_document(
    bytes: &[u8],
    mut each: impl FnMut(Value),
) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    // `end` skips whitespace and says whether anything is left.
    while de.end().is_err() {
        Document(&mut each).deserialize(&mut de)?;
    }
    Ok(())
}

/// One top-level value: an object (a list's items one by one), or an array
/// of them.
struct Document<'a, F>(&'a mut F);

impl<'de, F: FnMut(Value)> DeserializeSeed<'de> for Document<'_, F> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, F: FnMut(Value)> Visitor<'de> for Document<'_, F> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object, a list of them, or an array of them")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
        while items.next_element_seed(Document(&mut *self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut object = serde_json::Map::new();
        let mut list = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "items" {
                map.next_value_seed(Items(&mut *self.0))?;
                list = true;
            } else {
                object.insert(key, map.next_value()?);
            }
        }
        if !list {
            (self.0)(Value::Object(object));
        }
        Ok(())
    }

    // Anything else at the top (a bare string, a number) is a document the
    // caller reports as not an object.
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        (self.0)(Value::String(v.to_string()));
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        (self.0)(Value::Bool(v));
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        (self.0)(Value::from(v));
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        (self.0)(Value::from(v));
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        (self.0)(Value::from(v));
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// A list's `items`: each handed out as it is parsed.
struct Items<'a, F>(&'a mut F);

impl<'de, F: FnMut(Value)> DeserializeSeed<'de> for Items<'_, F> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, F: FnMut(Value)> Visitor<'de> for Items<'_, F> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list's items")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
        while let Some(item) = items.next_element::<Value>()? {
            (self.0)(item);
        }
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn documents(text: &str) -> Result<Vec<Value>, serde_json::Error> {
        let mut out = Vec::new();
        for_each_document(text.as_bytes(), |v| out.push(v))?;
        Ok(out)
    }

    fn names(values: &[Value]) -> Vec<&str> {
        values.iter().map(|v| v["metadata"]["name"].as_str().unwrap_or("?")).collect()
    }

    #[test]
    fn objects_arrays_and_lists_yield_their_objects_in_order() {
        let svc = |n: &str| format!(r#"{{"kind": "Service", "metadata": {{"name": "{n}"}}}}"#);
        // kubectl's List: items before kind.
        let list = format!(
            r#"{{"apiVersion": "v1", "items": [{}, {}], "kind": "List", "metadata": {{}}}}"#,
            svc("b"),
            svc("c")
        );
        let text = format!("{}\n{list}\n[{}, {}]\n  \n", svc("a"), svc("d"), svc("e"));
        let docs = documents(&text).unwrap();
        assert_eq!(names(&docs), ["a", "b", "c", "d", "e"]);
        assert_eq!(docs[0]["kind"], "Service");
        assert!(documents("").unwrap().is_empty());
    }

    #[test]
    fn a_syntax_error_stops_after_the_objects_before_it() {
        let mut seen = Vec::new();
        let text = r#"{"metadata": {"name": "a"}} {"metadata": {"name": "#;
        let err = for_each_document(text.as_bytes(), |v| seen.push(v)).unwrap_err();
        assert!(err.is_eof(), "{err}");
        assert_eq!(names(&seen), ["a"]);
        assert!(documents(r#"{"items": [1, }"#).is_err());
        // A bare value is handed out for the caller to report.
        assert_eq!(documents(r#""text" 7"#).unwrap().len(), 2);
    }
}
