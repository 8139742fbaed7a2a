//! Field ownership and server-side apply, as the API server keeps them in
//! `metadata.managedFields` (`FieldsV1`), for the in-memory API server.
//!
//! Every write names a field manager (`?fieldManager=`, else the client's user agent). A create,
//! an update or a non-apply patch gives its manager the fields it changed, taking them from
//! whoever had them. An apply (`application/apply-patch+yaml`) is a manager's whole intent:
//!
//! - it sets the fields its configuration names, and conflicts (409, reason `Conflict`) with any
//!   other manager that owns one of them with another value, unless `force=true`, which moves
//!   the field to the applier; equal values are owned by both;
//! - a field the manager applied before and no longer names is removed, unless another manager
//!   owns it too;
//! - lists are atomic, except the list maps the schemas declare ([`LIST_MAPS`]: a lock's
//!   `status.conditions` by `type`, `metadata.ownerReferences` by `uid`), which merge item by
//!   item, each item owned apart (`metadata.finalizers`, a set on a real server, is atomic
//!   here: nothing here applies finalizers);
//! - apply on the `status` subresource touches only the status, and on the object everything
//!   but the status.
//!
//! Managed fields sent by a client are ignored: the server's own record is kept.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

/// One step of a field's path: a field of an object, an item of a list map (its key fields as
/// canonical JSON), or the item itself (FieldsV1's `.`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Step {
    Field(String),
    Item(String),
    Itself,
}

pub(crate) type Path = Vec<Step>;
type FieldSet = BTreeSet<Path>;

/// The list maps: the list's path (field names from the object's root) and its key fields.
pub(crate) const LIST_MAPS: &[(&[&str], &[&str])] = &[
    (&["status", "conditions"], &["type"]),
    (&["metadata", "ownerReferences"], &["uid"]),
];

/// Fields nobody owns: the server's own, and the type's.
const UNOWNED: &[&[&str]] = &[
    &["apiVersion"],
    &["kind"],
    &["metadata", "name"],
    &["metadata", "namespace"],
    &["metadata", "uid"],
    &["metadata", "resourceVersion"],
    &["metadata", "generation"],
    &["metadata", "creationTimestamp"],
    &["metadata", "deletionTimestamp"],
    &["metadata", "managedFields"],
];

/// Which part of an object a write may touch.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The object itself: everything but the status.
    Object,
    /// The `status` subresource.
    Status,
}

impl Scope {
    pub(crate) fn of(subresource: Option<&str>) -> Self {
        if subresource == Some("status") {
            Scope::Status
        } else {
            Scope::Object
        }
    }

    fn admits(self, path: &Path) -> bool {
        let status = path.first() == Some(&Step::Field("status".into()));
        status == (self == Scope::Status)
    }

    fn subresource(self) -> Option<&'static str> {
        (self == Scope::Status).then_some("status")
    }
}

/// A manager's entry in `managedFields`.
struct Entry {
    manager: String,
    operation: &'static str,
    subresource: Option<String>,
    api_version: Value,
    fields: FieldSet,
}

/// A field another manager owns with another value than an apply sets.
pub(crate) struct Conflict {
    pub manager: String,
    /// The API version the manager wrote with.
    pub api_version: String,
    pub path: Path,
}

/// The field names of `path` while it has only fields (the list-map table's form).
fn names(path: &[Step]) -> Option<Vec<&str>> {
    path.iter()
        .map(|s| match s {
            Step::Field(name) => Some(name.as_str()),
            _ => None,
        })
        .collect()
}

fn list_map_keys(path: &[Step]) -> Option<&'static [&'static str]> {
    let names = names(path)?;
    LIST_MAPS
        .iter()
        .find(|(at, _)| *at == names.as_slice())
        .map(|(_, keys)| *keys)
}

fn item_key(item: &Value, keys: &[&str]) -> String {
    let key: Map<String, Value> = keys
        .iter()
        .map(|k| ((*k).to_owned(), item[*k].clone()))
        .collect();
    Value::Object(key).to_string()
}

