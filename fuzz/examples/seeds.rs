//! Writes the seed corpus of `delta_decode` (valid deltas against its fixed base), a
//! few inputs for `chunk_roundtrip`, the journals of the seed deltas' applies for
//! `undo_journal`, the genuine parts of `shard_part`, and valid conversations for `proto_frames` and
//! `proto_state`. Run from `fuzz/`:
//! `cargo run --example seeds` (the corpus directories are not in git).

use std::path::Path;

fn main() -> std::io::Result<()> {
    write_seeds("delta_decode", aurora_fuzz::seed_deltas(), ".adelta")?;
    write_seeds("chunk_roundtrip", aurora_fuzz::seed_roundtrips(), "")?;
    write_seeds("undo_journal", aurora_fuzz::seed_journals(), ".undo")?;
    let parts = aurora_fuzz::shard_fixture().1.iter().cloned().enumerate();
    write_seeds("shard_part", parts, ".part")?;
    let streams = aurora_fuzz::proto::seed_streams();
    // The state target reads a selector byte before the frames.
    write_seeds("proto_state", streams.clone(), "")?;
    let frames = streams
        .into_iter()
        .map(|(name, bytes)| (name, bytes[1..].to_vec()));
    write_seeds("proto_frames", frames, "")
}

/// Writes each seed as `corpus/TARGET/seed-NAME[EXTENSION]`.
fn write_seeds<N: std::fmt::Display>(
    target: &str,
    seeds: impl IntoIterator<Item = (N, Vec<u8>)>,
    extension: &str,
) -> std::io::Result<()> {
    let dir = Path::new("corpus").join(target);
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in seeds {
        let path = dir.join(format!("seed-{name}{extension}"));
        std::fs::write(&path, &bytes)?;
        println!("{}: {} bytes", path.display(), bytes.len());
    }
    Ok(())
}
