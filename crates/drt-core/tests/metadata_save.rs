//! Saving metadata versions of a published cache: the whole transaction, as the Python
//! `Cache.save_metadata` drives it.
#![allow(clippy::unwrap_used)]

use drt_core::build::BuildSession;
use drt_core::metadata::{checked_table, restore_plan, MetadataSave};
use drt_core::store::Store;
use drt_core::writer::WriteOptions;
use drt_core::Error;

fn built(store: &Store, name: &str) -> String {
    let lock = store.lock(name, || Ok(())).unwrap().0;
    let mut session = BuildSession::begin(store, &lock, WriteOptions::default()).unwrap();
    session.append(b"record").unwrap();
    std::fs::write(session.metadata_path(), b"first table").unwrap();
    let id = session.cache_id().to_string();
    session.finish(&lock, "pickle".into()).unwrap();
    id
}

#[test]
fn a_committed_save_becomes_the_live_version_with_its_checksum() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let id = built(&store, "saved");
    let lock = store.lock("saved", || Ok(())).unwrap().0;
    let mut save = MetadataSave::begin(&store, &lock, &id).unwrap();
    assert_eq!(save.version(), 2);
    std::fs::write(save.path(), b"second table").unwrap();
    assert_eq!(save.commit(&lock).unwrap(), 2);
    let manifest = store.manifest("saved").unwrap();
    assert_eq!(manifest.metadata_versions, vec![1, 2]);
    assert_eq!(manifest.metadata_version, 2);
    let dir = store.cache_dir("saved").unwrap();
    let expected = manifest.metadata_checksums.get(&2).map(String::as_str);
    let path = checked_table(&dir, 2, expected).unwrap();
    assert_eq!(std::fs::read(path).unwrap(), b"second table");
    assert!(save.commit(&lock).is_err(), "a save commits once");
}

#[test]
fn a_discarded_or_dropped_save_leaves_no_file_and_the_live_version() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let id = built(&store, "kept");
    let lock = store.lock("kept", || Ok(())).unwrap().0;
    let mut save = MetadataSave::begin(&store, &lock, &id).unwrap();
    std::fs::write(save.path(), b"abandoned").unwrap();
    let tmp = save.path().to_path_buf();
    save.discard().unwrap();
    assert!(!tmp.exists());
    let save = MetadataSave::begin(&store, &lock, &id).unwrap();
    std::fs::write(save.path(), b"dropped").unwrap();
    let tmp = save.path().to_path_buf();
    drop(save);
    assert!(!tmp.exists());
    assert_eq!(store.manifest("kept").unwrap().metadata_versions, vec![1]);
}

#[test]
fn a_save_of_a_rebuilt_cache_is_refused_before_anything_is_written() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let old = built(&store, "rebuilt");
    built(&store, "rebuilt");
    let lock = store.lock("rebuilt", || Ok(())).unwrap().0;
    let err = MetadataSave::begin(&store, &lock, &old).err().unwrap();
    assert!(matches!(err, Error::Rebuilt { .. }), "{err}");
}

#[test]
fn a_lost_plan_is_put_back_only_from_a_copy_with_its_recorded_checksum() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let lock = store.lock("planned", || Ok(())).unwrap().0;
    let mut session = BuildSession::begin(&store, &lock, WriteOptions::default()).unwrap();
    session.append(b"record").unwrap();
    std::fs::write(session.metadata_path(), b"table").unwrap();
    session.plan().write(&[0], &[1.0], None).unwrap();
    let id = session.cache_id().to_string();
    session.finish(&lock, "pickle".into()).unwrap();
    let plan = store
        .cache_dir("planned")
        .unwrap()
        .join("metadata/v00001.plan");
    let written = std::fs::read(&plan).unwrap();
    std::fs::remove_file(&plan).unwrap();

    let other = root.path().join("other");
    std::fs::write(&other, b"another plan").unwrap();
    assert!(!restore_plan(&store, &lock, &id, 1, &other).unwrap());
    assert!(!plan.exists());
    let same = root.path().join("same");
    std::fs::write(&same, &written).unwrap();
    assert!(
        !restore_plan(&store, &lock, &id, 2, &same).unwrap(),
        "no such version"
    );
    assert!(restore_plan(&store, &lock, &id, 1, &same).unwrap());
    assert_eq!(std::fs::read(&plan).unwrap(), written);
    let leftovers: Vec<_> = std::fs::read_dir(plan.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty());
}