/// The leaf fields `value` sets, below `base`.
fn fields(value: &Value, base: &mut Path, out: &mut FieldSet) {
    if names(base).is_some_and(|n| UNOWNED.contains(&n.as_slice())) {
        return;
    }
    match value {
        Value::Null => {}
        Value::Object(map) if !map.is_empty() => {
            for (name, child) in map {
                base.push(Step::Field(name.clone()));
                fields(child, base, out);
                base.pop();
            }
        }
        Value::Array(items) if list_map_keys(base).is_some() => {
            let keys = list_map_keys(base).expect("checked");
            for item in items {
                base.push(Step::Item(item_key(item, keys)));
                base.push(Step::Itself);
                out.insert(base.clone());
                base.pop();
                fields(item, base, out);
                base.pop();
            }
        }
        _ => {
            out.insert(base.clone());
        }
    }
}

fn field_set(value: &Value, scope: Option<Scope>) -> FieldSet {
    let mut out = FieldSet::new();
    fields(value, &mut Vec::new(), &mut out);
    out.retain(|p| scope.is_none_or(|s| s.admits(p)));
    out
}

/// The value at `path` (an item for `Itself`), if any.
fn value_at<'a>(value: &'a Value, path: &[Step]) -> Option<&'a Value> {
    let mut here = value;
    for (i, step) in path.iter().enumerate() {
        here = match step {
            Step::Field(name) => here.as_object()?.get(name)?,
            Step::Item(key) => {
                let keys = list_map_keys(&path[..i])?;
                here.as_array()?
                    .iter()
                    .find(|item| item_key(item, keys) == *key)?
            }
            Step::Itself => here,
        };
    }
    Some(here)
}

/// Remove the field (or list-map item) at `path`.
fn remove_at(value: &mut Value, path: &[Step]) {
    let Some((last, parent)) = path.split_last() else {
        return;
    };
    match last {
        Step::Itself => {
            let Some((Step::Item(key), list_path)) = parent.split_last() else {
                return;
            };
            let keys = list_map_keys(list_path);
            if let (Some(keys), Some(Value::Array(items))) = (keys, value_at_mut(value, list_path))
            {
                items.retain(|item| item_key(item, keys) != *key);
            }
        }
        Step::Field(name) => {
            if let Some(Value::Object(map)) = value_at_mut(value, parent) {
                map.remove(name);
            }
        }
        Step::Item(_) => {}
    }
}

fn value_at_mut<'a>(value: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut here = value;
    for (i, step) in path.iter().enumerate() {
        here = match step {
            Step::Field(name) => here.as_object_mut()?.get_mut(name)?,
            Step::Item(key) => {
                let keys = list_map_keys(&path[..i])?;
                here.as_array_mut()?
                    .iter_mut()
                    .find(|item| item_key(item, keys) == *key)?
            }
            Step::Itself => here,
        };
    }
    Some(here)
}

/// `config` merged into `target`: objects field by field, list maps item by item, anything
/// else replaced.
fn merge(target: &mut Value, config: &Value, base: &mut Path) {
    match (target, config) {
        (Value::Object(into), Value::Object(from)) => {
            for (name, child) in from {
                base.push(Step::Field(name.clone()));
                match into.get_mut(name) {
                    Some(existing) if !child.is_null() => merge(existing, child, base),
                    _ if child.is_null() => {}
                    _ => {
                        into.insert(name.clone(), child.clone());
                    }
                }
                base.pop();
            }
        }
        (Value::Array(into), Value::Array(from)) if list_map_keys(base).is_some() => {
            let keys = list_map_keys(base).expect("checked");
            for item in from {
                let key = item_key(item, keys);
                match into.iter_mut().find(|i| item_key(i, keys) == key) {
                    Some(existing) => {
                        base.push(Step::Item(key));
                        merge(existing, item, base);
                        base.pop();
                    }
                    None => into.push(item.clone()),
                }
            }
        }
        (target, config) => *target = config.clone(),
    }
}

