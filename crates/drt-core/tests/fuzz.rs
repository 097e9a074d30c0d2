//! Fuzzing the parsers of the on-disk format: the manifest, the Arrow index and the shard
//! headers, through every entry point that reads them (open, read every record, verify).
//!
//! Each case damages a valid cache (flipped bytes, truncation, garbage) and asserts that
//! dataset_rt answers with `Ok` or an `Err`, never a panic or a crash. The suite runs a
//! bounded number of cases; a longer run:
//!
//! ```text
//! DRT_FUZZ_CASES=20000 cargo test -p drt-core --release --test fuzz
//! ```

// A test target: a failed set-up step should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use drt_core::format::{Manifest, INDEX_FILE, MANIFEST_FILE};
use drt_core::reader::CacheReader;
use drt_core::writer::{CacheWriter, ManifestInfo, WriteOptions};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("DRT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96)
}

fn build(dir: &Path) -> Manifest {
    let mut writer = CacheWriter::create(
        dir,
        WriteOptions {
            shard_size: 2048,
            alignment: 64,
            ..WriteOptions::default()
        },
    )
    .unwrap();
    for i in 0..60u32 {
        writer
            .append(&vec![i as u8; 20 + (i as usize * 13) % 200])
            .unwrap();
    }
    std::fs::write(dir.join(Manifest::metadata_file(1)), b"metadata").unwrap();
    writer
        .finish(ManifestInfo {
            name: "fuzz".into(),
            cache_id: "0123456789ab".into(),
            serializer: "pickle".into(),
            metadata_version: 1,
            parts: Vec::new(),
            plan_digest: None,
        })
        .unwrap()
}

/// Opens the cache, reads every record (checked and unchecked), and verifies it; any of
/// these may fail, none may panic.
fn exercise(dir: &Path) {
    if let Ok(reader) = CacheReader::open(dir) {
        for id in 0..reader.len() + 2 {
            let _ = reader.record(id);
            let _ = reader.record_verified(id);
            let _ = reader.copy_record(id, false);
        }
    }
    let _ = drt_core::verify::verify(dir, |_| Ok(()));
}

#[derive(Debug, Clone)]
enum Damage {
    Flip { at: usize, mask: u8 },
    Truncate { keep: usize },
    Replace { bytes: Vec<u8> },
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Damage::Flip { at, mask }),
        2 => any::<usize>().prop_map(|keep| Damage::Truncate { keep }),
        1 => proptest::collection::vec(any::<u8>(), 0..300).prop_map(|bytes| Damage::Replace { bytes }),
    ]
}

fn apply(path: &Path, damages: &[Damage]) {
    let mut bytes = std::fs::read(path).unwrap();
    for d in damages {
        match d {
            Damage::Flip { at, mask } if !bytes.is_empty() => {
                let at = at % bytes.len();
                bytes[at] ^= mask;
            }
            Damage::Flip { .. } => {}
            Damage::Truncate { keep } => bytes.truncate(keep % (bytes.len() + 1)),
            Damage::Replace { bytes: new } => bytes.clone_from(new),
        }
    }
    std::fs::write(path, bytes).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn damaged_manifests_are_errors_not_panics(
        damages in proptest::collection::vec(damage(), 1..4)
    ) {
        let dir = tempfile::tempdir().unwrap();
        build(dir.path());
        apply(&dir.path().join(MANIFEST_FILE), &damages);
        exercise(dir.path());
    }

    #[test]
    fn damaged_indexes_are_errors_not_panics(
        damages in proptest::collection::vec(damage(), 1..4)
    ) {
        let dir = tempfile::tempdir().unwrap();
        build(dir.path());
        apply(&dir.path().join(INDEX_FILE), &damages);
        // Opening checks the size against the manifest; also try with the manifest updated
        // to the damaged size, so that the Arrow parser itself sees the damage.
        exercise(dir.path());
        let mut manifest = Manifest::read(dir.path()).unwrap();
        manifest.index.size = std::fs::metadata(dir.path().join(INDEX_FILE)).unwrap().len();
        manifest.write(dir.path()).unwrap();
        exercise(dir.path());
    }

    #[test]
    fn damaged_shard_headers_and_records_are_errors_not_panics(
        shard in 0usize..8,
        damages in proptest::collection::vec(damage(), 1..4)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let manifest = build(dir.path());
        let entry = &manifest.shards[shard % manifest.shards.len()];
        apply(&dir.path().join(&entry.file), &damages);
        exercise(dir.path());
    }
}
