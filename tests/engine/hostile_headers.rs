//! Hostile headers: the committed fuzz seed corpus (made from qemu-img images by
//! `fuzz/make-corpus.sh`) and systematic damage to it go through the same function the
//! `header` fuzz target calls. Nothing may panic; damaged headers give errors that name
//! the value.

use qimg_testkit::fuzzing::corpus;

use qimg::format::validate::{OpenMode, validate_cluster0};

#[test]
fn the_seed_corpus_replays_without_panics_and_the_seeds_are_valid() {
    let seeds = corpus("header");
    assert!(seeds.len() >= 15, "corpus has {} seeds", seeds.len());
    for (name, data) in &seeds {
        qimg_testkit::fuzzing::format::header_and_extensions(data);
        validate_cluster0(data, OpenMode::ReadOnly).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn every_truncation_of_every_seed_is_an_error_or_valid_never_a_panic() {
    for (name, data) in corpus("header") {
        for len in 0..data.len().min(1200) {
            qimg_testkit::fuzzing::format::header_and_extensions(&data[..len]);
            if len < 72 {
                let e = validate_cluster0(&data[..len], OpenMode::ReadOnly);
                assert!(e.is_err(), "{name}: {len} bytes decoded");
            }
        }
    }
}

#[test]
fn every_byte_of_the_header_garbled_is_handled() {
    for (_, data) in corpus("header") {
        for at in 0..112.min(data.len()) {
            for v in [0x00u8, 0x01, 0x7f, 0x80, 0xff] {
                let mut d = data.clone();
                d[at] = v;
                qimg_testkit::fuzzing::format::header_and_extensions(&d);
            }
        }
    }
}

#[test]
fn garbled_extension_lengths_are_refused_naming_the_extension() {
    let seeds = corpus("header");
    let (_, data) = seeds.iter().find(|(n, _)| n == "cs64k").unwrap();
    let mut d = data.clone();
    // The feature table extension starts at 112 (0x70); give it an absurd length.
    d[116..120].copy_from_slice(&0xffff_fff0u32.to_be_bytes());
    let e = validate_cluster0(&d, OpenMode::ReadOnly)
        .unwrap_err()
        .to_string();
    assert!(e.contains("0x6803f857") && e.contains("0x70"), "{e}");
}

#[test]
fn oversized_fields_are_refused_not_allocated() {
    let seeds = corpus("header");
    let (_, data) = seeds.iter().find(|(n, _)| n == "cs64k").unwrap();
    // l1_size in the billions, a refcount table of 4 Gi clusters, 4 billion snapshots.
    for (at, bytes, field) in [
        (36usize, 3_000_000_000u32.to_be_bytes(), "l1_size"),
        (56, u32::MAX.to_be_bytes(), "refcount_table_clusters"),
        (60, u32::MAX.to_be_bytes(), "nb_snapshots"),
    ] {
        let mut d = data.clone();
        d[at..at + 4].copy_from_slice(&bytes);
        let e = validate_cluster0(&d, OpenMode::ReadOnly)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}
