//! Appending parts to a published cache: the transaction as `drt.append` drives it, and the
//! reader and `verify` over a cache of several parts.
#![allow(clippy::unwrap_used)]

use drt_core::append::AppendSession;
use drt_core::build::BuildSession;
use drt_core::reader::CacheReader;
use drt_core::store::Store;
use drt_core::verify::verify;
use drt_core::writer::WriteOptions;
use drt_core::Error;

fn built(store: &Store, name: &str, records: &[&[u8]]) -> String {
    let lock = store.lock(name, || Ok(())).unwrap().0;
    let opts = WriteOptions {
        shard_size: 1024,
        alignment: 16,
        ..WriteOptions::default()
    };
    let mut session = BuildSession::begin(store, &lock, opts).unwrap();
    for record in records {
        session.append(record).unwrap();
    }
    std::fs::write(session.metadata_path(), b"first table").unwrap();
    let id = session.cache_id().to_string();
    session.finish(&lock, "pickle".into()).unwrap();
    id
}

fn appended(store: &Store, name: &str, id: &str, records: &[Vec<u8>]) -> u32 {
    let lock = store.lock(name, || Ok(())).unwrap().0;
    let mut session = AppendSession::begin(store, &lock, id, 1024).unwrap();
    for (i, record) in records.iter().enumerate() {
        assert_eq!(session.append(record).unwrap(), session.first() + i as u64);
    }
    std::fs::write(session.metadata_path(), b"grown table").unwrap();
    session.commit(&lock).unwrap()
}

fn records(range: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    // Sizes that cross several 1 KiB shards per part.
    range
        .map(|i| vec![(i % 251) as u8; 100 + i as usize])
        .collect()
}

#[test]
fn parts_read_as_one_cache_in_order() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let id = built(&store, "grown", &[b"zero", b"one"]);
    assert_eq!(appended(&store, "grown", &id, &records(2..20)), 2);
    assert_eq!(appended(&store, "grown", &id, &records(20..23)), 3);
    let manifest = store.manifest("grown").unwrap();
    assert_eq!(manifest.num_samples, 23);
    assert_eq!(manifest.parts.len(), 2);
    assert_eq!(manifest.parts[0].num_samples, 18);
    assert!(
        manifest.parts[0].shards.len() > 1,
        "records span several shards"
    );
    assert!(manifest.parts[1].index.file.starts_with("parts/00002/"));
    assert_eq!(manifest.metadata_versions, vec![1, 2, 3]);
    let reader = CacheReader::open(&store.cache_dir("grown").unwrap()).unwrap();
    assert_eq!(reader.len(), 23);
    assert_eq!(reader.record(0).unwrap(), b"zero");
    let expected = records(2..23);
    for id in 2..23u64 {
        assert_eq!(
            reader.record(id).unwrap(),
            expected[id as usize - 2].as_slice()
        );
        assert_eq!(reader.record_verified(id).unwrap().len(), 100 + id as usize);
    }
    assert!(matches!(
        reader.record(23),
        Err(Error::SampleOutOfRange { len: 23, .. })
    ));
    let report = verify(&store.cache_dir("grown").unwrap(), |_| Ok(())).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.samples_checked, 23);
}

#[test]
fn an_uncommitted_append_leaves_nothing_and_a_stale_id_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let id = built(&store, "kept", &[b"only"]);
    let lock = store.lock("kept", || Ok(())).unwrap().0;
    let mut session = AppendSession::begin(&store, &lock, &id, 1024).unwrap();
    session.append(b"lost").unwrap();
    drop(session);
    let mut session = AppendSession::begin(&store, &lock, &id, 1024).unwrap();
    session.append(b"discarded").unwrap();
    session.discard().unwrap();
    let parts = store.cache_dir("kept").unwrap().join("parts");
    assert_eq!(std::fs::read_dir(&parts).unwrap().count(), 0);
    let manifest = store.manifest("kept").unwrap();
    assert_eq!((manifest.num_samples, manifest.parts.len()), (1, 0));
    assert!(matches!(
        AppendSession::begin(&store, &lock, "000000000000", 1024),
        Err(Error::Rebuilt { .. })
    ));
}

#[test]
fn a_part_left_unlisted_by_a_dead_append_is_cleared_by_the_next() {
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let id = built(&store, "leftover", &[b"only"]);
    let dir = store.cache_dir("leftover").unwrap();
    // What an append killed between moving its part into place and writing the manifest
    // leaves, and one killed while writing.
    for left in ["parts/00001/shards", "parts/.tmp-1-abc/shards"] {
        std::fs::create_dir_all(dir.join(left)).unwrap();
        std::fs::write(dir.join(left).join("00000.bin"), b"junk").unwrap();
    }
    assert_eq!(store.manifest("leftover").unwrap().num_samples, 1);
    appended(&store, "leftover", &id, &records(1..4));
    let names: Vec<_> = std::fs::read_dir(dir.join("parts"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["00001"]);
    let reader = CacheReader::open(&dir).unwrap();
    assert_eq!(reader.record(3).unwrap(), records(3..4)[0].as_slice());
}

#[test]
fn a_build_lists_the_parts_other_writers_put_in_its_directory() {
    use drt_core::build::PartWriter;
    let root = tempfile::tempdir().unwrap();
    let store = Store::new(root.path());
    let lock = store.lock("parallel", || Ok(())).unwrap().0;
    let opts = WriteOptions {
        shard_size: 1024,
        alignment: 16,
        ..WriteOptions::default()
    };
    let mut session = BuildSession::begin(&store, &lock, opts).unwrap();
    let all = records(0..30);
    let mut parts = Vec::new();
    for (number, range) in [(1, 10..22), (2, 22..30)] {
        let relative = format!("parts/{number:05}");
        let mut writer = PartWriter::create(session.dir(), &relative, opts).unwrap();
        for (i, record) in all[range].iter().enumerate() {
            assert_eq!(writer.append(record).unwrap(), i as u64);
        }
        let part = writer.finish().unwrap();
        assert!(part.index.file.starts_with(&relative));
        parts.push(drt_core::format::Part::from_json(&part.to_json()).unwrap());
    }
    for record in &all[..10] {
        session.append(record).unwrap();
    }
    std::fs::write(session.metadata_path(), b"table").unwrap();
    session
        .finish_with_parts(&lock, "pickle".into(), parts)
        .unwrap();
    let dir = store.cache_dir("parallel").unwrap();
    let reader = CacheReader::open(&dir).unwrap();
    assert_eq!(reader.len(), 30);
    for (id, record) in all.iter().enumerate() {
        assert_eq!(reader.record(id as u64).unwrap(), record.as_slice());
    }
    assert!(verify(&dir, |_| Ok(())).unwrap().problems.is_empty());
}
