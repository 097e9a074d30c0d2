//! A cache copied file by file into another root (what `pull` does with downloads): the
//! manifest lists every file, and only a complete, intact copy is published.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use drt_core::append::AppendSession;
use drt_core::build::BuildSession;
use drt_core::format::MANIFEST_FILE;
use drt_core::reader::CacheReader;
use drt_core::store::Store;
use drt_core::verify::publish_copy;
use drt_core::writer::WriteOptions;
use drt_core::Error;

/// A cache `name` of two parts, with a second metadata version.
fn grown(store: &Store, name: &str) {
    let lock = store.lock(name, || Ok(())).unwrap().0;
    let opts = WriteOptions {
        shard_size: 1024,
        ..WriteOptions::default()
    };
    let mut session = BuildSession::begin(store, &lock, opts).unwrap();
    for i in 0..30u8 {
        session.append(&[i; 100]).unwrap();
    }
    std::fs::write(session.metadata_path(), b"first table").unwrap();
    let id = session.cache_id().to_string();
    session.finish(&lock, "pickle".into()).unwrap();
    let mut append = AppendSession::begin(store, &lock, &id, 1024).unwrap();
    for i in 30..40u8 {
        append.append(&[i; 200]).unwrap();
    }
    std::fs::write(append.metadata_path(), b"grown table").unwrap();
    append.commit(&lock).unwrap();
}

/// Copies every file the manifest names, and the manifest, from `from` into `to`.
fn copy_files(from: &Path, to: &Path, skip: Option<&str>) {
    let manifest = drt_core::format::Manifest::read(from).unwrap();
    let files = manifest.files();
    assert!(files.iter().all(|(_, checksum)| checksum.is_some()));
    for (file, _) in files.iter().chain(&[(MANIFEST_FILE.to_string(), None)]) {
        if Some(file.as_str()) == skip {
            continue;
        }
        let target = to.join(file);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(from.join(file), target).unwrap();
    }
}

#[test]
fn a_complete_copy_is_published_and_reads_like_the_original() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (source, target) = (Store::new(a.path()), Store::new(b.path()));
    grown(&source, "shared");
    let manifest = source.manifest("shared").unwrap();
    let names: Vec<String> = manifest.files().into_iter().map(|(f, _)| f).collect();
    for expected in ["index.arrow", "shards/00000.bin", "parts/00001/index.arrow"] {
        assert!(
            names.iter().any(|f| f == expected),
            "{expected} in {names:?}"
        );
    }
    assert!(names.iter().any(|f| f == "metadata/v00002.parquet"));

    let lock = target.lock("shared", || Ok(())).unwrap().0;
    let dir = target.begin_build(&lock).unwrap();
    copy_files(&source.cache_dir("shared").unwrap(), &dir, None);
    publish_copy(&target, &lock, &dir).unwrap();
    let (original, copy) = (
        CacheReader::open(&source.cache_dir("shared").unwrap()).unwrap(),
        CacheReader::open(&target.cache_dir("shared").unwrap()).unwrap(),
    );
    assert_eq!(copy.manifest().cache_id, original.manifest().cache_id);
    for id in 0..40 {
        assert_eq!(
            copy.copy_record(id, true).unwrap(),
            original.copy_record(id, true).unwrap()
        );
    }
}

#[test]
fn incomplete_damaged_or_misnamed_copies_are_refused() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (source, target) = (Store::new(a.path()), Store::new(b.path()));
    grown(&source, "shared");
    let from = source.cache_dir("shared").unwrap();

    let lock = target.lock("shared", || Ok(())).unwrap().0;
    let missing = target.begin_build(&lock).unwrap();
    copy_files(&from, &missing, Some("parts/00001/shards/00000.bin"));
    let err = publish_copy(&target, &lock, &missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parts/00001/shards/00000.bin"), "{err}");
    assert!(matches!(
        target.manifest("shared"),
        Err(Error::CacheNotFound { .. })
    ));

    let damaged = target.begin_build(&lock).unwrap();
    copy_files(&from, &damaged, None);
    let shard = damaged.join("shards/00001.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let err = publish_copy(&target, &lock, &damaged)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is damaged") && err.contains("00001.bin"),
        "{err}"
    );

    let other = target.lock("other", || Ok(())).unwrap().0;
    let misnamed = target.begin_build(&other).unwrap();
    copy_files(&from, &misnamed, None);
    let err = publish_copy(&target, &other, &misnamed)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds cache \"shared\", not \"other\""),
        "{err}"
    );
}