fn entries(object: &Value) -> Vec<Entry> {
    let Some(list) = object["metadata"]["managedFields"].as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|e| {
            let mut fields = FieldSet::new();
            decode(&e["fieldsV1"], &mut Vec::new(), &mut fields);
            Entry {
                manager: e["manager"].as_str().unwrap_or_default().to_owned(),
                operation: if e["operation"] == "Apply" {
                    "Apply"
                } else {
                    "Update"
                },
                subresource: e["subresource"].as_str().map(str::to_owned),
                api_version: e["apiVersion"].clone(),
                fields,
            }
        })
        .collect()
}

fn store_entries(object: &mut Value, entries: Vec<Entry>) {
    let list: Vec<Value> = entries
        .into_iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut entry = json!({
                "manager": e.manager,
                "operation": e.operation,
                "apiVersion": e.api_version,
                "time": "2026-01-01T00:00:00Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": encode(&e.fields),
            });
            if let Some(sub) = e.subresource {
                entry["subresource"] = json!(sub);
            }
            entry
        })
        .collect();
    if let Some(metadata) = object["metadata"].as_object_mut() {
        if list.is_empty() {
            metadata.remove("managedFields");
        } else {
            metadata.insert("managedFields".into(), Value::Array(list));
        }
    }
}

/// A field set as FieldsV1: `f:name`, `k:{key}` and `.`, each leaf `{}`.
fn encode(fields: &FieldSet) -> Value {
    let mut root = Map::new();
    for path in fields {
        let mut node = &mut root;
        for step in path {
            let name = match step {
                Step::Field(n) => format!("f:{n}"),
                Step::Item(k) => format!("k:{k}"),
                Step::Itself => ".".to_owned(),
            };
            node = node
                .entry(name)
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
                .expect("a FieldsV1 node is an object");
        }
    }
    Value::Object(root)
}

fn decode(node: &Value, base: &mut Path, out: &mut FieldSet) {
    let Some(map) = node.as_object() else {
        return;
    };
    if map.is_empty() && !base.is_empty() {
        out.insert(base.clone());
        return;
    }
    for (name, child) in map {
        let step = if name == "." {
            Step::Itself
        } else if let Some(n) = name.strip_prefix("f:") {
            Step::Field(n.to_owned())
        } else if let Some(k) = name.strip_prefix("k:") {
            Step::Item(k.to_owned())
        } else {
            continue;
        };
        base.push(step);
        decode(child, base, out);
        base.pop();
    }
}

/// `.status.conditions[type="Ready"].status`, as the API server names a field in a conflict.
pub(crate) fn show(path: &[Step]) -> String {
    let mut out = String::new();
    for step in path {
        match step {
            Step::Field(n) => out.push_str(&format!(".{n}")),
            Step::Item(k) => {
                let key: Map<String, Value> = serde_json::from_str(k).unwrap_or_default();
                let parts: Vec<String> = key.iter().map(|(f, v)| format!("{f}={v}")).collect();
                out.push_str(&format!("[{}]", parts.join(",")));
            }
            Step::Itself => {}
        }
    }
    out
}

/// `before` became `after` by a write of `manager` that is not an apply: it owns what it
/// changed now, and nobody owns what it removed.
pub(crate) fn record_update(before: &Value, after: &mut Value, manager: &str, scope: Scope) {
    let mut entries = entries(before);
    let (old, new) = (field_set(before, None), field_set(after, None));
    // An item of a list map is the writer's when it adds it; a field, when it changes it.
    let changed: FieldSet = new
        .iter()
        .filter(|p| match p.last() {
            Some(Step::Itself) => value_at(before, p).is_none(),
            _ => value_at(before, p) != value_at(after, p),
        })
        .cloned()
        .collect();
    let removed: FieldSet = old.difference(&new).cloned().collect();
    for entry in &mut entries {
        entry
            .fields
            .retain(|p| !changed.contains(p) && !removed.contains(p));
    }
    if !changed.is_empty() {
        let subresource = scope.subresource().map(str::to_owned);
        let at = entries.iter().position(|e| {
            e.manager == manager && e.operation == "Update" && e.subresource == subresource
        });
        let entry = match at {
            Some(i) => &mut entries[i],
            None => {
                entries.push(Entry {
                    manager: manager.to_owned(),
                    operation: "Update",
                    subresource,
                    api_version: after["apiVersion"].clone(),
                    fields: FieldSet::new(),
                });
                entries.last_mut().expect("just pushed")
            }
        };
        entry.fields.extend(changed);
    }
    store_entries(after, entries);
}

