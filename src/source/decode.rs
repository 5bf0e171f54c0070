//! Objects from the API decoded one by one. kube-rs' typed watcher decodes a whole list page
//! (or watch event) into the typed struct at once, so one object that does not decode fails
//! the list, and the relist that follows fails the same way for ever: that kind's updates
//! stop. Watching [`Raw<K>`] instead, every object arrives as JSON with only its name,
//! namespace and resource version read (leniently: a malformed field there is left empty),
//! and [`Raw::decode`] turns it into `K` on its own, with an error naming the object and the
//! field (`serde_path_to_error`) when it does not fit.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// An object of kind `K` as the API server sent it: the JSON, plus the metadata fields the
/// watcher and the store need (name, namespace, resource version), each read only if it is a
/// string.
pub struct Raw<K> {
    metadata: ObjectMeta,
    json: Value,
    kind: PhantomData<fn() -> K>,
}

// Derives would require `K: Clone` / `K: Debug`, which the marker does not need.
impl<K> Clone for Raw<K> {
    fn clone(&self) -> Self {
        Raw {
            metadata: self.metadata.clone(),
            json: self.json.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> fmt::Debug for Raw<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Raw")
            .field("metadata", &self.metadata)
            .field("json", &self.json)
            .finish()
    }
}

/// Why an object was not decoded: which object, and the field and problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// `Kind namespace/name` (or `Kind name` for cluster-scoped kinds).
    pub object: String,
    /// The path of the field that did not fit (`spec.ports[0].port`; `.` for the object).
    pub field: String,
    pub problem: String,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: field {}: {}", self.object, self.field, self.problem)
    }
}

impl std::error::Error for DecodeError {}

impl<K: k8s_openapi::Resource> Raw<K> {
    /// Wraps JSON as it came from the API server (what deserializing does).
    pub fn from_json(json: Value) -> Raw<K> {
        let meta = json.get("metadata");
        let text = |field: &str| {
            meta.and_then(|m| m.get(field))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        Raw {
            metadata: ObjectMeta {
                name: text("name"),
                namespace: text("namespace"),
                resource_version: text("resourceVersion"),
                uid: text("uid"),
                ..ObjectMeta::default()
            },
            json,
            kind: PhantomData,
        }
    }

    /// `Kind namespace/name`, as messages name the object.
    pub fn describe(&self) -> String {
        let name = self.metadata.name.as_deref().unwrap_or("<unnamed>");
        match &self.metadata.namespace {
            Some(ns) => format!("{} {ns}/{name}", K::KIND),
            None => format!("{} {name}", K::KIND),
        }
    }

    /// The typed object, or what stopped it from decoding.
    pub fn decode(self) -> Result<K, DecodeError>
    where
        K: DeserializeOwned,
    {
        let object = self.describe();
        serde_path_to_error::deserialize(self.json).map_err(|e| DecodeError {
            object,
            field: e.path().to_string(),
            problem: e.inner().to_string(),
        })
    }
}

impl<'de, K: k8s_openapi::Resource> Deserialize<'de> for Raw<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(Raw::from_json)
    }
}

impl<K: k8s_openapi::Resource> kube::Resource for Raw<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(_: &()) -> Cow<'_, str> {
        K::KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        K::GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        K::VERSION.into()
    }

    fn api_version(_: &()) -> Cow<'_, str> {
        K::API_VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        K::URL_PATH_SEGMENT.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use kube::Resource as _;
    use serde_json::json;

    use super::*;

    #[test]
    fn a_list_with_an_undecodable_object_still_decodes_object_by_object() {
        let list = json!({"items": [
            {"metadata": {"name": "good", "namespace": "d", "resourceVersion": "7"},
             "spec": {"ports": [{"port": 80}]}},
            {"metadata": {"name": "bad", "namespace": "d", "resourceVersion": "8", "labels": {"a": 1}},
             "spec": {"ports": [{"port": "eighty"}]}},
            {"metadata": {"name": 5, "resourceVersion": ["x"]}},
        ]});
        #[derive(Deserialize)]
        struct List {
            items: Vec<Raw<Service>>,
        }
        let items = serde_json::from_value::<List>(list).expect("the list decodes").items;
        assert_eq!(items.len(), 3);
        assert_eq!(items[1].meta().resource_version.as_deref(), Some("8"));
        let mut it = items.into_iter();
        let good = it.next().unwrap().decode().expect("decodes");
        assert_eq!(good.metadata.name.as_deref(), Some("good"));
        let bad = it.next().unwrap().decode().expect_err("does not decode");
        assert_eq!(bad.object, "Service d/bad");
        assert_eq!(bad.field, "metadata.labels.a");
        assert!(bad.problem.contains("expected a string"), "{bad}");
        let nameless = it.next().unwrap();
        assert_eq!(
            nameless.describe(),
            "Service <unnamed>",
            "malformed metadata is left empty"
        );
        assert_eq!(nameless.meta().resource_version, None);
        assert_eq!(
            nameless.decode().expect_err("metadata.name is a number").field,
            "metadata.name"
        );
    }

    #[test]
    fn its_resource_is_the_typed_kinds() {
        assert_eq!(Raw::<Service>::plural(&()), "services");
        assert_eq!(Raw::<Service>::api_version(&()), "v1");
        assert_eq!(
            Raw::<Service>::url_path(&(), Some("ns")),
            "/api/v1/namespaces/ns/services"
        );
    }
}