/// `config` applied to `current` by `manager`: the object as it is then, or the conflicts.
pub(crate) fn apply(
    current: &Value,
    config: &Value,
    manager: &str,
    scope: Scope,
    force: bool,
) -> Result<Value, Vec<Conflict>> {
    let mut entries = entries(current);
    let subresource = scope.subresource().map(str::to_owned);
    let applied = field_set(config, Some(scope));
    let mine =
        |e: &Entry| e.manager == manager && e.operation == "Apply" && e.subresource == subresource;
    let mut conflicts = Vec::new();
    for entry in entries.iter().filter(|e| !mine(e)) {
        for path in entry.fields.intersection(&applied) {
            if path.last() != Some(&Step::Itself)
                && value_at(current, path) != value_at(config, path)
            {
                conflicts.push(Conflict {
                    manager: entry.manager.clone(),
                    api_version: entry.api_version.as_str().unwrap_or_default().to_owned(),
                    path: path.clone(),
                });
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(conflicts);
    }
    for entry in entries.iter_mut().filter(|e| !mine(e)) {
        entry.fields.retain(|p| {
            !conflicts
                .iter()
                .any(|c| c.manager == entry.manager && c.path == *p)
        });
    }
    let before: FieldSet = entries
        .iter()
        .find(|e| mine(e))
        .map(|e| e.fields.clone())
        .unwrap_or_default();
    let mut object = current.clone();
    // What this manager no longer names goes, unless someone else owns it; whole items first,
    // since removing an item's key field would leave the item unfindable by its key.
    let owned_elsewhere = |path: &Path| {
        // An item stays while anyone owns a field of it.
        let within = match path.split_last() {
            Some((Step::Itself, item)) => item,
            _ => path.as_slice(),
        };
        entries
            .iter()
            .filter(|e| !mine(e))
            .any(|e| e.fields.iter().any(|f| f.starts_with(within)))
    };
    // The key fields of an item that stays stay with it: only a removed item takes them.
    let key_of_kept_item = |path: &Path| match path.as_slice() {
        [list @ .., Step::Item(key), Step::Field(field)] => {
            let itself: Path = [list, &[Step::Item(key.clone()), Step::Itself]].concat();
            let removed =
                before.contains(&itself) && !applied.contains(&itself) && !owned_elsewhere(&itself);
            list_map_keys(list).is_some_and(|keys| keys.contains(&field.as_str())) && !removed
        }
        _ => false,
    };
    let mut dropped: Vec<&Path> = before
        .difference(&applied)
        .filter(|p| !owned_elsewhere(p) && !key_of_kept_item(p))
        .collect();
    dropped.sort_by_key(|p| p.last() != Some(&Step::Itself));
    for path in dropped {
        remove_at(&mut object, path);
    }
    let mut part = config.clone();
    if let Some(map) = part.as_object_mut() {
        map.retain(|name, _| (name == "status") == (scope == Scope::Status));
        map.remove("apiVersion");
        map.remove("kind");
        if let Some(Value::Object(metadata)) = map.get_mut("metadata") {
            for unowned in UNOWNED.iter().filter(|u| u.len() == 2) {
                metadata.remove(unowned[1]);
            }
        }
    }
    merge(&mut object, &part, &mut Vec::new());
    match entries.iter_mut().find(|e| mine(e)) {
        Some(entry) => entry.fields = applied,
        None => entries.push(Entry {
            manager: manager.to_owned(),
            operation: "Apply",
            subresource,
            api_version: config["apiVersion"].clone(),
            fields: applied,
        }),
    }
    store_entries(&mut object, entries);
    Ok(object)
}
